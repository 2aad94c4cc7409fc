"""The engine's payload lane (Deliver over plain TCP) against a real engine and repository,
and the gateway's use of it (and its fallback to gRPC) against a real master."""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from hio.proto import master_pb2
from hio.proto.engine_pb2 import LaneHello, LaneStatus
from hio.transport.frames import TupleReceipt, unpacked_receipts
from hio.transport.lane import MAGIC, LaneCall, LaneError, lane_frames, lane_hello, open_lane
from tests.harness import free_port, wait_for
from tests.worker.conftest import (
    TEST_IMAGE,
    Master,
    Repo,
    RunningEngine,
    engine_config,
    make_tuple,
    needs_master,
    register_channel,
)

TOKEN = "lane-s3cret"


def lane_engine(repo: Repo, master: str | None = None, **overrides: Any) -> RunningEngine:
    return RunningEngine(
        engine_config(
            master=master or f"127.0.0.1:{free_port()}", repository=repo.address, lane_listen="127.0.0.1:0", **overrides
        )
    )


@pytest.fixture
def engine(repo: Repo) -> Iterator[RunningEngine]:
    e = lane_engine(repo)
    yield e
    e.close()


def lane_address(engine: RunningEngine) -> str:
    assert engine.engine.lane is not None, "the engine serves no lane"
    return f"127.0.0.1:{engine.engine.lane.port}"


def deliver(
    engine: RunningEngine, tuples: list[tuple[Any, Any]], *, token: str = "", timeout: float = 30
) -> list[TupleReceipt]:
    """Send tuples (payload: bytes or an open file at its offset) over the lane; the receipts."""
    sock = open_lane(lane_address(engine), lane_hello(token, "Deliver"), connect_seconds=5)
    call = LaneCall(sock, lane_frames(iter(tuples), chunk_bytes=1024, pack_bytes=64 * 1024), timeout=timeout)
    return [r for message in call for r in unpacked_receipts(message)]


def raw_status(engine: RunningEngine, send: bytes, *, shut: bool = True, timeout: float = 10) -> LaneStatus:
    """Send raw bytes to the lane and read the engine's final status (receipts skipped)."""
    with socket.create_connection(("127.0.0.1", engine.engine.lane.port), timeout=timeout) as sock:
        sock.sendall(send)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        reader = sock.makefile("rb")
        while True:
            kind, size = struct.unpack(">BI", reader.read(5))
            body = reader.read(size)
            if kind == 2:
                return LaneStatus.FromString(body)


def hello(token: str = "", method: str = "Deliver") -> bytes:
    body = LaneHello(method=method, token=token).SerializeToString()
    return MAGIC + struct.pack(">I", len(body)) + body


def test_lane_stores_tuples_of_every_size_in_order(engine: RunningEngine, repo: Repo, tmp_path: Path) -> None:
    small, empty = b"aab", b""
    big = os.urandom(3 * 1000 * 1000)  # one frame: far over the gRPC chunk size of 1 KiB
    spooled = os.urandom(200_000)
    path = tmp_path / "spooled.bin"
    path.write_bytes(b"x" * 100 + spooled + b"y" * 50)  # the payload sits inside a larger file, as in the spool
    with open(path, "rb") as fh:
        fh.seek(100)
        tuples = [make_tuple(1, small), make_tuple(2, big), make_tuple(3, empty)]
        meta4, _ = make_tuple(4, spooled)
        receipts = deliver(engine, [*tuples, (meta4, fh)])
        assert [(r.index, r.tuple_id, r.state) for r in receipts] == [(i, i + 1, TupleReceipt.STORED) for i in range(4)]
        assert fh.closed  # the lane closed it
    records = repo.records()
    assert {t: records[t].meta.size for t in records} == {1: 3, 2: len(big), 3: 0, 4: len(spooled)}
    assert records[2].features["size"].number == len(big)
    assert records[4].meta.crc32 == zlib.crc32(spooled) & 0xFFFFFFFF
    assert engine.engine.lane.calls == 1


def test_corrupt_tuple_ends_the_call_with_data_loss_after_the_good_ones(engine: RunningEngine, repo: Repo) -> None:
    bad_meta, bad = make_tuple(12, os.urandom(100_000))
    bad_meta.crc32 ^= 1
    sock = open_lane(lane_address(engine), lane_hello("", "Deliver"), connect_seconds=5)
    call = LaneCall(sock, lane_frames(iter([make_tuple(11, b"fine"), (bad_meta, bad)]), 1024, 64 * 1024), timeout=30)
    got: list[TupleReceipt] = []
    with pytest.raises(LaneError) as err:
        for message in call:
            got.extend(unpacked_receipts(message))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "12" in err.value.details()
    assert [(r.tuple_id, r.state) for r in got] == [(11, TupleReceipt.STORED)]
    assert set(repo.records()) == {11}


def test_tuple_of_another_image_is_failed_precondition(engine: RunningEngine, repo: Repo) -> None:
    with pytest.raises(LaneError) as err:
        deliver(engine, [make_tuple(21, b"x" * 70_000, image="hio/other")])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "hio/other" in err.value.details()
    assert repo.records() == {}


def test_a_client_that_is_not_a_lane_client_gets_a_clear_status(engine: RunningEngine) -> None:
    status = raw_status(engine, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "HIOLANE2" in status.message
    status = raw_status(engine, hello(method="PullTuple"))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "Deliver" in status.message


def test_random_bytes_and_a_silent_or_trickling_client_are_refused_and_the_lane_keeps_serving(
    engine: RunningEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hio.transport.lane as lane_module

    monkeypatch.setattr(lane_module, "HELLO_SECONDS", 0.5)
    status = raw_status(engine, os.urandom(64))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    status = raw_status(engine, b"", shut=False)  # connects, says nothing
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "within 0.5 s" in status.message
    with socket.create_connection(("127.0.0.1", engine.engine.lane.port), timeout=10) as sock:
        started = time.monotonic()
        for byte in hello()[:6]:  # a byte at a time, slower than the deadline
            sock.sendall(bytes([byte]))
            time.sleep(0.15)
        reader = sock.makefile("rb")
        kind, size = struct.unpack(">BI", reader.read(5))
        status = LaneStatus.FromString(reader.read(size))
    assert kind == 2 and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert time.monotonic() - started < 5
    assert deliver(engine, [make_tuple(71, b"still serving")])[0].state == TupleReceipt.STORED


def test_oversized_frame_head_and_data_are_refused_before_reading_them(engine: RunningEngine) -> None:
    status = raw_status(engine, hello() + struct.pack(">IQ", 1 << 31, 0))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "head" in status.message
    status = raw_status(engine, hello() + struct.pack(">IQ", 10, 1 << 40))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "over the limit" in status.message


def test_a_frame_cut_short_is_data_loss_and_the_channel_is_free_again(engine: RunningEngine, repo: Repo) -> None:
    meta, data = make_tuple(31, os.urandom(5000))
    head = make_head(meta)
    status = raw_status(engine, hello() + struct.pack(">IQ", len(head), len(data)) + head + data[:100])
    assert status.code == grpc.StatusCode.DATA_LOSS.value[0] and "inside a frame's data" in status.message
    receipts = deliver(engine, [make_tuple(32, b"after")])
    assert [(r.tuple_id, r.state) for r in receipts] == [(32, TupleReceipt.STORED)]
    assert set(repo.records()) == {32}


def test_a_sender_that_goes_without_ending_its_input_is_a_cancelled_call(engine: RunningEngine, repo: Repo) -> None:
    """Only END_OF_INPUT ends a call normally; a connection that just ends (the gateway gave up,
    was stopped or crashed) is CANCELLED, as a gRPC call would be, and the channel is free again."""
    meta, data = make_tuple(35, b"whole frame")
    head = make_head(meta)
    status = raw_status(engine, hello() + struct.pack(">IQ", len(head), len(data)) + head + data)
    assert status.code == grpc.StatusCode.CANCELLED.value[0] and "before ending its input" in status.message
    assert deliver(engine, [make_tuple(36, b"next")])[0].state == TupleReceipt.STORED


def make_head(meta: Any) -> bytes:
    from hio.transport.frames import TupleFrame

    return TupleFrame(meta=meta, last=True).SerializeToString()


def test_a_stalled_sender_is_cut_off_and_frees_the_channel(repo: Repo) -> None:
    e = lane_engine(repo, stream_idle_seconds=0.5)
    try:
        with socket.create_connection(("127.0.0.1", e.engine.lane.port), timeout=10) as sock:
            sock.sendall(hello())  # then nothing, without ending the input
            reader = sock.makefile("rb")
            kind, size = struct.unpack(">BI", reader.read(5))
            status = LaneStatus.FromString(reader.read(size))
        assert kind == 2 and status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert "stalled" in status.message
        receipts = deliver(e, [make_tuple(41, b"next")])
        assert receipts[0].state == TupleReceipt.STORED
    finally:
        e.close()


def test_the_lane_checks_the_token_like_grpc(repo: Repo) -> None:
    e = lane_engine(repo, token=TOKEN)
    try:
        for token, reason in (("", "missing token"), ("wrong", "invalid token")):
            with pytest.raises(LaneError) as err:
                deliver(e, [make_tuple(51, b"x")], token=token)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and reason in err.value.details()
        assert repo.records() == {}
        assert deliver(e, [make_tuple(52, b"x")], token=TOKEN)[0].state == TupleReceipt.STORED
    finally:
        e.close()


def test_a_busy_channel_refuses_a_second_call_with_resource_exhausted(engine: RunningEngine) -> None:
    first = open_lane(lane_address(engine), lane_hello("", "Deliver"), connect_seconds=5)
    first.sendall(struct.pack(">IQ", len(make_head(make_tuple(61, b"z" * 10)[0])), 10))  # a frame begun, not ended
    try:
        wait_for(lambda: engine.engine._active == "deliver", timeout=10, what="the first call to hold the channel")
        with pytest.raises(LaneError) as err:
            deliver(engine, [make_tuple(62, b"y")])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        first.close()


def test_a_stopped_lane_accepts_no_more_calls(repo: Repo) -> None:
    e = lane_engine(repo)
    address = lane_address(e)
    e.close()
    with pytest.raises(OSError):
        open_lane(address, lane_hello("", "Deliver"), connect_seconds=2)


@needs_master
def test_a_tls_cluster_keeps_its_lanes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With mutual TLS and a token on every role, payloads still take the lanes (over TLS, with
    the certificates gRPC uses): the gateway's Deliver to the engine and Enqueue to the master,
    the engine's pulls from the master; every tuple stored intact, no lane skipped."""
    from hio.gateway import Gateway, GatewayConfig
    from hio.settings import ClusterSettings
    from hio.transport.certs import generate

    certs = generate(tmp_path / "certs", ("node",), ("127.0.0.1",))
    tls: dict[str, Any] = {
        "tls_cert": str(certs["node"]),
        "tls_key": str(certs["node-key"]),
        "tls_ca": str(certs["ca"]),
        "token": TOKEN,
    }
    client = ClusterSettings(chunk_bytes=1024, **tls)
    repo = Repo(tmp_path / "repo", settings=client, tls_client_auth=True, **tls)
    master = Master(tmp_path / "master", settings=client, tls_client_auth=True, images=(TEST_IMAGE,), **tls)
    e = lane_engine(repo, master=master.address, tls_client_auth=True, **tls)
    try:
        assert master.domain.lane is not None
        register_channel(master, e, lane_address=lane_address(e))
        direct = [os.urandom(2_000_000), b"small", os.urandom(300_000)]
        queued = [os.urandom(1_500_000), b"tiny"]
        with caplog.at_level(logging.WARNING):
            base = {
                "master_address": master.address,
                "repository_address": repo.address,
                "ingest_listen": "",
                "grace_seconds": 2.0,
                **tls,
            }
            with Gateway(GatewayConfig(data_dir=str(tmp_path / "gw"), source="tls", **base)) as gw:
                ids = gw.send_many(direct, image=TEST_IMAGE, timeout=60)
                assert gw.status().sent_direct == 3
                assert gw.status().bytes_sent_direct == sum(map(len, direct))
            with Gateway(GatewayConfig(data_dir=str(tmp_path / "gwq"), source="tlsq", force_queue=True, **base)) as gw:
                ids += gw.send_many(queued, image=TEST_IMAGE, timeout=60)
                assert gw.status().enqueued == 2

            def stored() -> dict[int, Any] | None:
                found = repo.records()
                return found if set(ids) <= set(found) else None

            records = wait_for(stored, timeout=60, what="every tuple stored")
        assert [records[i].meta.crc32 for i in ids] == [zlib.crc32(p) for p in direct + queued]
        assert [records[i].meta.size for i in ids] == [len(p) for p in direct + queued]
        assert e.engine.lane.calls >= 1  # Deliver over the engine's TLS lane
        assert master.domain.lane.methods["Enqueue"] >= 1  # Enqueue over the master's
        assert master.domain.lane.methods["PullTuple"] >= 1  # the engine's pulls, too
        skipped = [r.getMessage() for r in caplog.records if "this peer uses gRPC" in r.getMessage()]
        assert skipped == []
    finally:
        e.close()
        master.close()
        repo.close()


@needs_master
def test_a_tls_cluster_s_payload_calls_share_kept_connections(tmp_path: Path) -> None:
    """Tuples sent one at a time, each its own call, over mutual TLS: the gateway's Deliver calls
    to the engine take one connection (one TLS handshake at each end); at the master, its
    Enqueue calls and the engine's pulls (stored tuples, then idle long-polls) take a
    connection or two each, not one per call."""
    from hio.gateway import Gateway, GatewayConfig
    from hio.settings import ClusterSettings
    from hio.transport.certs import generate

    certs = generate(tmp_path / "certs", ("node",), ("127.0.0.1",))
    tls: dict[str, Any] = {
        "tls_cert": str(certs["node"]),
        "tls_key": str(certs["node-key"]),
        "tls_ca": str(certs["ca"]),
    }
    client = ClusterSettings(chunk_bytes=1024, **tls)
    repo = Repo(tmp_path / "repo", settings=client, tls_client_auth=True, **tls)
    master = Master(tmp_path / "master", settings=client, tls_client_auth=True, images=(TEST_IMAGE,), **tls)
    e = lane_engine(repo, master=master.address, tls_client_auth=True, pull_wait=0.3, **tls)
    try:
        register_channel(master, e, lane_address=lane_address(e))
        base = {
            "master_address": master.address,
            "repository_address": repo.address,
            "ingest_listen": "",
            "grace_seconds": 2.0,
            **tls,
        }
        with Gateway(GatewayConfig(data_dir=str(tmp_path / "gw"), source="kept", **base)) as gw:
            ids = [gw.send(os.urandom(50_000 + n), image=TEST_IMAGE, timeout=60) for n in range(5)]
        # One connection for the five calls; on a loaded machine a second one at most (a send that
        # began before the last call's connection was back, or a kept one found closed): never one a call.
        assert e.engine.lane.calls == 5 and e.engine.lane.accepted <= 2
        with Gateway(GatewayConfig(data_dir=str(tmp_path / "gwq"), source="keptq", force_queue=True, **base)) as gw:
            ids += [gw.send(os.urandom(50_000 + n), image=TEST_IMAGE, timeout=60) for n in range(5)]
        wait_for(lambda: set(ids) <= set(repo.records()), timeout=60, what="every tuple stored")
        lane = master.domain.lane
        wait_for(lambda: lane.methods["PullTuple"] >= 5, timeout=30, what="the engine's idle pulls on the lane")
        assert lane.methods["Enqueue"] == 5
        assert lane.accepted <= 3, f"{lane.accepted} connections for {lane.calls} calls"
    finally:
        e.close()
        master.close()
        repo.close()


def test_a_plaintext_client_of_a_tls_engine_lane_is_told_to_use_tls(repo: Repo, tmp_path: Path) -> None:
    from hio.transport.certs import generate

    certs = generate(tmp_path / "certs", ("engine",), ("127.0.0.1",))
    e = lane_engine(repo, tls_cert=str(certs["engine"]), tls_key=str(certs["engine-key"]))
    try:
        with pytest.raises(LaneError) as err:
            deliver(e, [make_tuple(81, b"x")])
        assert err.value.transport and "speaks TLS" in err.value.details()
        assert e.engine.lane.calls == 0
    finally:
        e.close()


# -- the gateway's side, with a real master routing to the engine ------------------------


class _ClosingListener:
    """A port that accepts connections and closes them at once: a broken lane, as a
    middlebox or a crashed process would present it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@needs_master
@pytest.mark.parametrize("lane", ["engine", "unreachable", "broken"])
def test_gateway_sends_over_the_lane_or_grpc_as_chosen_for_the_peer(
    lane: str, master: Master, repo: Repo, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's lane when it answers at connect; gRPC Deliver when it refuses connections;
    when it closes them without a word (chosen, then broken), the peer moves to gRPC and the
    batch is sent there again, no attempt charged."""
    from hio.gateway import Gateway, GatewayConfig

    e = lane_engine(repo, master=master.address)
    broken = _ClosingListener() if lane == "broken" else None
    try:
        address = {"engine": lane_address(e), "unreachable": f"127.0.0.1:{free_port()}"}.get(lane)
        register_channel(master, e, lane_address=address or broken.address)  # type: ignore[union-attr] - broken is set when no address is
        config = GatewayConfig(
            master_address=master.address,
            repository_address=repo.address,
            data_dir=str(tmp_path / "gw"),
            source="lane",
            ingest_listen="",
            grace_seconds=2.0,
        )
        payloads = [os.urandom(300_000), b"small"]
        with caplog.at_level(logging.WARNING, logger="hio.gateway"), Gateway(config) as gw:
            ids = gw.send_many(payloads, image=TEST_IMAGE, timeout=60)
            status = gw.status()
        assert status.sent_direct == 2 and status.retries == 0

        def stored() -> dict[int, Any] | None:
            found = repo.records()
            return found if set(ids) <= set(found) else None

        records = wait_for(stored, timeout=30, what="both tuples stored")
        assert [records[i].meta.size for i in ids] == [300_000, 5]
        assert all(records[i].meta.attempt == 1 for i in ids)  # the lane's failure was not the tuples'
        if lane == "engine":
            assert e.engine.lane.calls >= 1  # one call per batch; the two may share one
        else:
            assert e.engine.lane.calls == 0
        if broken is not None:
            assert broken.accepted >= 1
        moved = [r.getMessage() for r in caplog.records if "this peer uses gRPC" in r.getMessage()]
        assert (
            moved
            == {
                "engine": [],
                "unreachable": ["payload lane unreachable; this peer uses gRPC"],
                "broken": ["payload lane broke; this peer uses gRPC"],
            }[lane]
        )
    finally:
        if broken is not None:
            broken.close()
        e.close()


@needs_master
def test_an_engine_that_refuses_connections_costs_the_tuples_no_attempt(
    master: Master, repo: Repo, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed worker's channels stay in routing until the master expires them: tuples routed
    to them meanwhile are routed again uncharged, not dead-lettered (here with one attempt
    allowed), and are stored once an engine answers on that address."""
    from hio.gateway import Gateway, GatewayConfig

    port = free_port()
    register_channel(master, f"127.0.0.1:{port}")
    config = GatewayConfig(
        master_address=master.address,
        repository_address=repo.address,
        max_attempts=1,
        data_dir=str(tmp_path / "gw"),
        source="refused",
        ingest_listen="",
        grace_seconds=2.0,
    )
    result: dict[str, Any] = {}
    with caplog.at_level(logging.WARNING, logger="hio.gateway"), Gateway(config) as gw:
        sender = threading.Thread(
            target=lambda: result.update(
                ids=gw.send_many([os.urandom(5000) for _ in range(3)], image=TEST_IMAGE, timeout=90)
            )
        )
        sender.start()
        wait_for(
            lambda: any("engine unreachable" in r.getMessage() for r in caplog.records),
            timeout=30,
            what="the gateway finding the engine unreachable",
        )
        e = RunningEngine(engine_config(master=master.address, repository=repo.address, listen=f"127.0.0.1:{port}"))
        try:
            sender.join(90)
            status = gw.status()
            assert not sender.is_alive() and len(result.get("ids", [])) == 3, result
            # stored directly, or through the queue if the retry found the channel still reserved
            records = wait_for(
                lambda: (lambda found: found if set(result["ids"]) <= set(found) else None)(repo.records()),
                timeout=30,
                what="the tuples stored",
            )
        finally:
            e.close()
    assert status.retries == 0 and status.failed == 0
    assert all(records[i].meta.attempt == 1 for i in result["ids"])
    assert not master.stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=5).dead_letters
