"""No tuple is lost or duplicated while engines and workers start and stop under load: a stream
runs while an operator scales out and in, twice, and a worker whose engines are being drained
is killed with -9 (with its engines); every tuple is stored exactly once and none became a dead
letter."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from benchmarks.measure import worker_processes
from hio.proto import master_pb2
from tests.elastic.helpers import (
    IMAGE,
    LOCAL,
    elastic_cluster,
    gateway,
    hio_scale,
    live_workers,
    record_pid,
    stored,
)
from tests.harness import stop_cleanly, wait_for

pytestmark = pytest.mark.slow

# One engine per worker (worker_cpus 1, every engine sized 0.9 cores): engines spread over workers.
ONE_PER_WORKER = ["--max-workers", "3", "--default-share", "0.9", "--profile-seconds", "1000"]


def serving(cluster, count: int) -> bool:  # type: ignore[no-untyped-def]
    """``count`` engines of the image up and not retiring."""
    (image,) = [e for e in cluster.status().engines if e.image == IMAGE] or [master_pb2.ImageEngines()]
    return image.running >= count


def draining(cluster) -> str:  # type: ignore[no-untyped-def]
    """A worker with a retiring channel that still holds a tuple; '' if none."""
    for worker in cluster.status().workers:
        for channel in worker.channels:
            if channel.retiring and (channel.state != master_pb2.FREE or channel.processing):
                return str(worker.worker_id)
    return ""


def test_scaling_out_and_in_under_load_with_a_draining_worker_killed_loses_and_duplicates_nothing(
    tmp_path: Path,
) -> None:
    cluster = elastic_cluster(tmp_path, [*LOCAL, *ONE_PER_WORKER])
    cluster.start()
    ids: list[int] = []
    errors: list[BaseException] = []
    streaming = threading.Event()
    streaming.set()

    def stream() -> None:
        try:
            with gateway(cluster) as gw:
                futures = []
                while streaming.is_set():
                    futures += [
                        gw.submit(os.urandom(2000), image=IMAGE, attributes={"cost_ms": "400"}) for _ in range(3)
                    ]
                    time.sleep(0.5)
                ids.extend(future.result(timeout=240) for future in futures)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    sender = threading.Thread(target=stream, name="stream")
    killed = ""
    try:
        sender.start()
        for _round in range(2):
            hio_scale(cluster, "--pin", f"{IMAGE}=3")
            wait_for(lambda: serving(cluster, 3), timeout=120, what="three engines on three workers", interval=0.2)
            assert len(live_workers(cluster)) == 3
            hio_scale(cluster, "--pin", f"{IMAGE}=1")  # the two highest-ranked workers' engines drain
            if not killed:
                killed = wait_for(lambda: draining(cluster), timeout=30, what="an engine draining", interval=0.05)
                os.killpg(record_pid(tmp_path, killed), signal.SIGKILL)  # the worker and its engines
            wait_for(lambda: serving(cluster, 1) and not draining(cluster), timeout=60, what="back to one engine")
        hio_scale(cluster, "--unpin", IMAGE)
        streaming.clear()
        sender.join(300)
        assert not errors, errors
        wait_for(lambda: len(stored(cluster)) >= len(ids), timeout=120, what="every tuple stored")
        counts = stored(cluster)
        assert sorted(counts) == sorted(ids), "every tuple sent is stored, and nothing else"
        assert set(counts.values()) == {1}, "none stored twice"
        assert len(ids) >= 30
        status = cluster.status()
        assert status.dead_letters == 0
        decisions = [(d.subject, d.action) for d in hio_scaling_decisions(cluster)]
        assert any(action == "drop worker" and subject == killed for subject, action in decisions)
    finally:
        streaming.clear()
        sender.join(60)
        stop_cleanly(cluster)
    assert worker_processes(tmp_path) == {}


def hio_scaling_decisions(cluster):  # type: ignore[no-untyped-def]
    from tests.elastic.helpers import scaling

    return scaling(cluster).decisions
