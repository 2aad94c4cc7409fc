"""`hio worker` as a real process beside a real master and repository.

One cluster serves the whole module (starting it costs seconds); the tests
run in file order and the last one stops the worker.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hio.cluster import LocalCluster
from hio.proto import engine_pb2_grpc, master_pb2, master_pb2_grpc, repository_pb2, repository_pb2_grpc
from hio.transport.frames import TupleReceipt, frames_for_bytes
from hio.transport.net import create_channel
from tests.harness import HioProcess, engine_pids, health_of, wait_for
from tests.worker.conftest import REPO_ROOT, SETTINGS, TEST_IMAGE, TEST_PIPELINE, make_tuple, master_available

pytestmark = pytest.mark.skipif(not master_available(), reason="hio.master.create_master_server not built yet")

WORKER_ID = "wt"
GRACE = 2.0


class Cluster(LocalCluster):
    def __init__(self, root: Path) -> None:
        super().__init__(
            root,
            process=HioProcess,
            env={"PYTHONPATH": REPO_ROOT},
            master_args=["--expiry-seconds", "4", "--max-attempts", "2", "--images", TEST_IMAGE],
        )

    def start(self) -> Cluster:
        super().start()
        self.worker = self.add_worker(
            WORKER_ID,
            [f"{TEST_IMAGE}=2"],
            wait=False,
            args=[
                "--pipelines",
                f"{TEST_IMAGE}={TEST_PIPELINE}",
                "--tuple-timeout",
                "1.5",
                "--pull-wait",
                "1",
                "--max-attempts",
                "2",
                "--grace-seconds",
                str(GRACE),
                "--restart-backoff-max",
                "2",
            ],
        )
        self._channels = [create_channel(address, SETTINGS) for address in (self.master, self.repository)]
        self.stub = master_pb2_grpc.MasterStub(self._channels[0])
        self.repo_stub = repository_pb2_grpc.RepositoryStub(self._channels[1])
        return self

    def channels(self) -> dict[str, master_pb2.ChannelInfo]:
        status = self.stub.GetStatus(master_pb2.GetStatusRequest(), timeout=5)
        return {c.channel_id: c for w in status.workers if w.worker_id == WORKER_ID for c in w.channels}

    def stored_ids(self) -> set[int]:
        return {
            r.tuple_id
            for batch in self.repo_stub.ReadFeatures(repository_pb2.ReadFeaturesRequest(), timeout=5)
            for r in batch.records
        }

    def stop(self) -> list[str]:
        for channel in getattr(self, "_channels", []):
            channel.close()
        return super().stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(tmp_path_factory.mktemp("worker-e2e")) as c:
        try:
            yield c
        except BaseException:
            print(c.worker.output())
            raise


def _all_free(cluster: Cluster) -> dict[str, master_pb2.ChannelInfo] | None:
    channels = cluster.channels()
    ok = len(channels) == 2 and all(c.state == master_pb2.FREE for c in channels.values())
    return channels if ok else None


def _route_and_deliver(cluster: Cluster, data: bytes, **attributes: str) -> tuple[int, list[TupleReceipt]]:
    # the module's tests may run apart (pytest -n without --dist loadfile): on a fresh
    # cluster, a route asked for before the engines serve goes to the master's queue
    wait_for(lambda: _all_free(cluster), timeout=60, what="two FREE channels")
    route = cluster.stub.RouteTuples(
        master_pb2.RouteTuplesRequest(source="test", image=TEST_IMAGE, items=[master_pb2.RouteItem(size=len(data))]),
        timeout=5,
    )
    assert route.WhichOneof("route") == "channel", route
    meta, payload = make_tuple(route.tuple_ids[0], data, **attributes)
    meta.ticket = route.tickets[0]
    with create_channel(route.channel.address, SETTINGS) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        receipts = list(stub.Deliver(frames_for_bytes(meta, payload, SETTINGS.chunk_bytes), timeout=30))
    return meta.tuple_id, receipts


def test_worker_registers_its_channels(cluster: Cluster) -> None:
    channels = wait_for(lambda: _all_free(cluster), timeout=60, what="two FREE channels")
    assert set(channels) == {f"{WORKER_ID}/0", f"{WORKER_ID}/1"}
    assert all(c.image == TEST_IMAGE and c.address.startswith("127.0.0.1:") for c in channels.values())
    # each engine also serves a payload lane, on a port of its own
    assert all(c.lane_address.startswith("127.0.0.1:") and c.lane_address != c.address for c in channels.values())


def test_a_registered_worker_with_engines_serving_is_ready(cluster: Cluster) -> None:
    wait_for(lambda: _all_free(cluster), timeout=60, what="two FREE channels")
    address = cluster.health[WORKER_ID]  # the worker's own gRPC server (--listen)
    wait_for(lambda: health_of(address) == "SERVING", timeout=10, what="the worker ready")
    assert health_of(address, "liveness") == "SERVING"


def test_gateway_like_client_gets_stored(cluster: Cluster) -> None:
    tuple_id, receipts = _route_and_deliver(cluster, b"hello engine")
    assert [(r.tuple_id, r.state) for r in receipts] == [(tuple_id, TupleReceipt.STORED)]
    assert tuple_id in cluster.stored_ids()


def test_killed_engine_is_reported_down_and_restarted(cluster: Cluster) -> None:
    wait_for(lambda: _all_free(cluster), timeout=30, what="FREE channels")
    pids = engine_pids(cluster.worker.proc.pid)  # type: ignore[union-attr]
    victim = f"{WORKER_ID}/1"
    os.kill(pids[victim], signal.SIGKILL)
    down = wait_for(
        lambda: (c := cluster.channels().get(victim)) and c.state == master_pb2.DOWN and c,
        timeout=10,
        interval=0.05,
        what="the killed channel DOWN",
    )
    # The next heartbeat (about a second later) already says it is restarting.
    assert "exited with code -9" in down.detail or "restart" in down.detail, down.detail
    wait_for(lambda: _all_free(cluster), timeout=30, what="the channel FREE again")
    assert engine_pids(cluster.worker.proc.pid)[victim] != pids[victim]  # type: ignore[union-attr]


def test_hung_tuple_times_out_and_goes_to_the_master(cluster: Cluster) -> None:
    wait_for(lambda: _all_free(cluster), timeout=30, what="FREE channels")
    with pytest.raises(grpc.RpcError) as err:  # the engine exits mid-tuple: the stream breaks
        _route_and_deliver(cluster, b"never ends", mode="sleep", seconds="60")
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

    def dead() -> list[master_pb2.DeadLetter]:
        return list(cluster.stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=5).dead_letters)

    letters = wait_for(dead, timeout=60, what="the hung tuple to become a dead letter")
    text = letters[0].reason + letters[0].meta.attributes.get("hio.last_error", "")
    assert "timeout after 1.5 s" in text
    wait_for(lambda: _all_free(cluster), timeout=30, what="channels restarted")


def test_sigterm_stops_worker_and_engines(cluster: Cluster) -> None:
    pids = engine_pids(cluster.worker.proc.pid)  # type: ignore[union-attr]
    assert len(pids) == 2
    started = time.monotonic()
    cluster.worker.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert cluster.worker.proc.wait(GRACE + 15) == 0  # type: ignore[union-attr]
    assert time.monotonic() - started < GRACE + 15
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
