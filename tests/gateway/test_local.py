"""The gateway on its own (no master needed): ingest API refusals and
acceptance, spool-full back-pressure, the watcher's settle rule, config, and
`hio send` against an unreachable master. Real gRPC over loopback, real files."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hio.config import ConfigError, build
from hio.gateway import Gateway, GatewayConfig, SendConfig
from hio.gateway.config import infer_image
from hio.gateway.daemon import run_gateway
from hio.gateway.metrics import gateway_registry
from hio.gateway.spool import spooled_metas
from hio.gateway.watch import DirectoryWatcher
from hio.proto import ingest_pb2, ingest_pb2_grpc
from hio.proto.tuple_pb2 import TupleFrame, TupleMeta, TupleReceipt
from hio.transport.errors import FailedPrecondition, retry_after
from tests.harness import FsyncDisk, free_port, health_of, hio_env, wait_for

DEAD_MASTER = "127.0.0.1:1"  # nothing listens on port 1: every call is UNAVAILABLE


def frames(data: bytes, chunk: int = 1 << 20, **fields: object) -> Iterator[TupleFrame]:
    meta = TupleMeta(size=len(data), crc32=zlib.crc32(data) & 0xFFFFFFFF, **fields)
    for start in range(0, max(len(data), 1), chunk):
        part = data[start : start + chunk]
        yield TupleFrame(meta=meta if start == 0 else None, data=part, last=start + chunk >= len(data))


@contextlib.contextmanager
def running_gateway(config: GatewayConfig) -> Iterator[ingest_pb2_grpc.IngestStub]:
    """`run_gateway` in a thread (its HTTP endpoint on a free port), and a stub to its ingest
    API; stopped cleanly on exit."""
    config = dataclasses.replace(config, http_listen="127.0.0.1:0")
    stop = threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(run_gateway(config, stop)), daemon=True)
    thread.start()
    channel = grpc.insecure_channel(config.ingest_listen)
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
        yield ingest_pb2_grpc.IngestStub(channel)
    finally:
        channel.close()
        stop.set()
        thread.join(15)
    assert result == [0]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[ingest_pb2_grpc.IngestStub, Path]]:
    """`run_gateway` in a thread with an unreachable master: tuples are accepted and stay spooled."""
    config = GatewayConfig(
        master_address=DEAD_MASTER,
        data_dir=str(tmp_path / "var"),
        source="lab",
        ingest_listen=f"127.0.0.1:{free_port()}",
        max_tuple_bytes=1 << 20,
        spool_bytes=64 * 1024,
        chunk_bytes=16 * 1024,
        grace_seconds=1.0,
    )
    with running_gateway(config) as stub:
        yield stub, tmp_path / "var" / "gateway" / "spool" / "lab"


def test_ingest_accepts_and_spools(daemon: tuple[ingest_pb2_grpc.IngestStub, Path]) -> None:
    stub, spool_dir = daemon
    data = os.urandom(40_000)
    receipts = list(stub.Submit(frames(data, chunk=16 * 1024, image="hio/synthetic", name="a.bin"), timeout=10))
    assert [(r.index, r.state) for r in receipts] == [(0, TupleReceipt.ACCEPTED)]
    status = stub.GetGatewayStatus(ingest_pb2.GetGatewayStatusRequest(), timeout=5)
    assert (status.spooled_tuples, status.spooled_bytes, status.spool_bytes_limit) == (1, 40_000, 64 * 1024)
    payloads = list(spool_dir.glob("*.data"))
    assert len(payloads) == 1 and payloads[0].read_bytes() == data
    [meta] = spooled_metas(spool_dir)
    assert (meta.source, meta.image, meta.name, meta.attempt) == ("lab", "hio/synthetic", "a.bin", 1)


def test_gateway_status_says_why_tuples_wait(daemon: tuple[ingest_pb2_grpc.IngestStub, Path]) -> None:
    """An instrument's software can learn from GetGatewayStatus why nothing is delivered."""
    stub, _ = daemon
    list(stub.Submit(frames(b"x" * 100, image="hio/synthetic", name="w.bin"), timeout=10))

    def warned() -> ingest_pb2.GetGatewayStatusResponse | None:
        status = stub.GetGatewayStatus(ingest_pb2.GetGatewayStatusRequest(), timeout=5)
        return status if status.warnings else None

    status = wait_for(warned, timeout=20, what="a warning in the gateway's status")
    assert status.master_unreachable_seconds > 0 and status.spooled_tuples == 1
    warning = status.warnings[0]
    assert f"the master at {DEAD_MASTER} has been unreachable" in warning and "wait in the spool" in warning
    assert "UNAVAILABLE" in warning, f"how the last call failed: {warning}"


def test_ingest_refuses_missing_image(daemon: tuple[ingest_pb2_grpc.IngestStub, Path]) -> None:
    stub, _ = daemon
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Submit(frames(b"abc", name="noimage.bin"), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no image" in info.value.details()


def test_ingest_drops_fields_it_does_not_know_and_refuses_a_creation_time_that_is_none(
    daemon: tuple[ingest_pb2_grpc.IngestStub, Path],
) -> None:
    """The metadata's bounds hold for the fields the gateway knows: an unknown field of any size
    (a newer or a broken client's) is not kept, carried or stored."""
    stub, spool_dir = daemon
    data = b"abc"
    known = TupleMeta(image="hio/synthetic", name="u.bin", size=3, crc32=zlib.crc32(data) & 0xFFFFFFFF)
    unknown = b"\x9a\x06" + bytes([0x80, 0x80, 0x04]) + b"z" * 65536  # field 99, 64 KiB
    meta = TupleMeta.FromString(known.SerializeToString() + unknown)
    assert meta.ByteSize() > 65536
    receipts = list(stub.Submit(iter([TupleFrame(meta=meta, data=data, last=True)]), timeout=10))
    assert [r.state for r in receipts] == [TupleReceipt.ACCEPTED]
    [spooled] = spooled_metas(spool_dir)
    assert spooled.name == "u.bin" and spooled.ByteSize() < 1024, "the unknown field was dropped"
    for bad in (float("nan"), float("inf")):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Submit(frames(data, image="hio/synthetic", name="t.bin", created_unix=bad), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tuple 't.bin': created_unix must be a time" in info.value.details()
    assert len(spooled_metas(spool_dir)) == 1, "nothing kept of a refused tuple"


def test_ingest_refuses_oversized_tuple(daemon: tuple[ingest_pb2_grpc.IngestStub, Path]) -> None:
    stub, spool_dir = daemon
    meta = TupleMeta(image="hio/synthetic", name="huge", size=2 << 20, crc32=0)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Submit(iter([TupleFrame(meta=meta, data=b"x", last=False)]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "over the limit" in info.value.details()
    assert not list(spool_dir.glob("*.data"))


def test_ingest_refuses_corrupt_tuple_and_keeps_nothing(daemon: tuple[ingest_pb2_grpc.IngestStub, Path]) -> None:
    stub, spool_dir = daemon
    bad = TupleFrame(meta=TupleMeta(image="hio/synthetic", size=3, crc32=12345), data=b"abc", last=True)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Submit(iter([bad]), timeout=10))
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert not list(spool_dir.glob("*.data")) and not list(spool_dir.glob(".tmp-*"))


def test_a_spool_that_failed_to_sync_shows_in_the_gateways_metrics_until_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hio_gateway_spool_sync_failed`` is what an alert watches: 1 from the failed fsync
    (the gateway takes no new tuple) until the gateway is restarted."""
    disk = FsyncDisk(monkeypatch)
    settings = {"master_address": DEAD_MASTER, "data_dir": str(tmp_path / "var"), "source": "lab"}
    with Gateway(spool_fsync="always", **settings) as gateway:  # type: ignore[arg-type]  # Gateway settings
        registry = gateway_registry(gateway)
        assert registry.get_sample_value("hio_gateway_spool_sync_failed") == 0
        disk.error = OSError(errno.EIO, "Input/output error")
        with pytest.raises(FailedPrecondition, match="the spool's disk failed to sync"):
            gateway.submit(b"a" * 100, image="hio/synthetic", name="a.bin")
        disk.error = None
        assert registry.get_sample_value("hio_gateway_spool_sync_failed") == 1
    with Gateway(spool_fsync="always", **settings) as gateway:  # type: ignore[arg-type]  # Gateway settings
        assert gateway_registry(gateway).get_sample_value("hio_gateway_spool_sync_failed") == 0


def test_ingest_spool_full_is_resource_exhausted(daemon: tuple[ingest_pb2_grpc.IngestStub, Path]) -> None:
    stub, _ = daemon
    list(stub.Submit(frames(b"a" * 50_000, chunk=16 * 1024, image="hio/synthetic"), timeout=10))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Submit(frames(b"b" * 50_000, chunk=16 * 1024, image="hio/synthetic"), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "spool_bytes" in info.value.details()


def test_a_gateway_whose_spool_failed_to_sync_takes_no_new_tuple_until_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After a failed spool fsync a later one can report success for bytes the failed one
    lost, so the gateway takes no new tuple, also once the disk syncs again: the ingest API
    answers FAILED_PRECONDITION with the reason and a retry hint, the status names it, and watched
    files wait in their folder. The tuples taken before stay spooled; after a restart the
    gateway takes tuples again, the waiting files included."""
    disk = FsyncDisk(monkeypatch)
    watch = tmp_path / "in"
    watch.mkdir()
    config = GatewayConfig(
        master_address=DEAD_MASTER,
        data_dir=str(tmp_path / "var"),
        source="lab",
        ingest_listen=f"127.0.0.1:{free_port()}",
        watch=str(watch),
        settle_seconds=0.2,
        poll_seconds=0.05,
        grace_seconds=1.0,
    )

    def status(stub: ingest_pb2_grpc.IngestStub) -> ingest_pb2.GetGatewayStatusResponse:
        return stub.GetGatewayStatus(ingest_pb2.GetGatewayStatusRequest(), timeout=5)

    with running_gateway(config) as stub:
        disk.open.clear()  # no round ends before 'a' is in
        disk.error = OSError(errno.EIO, "Input/output error")
        [receipt] = stub.Submit(frames(b"a" * 100, image="hio/synthetic", name="a.bin"), timeout=10)
        assert receipt.state == TupleReceipt.ACCEPTED  # 'batch': receipted before its fsync
        disk.open.set()
        warned = wait_for(
            lambda: [w for w in status(stub).warnings if "failed to sync" in w],
            timeout=10,
            what="the failed fsync in the gateway's status",
        )
        assert "Input/output error" in warned[0] and "restart the gateway" in warned[0]
        address = config.ingest_listen
        wait_for(lambda: health_of(address) == "NOT_SERVING", timeout=5, what="the gateway no longer ready")
        assert health_of(address, "hio.proto.Ingest") == "NOT_SERVING" and health_of(address, "liveness") == "SERVING"
        disk.error = None
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Submit(frames(b"b" * 100, image="hio/synthetic", name="b.bin"), timeout=10))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "the spool's disk failed to sync" in refused.value.details() and retry_after(refused.value)
        (watch / "late.tif").write_bytes(b"t" * 100)
        wait_for(
            lambda: any("the spool takes no new files" in r.getMessage() for r in caplog.records),
            timeout=10,
            what="the watcher refused by the spool",
        )
        assert (watch / "late.tif").exists() and status(stub).spooled_tuples == 1
        assert not list((tmp_path / "var" / "gateway" / "spool" / "lab").glob(".tmp-*"))
    with running_gateway(config) as stub:
        wait_for(lambda: status(stub).spooled_tuples == 2, timeout=10, what="the watched file taken")
        [receipt] = stub.Submit(frames(b"b" * 100, image="hio/synthetic", name="b.bin"), timeout=10)
        assert receipt.state == TupleReceipt.ACCEPTED
        st = status(stub)
        assert st.spooled_tuples == 3 and not [w for w in st.warnings if "failed to sync" in w]
        assert health_of(config.ingest_listen) == "SERVING"  # restarted: ready again


def test_library_blocks_then_raises_spool_full(tmp_path: Path) -> None:
    from hio.gateway import SpoolFull

    with Gateway(
        master_address=DEAD_MASTER, data_dir=str(tmp_path), spool_bytes=4096, chunk_bytes=1024, grace_seconds=0.2
    ) as gw:
        gw.submit(b"x" * 3000, image="hio/synthetic")
        start = time.monotonic()
        with pytest.raises(SpoolFull, match="spool_bytes"):
            gw.submit(b"y" * 3000, image="hio/synthetic", timeout=0.5)
        assert time.monotonic() - start >= 0.45
        with pytest.raises(Exception, match=r"DEAD|unreachable|within"):
            gw.send(b"z" * 10, image="hio/synthetic", timeout=1.0)


def test_watcher_takes_a_file_only_once_it_settles(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    watch = tmp_path / "in"
    (watch / "plate").mkdir(parents=True)
    with Gateway(master_address=DEAD_MASTER, data_dir=str(tmp_path / "var"), grace_seconds=0.2) as gw:
        watcher = DirectoryWatcher(gw, watch, watch / ".hio-done", settle_seconds=1.0)
        growing = watch / "plate" / "a.tif"
        growing.write_bytes(b"1" * 100)
        (watch / "b.tif.part").write_bytes(b"ignored")
        (watch / ".hidden.tif").write_bytes(b"ignored")
        (watch / "notes.txt").write_bytes(b"no image for this one")
        assert watcher.scan_once(now=0.0) == 0
        with open(growing, "ab") as fh:
            fh.write(b"2" * 100)
        os.utime(growing, ns=(1, 1))  # the writer touched it: the clock restarts
        assert watcher.scan_once(now=0.9) == 0
        assert watcher.scan_once(now=1.5) == 0  # unchanged for 0.6 s only
        assert watcher.scan_once(now=2.0) == 1  # unchanged for 1.1 s: taken
        assert watcher.scan_once(now=9.0) == 0  # never twice
        [entry] = gw.spool.entries()
        assert (entry.meta.image, entry.meta.name, entry.meta.size) == ("hio/microscopy", "a.tif", 200)
        assert entry.move.target == str((watch / ".hio-done" / "plate" / "a.tif").resolve())
        assert growing.exists()  # moved only once delivered
        [refused] = [r for r in caplog.records if r.getMessage() == "file not sent"]
        assert "notes.txt: cannot tell the image from the extension '.txt'" in vars(refused)["error"]
        assert (watch / "notes.txt").exists(), "a file it cannot send stays where the instrument put it"
        assert not (watch / ".hio-done" / ".rejected").exists()


def test_image_inference() -> None:
    assert infer_image("x/plate.TIFF") == "hio/microscopy"
    assert infer_image("run.npz") == "hio/simulation"
    assert infer_image("notes.txt", "my/image") == "my/image"
    with pytest.raises(ConfigError, match=r"notes\.txt.*--image"):
        infer_image("notes.txt")


def test_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="streams"):
        build(GatewayConfig, "gateway", overrides={"streams": 0})
    with pytest.raises(ConfigError, match="watch"):
        build(GatewayConfig, "gateway", overrides={"watch": str(tmp_path / "missing")})
    config = build(GatewayConfig, "gateway", overrides={"watch": str(tmp_path)})
    assert config.resolved_done_dir() == str(tmp_path / ".hio-done")
    assert config.resolved_source()
    assert build(SendConfig, "gateway").files == (), "no FILE: finish what an earlier hio send left spooled"
    with pytest.raises(ConfigError, match="name no FILE"):
        build(SendConfig, "gateway", overrides={"files": ("a.bin",), "drop_spooled": True})
    with pytest.raises(ConfigError, match="FILE"):
        build(SendConfig, "gateway", overrides={"wait": False})


def test_send_fails_fast_naming_an_unreachable_master(tmp_path: Path) -> None:
    sample = tmp_path / "plate.tif"
    sample.write_bytes(b"x" * 100)
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hio.cli",
            "send",
            str(sample),
            "--master-address",
            DEAD_MASTER,
            "--connect-seconds",
            "1",
            "--data-dir",
            str(tmp_path / "var"),
        ],
        capture_output=True,
        text=True,
        env=hio_env(),
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert DEAD_MASTER in proc.stderr and "cannot reach the master" in proc.stderr
    assert time.monotonic() - start < 30


def test_send_refuses_a_file_without_image(tmp_path: Path) -> None:
    sample = tmp_path / "notes.txt"
    sample.write_text("hello")
    proc = subprocess.run(
        [sys.executable, "-m", "hio.cli", "send", str(sample), "--master-address", DEAD_MASTER],
        capture_output=True,
        text=True,
        env=hio_env(),
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "notes.txt" in proc.stderr and "--image" in proc.stderr


def test_close_ends_a_route_call_a_silent_master_never_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A master that takes the connection and never answers holds a RouteTuples call until its
    deadline (15 s); closing the gateway ends it, and no delivery thread outlives the close."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # never accepted, never answered
    before = set(threading.enumerate())
    try:
        gw = Gateway(master_address=f"127.0.0.1:{silent.getsockname()[1]}", data_dir=str(tmp_path), grace_seconds=0.2)
        gw.submit(b"held", image="hio/synthetic")
        time.sleep(0.5)  # the route call is on its way
        started = time.monotonic()
        gw.close(drain=False)
        took = time.monotonic() - started
        left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("hio-gateway-stream-")]
    finally:
        silent.close()
    assert took < 4.0, f"close waited {took:.1f} s for a route call"
    assert not left, f"delivery threads outlived the close: {left}"
    assert not [r for r in caplog.records if r.getMessage() == "master unreachable; retrying"], "the stop is no news"


def test_submit_after_close_says_the_gateway_is_closed(tmp_path: Path) -> None:
    from hio.gateway import DeliveryError

    gw = Gateway(master_address=DEAD_MASTER, data_dir=str(tmp_path), grace_seconds=0.2)
    gw.close(drain=False)
    with pytest.raises(DeliveryError, match="gateway is closed"):
        gw.submit(b"late", image="hio/synthetic")
    (tmp_path / "late.bin").write_bytes(b"late")
    with pytest.raises(DeliveryError, match="gateway is closed"):
        gw.submit_file(tmp_path / "late.bin", image="hio/synthetic")


def test_send_names_a_file_that_vanished_before_it_was_spooled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hio.gateway.config import SendConfig
    from hio.gateway.send import _Sender

    gone = tmp_path / "gone.bin"  # listed, then deleted by the instrument before hio send reached it
    config = SendConfig(
        master_address=DEAD_MASTER,
        data_dir=str(tmp_path / "var"),
        connect_seconds=1.0,
        progress=False,
        grace_seconds=0.2,
    )
    code = _Sender(config, [gone], {gone: "hio/synthetic"}).run()
    assert code != 0
    out = capsys.readouterr().out
    assert "FAILED" in out and "gone.bin" in out and "No such file" in out


def test_send_stops_at_once_when_the_master_refuses_its_token(tmp_path: Path) -> None:
    """A missing or wrong token never mends itself while hio send waits, so it says so and
    stops instead of retrying; the file stays spooled for the next hio send."""
    from tests.harness import HioProcess

    tokens = tmp_path / "tokens"
    tokens.write_text("good-token gateway lab\n")
    address = f"127.0.0.1:{free_port()}"
    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    with HioProcess(
        "master", ["--listen", address, "--data-dir", str(tmp_path / "m"), "--tokens-file", str(tokens)], tmp_path
    ) as master:
        master.wait_started(address)
        started = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hio.cli",
                "send",
                str(tmp_path / "a.bin"),
                "--image",
                "hio/synthetic",
                "--master-address",
                address,
                "--token",
                "wrong-token",
                "--data-dir",
                str(tmp_path / "var"),
            ],
            capture_output=True,
            text=True,
            env=hio_env(),
            timeout=60,
            cwd=tmp_path,
        )
        assert time.monotonic() - started < 30
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "refuses this gateway" in proc.stderr and "UNAUTHENTICATED" in proc.stderr, proc.stderr
    assert "stay spooled" in proc.stderr


def test_drop_spooled_while_another_hio_send_runs_says_so(tmp_path: Path) -> None:
    from hio.gateway.spool import Spool

    held = Spool(tmp_path / "var" / "gateway" / "spool" / "send-busy", 1 << 20)  # as a running hio send holds it
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hio.cli",
                "send",
                "--drop-spooled",
                "--source",
                "busy",
                "--data-dir",
                str(tmp_path / "var"),
            ],
            capture_output=True,
            text=True,
            env=hio_env(),
            timeout=60,
            cwd=tmp_path,
        )
    finally:
        held.close()
    assert proc.returncode == 2
    assert "another hio send of source 'busy' is running and holds its spool; wait for it" in proc.stderr
