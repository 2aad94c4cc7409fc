"""Worker settings, engine environment, pipeline loading, feature conversion."""

from __future__ import annotations

import argparse
import os
import re

import numpy as np
import pytest

from hio.config import ConfigError, build, load_file
from hio.proto import features_pb2, tuple_pb2
from hio.worker.api import PIPELINE_EXIT_CODE, TupleInfo, load_pipeline, pipeline_for_image
from hio.worker.config import EngineConfig, WorkerConfig, engine_counts
from hio.worker.controller import EngineSlot, engine_env
from hio.worker.features import FeatureError, build_record, feature_value


def test_engine_counts_spread_cpus_over_images() -> None:
    assert engine_counts(("a", "b"), 8) == [("a", 4), ("b", 4)]
    assert engine_counts(("a", "b", "c"), 2) == [("a", 1), ("b", 1), ("c", 1)]
    assert engine_counts(("a=3", "b"), 4) == [("a", 3), ("b", 2)]


@pytest.mark.parametrize(
    "engines, needle",
    [
        (("a=x",), "not an integer"),
        (("a=0",), "between 1 and 1024"),
        (("a", "a=2"), "twice"),
        (("=2",), "no image"),
    ],
)
def test_engine_counts_refuse_bad_entries(engines: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        engine_counts(engines, 4)


def test_worker_config_validates_with_names() -> None:
    with pytest.raises(ConfigError, match="runtime"):
        build(WorkerConfig, "worker", overrides={"runtime": "vm"})
    with pytest.raises(ConfigError, match="pipelines entry"):
        build(WorkerConfig, "worker", overrides={"pipelines": ("nomapping",)})
    with pytest.raises(ConfigError, match="worker_id"):
        build(WorkerConfig, "worker", overrides={"worker_id": "a/b"})
    assert build(WorkerConfig, "worker").effective_worker_id()


def test_engine_env_builds_the_engine_config(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    worker = build(
        WorkerConfig,
        "worker",
        overrides={
            "master_address": "m:1",
            "repository_address": "r:2",
            "token": "s3cret",
            "tuple_timeout": 7.5,
            "chunk_bytes": 65536,
            "tls_ca": str(tmp_path / "ca.pem"),
            "tls_cert": str(tmp_path / "w.pem"),
            "tls_key": str(tmp_path / "w-key.pem"),
            "pull_batch_seconds": 0.0,
            "pull_batch_tuples": 32,
            "stream_idle_seconds": 12.5,
            "pull_ahead": False,
        },
    )
    env = engine_env(worker, channel_id="w/3", image="hio/synthetic", pipeline="", port=4321)
    assert "HIO_ENGINE_PIPELINE" not in env  # the image's own HIO_PIPELINE may apply
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    engine = build(EngineConfig, "engine")
    assert (engine.channel_id, engine.image, engine.listen) == ("w/3", "hio/synthetic", "127.0.0.1:4321")
    assert (engine.master_address, engine.repository_address, engine.token) == ("m:1", "r:2", "s3cret")
    assert (engine.tuple_timeout, engine.chunk_bytes, engine.tls_ca) == (7.5, 65536, str(tmp_path / "ca.pem"))
    assert (engine.tls_cert, engine.tls_key) == (str(tmp_path / "w.pem"), str(tmp_path / "w-key.pem"))
    assert (engine.pull_batch_seconds, engine.pull_batch_tuples, engine.pull_batch_bytes) == (0.0, 32, 1024 * 1024)
    assert engine.pull_ahead is False
    assert engine.stream_idle_seconds == 12.5  # every [cluster] setting reaches the engines
    monkeypatch.setenv("HIO_PIPELINE", "image.module:process")
    assert build(EngineConfig, "engine").pipeline == "image.module:process"


def test_the_engine_table_of_a_worker_s_file_reaches_its_engines(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "hio.toml"
    path.write_text(
        '[worker]\nengine_settings = ["rpc_deadline=30"]\n[engine]\nrpc_deadline = 120\nstore_batch_records = 64\n'
    )
    worker = build(WorkerConfig, "worker", file_data=load_file(path))
    env = engine_env(worker, channel_id="w/1", image="hio/synthetic", pipeline="", port=4321)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    engine = build(EngineConfig, "engine")
    assert (engine.store_batch_records, engine.rpc_deadline) == (64, 30.0), "the worker's own list wins"


def _engine_of(worker: WorkerConfig, monkeypatch: pytest.MonkeyPatch) -> EngineConfig:
    """The config an engine of ``worker`` builds from the environment the worker gives it
    (and nothing else: engines start with a clean environment)."""
    env = engine_env(worker, channel_id="w/1", image="hio/synthetic", pipeline="", port=4321)
    for key in [k for k in os.environ if k.startswith("HIO_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return build(EngineConfig, "engine")


def test_engine_variables_of_a_worker_s_environment_reach_its_engines(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """An engine reads HIO_ENGINE_<NAME>, so an operator sets it in the worker's environment
    (a systemd unit, a container): the worker passes it on; the worker's own HIO_ENGINE_*
    settings (engine_listen_host, engine_cpus, engine_ports, engine_memory_bytes,
    engine_settings) stay its own."""
    path = tmp_path / "hio.toml"
    path.write_text("[engine]\nrpc_deadline = 120\nstore_batch_records = 64\n")
    monkeypatch.setenv("HIO_ENGINE_RPC_DEADLINE", "45")
    monkeypatch.setenv("HIO_ENGINE_RESERVATION_SECONDS", "9")
    monkeypatch.setenv("HIO_ENGINE_LISTEN_HOST", "0.0.0.0")
    monkeypatch.setenv("HIO_ENGINE_CPUS", "0.5")
    monkeypatch.setenv("HIO_ENGINE_PORTS", "20000-20100")
    monkeypatch.setenv("HIO_ENGINE_MEMORY_BYTES", "1G")
    monkeypatch.setenv("HIO_ENGINE_SETTINGS", "store_pending_records=7")
    worker = build(WorkerConfig, "worker", file_data=load_file(path))
    assert (worker.engine_listen_host, worker.engine_cpus, worker.engine_ports) == ("0.0.0.0", 0.5, "20000-20100")
    assert worker.engine_memory_bytes == 1024**3 and worker.engine_settings[-1] == "store_pending_records=7"
    assert worker.engine_overrides() == {
        "rpc_deadline": "45.0",
        "store_batch_records": "64",
        "reservation_seconds": "9.0",
        "store_pending_records": "7",
    }
    engine = _engine_of(worker, monkeypatch)
    assert (engine.rpc_deadline, engine.store_batch_records, engine.reservation_seconds) == (45.0, 64, 9.0)
    assert engine.store_pending_records == 7


def test_engine_settings_reach_the_engines_in_the_usual_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """File < environment < flags, and [cluster] < [role], HIO_<NAME> < HIO_ENGINE_<NAME>, as
    for any setting: an engine's tunable set in [cluster] or as HIO_<NAME> reaches the engines
    (an engine is a role that has it), and the environment beats the worker's file, its
    engine_settings included."""
    path = tmp_path / "hio.toml"
    path.write_text(
        "[cluster]\nrpc_deadline = 11\nstore_batch_records = 12\nreservation_seconds = 13\n"
        "store_pending_records = 14\n"
        "[engine]\nstore_batch_records = 22\nreservation_seconds = 23\nstore_pending_records = 24\n"
        '[worker]\nengine_settings = ["reservation_seconds=33", "store_pending_records=34"]\n'
    )
    worker = build(WorkerConfig, "worker", file_data=load_file(path))
    engine = _engine_of(worker, monkeypatch)
    assert (engine.rpc_deadline, engine.store_batch_records) == (11.0, 22)
    assert (engine.reservation_seconds, engine.store_pending_records) == (33.0, 34)
    for key in [k for k in os.environ if k.startswith("HIO_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HIO_STORE_BATCH_RECORDS", "41")
    monkeypatch.setenv("HIO_RESERVATION_SECONDS", "42")
    monkeypatch.setenv("HIO_ENGINE_RESERVATION_SECONDS", "52")
    monkeypatch.setenv("HIO_ENGINE_STORE_PENDING_RECORDS", "54")
    worker = build(WorkerConfig, "worker", file_data=load_file(path))
    engine = _engine_of(worker, monkeypatch)
    assert (engine.rpc_deadline, engine.store_batch_records) == (11.0, 41), "HIO_<NAME> beats the file"
    assert (engine.reservation_seconds, engine.store_pending_records) == (52.0, 54), "HIO_ENGINE_<NAME> beats both"
    for key in [k for k in os.environ if k.startswith("HIO_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HIO_ENGINE_STORE_PENDING_RECORDS", "54")
    args = argparse.Namespace(config=str(path), engine_settings=["store_pending_records=64"])
    engine = _engine_of(build(WorkerConfig, "worker", args), monkeypatch)
    assert engine.store_pending_records == 64, "a flag beats the environment"
    for key in [k for k in os.environ if k.startswith("HIO_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HIO_ENGINE_STORE_PENDING_RECORDS", "54")
    args = argparse.Namespace(config=str(path), engine_settings=["reservation_seconds=33", "store_pending_records=34"])
    engine = _engine_of(build(WorkerConfig, "worker", args), monkeypatch)
    assert engine.store_pending_records == 34, "a flag beats the environment, also when it says what the file says"


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("HIO_ENGINE_CHANNEL_ID", "w/9", "engine_settings ([engine], HIO_ENGINE_*): channel_id: the worker sets it"),
        (
            "HIO_ENGINE_TUPLE_TIMEOUT",
            "3",
            ("tuple_timeout: set it for the worker ([worker] or [cluster], HIO_WORKER_TUPLE_TIMEOUT)"),
        ),
        ("HIO_ENGINE_RPC_DEADLINE", "soon", "rpc_deadline: 'soon' is not a number"),
        ("HIO_ENGINE_RPC_DEADLIN", "3", "unknown setting 'rpc_deadlin'"),
    ],
)
def test_a_wrong_engine_variable_of_a_worker_s_environment_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(WorkerConfig, "worker")


@pytest.mark.parametrize(
    "table, message",
    [
        ({"tuple_timeout": 3}, "tuple_timeout: set it for the worker"),
        ({"listen": "127.0.0.1:9"}, "listen: the worker sets it for each engine"),
        (
            {"lanes": False},
            ("lanes: set it for the worker ([worker] or [cluster], HIO_WORKER_LANES); it passes its value on"),
        ),
        ({"rpc_deadlin": 3}, "unknown setting 'rpc_deadlin'; known: reservation_seconds, rpc_deadline"),
        ({"store_batch_records": "many"}, "store_batch_records: 'many' is not an integer"),
        ({"rpc_deadline": 0}, "engine_settings ([engine], HIO_ENGINE_*): rpc_deadline must be positive"),
        ({"cpus": 2}, "unknown setting 'cpus'"),
    ],
)
def test_a_wrong_engine_table_is_refused_by_name(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(WorkerConfig, "worker", file_data={"engine": table})


def test_a_typo_in_the_cluster_table_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting 'master_adress' in \[cluster\]: no role has it"):
        build(WorkerConfig, "worker", file_data={"cluster": {"master_adress": "m:1"}})
    from hio.repository.config import RepositoryConfig  # a setting some roles share is no typo for the others

    assert build(RepositoryConfig, "repository", file_data={"cluster": {"max_attempts": 5}})


def test_engine_config_requires_identity() -> None:
    with pytest.raises(ConfigError, match="channel_id"):
        build(EngineConfig, "engine", overrides={"image": "x"})


@pytest.mark.parametrize(
    "setting, value",
    [
        ("pull_batch_seconds", -1.0),
        ("pull_batch_tuples", 0),
        ("pull_batch_tuples", 2000),
        ("pull_batch_bytes", -1),
    ],
)
def test_engine_config_refuses_bad_pull_batches_by_name(setting: str, value: float) -> None:
    with pytest.raises(ConfigError, match=setting):
        build(EngineConfig, "engine", overrides={"channel_id": "w/0", "image": "x", setting: value})
    with pytest.raises(ConfigError, match=setting):
        build(WorkerConfig, "worker", overrides={setting: value})


def test_restart_backoff_doubles_to_the_cap_and_resets_after_a_healthy_run() -> None:
    slot = EngineSlot(channel_id="w/0", image="x", pipeline="m:f", port=1)
    assert slot.on_exit(-9, 0.0, 2.0) == "exited with code -9; restart 1 in 0.5s"
    assert slot.on_exit(1, 1.0, 2.0) == "exited with code 1; restart 2 in 1.0s"
    slot.on_exit(1, 2.0, 2.0)
    assert slot.on_exit(1, 3.0, 2.0).endswith("restart 4 in 2.0s")
    assert slot.next_start == 5.0 and slot.failed_starts == 4
    slot.on_healthy(10.0)
    slot.settle(30.0)
    assert slot.backoff == 2.0
    slot.settle(70.0)
    assert slot.backoff == 0.5 and slot.failed_starts == 0


def test_an_engine_that_cannot_load_its_pipeline_says_why_and_keeps_its_port() -> None:
    slot = EngineSlot(channel_id="w/0", image="x", pipeline="m:f", port=1)
    line = "hio engine: cannot load the pipeline: pipeline 'm:f': cannot import m: No module named 'm'"
    for n in range(5):
        detail = slot.on_exit(PIPELINE_EXIT_CODE, float(n), 2.0, line)
    assert detail.startswith("cannot load the pipeline: pipeline 'm:f': cannot import m") and "restart 5" in detail
    assert slot.failed_starts == 0, "a pipeline that cannot be loaded is not a port in use"


def test_load_pipeline_runs_setup_once_and_reads_kd_features() -> None:
    pipe = load_pipeline("tests.worker.pipe_test:process")
    assert pipe.kd_features == ("size",)
    info = TupleInfo(tuple_id=1, source="s", image="test/echo", name="n", size=3, created_unix=0.0)
    assert pipe.process(b"abb", info)["histogram"] == [1.0, 2.0]
    bare = load_pipeline("tests.worker.pipe_nokd:process")
    assert bare.kd_features == ()


@pytest.mark.parametrize("attributes", [{"cost_ms": "10", "plate": "A1"}, {}])
def test_tuple_info_from_meta_is_the_frozen_info_the_constructor_makes(attributes: dict[str, str]) -> None:
    meta = tuple_pb2.TupleMeta(
        tuple_id=7,
        source="scope",
        image="hio/synthetic",
        name="a.tif",
        size=3,
        created_unix=12.5,
        attributes=attributes,
        ticket=b"t",
    )
    info = TupleInfo.from_meta(meta)
    assert info == TupleInfo(
        tuple_id=7,
        source="scope",
        image="hio/synthetic",
        name="a.tif",
        size=3,
        created_unix=12.5,
        attributes=attributes,
    )
    assert dict(info.attributes) == attributes
    with pytest.raises(AttributeError):  # frozen: a pipeline cannot change what other code reads
        info.name = "b.tif"  # type: ignore[misc]
    with pytest.raises(TypeError):  # read-only, and not the message's own map
        info.attributes["plate"] = "B2"  # type: ignore[index]
    meta.attributes["late"] = "x"
    assert "late" not in info.attributes


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("nocolon", "module:function"),
        ("tests.worker.pipe_nokd:missing", "no function"),
        ("tests.worker.pipe_nokd:NOT_CALLABLE", "no function"),
        ("tests.worker.pipe_broken:process", "cannot import"),
    ],
)
def test_load_pipeline_refuses_with_the_spec_named(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        load_pipeline(spec)
    assert spec in str(err.value)


def test_pipeline_for_image_builtins_extras_and_unknown() -> None:
    assert pipeline_for_image("hio/microscopy") == "hio.worker.pipelines.microscopy:process"
    assert pipeline_for_image("lab/x", ("lab/x=my.mod:run",)) == "my.mod:run"
    assert pipeline_for_image("hio/synthetic", ("hio/synthetic=my.mod:run",)) == "my.mod:run"
    with pytest.raises(ConfigError, match="no pipeline for image 'lab/y'"):
        pipeline_for_image("lab/y")


def test_tuple_info_from_meta_is_read_only() -> None:
    meta = tuple_pb2.TupleMeta(
        tuple_id=9, source="g", image="i", size=4, name="f", created_unix=1.5, attributes={"k": "v"}
    )
    info = TupleInfo.from_meta(meta)
    assert (info.tuple_id, info.attributes["k"]) == (9, "v")
    with pytest.raises(TypeError):
        info.attributes["k"] = "w"  # type: ignore[index]


def test_feature_conversion_of_supported_types() -> None:
    assert feature_value("a", 3).number == 3.0
    assert feature_value("a", True).number == 1.0
    assert feature_value("a", np.float32(2.5)).number == 2.5
    assert feature_value("a", np.int64(4)).number == 4.0
    assert feature_value("a", "label").text == "label"
    assert list(feature_value("a", [1, 2.5, False]).array.values) == [1.0, 2.5, 0.0]
    assert list(feature_value("a", np.arange(3, dtype=np.uint8)).array.values) == [0.0, 1.0, 2.0]
    assert list(feature_value("a", ()).array.values) == []


@pytest.mark.parametrize(
    "value, needle",
    [
        (b"raw", "bytes"),
        (np.bytes_(b"raw"), "bytes_ is not a number"),
        ({"x": 1}, "dict"),
        (None, "NoneType"),
        ([1, "x"], "item 1 is str"),
        (np.zeros((2, 2)), "2 dimensions"),
        (np.array(["a"]), "not numeric"),
        ([[1.0]], "item 0 is list"),
    ],
)
def test_feature_conversion_refuses_with_the_feature_named(value: object, needle: str) -> None:
    with pytest.raises(FeatureError, match=needle) as err:
        feature_value("feat", value)
    assert "'feat'" in str(err.value)


def test_build_record_copies_meta_without_ticket_and_checks_kd_features() -> None:
    meta = tuple_pb2.TupleMeta(tuple_id=5, image="i", size=1, ticket=b"proof", name="n")
    record = build_record(
        {"size": 1, "tag": "x"}, meta, kd_features=("size",), engine="w/0", processed_unix=10.0, processing_seconds=0.25
    )
    again = features_pb2.FeatureRecord.FromString(record.SerializeToString())
    assert (again.tuple_id, again.meta.name, again.meta.ticket, again.engine) == (5, "n", b"", "w/0")
    assert list(again.kd_features) == ["size"] and again.processing_seconds == 0.25
    with pytest.raises(FeatureError, match="KD feature 'size'"):
        build_record({"tag": "x"}, meta, kd_features=("size",), engine="e", processed_unix=0, processing_seconds=0)
    with pytest.raises(FeatureError, match="must return a dict"):
        build_record([1], meta, kd_features=(), engine="e", processed_unix=0, processing_seconds=0)


def test_build_record_stores_every_kind_of_value_as_feature_value_would() -> None:
    """The record builder's fast path for plain values must agree with the general conversion."""
    meta = tuple_pb2.TupleMeta(tuple_id=1, image="i", size=1)
    result = {
        "f": 2.5,
        "i": 7,
        "b": True,
        "n": np.float64(1.5),
        "s": "text",
        "a": [1, 2],
        "big": 2**70,
        "nan": float("nan"),
        "long": "x" * 70_000,
    }
    with pytest.raises(FeatureError, match="'long': text of 70000 characters"):
        build_record(result, meta, kd_features=(), engine="e", processed_unix=0, processing_seconds=0)
    del result["long"]
    record = build_record(
        result, meta, kd_features=("f", "i", "b", "n"), engine="e", processed_unix=0, processing_seconds=0
    )
    for name, value in result.items():
        expected = feature_value(name, value)
        if name == "nan":
            assert record.features[name].number != record.features[name].number
        else:
            assert record.features[name] == expected, name
    for kd, needle in (
        ("s", "missing from the result or not a number"),
        ("a", "not a number"),
        ("nan", "nan, not a finite number"),
        ("absent", "missing"),
    ):
        with pytest.raises(FeatureError, match=f"KD feature '{kd}'.*{needle}"):
            build_record(result, meta, kd_features=(kd,), engine="e", processed_unix=0, processing_seconds=0)


def test_engine_ports_come_from_the_configured_range() -> None:
    from hio.config import ConfigError
    from hio.worker.config import WorkerConfig
    from hio.worker.controller import free_port

    config = WorkerConfig(engine_ports="20100-20110")
    ports = {free_port("127.0.0.1", config.engine_port_range()) for _ in range(20)}
    assert ports <= set(range(20100, 20111))
    for bad in ("abc", "9-1", "0-10", "70000"):
        with pytest.raises(ConfigError, match="engine_ports"):
            WorkerConfig(engine_ports=bad).validate()


@pytest.mark.parametrize(
    "service, warned", [("hio.proto.Engine", False), ("", True)], ids=["engine", "engine-of-an-older-image"]
)
def test_the_engine_health_probe_asks_by_name_and_still_knows_an_older_image(
    service: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine answers health for hio.proto.Engine (so another role's server on its port is not
    taken for it); one whose image answers only for the server as a whole is found serving
    too, with a warning that says to rebuild the image."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hio.settings import ClusterSettings
    from hio.transport.net import create_channel, create_server
    from hio.worker.controller import _engine_health

    server, port, health = create_server(ClusterSettings(), "127.0.0.1:0", service=service)
    server.start()
    health.start()
    try:
        with create_channel(f"127.0.0.1:{port}", ClusterSettings()) as channel:
            reply = _engine_health(health_pb2_grpc.HealthStub(channel), "w1/0")
    finally:
        server.stop(0)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert any("older hio" in r.getMessage() for r in caplog.records) == warned
