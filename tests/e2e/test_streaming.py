"""The streaming core end to end, with real `hio` processes over loopback.

Two workers with two synthetic channels each, a repository and a master;
gateways in the test process. Checks the routing promises (direct when free,
queue when busy or when tuples already wait, first come first served), big
tuples in chunks, and recovery when a worker is killed mid-run.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest

from hio.cluster import LocalCluster
from hio.proto import master_pb2
from hio.up import read_features
from tests.harness import HioProcess, cluster_gateway, free_port, stop_cleanly, wait_for

pytestmark = pytest.mark.slow


class Cluster(LocalCluster):
    """Repository + master + workers (id -> engines) as real processes; gateways in this one."""

    def __init__(self, root: Path, workers: dict[str, str], expiry_seconds: float = 6.0) -> None:
        super().__init__(
            root,
            process=HioProcess,
            workers={w: [e] for w, e in workers.items()},
            master_args=["--expiry-seconds", f"{expiry_seconds:g}", "--heartbeat-interval", f"{expiry_seconds / 6:g}"],
        )

    def records(self) -> list:  # type: ignore[type-arg]
        return read_features(self.settings)


def wait_all_stored(cluster: Cluster, ids: list[int], timeout: float = 120) -> list:  # type: ignore[type-arg]
    wanted = set(ids)

    def all_there() -> list | None:  # type: ignore[type-arg]
        records = cluster.records()
        return records if wanted <= {r.tuple_id for r in records} else None

    return wait_for(all_there, timeout=timeout, interval=0.3, what=f"{len(ids)} tuples stored")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    c = Cluster(tmp_path_factory.mktemp("e2e"), {"w1": "hio/synthetic=2", "w2": "hio/synthetic=2"})
    try:
        yield c.start()
    finally:
        stop_cleanly(c)


def test_two_gateways_route_direct_and_spill_to_queue(cluster: Cluster) -> None:
    before = cluster.status()
    payload = os.urandom(200_000)
    results: dict[str, list[int]] = {}

    def run(name: str) -> None:
        # No waiting for a channel: batches that find every channel busy spill to the queue.
        with cluster_gateway(cluster, name, streams=4, route_wait_seconds=0) as gw:
            futures = [
                gw.submit(payload, image="hio/synthetic", name=f"{name}-{i}", attributes={"cost_ms": "150"})
                for i in range(24)
            ]
            results[name] = [f.result(timeout=180) for f in futures]

    threads = [threading.Thread(target=run, args=(n,)) for n in ("gw-a", "gw-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    ids = results["gw-a"] + results["gw-b"]
    assert len(ids) == 48 and len(set(ids)) == 48, "every tuple gets its own id"
    records = wait_all_stored(cluster, ids)
    counts = Counter(r.tuple_id for r in records)
    assert all(counts[i] == 1 for i in ids), "features stored exactly once per tuple"
    mine = [r for r in records if r.tuple_id in set(ids)]
    assert {r.meta.source for r in mine} == {"gw-a", "gw-b"}
    assert all(r.meta.size == len(payload) for r in mine)
    after = cluster.status()
    assert after.routed_direct > before.routed_direct, "free channels got tuples directly"
    assert after.routed_queue > before.routed_queue, "busy channels spilled to the queue"
    engines = Counter(r.engine for r in mine)
    assert len(engines) == 4, f"all four channels on both workers processed tuples: {engines}"


def test_busy_channels_make_batches_wait_instead_of_crossing_the_master(cluster: Cluster) -> None:
    """Every channel busy, queue empty: the master holds route requests, then hands out channels."""
    before = cluster.status()
    with cluster_gateway(cluster, "patient", streams=8, batch_tuples=2, route_wait_seconds=10) as gw:
        futures = [
            gw.submit(os.urandom(50_000), image="hio/synthetic", name=f"p-{i}", attributes={"cost_ms": "100"})
            for i in range(32)
        ]
        ids = [f.result(timeout=120) for f in futures]
    wait_all_stored(cluster, ids)
    after = cluster.status()
    assert after.routed_direct - before.routed_direct == 32, "every tuple went peer to peer"
    assert after.routed_queue == before.routed_queue, "none crossed the master"


def test_ten_megabyte_tuples_move_in_chunks(cluster: Cluster) -> None:
    sizes = [10 * 1024 * 1024, 12 * 1024 * 1024 + 17]
    payloads = [os.urandom(n) for n in sizes]
    with cluster_gateway(cluster, "big", chunk_bytes=1024 * 1024) as gw:
        ids = [
            gw.send(p, image="hio/synthetic", name=f"big-{len(p)}", attributes={"cost_ms": "0"}, timeout=120)
            for p in payloads
        ]
    records = {r.tuple_id: r for r in wait_all_stored(cluster, ids)}
    for tuple_id, payload in zip(ids, payloads, strict=True):
        record = records[tuple_id]
        assert record.meta.size == len(payload)
        assert record.features["size_bytes"].number == len(payload)


def test_a_killed_worker_loses_nothing(tmp_path: Path) -> None:
    c = Cluster(tmp_path, {"k1": "hio/synthetic=2", "k2": "hio/synthetic=2"}, expiry_seconds=3.0).start()
    try:
        with cluster_gateway(c, "kill", streams=4) as gw:
            futures = [
                gw.submit(os.urandom(100_000), image="hio/synthetic", name=f"k-{i}", attributes={"cost_ms": "250"})
                for i in range(40)
            ]
            wait_for(lambda: c.status().tuples_done >= 4, timeout=60, what="processing under way")
            c.procs["k1"].kill()
            killed_at = time.monotonic()
            expired = wait_for(
                lambda: (
                    all(
                        w.worker_id != "k1" or all(ch.state == master_pb2.DOWN for ch in w.channels)
                        for w in c.status().workers
                    )
                    and time.monotonic()
                ),
                timeout=15,
                what="k1 leaving routing",
            )
            assert expired - killed_at <= 10.0, "a silent worker leaves routing within 10 s"
            ids = [f.result(timeout=240) for f in futures]
        records = wait_all_stored(c, ids, timeout=180)
        counts = Counter(r.tuple_id for r in records)
        assert sorted(counts) == sorted(ids), "every tuple stored"
        assert max(counts.values()) == 1, "and none twice"
    finally:
        stop_cleanly(c)


def _finishing(c: Cluster) -> bool:
    """The channel took its stream's last tuple into processing and handed itself over."""
    from hio.proto import master_pb2

    channels = [ch for w in c.status().workers for ch in w.channels]
    return len(channels) == 1 and channels[0].state == master_pb2.FREE and channels[0].processing


def test_queue_drains_first_come_first_served(tmp_path: Path) -> None:
    c = Cluster(tmp_path, {"solo": "hio/synthetic=1"}).start()
    try:
        with cluster_gateway(c, "fifo", streams=4, route_wait_seconds=0) as gw:
            # The first tuple is processed; the second is received meanwhile and waits for the
            # processing slot (one ahead), holding the channel: everything after goes to the queue.
            first = gw.submit(os.urandom(10_000), image="hio/synthetic", name="f-first", attributes={"cost_ms": "5000"})
            # Handed over: FREE at the master while the first tuple is processed (and counted busy).
            wait_for(lambda: _finishing(c), timeout=30, what="the only channel handed over while processing")
            assert c.status().channels_busy == 1
            second = gw.submit(os.urandom(10_000), image="hio/synthetic", name="f-second", attributes={"cost_ms": "50"})
            wait_for(lambda: c.status().routed_direct == 2, timeout=30, what="the second tuple routed direct")
            # One at a time, each returning once durably queued: the queue's order is known.
            queued = [
                gw.send(
                    os.urandom(10_000), image="hio/synthetic", name=f"f-{i}", attributes={"cost_ms": "50"}, timeout=60
                )
                for i in range(8)
            ]
            ids = [first.result(timeout=60), second.result(timeout=60), *queued]
        records = wait_all_stored(c, ids)
        order = [r.tuple_id for r in sorted(records, key=lambda r: r.processed_unix) if r.tuple_id in set(ids)]
        assert order == ids, "the channel took the queue head, first come first served"
        status = c.status()
        assert status.routed_queue >= 8, "with the channel busy, later tuples waited in the queue"
        assert status.routed_direct >= 2
    finally:
        stop_cleanly(c)


def test_operator_commands_report_the_running_cluster(cluster: Cluster, capsys: pytest.CaptureFixture) -> None:
    from hio.cli import main

    where = ["--master-address", cluster.master, "--repository-address", cluster.repository]
    assert main(["status", *where]) == 0
    out = capsys.readouterr().out
    assert "channels    free" in out and "worker w1" in out and "worker w2" in out and "hio/synthetic" in out
    assert main(["status", "--json", *where]) == 0
    assert '"channelsFree"' in capsys.readouterr().out
    assert main(["dead-letters", *where]) == 0
    assert "no dead letters" in capsys.readouterr().out
    assert main(["knowledge", *where]) == 1, "no KD has run against this repository"
    assert "no knowledge yet" in capsys.readouterr().out
    assert main(["dead-letters", "--retry", "999999", *where]) == 1
    assert "no dead letter with tuple id 999999 (hio dead-letters lists them)" in capsys.readouterr().err
    assert main(["dead-letters", "--retry", "abc", *where]) == 2
    assert "--retry: 'abc' is not an integer" in capsys.readouterr().err

    class _ReaderGone(io.StringIO):  # `hio status | head -1`: the reader has left
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    with mock.patch("sys.stdout", _ReaderGone()):
        assert main(["status", *where]) == 1, "no traceback when the reader of stdout is gone"
    assert main(["status", "--master-address", f"127.0.0.1:{free_port()}"]) == 1
    assert "cannot get status from the master" in capsys.readouterr().err
