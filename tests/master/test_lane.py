"""The master's payload lane (Enqueue over plain TCP) against a real master, gateway,
engine and repository: the queue path's payloads, its refusals, and its configuration."""

from __future__ import annotations

import os
import socket
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from hio.config import ConfigError, build
from hio.master import MasterConfig
from hio.proto import master_pb2
from hio.proto.engine_pb2 import LaneHello, LaneStatus
from hio.settings import ClusterSettings
from hio.transport.errors import Unavailable
from hio.transport.frames import TupleReceipt, unpacked_receipts
from hio.transport.lane import END_OF_INPUT, MAGIC, LaneCall, LaneDownload, lane_frames, lane_hello, open_lane
from tests.harness import wait_for
from tests.worker import conftest as worker_conftest
from tests.worker.conftest import TEST_IMAGE, Master, Repo, RunningEngine, engine_config, make_tuple, register_channel

repo = worker_conftest.repo  # the worker tests' repository fixture, for the tests here

TOKENS = "gw-secret gateway gw1\nwk-secret worker w1\nview-secret viewer v1\n"


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    """A master that accepts the test image before any worker offers it."""
    m = Master(tmp_path / "master", images=(TEST_IMAGE,))
    yield m
    m.close()


def queued(master: Master) -> int:
    return sum(q.length for q in master.status().queues)


def lane_of(master: Master) -> str:
    assert master.domain.lane is not None, "the master serves no lane"
    return f"127.0.0.1:{master.domain.lane.port}"


def routed(master: Master, count: int) -> list[tuple[int, bytes]]:
    """Ids and tickets for ``count`` tuples, routed to the queue (as a gateway would be)."""
    reply = master.stub.RouteTuples(
        master_pb2.RouteTuplesRequest(
            source="test",
            image=TEST_IMAGE,
            force_queue=True,
            items=[master_pb2.RouteItem(size=1) for _ in range(count)],
        ),
        timeout=5,
    )
    assert reply.HasField("queue") and reply.queue.lane_port == master.domain.lane.port
    return list(zip(reply.tuple_ids, reply.tickets, strict=True))


def test_gateway_queues_over_the_lane_and_an_engine_stores_every_payload(
    master: Master, repo: Repo, tmp_path: Path
) -> None:
    """Forced through the queue, payloads of every size cross the master's lane intact."""
    from hio.gateway import Gateway, GatewayConfig

    config = GatewayConfig(
        master_address=master.address,
        repository_address=repo.address,
        force_queue=True,
        data_dir=str(tmp_path / "gw"),
        source="queue-lane",
        ingest_listen="",
        grace_seconds=2.0,
    )
    payloads = [b"", b"small", os.urandom(200_000), os.urandom(3_000_000)]
    with Gateway(config) as gw:
        ids = gw.send_many(payloads, image=TEST_IMAGE, timeout=60)
        status = gw.status()
    assert status.enqueued == len(payloads) and status.retries == 0
    assert master.domain.lane.methods["Enqueue"] >= 1
    assert queued(master) == len(payloads)
    engine = RunningEngine(engine_config(master=master.address, repository=repo.address))
    try:
        register_channel(master, engine)
        records = wait_for(
            lambda: (lambda found: found if set(ids) <= set(found) else None)(repo.records()),
            timeout=60,
            what="the queued tuples stored",
        )
        # The engine learns the lane from its reports' answers; its pulls use it from then on.
        wait_for(lambda: master.domain.lane.methods["PullTuple"] >= 1, timeout=30, what="a pull over the lane")
    finally:
        engine.close()
    assert [records[i].meta.size for i in ids] == [len(p) for p in payloads]
    assert [records[i].meta.crc32 for i in ids] == [zlib.crc32(p) for p in payloads]


def test_the_lane_answers_with_enqueues_receipts_and_checks(master: Master) -> None:
    (good_id, good_ticket), (bad_id, _) = routed(master, 2)
    good = make_tuple(good_id, b"x" * 5000)
    good[0].ticket = good_ticket
    sock = open_lane(lane_of(master), lane_hello("", "Enqueue"), connect_seconds=5)
    call = LaneCall(sock, lane_frames(iter([good]), chunk_bytes=1024, pack_bytes=0), timeout=30)
    receipts = [r for message in call for r in unpacked_receipts(message)]
    assert [(r.tuple_id, r.state) for r in receipts] == [(good_id, TupleReceipt.ENQUEUED)]
    assert master.domain.lane.methods["Enqueue"] == 1

    meta, data = make_tuple(bad_id, b"y" * 5000)
    meta.crc32 ^= 1  # damaged on the way
    sock = open_lane(lane_of(master), lane_hello("", "Enqueue"), connect_seconds=5)
    call = LaneCall(sock, lane_frames(iter([(meta, data)]), chunk_bytes=1024, pack_bytes=0), timeout=30)
    with pytest.raises(grpc.RpcError) as failed:
        list(call)
    assert failed.value.code().name == "DATA_LOSS"
    assert queued(master) == 1  # the damaged tuple left nothing behind


def _status_for(address: str, hello: LaneHello, *, end: bool = False) -> LaneStatus:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        body = hello.SerializeToString()
        sock.sendall(MAGIC + struct.pack(">I", len(body)) + body + (END_OF_INPUT if end else b""))
        sock.shutdown(socket.SHUT_WR)
        reader = sock.makefile("rb")
        kind, size = struct.unpack(">BI", reader.read(5))
        assert kind == 2
        return LaneStatus.FromString(reader.read(size))


def _pull_status(address: str, token: str, request: master_pb2.PullTupleRequest) -> str:
    """The outcome of a PullTuple on the lane: 'OK: n frames' or the error's code name."""
    call = LaneDownload(
        open_lane(address, lane_hello(token, "PullTuple", request.SerializeToString()), connect_seconds=5),
        timeout=20,
        max_head_bytes=1 << 20,
        max_data_bytes=1 << 26,
    )
    try:
        return f"OK: {len(list(call.frames()))} frames"
    except grpc.RpcError as exc:
        return exc.code().name


def test_the_lane_serves_its_methods_only_and_to_the_roles_grpc_allows(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    m = Master(tmp_path / "master", tokens_file=str(tokens), images=(TEST_IMAGE,))
    try:
        address = lane_of(m)
        for method in ("Deliver", "Calls", "RouteTuples"):  # every call but the payloads' is gRPC's
            wrong = _status_for(address, LaneHello(method=method, token="gw-secret"))
            assert wrong.code == 3 and "serves Enqueue and PullTuple only" in wrong.message
        assert _status_for(address, LaneHello(method="Enqueue", token="nope")).code == 16  # UNAUTHENTICATED
        assert _status_for(address, LaneHello(method="Enqueue", token="view-secret")).code == 7  # PERMISSION_DENIED
        assert _status_for(address, LaneHello(method="Enqueue", token="gw-secret"), end=True).code == 0
        pull = master_pb2.PullTupleRequest(channel_id="w1/0", wait_seconds=0.1, max_tuples=1)
        assert _pull_status(address, "gw-secret", pull) == "PERMISSION_DENIED"  # pulling is the workers'
        assert _pull_status(address, "wk-secret", pull) == "NOT_FOUND"  # no such channel
    finally:
        m.close()


def test_a_master_without_lane_routes_without_one_and_the_gateway_uses_grpc(repo: Repo, tmp_path: Path) -> None:
    from hio.gateway import Gateway, GatewayConfig

    m = Master(tmp_path / "master", lanes=False, images=(TEST_IMAGE,))
    try:
        assert m.domain.lane is None
        route = m.stub.RouteTuples(
            master_pb2.RouteTuplesRequest(
                source="t", image=TEST_IMAGE, force_queue=True, items=[master_pb2.RouteItem(size=1)]
            ),
            timeout=5,
        )
        assert route.HasField("queue") and route.queue.lane_port == 0
        config = GatewayConfig(
            master_address=m.address,
            repository_address=repo.address,
            force_queue=True,
            data_dir=str(tmp_path / "gw"),
            source="no-lane",
            ingest_listen="",
            grace_seconds=2.0,
        )
        with Gateway(config) as gw:
            gw.send_many([os.urandom(100_000)], image=TEST_IMAGE, timeout=60)
            assert gw.status().enqueued == 1
        assert queued(m) == 1
    finally:
        m.close()


def _config(**values: Any) -> MasterConfig:
    return build(MasterConfig, "master", overrides={"data_dir": "/tmp/unused", **values})


def test_lane_address_follows_listen_unless_set() -> None:
    assert _config(listen="0.0.0.0:7000").lane_address() == "0.0.0.0:7001"
    assert _config(listen="127.0.0.1:0").lane_address() == "127.0.0.1:0"
    assert _config(listen="[::1]:7000").lane_address() == "[::1]:7001"
    assert _config(listen="0.0.0.0:7000", lane_listen="10.0.0.5:9000").lane_address() == "10.0.0.5:9000"
    assert _config(listen="0.0.0.0:7000", lanes=False).lane_address() == ""
    with pytest.raises(ConfigError, match="lane_listen"):
        _config(listen="0.0.0.0:65535")
    with pytest.raises(ConfigError, match="lane_listen"):
        _config(lane_listen="nohostport")
    with pytest.raises(ConfigError, match="lane_listen :7000 takes listen's port"):
        _config(listen="127.0.0.1:7000", lane_listen=":7000")


def test_a_taken_lane_port_gives_way_only_when_derived(tmp_path: Path) -> None:
    """listen's port + 1 taken: the lane takes any port (queue routes name it); a lane_listen
    set by the operator and taken is a clear error."""
    blocker = socket.socket()
    try:
        for _ in range(50):  # a taken port whose port - 1 is free, for the master's listen
            blocker.close()
            blocker = socket.socket()
            blocker.bind(("127.0.0.1", 0))
            blocker.listen()
            taken = blocker.getsockname()[1]
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", taken - 1))
                    break
                except OSError:
                    continue
        else:
            pytest.skip("no taken port with a free port below it found")
        m = Master(tmp_path / "m1", listen=f"127.0.0.1:{taken - 1}")
        try:
            assert m.domain.lane is not None and m.domain.lane.port not in (0, taken)
        finally:
            m.close()
        with pytest.raises(ConfigError, match="payload lane"):
            Master(tmp_path / "m2", lane_listen=f"127.0.0.1:{taken}")
    finally:
        blocker.close()


def test_a_full_queue_answers_with_the_retry_hint_gRPC_would_carry(tmp_path: Path) -> None:
    from hio.transport.errors import retry_after

    m = Master(tmp_path / "master", images=(TEST_IMAGE,), queue_bytes=1_000_000)
    try:
        (first, first_ticket), (second, second_ticket) = routed(m, 2)
        tuples = [make_tuple(first, os.urandom(600_000)), make_tuple(second, os.urandom(600_000))]
        tuples[0][0].ticket, tuples[1][0].ticket = first_ticket, second_ticket
        sock = open_lane(lane_of(m), lane_hello("", "Enqueue"), connect_seconds=5)
        call = LaneCall(sock, lane_frames(iter(tuples), chunk_bytes=1024, pack_bytes=0), timeout=30)
        receipts = []
        with pytest.raises(grpc.RpcError) as full:
            for message in call:
                receipts.extend(unpacked_receipts(message))
        assert [r.tuple_id for r in receipts] == [first]
        assert full.value.code().name == "RESOURCE_EXHAUSTED" and "queue full" in full.value.details()
        assert (retry_after(full.value) or 0) > 0
        assert queued(m) == 1
    finally:
        m.close()


def test_a_pull_over_the_lane_brings_each_queued_tuple_intact_from_memory_or_disk(tmp_path: Path) -> None:
    """Small tuples packed, one cached in memory, one read from its backlog segment (sendfile)."""
    from hio.transport.frames import FrameReader

    m = Master(tmp_path / "master", images=(TEST_IMAGE,), queue_memory_bytes=1_000_000)
    try:
        register_channel(m, "127.0.0.1:1")
        payloads = [b"tiny", os.urandom(500_000), os.urandom(3_000_000)]  # the last one is not cached
        routes = routed(m, len(payloads))
        tuples = []
        for (tuple_id, ticket), payload in zip(routes, payloads, strict=True):
            meta, data = make_tuple(tuple_id, payload)
            meta.ticket = ticket
            tuples.append((meta, data))
        call = LaneCall(
            open_lane(lane_of(m), lane_hello("", "Enqueue"), connect_seconds=5),
            lane_frames(iter(tuples), chunk_bytes=1024, pack_bytes=64 * 1024),
            timeout=30,
        )
        assert len([r for message in call for r in unpacked_receipts(message)]) == 3
        request = master_pb2.PullTupleRequest(channel_id="w1/0", wait_seconds=1.0, max_tuples=3, max_bytes=10_000_000)
        download = LaneDownload(
            open_lane(lane_of(m), lane_hello("", "PullTuple", request.SerializeToString()), connect_seconds=5),
            timeout=20,
            max_head_bytes=1 << 20,
            max_data_bytes=1 << 26,
        )
        reader = FrameReader(download.frames(), max_tuple_bytes=1 << 26, max_chunk_bytes=1 << 26, need_id=True)
        got = []
        while (item := reader.next_tuple_bytes()) is not None:
            got.append(item)
        assert [meta.tuple_id for meta, _ in got] == [tuple_id for tuple_id, _ in routes]
        assert [data for _, data in got] == payloads
        assert sum(q.leased for q in m.status().queues) == 3
    finally:
        m.close()


def test_a_pull_whose_engine_went_away_while_waiting_takes_nothing(tmp_path: Path) -> None:
    m = Master(tmp_path / "master", images=(TEST_IMAGE,), max_attempts=1)  # a charge would dead-letter it
    try:
        register_channel(m, "127.0.0.1:1")
        request = master_pb2.PullTupleRequest(channel_id="w1/0", wait_seconds=5.0, max_tuples=1)
        sock = open_lane(lane_of(m), lane_hello("", "PullTuple", request.SerializeToString()), connect_seconds=5)
        wait_for(lambda: m.domain.lane.methods["PullTuple"] == 1, timeout=5, what="the pull waiting")
        sock.close()  # the engine is gone while its pull waits
        [(tuple_id, ticket)] = routed(m, 1)
        meta, data = make_tuple(tuple_id, b"z" * 1000)
        meta.ticket = ticket
        call = LaneCall(
            open_lane(lane_of(m), lane_hello("", "Enqueue"), connect_seconds=5),
            lane_frames(iter([(meta, data)]), chunk_bytes=1024, pack_bytes=0),
            timeout=30,
        )
        list(call)
        # The enqueue woke the pull; it leased the tuple, found its engine gone and gave it back.
        wait_for(lambda: m.domain.lane.open_calls == 0, timeout=10, what="the pull's handler done")
        [queue] = m.status().queues
        assert (queue.length, queue.leased) == (1, 0)
        assert not m.stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=5).dead_letters
    finally:
        m.close()


@pytest.mark.parametrize("error", [5, 28], ids=["EIO", "ENOSPC"])
def test_a_handlers_own_error_is_internal_with_a_log_reference_not_a_lost_client(error: int) -> None:
    """A disk error while storing is the server's: INTERNAL (details in the log, as gRPC's
    servicers do), not a silently dropped connection the sender would take for an outage.
    A full disk says so, as RESOURCE_EXHAUSTED: the sender waits and retries, uncharged."""
    from hio.transport.lane import LaneServer

    def failing(frames: Iterator[Any]) -> Iterator[TupleReceipt]:
        next(frames)
        raise OSError(error, os.strerror(error))
        yield  # a generator, like the real handlers

    server = LaneServer(
        ClusterSettings(stream_idle_seconds=10, max_tuple_bytes=1 << 24),
        service="Master",
        uploads={"Enqueue": failing},
        table=None,
        policy={},
        piece_bytes=1024,
    )
    server.start("127.0.0.1:0")
    try:
        sock = open_lane(f"127.0.0.1:{server.port}", lane_hello("", "Enqueue"), connect_seconds=5)
        call = LaneCall(
            sock, lane_frames(iter([make_tuple(7, os.urandom(5000))]), chunk_bytes=1024, pack_bytes=0), timeout=30
        )
        with pytest.raises(grpc.RpcError) as failed:
            list(call)
        if error == 28:
            assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "disk is full" in failed.value.details()
        else:
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            assert "see the server log" in failed.value.details() and "Input/output" not in failed.value.details()
    finally:
        server.stop()


def test_an_engine_pulls_over_grpc_when_the_masters_lane_breaks(master: Master, tmp_path: Path) -> None:
    """A lane that accepts and then closes (a crowded or foreign listener) breaks the pull made
    on it, and the master is then the engine's over gRPC."""
    from hio.worker.cluster import ClusterLink
    from tests.worker.test_lane import _ClosingListener

    register_channel(master, "127.0.0.1:1")
    closing = _ClosingListener()
    link = ClusterLink(engine_config(master=master.address, repository="127.0.0.1:1"), rpc_deadline=5)
    try:
        link._master_lane_port = int(closing.address.rsplit(":", 1)[1])  # as a report's answer would set it
        with pytest.raises(Unavailable) as broken:
            list(link.pull("w1/0", 0.2).frames())
        assert "payload lane broke" in str(broken.value)
        assert list(link.pull("w1/0", 0.2).frames()) == []  # over gRPC: nothing queued, no error
        assert closing.accepted == 1, "the pull it broke (no connection is made only to probe the lane)"
    finally:
        link.close()
        closing.close()


def test_an_engine_told_not_to_use_lanes_pulls_over_grpc_though_the_master_offers_one(
    master: Master, repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's ``lanes = false`` (a firewall that opens only the gRPC ports) reaches its engines'
    pulls too: they never connect to the master's lane, and the queued tuples are still stored."""
    from hio.gateway import Gateway, GatewayConfig
    from hio.worker.config import WorkerConfig
    from hio.worker.controller import engine_env

    worker = build(
        WorkerConfig,
        "worker",
        overrides={"lanes": False, "master_address": master.address, "repository_address": repo.address},
    )
    env = engine_env(worker, channel_id="w1/0", image=TEST_IMAGE, pipeline="", port=1)
    monkeypatch.setenv("HIO_ENGINE_LANES", env["HIO_ENGINE_LANES"])  # as the worker starts its engines
    config = GatewayConfig(
        master_address=master.address,
        repository_address=repo.address,
        force_queue=True,
        data_dir=str(tmp_path / "gw"),
        source="no-lanes",
        ingest_listen="",
        grace_seconds=2.0,
    )
    with Gateway(config) as gw:
        ids = gw.send_many([b"one", os.urandom(100_000)], image=TEST_IMAGE, timeout=60)
    engine_settings = engine_config(master=master.address, repository=repo.address)
    assert not engine_settings.lanes
    engine = RunningEngine(engine_settings)
    try:
        register_channel(master, engine)
        wait_for(lambda: set(ids) <= set(repo.records()), timeout=60, what="the queued tuples stored")
    finally:
        engine.close()
    assert master.domain.lane.methods["PullTuple"] == 0


def test_routes_and_reports_of_tuples_sent_one_at_a_time_are_grpc_calls_and_lose_nothing(
    master: Master, repo: Repo, tmp_path: Path
) -> None:
    """RouteTuples (gateway), ReportTuples and the features stream (engine) are gRPC calls on each peer's
    kept channel; the lanes carry payloads only."""
    from hio.gateway import Gateway, GatewayConfig

    engine = RunningEngine(engine_config(master=master.address, repository=repo.address))
    config = GatewayConfig(
        master_address=master.address,
        repository_address=repo.address,
        data_dir=str(tmp_path / "gw"),
        source="one-at-a-time",
        ingest_listen="",
        grace_seconds=2.0,
    )
    try:
        register_channel(master, engine)
        with Gateway(config) as gw:
            ids = [gw.send(f"tuple {n}".encode(), image=TEST_IMAGE, timeout=30) for n in range(8)]
            status = gw.status()
        records = wait_for(
            lambda: (lambda found: found if set(ids) <= set(found) else None)(repo.records()),
            timeout=30,
            what="the tuples stored",
        )
    finally:
        engine.close()
    assert status.stored == 8 and status.retries == 0
    assert sorted(records) == sorted(ids)
    assert set(master.domain.lane.methods) <= {"Enqueue", "PullTuple"}
