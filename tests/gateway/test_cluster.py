"""The gateway against the real master, worker (hio/synthetic engines) and
repository, each a real `hio` process on free loopback ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from hio.gateway import Gateway, GatewayConfig
from hio.gateway.client import DeliveryTimeout
from hio.proto import (
    features_pb2,
    ingest_pb2,
    ingest_pb2_grpc,
    master_pb2,
    master_pb2_grpc,
    repository_pb2,
    repository_pb2_grpc,
)
from hio.proto.tuple_pb2 import TupleFrame, TupleMeta, TupleReceipt
from tests.harness import HioProcess, error_after_stop, free_port, hio_env, local_cluster, wait_for

if TYPE_CHECKING:
    from hio.gateway.watch import DirectoryWatcher

IMAGE = "hio/synthetic"


def _roles_built() -> str:
    """'' when the master, worker and repository roles can run, else what is missing."""
    import importlib

    for module, name in (
        ("hio.master", "run_master"),
        ("hio.worker", "run_worker"),
        ("hio.repository", "run_repository"),
        ("hio.worker.pipelines.synthetic", "process"),
    ):
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            return f"{module}.{name} not available yet ({exc})"
    return ""


pytestmark = pytest.mark.skipif(bool(_roles_built()), reason=_roles_built() or "roles built")


@dataclass
class Cluster:
    master: str
    repository: str
    root: Path

    def config(self, name: str, **overrides: object) -> GatewayConfig:
        values = {
            "master_address": self.master,
            "repository_address": self.repository,
            "data_dir": str(self.root / name),
            "source": name,
            "ingest_listen": "",
            "grace_seconds": 2.0,
        }
        values.update(overrides)
        return GatewayConfig(**values)  # type: ignore[arg-type]

    def records(self) -> dict[int, features_pb2.FeatureRecord]:
        """Every feature record in the repository, by tuple id."""
        import zstandard

        out: dict[int, features_pb2.FeatureRecord] = {}
        with grpc.insecure_channel(self.repository) as channel:
            stub = repository_pb2_grpc.RepositoryStub(channel)
            for batch in stub.ReadFeatures(repository_pb2.ReadFeaturesRequest(after=0), timeout=10):
                for stored in batch.records:
                    raw = zstandard.ZstdDecompressor().decompressobj().decompress(stored.record_zstd)
                    out[stored.tuple_id] = features_pb2.FeatureRecord.FromString(raw)
        return out

    def wait_records(self, ids: list[int], timeout: float = 60.0) -> dict[int, features_pb2.FeatureRecord]:
        def ready() -> dict[int, features_pb2.FeatureRecord] | None:
            found = self.records()
            return found if all(i in found for i in ids) else None

        return wait_for(ready, timeout=timeout, interval=0.3, what=f"features of tuples {ids}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    with local_cluster(root, workers={"": [f"{IMAGE}=2"]}) as roles:
        yield Cluster(roles.master, roles.repository, root)


def test_send_bytes_stores_features(cluster: Cluster) -> None:
    data = os.urandom(50_000)
    with Gateway(cluster.config("bytes")) as gw:
        tuple_id = gw.send(data, image=IMAGE, name="first", attributes={"plate": "7"}, timeout=60)
        assert tuple_id > 0
        status = gw.status()
    record = cluster.wait_records([tuple_id])[tuple_id]
    assert (record.meta.size, record.meta.crc32) == (len(data), zlib.crc32(data) & 0xFFFFFFFF)
    assert (record.meta.name, record.meta.source, record.meta.attributes["plate"]) == ("first", "bytes", "7")
    assert record.features
    assert status.stored + status.enqueued == 1 and status.spooled_tuples == 0


def test_ten_megabyte_tuple_is_chunked(cluster: Cluster, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(10 * 1000 * 1000))
    with Gateway(cluster.config("big", chunk_bytes=256 * 1024)) as gw:
        tuple_id = gw.send_file(big, image=IMAGE, timeout=120)
    record = cluster.wait_records([tuple_id])[tuple_id]
    # 10 MB cannot travel in one 256 KiB frame: the engine verified all ~39 frames.
    assert record.meta.size == 10 * 1000 * 1000
    assert big.read_bytes()[:4] and big.exists()  # the caller's file is untouched


def test_send_many_concurrently(cluster: Cluster) -> None:
    payloads = [os.urandom(2000 + i) for i in range(30)]
    with Gateway(cluster.config("many", streams=4, batch_tuples=8)) as gw:
        ids = gw.send_many(payloads, image=IMAGE, timeout=120)
    assert len(set(ids)) == 30
    records = cluster.wait_records(ids)
    assert [records[i].meta.size for i in ids] == [len(p) for p in payloads]


def test_forced_queue_path(cluster: Cluster) -> None:
    with Gateway(cluster.config("queued", force_queue=True)) as gw:
        tuple_id = gw.send(b"q" * 5000, image=IMAGE, timeout=60)
        status = gw.status()
        assert (status.sent_queue, status.sent_direct) == (1, 0)
        assert (status.bytes_sent_queue, status.bytes_sent_direct) == (5000, 0)
    assert cluster.wait_records([tuple_id])[tuple_id].meta.size == 5000  # an idle engine pulled it


def _gateway_args(cluster: Cluster, tmp_path: Path, port: int, *extra: str) -> list[str]:
    return [
        "--master-address",
        cluster.master,
        "--ingest-listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(tmp_path / "var"),
        "--source",
        "ingest",
        *extra,
    ]


def _ingest_frames(data: bytes, name: str, **attributes: str) -> list[TupleFrame]:
    """One tuple as an integrator frames it (docs/ingest.md): metadata first, chunks, last."""
    meta = TupleMeta(
        image=IMAGE,
        name=name,
        size=len(data),
        crc32=zlib.crc32(data) & 0xFFFFFFFF,
        attributes={"hio.wait": "stored", **attributes},
    )
    chunks = [data[start : start + (1 << 20)] for start in range(0, len(data), 1 << 20)]
    frames = [TupleFrame(data=chunk) for chunk in chunks]
    frames[0].meta.CopyFrom(meta)
    frames[-1].last = True
    return frames


def test_ingest_submit_from_a_raw_stub(cluster: Cluster, tmp_path: Path) -> None:
    """A client of the proto alone: the limits from GetGatewayStatus, a tuple STORED, and one
    whose processing failed ENQUEUED as RETRYING (no message to parse)."""
    port = free_port()
    with HioProcess("gateway", _gateway_args(cluster, tmp_path, port), tmp_path) as gateway:
        gateway.wait_started(f"127.0.0.1:{port}")
        data = os.urandom(2 * 1024 * 1024 + 500_017)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ingest_pb2_grpc.IngestStub(channel)
            limits = stub.GetGatewayStatus(ingest_pb2.GetGatewayStatusRequest(), timeout=5)
            frames = _ingest_frames(data, "from-c++") + _ingest_frames(b"x" * 5000, "bad.bin", cost_ms="abc")
            receipts = list(stub.Submit(iter(frames), timeout=60))
            status = stub.GetGatewayStatus(ingest_pb2.GetGatewayStatusRequest(), timeout=5)
    assert (limits.chunk_bytes, limits.max_tuple_bytes, limits.stream_idle_seconds) == (1 << 20, 256 << 20, 30.0)
    accepted = [r.index for r in receipts if r.state == TupleReceipt.ACCEPTED]
    final = {r.index: r for r in receipts if r.state != TupleReceipt.ACCEPTED}
    assert sorted(accepted) == [0, 1] and sorted(final) == [0, 1]
    assert final[0].state == TupleReceipt.STORED and final[0].queued == TupleReceipt.QUEUED_UNSPECIFIED
    assert final[1].state == TupleReceipt.ENQUEUED and final[1].queued == TupleReceipt.RETRYING
    assert "cost_ms='abc' is not a number" in final[1].message
    tuple_id = final[0].tuple_id
    assert tuple_id > 0 and status.stored == 1 and status.spooled_tuples == 0
    record = cluster.wait_records([tuple_id])[tuple_id]
    assert (record.meta.name, record.meta.size, record.meta.source) == ("from-c++", len(data), "ingest")
    assert "hio.wait" not in record.meta.attributes


def test_ingest_receipts_say_a_tuple_waits_in_the_queue(cluster: Cluster, tmp_path: Path) -> None:
    port = free_port()
    with HioProcess("gateway", _gateway_args(cluster, tmp_path, port, "--force-queue"), tmp_path) as gateway:
        gateway.wait_started(f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            receipts = list(
                ingest_pb2_grpc.IngestStub(channel).Submit(iter(_ingest_frames(b"q" * 5000, "q")), timeout=60)
            )
    assert [(r.state, r.queued) for r in receipts] == [
        (TupleReceipt.ACCEPTED, TupleReceipt.QUEUED_UNSPECIFIED),
        (TupleReceipt.ENQUEUED, TupleReceipt.WAITING),
    ]
    assert cluster.wait_records([receipts[1].tuple_id])  # an idle engine pulled it


def test_ingest_waiting_for_an_image_no_engine_serves_ends_at_the_deadline_or_the_gateway_stop(
    cluster: Cluster, tmp_path: Path
) -> None:
    """docs/ingest.md: the final receipt waits for an engine of the image; the gateway's status
    names the image; the client's deadline or the gateway's stop ends the stream (the stop
    saying so), and the tuples stay accepted."""
    port = free_port()
    with HioProcess("gateway", _gateway_args(cluster, tmp_path, port), tmp_path) as gateway:
        gateway.wait_started(f"127.0.0.1:{port}")
        frames = _ingest_frames(b"u" * 5000, "unserved")
        frames[0].meta.image = "hio/served-by-nobody"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ingest_pb2_grpc.IngestStub(channel)
            stream = stub.Submit(iter(frames), timeout=4)
            assert next(stream).state == TupleReceipt.ACCEPTED
            with pytest.raises(grpc.RpcError) as ended:
                next(stream)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            status = wait_for(
                lambda: (s := stub.GetGatewayStatus(ingest_pb2.GetGatewayStatusRequest(), timeout=5)).warnings and s,
                timeout=20,
                what="the unserved image in the gateway's status",
            )
            waiting = stub.Submit(iter(frames), timeout=60)
            assert next(waiting).state == TupleReceipt.ACCEPTED
            assert gateway.proc is not None
            gateway.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as stopped:
                next(waiting)
    assert stopped.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (stopped.value.details() or "").startswith("the gateway is stopping; submit what it did not accept")
    assert "the tuples this stream waits for (1) are ACCEPTED, kept in its spool" in (stopped.value.details() or "")
    assert status.spooled_tuples == 1, "accepted, so kept for delivery"
    assert any("no engine serves image 'hio/served-by-nobody'" in w for w in status.warnings), status.warnings
    with HioProcess("gateway", _gateway_args(cluster, tmp_path, port), tmp_path) as gateway:
        gateway.wait_started(f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            after = ingest_pb2_grpc.IngestStub(channel).GetGatewayStatus(
                ingest_pb2.GetGatewayStatusRequest(), timeout=5
            )
    assert after.spooled_tuples == 2, "both accepted tuples kept across the stop"


def test_a_tuple_still_arriving_when_the_gateway_stops_is_cut_off_with_the_reason(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A sender stalled in the middle of a tuple has grace_seconds / 2 - 1 s to finish it once
    the gateway stops; then the gateway ends the stream itself (UNAVAILABLE, saying what to send
    again), not the server's stop with CANCELLED; the tuple cut off is not kept."""
    port = free_port()
    release = threading.Event()
    frames = _ingest_frames(os.urandom(3 * 1024 * 1024), "half-sent")

    def stalled_sender() -> Iterator[TupleFrame]:
        yield frames[0]  # the metadata and the first of three chunks
        release.wait(60)

    args = _gateway_args(cluster, tmp_path, port, "--grace-seconds", "4")
    with HioProcess("gateway", args, tmp_path) as gateway:
        gateway.wait_started(f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = ingest_pb2_grpc.IngestStub(channel).Submit(stalled_sender(), timeout=60)
            time.sleep(0.5)  # the first frame arrives
            assert gateway.proc is not None
            error, took = error_after_stop(lambda: gateway.proc.send_signal(signal.SIGTERM), stream)
        release.set()
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert error.details() == "the gateway is stopping; submit what it did not accept to its next start"
    assert 0.8 < took < 4, f"cut off {took:.1f} s after the stop; the tuple had 1 s to finish"
    with HioProcess("gateway", args, tmp_path) as gateway:
        gateway.wait_started(f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            after = ingest_pb2_grpc.IngestStub(channel).GetGatewayStatus(
                ingest_pb2.GetGatewayStatusRequest(), timeout=5
            )
    assert after.spooled_tuples == 0, "a tuple cut off is not accepted, so not kept"


def test_watch_takes_a_slowly_written_file_once_settled(cluster: Cluster, tmp_path: Path) -> None:
    watch = tmp_path / "instrument"
    (watch / "day1").mkdir(parents=True)
    args = [
        "--master-address",
        cluster.master,
        "--ingest-listen",
        "",
        "--watch",
        str(watch),
        "--image",
        IMAGE,
        "--settle-seconds",
        "1.0",
        "--data-dir",
        str(tmp_path / "var"),
        "--source",
        "watch",
    ]
    target = watch / "day1" / "slow.bin"
    with HioProcess("gateway", args, tmp_path):
        with open(target, "wb") as fh:
            for _ in range(4):  # 4 writes 0.4 s apart: never still for the settle time
                fh.write(os.urandom(100_000))
                fh.flush()
                time.sleep(0.4)
                assert target.exists(), "taken before it settled"
        done = watch / ".hio-done" / "day1" / "slow.bin"
        wait_for(done.exists, timeout=60, what="the file in the done folder")
        assert not target.exists()
    records = [r for r in cluster.records().values() if r.meta.source == "watch"]
    assert [(r.meta.name, r.meta.size) for r in records] == [("slow.bin", 400_000)]


def test_spooled_tuples_survive_kill_9(cluster: Cluster, tmp_path: Path) -> None:
    port = free_port()
    base = ["--ingest-listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "var"), "--source", "crashy"]
    payloads = [os.urandom(10_000 + i) for i in range(3)]
    dead_master = f"127.0.0.1:{free_port()}"  # nothing listens: tuples stay spooled
    first = HioProcess("gateway", ["--master-address", dead_master, *base], tmp_path, name="gateway-1").start()
    try:
        first.wait_started(f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ingest_pb2_grpc.IngestStub(channel)
            for n, data in enumerate(payloads):
                meta = TupleMeta(image=IMAGE, name=f"t{n}", size=len(data), crc32=zlib.crc32(data) & 0xFFFFFFFF)
                receipts = list(stub.Submit(iter([TupleFrame(meta=meta, data=data, last=True)]), timeout=10))
                assert receipts[0].state == TupleReceipt.ACCEPTED
    finally:
        first.kill()
    with HioProcess("gateway", ["--master-address", cluster.master, *base], tmp_path, name="gateway-2") as second:
        second.wait_started(f"127.0.0.1:{port}")

        def drained() -> bool:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                status = ingest_pb2_grpc.IngestStub(channel).GetGatewayStatus(
                    ingest_pb2.GetGatewayStatusRequest(), timeout=5
                )
            return status.spooled_tuples == 0 and status.stored + status.sent_queue == 3

        wait_for(drained, timeout=60, what="the resumed tuples delivered")
    records = [r for r in cluster.records().values() if r.meta.source == "crashy"]
    assert sorted(r.meta.name for r in records) == ["t0", "t1", "t2"]


@pytest.mark.parametrize(
    "lanes, master_attempts", [(False, 1000), (True, 1000), (True, 1)], ids=["grpc", "lane", "master-dead-letters"]
)
def test_a_spooled_payload_that_cannot_be_read_is_named_and_sent_once_it_can_be(
    cluster: Cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture, lanes: bool, master_attempts: int
) -> None:
    """Over gRPC or a payload lane, a spooled file that cannot be read while it is streamed ends
    the call with its path and the reason, not gRPC's "Exception iterating requests!"
    and a traceback; it stays spooled, and goes once it can be read again. A second
    real master (no workers: the tuple goes to its backlog) starts after the file is
    spooled, so the read fails in the stream, past the spool's checks.

    Every failed read counts an attempt (a disk error is the tuple's) with a short backoff,
    so both sides get enough attempts that a loaded machine cannot use them up before the
    test mends the file. With a master that allows one attempt, the tuple arrives as a dead
    letter: the gateway must say so (the master decides), though it would try again itself."""
    import logging

    from hio.gateway import DeliveryError

    caplog.set_level(logging.WARNING)
    master = f"127.0.0.1:{free_port()}"
    original = tmp_path / "frame.bin"
    original.write_bytes(os.urandom(300_000))
    with Gateway(
        cluster.config(f"unreadable-{lanes}-{master_attempts}", master_address=master, lanes=lanes, max_attempts=1000)
    ) as gw:
        future = gw.submit_file(original, image=IMAGE)
        spooled = [
            p
            for p in (cluster.root / f"unreadable-{lanes}-{master_attempts}").rglob("*")
            if p.is_file() and p.stat().st_ino == original.stat().st_ino
        ]
        assert len(spooled) == 1, "put_file hard-links the file into the spool"
        spooled[0].unlink()
        (tmp_path / "a-folder").mkdir()
        spooled[0].symlink_to(tmp_path / "a-folder")  # open() now fails: IsADirectoryError
        with HioProcess(
            "master",
            ["--listen", master, "--data-dir", str(tmp_path / "master"), "--max-attempts", str(master_attempts)],
            tmp_path,
            name="master-unreadable",
        ) as second:
            second.wait_started(master)

            def named() -> bool:
                return any(
                    r.getMessage() == "cannot read a spooled payload"
                    and getattr(r, "path", "") == str(spooled[0])
                    and "Is a directory" in getattr(r, "error", "")
                    for r in caplog.records
                )

            wait_for(named, timeout=30, what="the unreadable payload named in the log")
            assert not future.done()
            os.link(original, tmp_path / "mended")
            os.replace(tmp_path / "mended", spooled[0])  # in one step: the gateway never finds it missing
            with grpc.insecure_channel(master) as channel:
                stub = master_pb2_grpc.MasterStub(channel)
                if master_attempts > 1:
                    assert gw.result(future, timeout=60) > 0 and future.outcome == "enqueued"
                    status = stub.GetStatus(master_pb2.GetStatusRequest(), timeout=10)
                    assert sum(q.length for q in status.queues) == 1 and status.dead_letters == 0
                else:
                    with pytest.raises(DeliveryError, match="Is a directory"):
                        gw.result(future, timeout=60)
                    assert future.outcome == "dead-lettered"
                    letters = stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=10).dead_letters
                    assert len(letters) == 1 and "Is a directory" in letters[0].reason
    assert not [r for r in caplog.records if "Exception iterating requests" in r.getMessage()]


def test_hio_send_prints_a_summary(cluster: Cluster, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    for n in range(3):
        (folder / f"r{n}.bin").write_bytes(os.urandom(20_000))
    (folder / "skip.part").write_bytes(b"still being written")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hio.cli",
            "send",
            str(folder),
            "--image",
            IMAGE,
            "--master-address",
            cluster.master,
            "--data-dir",
            str(tmp_path / "var"),
        ],
        capture_output=True,
        text=True,
        env=hio_env(),
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sent 3 of 3 tuples" in proc.stdout and "0 failed" in proc.stdout and "MB/s" in proc.stdout


def test_hio_send_gives_up_on_an_image_no_engine_serves_and_says_which(cluster: Cluster, tmp_path: Path) -> None:
    """A misspelt image never finds an engine: hio send names it (and the images the master
    knows) after --image-wait-seconds, instead of waiting for ever; files of served images
    are still delivered, and the unserved one stays spooled."""
    good, typo = tmp_path / "good.bin", tmp_path / "typo.bin"
    good.write_bytes(os.urandom(10_000))
    typo.write_bytes(os.urandom(10_000))
    common = ["--master-address", cluster.master, "--data-dir", str(tmp_path / "var"), "--source", "typo"]
    send = [sys.executable, "-m", "hio.cli", "send", "--image-wait-seconds", "3", *common]
    started = time.monotonic()
    first = subprocess.run(
        [*send, "--image", IMAGE, str(good)], capture_output=True, text=True, env=hio_env(), timeout=60, cwd=tmp_path
    )
    assert first.returncode == 0, first.stdout + first.stderr
    second = subprocess.run(
        [*send, "--image", "hio/synthetik", str(typo)],
        capture_output=True,
        text=True,
        env=hio_env(),
        timeout=60,
        cwd=tmp_path,
    )
    assert time.monotonic() - started < 50
    assert second.returncode == 1, second.stdout + second.stderr
    assert "sent 0 of 1 tuples" in second.stdout
    failed = [line for line in second.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "typo.bin" in failed[0], second.stdout
    assert "no engine serves image 'hio/synthetik'" in failed[0] and IMAGE in failed[0], failed[0]
    assert "stays spooled" in failed[0]
    with Gateway(cluster.config("typo-status", image_wait_seconds=2.0)) as gw:  # the library and the daemon too
        gw.submit(b"abc", image="hio/synthetik")
        warnings = wait_for(lambda: gw.status().warnings(), timeout=20, what="the unserved image in the status")
        assert "no engine serves image 'hio/synthetik'" in warnings[0] and IMAGE in warnings[0]
        blocked = time.monotonic()
        with pytest.raises(DeliveryTimeout, match="no engine serves image 'hio/synthetik' after") as gave_up:
            gw.send(b"abcd", image="hio/synthetik", timeout=120)
        assert time.monotonic() - blocked < 30, "the blocking send gives up after image_wait_seconds"
        assert "stays spooled" in str(gave_up.value) and IMAGE in str(gave_up.value)
        gw.close(timeout=0.2, drain=False)
    stored = [r.meta.name for r in cluster.records().values() if r.meta.source == "typo"]
    assert stored == ["good.bin"]
    from hio.gateway.spool import spooled_metas

    spool = tmp_path / "var" / "gateway" / "spool" / "send-typo"
    assert [(m.name, m.image) for m in spooled_metas(spool)] == [("typo.bin", "hio/synthetik")], (
        "the unserved tuple stays spooled"
    )
    again = subprocess.run(
        [*send, "--image", "hio/synthetik", str(typo)],
        capture_output=True,
        text=True,
        env=hio_env(),
        timeout=60,
        cwd=tmp_path,
    )  # the same file again: not spooled twice
    assert again.returncode == 1 and "1 of them among the files named" in again.stderr, again.stdout + again.stderr
    assert "sent 0 of 1 tuples" in again.stdout and len(spooled_metas(spool)) == 1
    dropped = subprocess.run(
        [*send, "--drop-spooled"], capture_output=True, text=True, env=hio_env(), timeout=60, cwd=tmp_path
    )
    assert dropped.returncode == 0, dropped.stdout + dropped.stderr
    assert "dropped typo.bin (0.0 MB, image hio/synthetik" in dropped.stdout
    assert "dropped 1 spooled tuples" in dropped.stdout and spooled_metas(spool) == []
    nothing = subprocess.run(send, capture_output=True, text=True, env=hio_env(), timeout=60, cwd=tmp_path)
    assert nothing.returncode == 2 and "nothing to send" in nothing.stderr, nothing.stdout + nothing.stderr


def _spool_for_send(root: Path, source: str, files: list[Path], **submit: object) -> None:
    """Leave ``files`` in ``hio send``'s spool for ``source``, as a run cut short
    (its master unreachable) would."""
    config = GatewayConfig(
        master_address=f"127.0.0.1:{free_port()}",
        data_dir=str(root),
        source=source,
        ingest_listen="",
        grace_seconds=0.2,
    )
    gw = Gateway(config, spool_name=f"send-{source}")
    for path in files:
        gw.submit_file(path, image=IMAGE, **submit)  # type: ignore[arg-type]
    gw.close(timeout=0.2, drain=False)


def test_hio_send_again_after_a_cut_short_run_sends_each_file_once(cluster: Cluster, tmp_path: Path) -> None:
    """Including files of one name, size and mtime in two folders (per-well img.bin after a tar)."""
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    files = [tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "A" / "img.bin", tmp_path / "B" / "img.bin"]
    for path in files:
        path.write_bytes(os.urandom(20_000))
        os.utime(path, (1_700_000_000, 1_700_000_000))
    _spool_for_send(tmp_path / "var", "rerun", [files[0], files[2]])
    send = [
        sys.executable,
        "-m",
        "hio.cli",
        "send",
        "--image",
        IMAGE,
        "--master-address",
        cluster.master,
        "--data-dir",
        str(tmp_path / "var"),
        "--source",
        "rerun",
    ]
    proc = subprocess.run(
        [*send, *map(str, files)], capture_output=True, text=True, env=hio_env(), timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resuming 2 tuples" in proc.stderr and "2 of them among the files named" in proc.stderr
    assert "sent 4 of 4 tuples" in proc.stdout, proc.stdout
    stored = [r.meta for r in cluster.records().values() if r.meta.source == "rerun"]
    assert sorted(m.name for m in stored) == ["a.bin", "b.bin", "img.bin", "img.bin"], "each file stored once"
    assert {m.crc32 for m in stored} == {zlib.crc32(p.read_bytes()) for p in files}, "and every one of them"


def test_hio_send_names_a_tuple_whose_processing_failed_and_went_to_the_queue(cluster: Cluster, tmp_path: Path) -> None:
    """hio send with no FILE finishes what is spooled; a tuple the engine could not process
    is delivered (the master's queue tries it again) but listed with the engine's error."""
    bad = tmp_path / "bad.bin"
    bad.write_bytes(os.urandom(5_000))
    _spool_for_send(tmp_path / "var", "retrying", [bad], attributes={"cost_ms": "abc"})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hio.cli",
            "send",
            "--master-address",
            cluster.master,
            "--data-dir",
            str(tmp_path / "var"),
            "--source",
            "retrying",
        ],
        capture_output=True,
        text=True,
        env=hio_env(),
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sent 1 of 1 tuples" in proc.stdout and "1 queued again after their processing failed" in proc.stdout
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RETRYING")]
    assert line.startswith("RETRYING bad.bin (spooled earlier): processing failed:"), line
    assert "cost_ms='abc' is not a number" in line and "hio dead-letters" in line


def test_hio_send_no_wait_hands_files_to_the_daemon(cluster: Cluster, tmp_path: Path) -> None:
    port = free_port()
    files = []
    for n in range(2):
        files.append(tmp_path / f"h{n}.bin")
        files[-1].write_bytes(os.urandom(30_000))
    args = [
        "--master-address",
        cluster.master,
        "--ingest-listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(tmp_path / "var"),
        "--source",
        "handover",
    ]
    with HioProcess("gateway", args, tmp_path) as gateway:
        gateway.wait_started(f"127.0.0.1:{port}")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hio.cli",
                "send",
                *map(str, files),
                "--no-wait",
                "--image",
                IMAGE,
                "--ingest-listen",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            env=hio_env(),
            timeout=60,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "handed 2 of 2 tuples" in proc.stdout
        wait_for(
            lambda: len([r for r in cluster.records().values() if r.meta.source == "handover"]) == 2,
            timeout=60,
            what="the handed-over tuples stored",
        )


def _unmovable(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A watched folder with one file, and a done folder that cannot be made (a file is where
    it should be; moving fails even as root): (watch, blocker, the file)."""
    watch = tmp_path / "instrument"
    watch.mkdir()
    blocker = tmp_path / "done"
    blocker.write_text("a file where the done folder should be")
    original = watch / "plate.bin"
    original.write_bytes(os.urandom(5_000))
    return watch, blocker, original


def _take_and_store(gw: Gateway, watch: Path, blocker: Path) -> DirectoryWatcher:
    """A watcher on ``watch``; its first settled file taken and stored."""
    from hio.gateway.watch import DirectoryWatcher

    watcher = DirectoryWatcher(gw, watch, blocker / "day1", settle_seconds=0.0, poll_seconds=0.1, image=IMAGE)
    watcher.scan_once(now=0.0)  # first sight
    assert watcher.scan_once(now=1.0) == 1  # settled: taken
    wait_for(lambda: gw.status().stored == 1, timeout=60, what="the file stored")
    return watcher


def test_a_delivered_file_that_cannot_be_moved_is_not_sent_again(cluster: Cluster, tmp_path: Path) -> None:
    watch, blocker, original = _unmovable(tmp_path)
    with Gateway(cluster.config("unmovable")) as gw:
        watcher = _take_and_store(gw, watch, blocker)
        for n in range(5):  # delivered, not movable: left alone
            assert watcher.scan_once(now=2.0 + n) == 0
        assert original.exists() and gw.unmoved_sources() == {str(original)}
        blocker.unlink()  # the folder can be made now
        watcher.scan_once(now=10.0)
        assert not original.exists() and (blocker / "day1" / "plate.bin").exists()
        assert gw.unmoved_sources() == set()
    records = [r for r in cluster.records().values() if r.meta.source == "unmovable"]
    assert [r.meta.name for r in records] == ["plate.bin"]


def test_a_delivered_file_that_cannot_be_moved_is_not_sent_again_after_a_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The gateway keeps the delivered-but-unmoved originals on disk beside its spool: a
    restarted gateway leaves them alone too, and moves them once it can."""
    from hio.gateway.watch import DirectoryWatcher

    watch, blocker, original = _unmovable(tmp_path)
    config = cluster.config("unmovable-restart")
    with Gateway(config) as gw:
        _take_and_store(gw, watch, blocker)
    with Gateway(config) as gw:  # a restart: still not movable
        assert gw.unmoved_sources() == {str(original)}
        again = DirectoryWatcher(gw, watch, blocker / "day1", settle_seconds=0.0, poll_seconds=0.1, image=IMAGE)
        for n in range(3):
            assert again.scan_once(now=float(n)) == 0
        blocker.unlink()
        again.scan_once(now=5.0)
        assert not original.exists() and (blocker / "day1" / "plate.bin").exists()
        assert gw.unmoved_sources() == set()
    with Gateway(config) as gw:
        assert gw.unmoved_sources() == set()
    records = [r for r in cluster.records().values() if r.meta.source == "unmovable-restart"]
    assert [r.meta.name for r in records] == ["plate.bin"]


def test_a_new_file_under_an_unmoved_file_s_name_is_sent(cluster: Cluster, tmp_path: Path) -> None:
    watch, blocker, original = _unmovable(tmp_path)
    config = cluster.config("unmovable-renewed")
    with Gateway(config) as gw:
        _take_and_store(gw, watch, blocker)
    original.unlink()
    original.write_bytes(os.urandom(6_000))  # the instrument's next run, same name
    with Gateway(config) as gw:
        assert gw.unmoved_sources() == set()
        _take_and_store(gw, watch, blocker)
    sizes = sorted(r.meta.size for r in cluster.records().values() if r.meta.source == "unmovable-renewed")
    assert sizes == [5_000, 6_000]


def test_a_spooled_tuple_whose_id_the_master_never_issued_is_sent_as_a_new_tuple(
    cluster: Cluster, tmp_path: Path
) -> None:
    """As after the master lost its state: the tuple is no less the user's data."""
    dead_master = f"127.0.0.1:{free_port()}"
    config = cluster.config("stranger")
    with Gateway(config, master_address=dead_master) as gw:
        gw.submit(b"kept through a master reset", image=IMAGE, name="orphan")
        entry = gw.spool.entries()[0]
        entry.meta.tuple_id, entry.meta.ticket = 10**15, b"not-a-ticket"  # an id from another master
        gw.spool.update_many([entry])
        gw.close(timeout=0.2, drain=False)
    with Gateway(config) as gw:
        assert len(gw.resumed_futures) == 1
        assert gw.flush(timeout=60)
        status = gw.status()
        assert (status.stored, status.failed, status.spooled_tuples) == (1, 0, 0)
    records = [r for r in cluster.records().values() if r.meta.source == "stranger"]
    assert [r.meta.name for r in records] == ["orphan"] and records[0].meta.tuple_id != 10**15


def test_a_file_rewritten_in_place_after_it_was_spooled_is_rejected_by_name_not_retried_forever(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The spool hard-links a file; an instrument that rewrites it in place changes the spooled
    copy too, and every receiver then finds it damaged (DATA_LOSS)."""
    dead_master = f"127.0.0.1:{free_port()}"
    config = cluster.config("rewriter", max_attempts=2)
    original = tmp_path / "frame.bin"
    original.write_bytes(b"a" * 50_000)
    with Gateway(config, master_address=dead_master) as gw:
        gw.submit_file(original, image=IMAGE)
        gw.close(timeout=0.2, drain=False)
    with open(original, "r+b") as fh:  # same size, other bytes, same inode
        fh.write(b"b" * 50_000)
    with Gateway(config) as gw:
        assert len(gw.resumed_futures) == 1
        assert gw.flush(timeout=60), "the damaged tuple was retried instead of settled"
        status = gw.status()
        assert (status.stored, status.failed, status.spooled_tuples) == (0, 1, 0)
    assert not [r for r in cluster.records().values() if r.meta.source == "rewriter"]
