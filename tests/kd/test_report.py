"""`format_knowledge` (what `hio knowledge` prints) and KD's settings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hio.config import ConfigError
from hio.kd.config import KDConfig
from hio.kd.report import format_knowledge
from hio.proto import features_pb2


def test_knowledge_reads_as_text() -> None:
    k = features_pb2.Knowledge(
        computed_unix=1.0e9,
        tuple_count=30,
        up_to_offset=31,
        malformed_records=1,
        new_records=10,
        interval_seconds=2.5,
        algorithm="BisectingKMeans(k=2)",
        feature_names=["a", "b"],
        feature_mean=[10.0, 0.0],
        feature_std=[2.0, 1.0],
    )
    k.clusters.add(id=0, centre=[-1.0, 0.0], count=10)
    k.clusters.add(id=1, centre=[1.0, 0.5], count=20)
    k.dendrogram.add(left=0, right=1, distance=2.06, size=2)
    k.assignments.add(tuple_id=99, cluster=1)
    text = format_knowledge(k)
    assert "tuples:        30 (up to repository offset 31)" in text
    assert "malformed:     1 records skipped" in text
    assert "#1          20 tuples ( 66.7%)  a=12, b=0.5" in text  # centre back in original units
    assert "m0   = #0 + #1   distance 2.06" in text
    assert "99->#1" in text


def test_empty_knowledge_still_prints() -> None:
    assert "tuples:        0" in format_knowledge(features_pb2.Knowledge())


def test_paths_default_under_data_dir(tmp_path: Path) -> None:
    config = KDConfig(data_dir=str(tmp_path))
    assert config.parquet_dir == tmp_path / "kd" / "features.parquet"
    assert config.checkpoint_dir == tmp_path / "kd" / "checkpoint"
    assert KDConfig(preview_path=str(tmp_path / "p.png")).preview_file == tmp_path / "p.png"


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("k", 0, "k"),
        ("interval", 0.0, "interval"),
        ("max_records_per_interval", 0, "max_records_per_interval"),
        ("spark_conf", ("novalue",), "spark_conf"),
        ("consumer", " ", "consumer"),
        ("max_groups", 0, "max_groups"),
        ("fit_parallelism", 0, "fit_parallelism"),
        ("preview_groups", 0, "preview_groups"),
    ],
)
def test_bad_settings_are_named(field: str, value: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        KDConfig(**{field: value}).validate()


@pytest.mark.parametrize("master", ["local", "local[2]", "local[*]", "local[4,2]", "spark://127.0.0.1:7077"])
def test_local_and_loopback_masters_put_the_driver_on_loopback(master: str) -> None:
    config = KDConfig(spark_master=master)
    config.validate()
    assert config.driver_host == "127.0.0.1"


def test_a_remote_standalone_master_leaves_the_driver_address_to_spark_or_the_setting() -> None:
    remote = {"spark_master": "spark://10.0.0.5:7077,10.0.0.6:7077", "repository_address": "10.0.0.7:7100"}
    KDConfig(**remote).validate()
    assert KDConfig(**remote).driver_host == ""
    assert KDConfig(**remote, spark_driver_host="10.0.0.8").driver_host == "10.0.0.8"


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"spark_master": "yarn"}, "spark_master must be local[N] or spark://host:port"),
        ({"spark_master": "spark://spark-master"}, "spark_master must be local[N] or spark://host:port"),
        ({"spark_master": "local[two]"}, "spark_master must be local[N] or spark://host:port"),
        (
            {"spark_master": "spark://10.0.0.5:7077", "repository_address": "127.0.0.1:7100"},
            "repository_address 127.0.0.1:7100 names whatever host dials it",
        ),
    ],
)
def test_a_master_kd_cannot_run_on_is_refused(settings: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        KDConfig(**settings).validate()  # type: ignore[arg-type]
