"""PayloadPeers and the lane's kept connections (lane version 2), over real sockets against a
real LaneServer: calls one after another share a connection (TLS included: one handshake);
a kept connection the server closed is no error and keeps the peer on its lane; a crowded
server makes room by closing its longest-idle connection; a failed call's connection is not
kept; a version-1 client is served one call and closed. A lane that cannot be opened, or
breaks, or speaks another version moves the peer to gRPC, and the lane is tried again later."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from hio.proto.engine_pb2 import LaneHello, LaneStatus
from hio.proto.master_pb2 import PullTupleRequest
from hio.settings import ClusterSettings
from hio.transport import lane as lane_module
from hio.transport import payload
from hio.transport.certs import generate
from hio.transport.errors import DataLoss
from hio.transport.frames import TupleFrame, TupleMeta, TupleReceipt, crc32
from hio.transport.lane import (
    END_OF_INPUT,
    FRAME_PREFIX,
    HELLO,
    REPLY_PREFIX,
    STATUS,
    LaneError,
    LaneFrame,
    LaneServer,
    lane_frames,
    magic,
)
from hio.transport.net import create_channel
from hio.transport.payload import LanePayload, PayloadPeers
from tests.harness import free_port, wait_for

PEER = "peer:1"  # the peer's gRPC address: only a key here, as no call goes to gRPC unless said
MOVED = "this peer uses gRPC"


def meta_of(tuple_id: int, data: bytes) -> TupleMeta:
    return TupleMeta(tuple_id=tuple_id, source="test", image="i", size=len(data), crc32=crc32(data), attempt=1)


class Stored:
    """The upload handler: checks each tuple as an engine would and says STORED; a tuple whose
    id is ``refuse`` ends the call with DATA_LOSS (a server's verdict, not a broken lane)."""

    def __init__(self, refuse: int = -1) -> None:
        self.tuples: list[int] = []
        self.refuse = refuse

    def __call__(self, frames: Iterator[Any]) -> Iterator[TupleReceipt]:
        for frame in frames:
            meta, data = frame.meta, bytes(frame.data)
            assert len(data) == meta.size and crc32(data) == meta.crc32, f"tuple {meta.tuple_id} damaged"
            if meta.tuple_id == self.refuse:
                raise DataLoss(f"tuple {meta.tuple_id} refused")
            self.tuples.append(meta.tuple_id)
            yield TupleReceipt(tuple_id=meta.tuple_id, state=TupleReceipt.STORED)


def pulled(request: bytes, alive: Callable[[], bool]) -> Iterator[LaneFrame]:
    """The download handler: ``max_tuples`` tuples of 1,000 bytes, ids from 1."""
    count = PullTupleRequest.FromString(request).max_tuples
    tuples = [(meta_of(n, bytes([n % 256]) * 1000), bytes([n % 256]) * 1000) for n in range(1, count + 1)]
    yield from lane_frames(iter(tuples), 1 << 20, 0)  # type: ignore[arg-type]  # bytes payloads


def lane_server(
    handler: Stored, *, port: int = 0, max_connections: int = 16, tls: ClusterSettings | None = None
) -> LaneServer:
    server = LaneServer(
        dataclasses.replace(tls or ClusterSettings(), stream_idle_seconds=10, max_tuple_bytes=1 << 26),
        service="Master",
        uploads={"Enqueue": handler},
        downloads={"PullTuple": pulled},
        table=None,
        policy={},
        max_connections=max_connections,
    )
    server.start(f"127.0.0.1:{port}")
    return server


def _no_grpc(address: str) -> grpc.Channel:
    raise AssertionError(f"the peer {address} was moved to gRPC")


def _grpc_nowhere(address: str) -> grpc.Channel:
    """The peer's gRPC channel, to a port nothing listens on (calls: UNAVAILABLE)."""
    return create_channel(f"127.0.0.1:{free_port()}", ClusterSettings())


def peers(
    *, tls: ClusterSettings | None = None, grpc_channel: Callable[[str], grpc.Channel] = _no_grpc
) -> PayloadPeers:
    return PayloadPeers(
        dataclasses.replace(tls or ClusterSettings(), max_tuple_bytes=1 << 26),
        lanes=True,
        channel=grpc_channel,
        logger=logging.getLogger("test.payload"),
    )


def enqueue(chooser: PayloadPeers, lane: str, *ids: int) -> list[int]:
    """One Enqueue of tuples ``ids`` (2,000 bytes each); the ids receipted."""
    tuples = iter([(meta_of(n, b"e" * 2000), b"e" * 2000) for n in ids])
    call, _reading = chooser.upload(PEER, lane, "Enqueue", tuples, timeout=30)  # type: ignore[arg-type]  # bytes payloads
    return [receipt.tuple_id for receipt in call]


def pull(chooser: PayloadPeers, lane: str, count: int) -> int:
    """One PullTuple of ``count`` tuples; how many frames came."""
    call, _limit = chooser.download(PEER, lane, PullTupleRequest(channel_id="c", max_tuples=count), timeout=30)
    return len(list(call))


def opened(chooser: PayloadPeers, lane: str) -> int:
    channel = chooser.get(PEER, lane)
    assert isinstance(channel, LanePayload), "the peer is on gRPC"
    return channel.opened


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ClusterSettings]:
    certs = generate(tmp_path_factory.mktemp("certs"), ("server", "client"), ("127.0.0.1",))
    return {
        "server": ClusterSettings(
            tls_cert=str(certs["server"]),
            tls_key=str(certs["server-key"]),
            tls_ca=str(certs["ca"]),
            tls_client_auth=True,
        ),
        "client": ClusterSettings(
            tls_cert=str(certs["client"]), tls_key=str(certs["client-key"]), tls_ca=str(certs["ca"])
        ),
    }


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "mutual-tls"])
def test_calls_one_after_another_share_one_connection(
    secure: bool, tls: dict[str, ClusterSettings], caplog: pytest.LogCaptureFixture
) -> None:
    """Uploads and downloads in turn, 40 calls: the server accepts one connection (over TLS:
    one handshake at each end), and every call's tuples arrive whole, in order."""
    handler = Stored()
    server = lane_server(handler, tls=tls["server"] if secure else None)
    chooser = peers(tls=tls["client"] if secure else None)
    lane = f"127.0.0.1:{server.port}"
    try:
        with caplog.at_level(logging.WARNING):
            for n in range(20):
                assert enqueue(chooser, lane, 2 * n, 2 * n + 1) == [2 * n, 2 * n + 1]
                assert pull(chooser, lane, n % 3 + 1) == n % 3 + 1
        assert handler.tuples == list(range(40))
        assert server.calls == 40 and server.methods["PullTuple"] == 20
        assert server.accepted == 1 and opened(chooser, lane) == 1
        wait_for(lambda: server.kept == 1, timeout=5, what="the connection waiting for the next call")
        assert not [r for r in caplog.records if MOVED in r.getMessage()]
    finally:
        chooser.close()
        server.stop()
    wait_for(lambda: server.open_calls == 0, timeout=5, what="the server's connections closed")


def test_calls_at_once_use_a_connection_each_and_keep_a_few(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six uploads at once take six connections; afterwards the client keeps at most
    KEPT_CONNECTIONS of them, and later calls reuse those."""
    monkeypatch.setattr(payload, "KEPT_CONNECTIONS", 2)
    server = lane_server(Stored())
    chooser = peers()
    lane = f"127.0.0.1:{server.port}"
    started = threading.Barrier(6)
    results: list[list[int]] = []

    def one(n: int) -> None:
        started.wait(10)
        results.append(enqueue(chooser, lane, *range(100 * n, 100 * n + 50)))

    try:
        threads = [threading.Thread(target=one, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sorted(len(r) for r in results) == [50] * 6
        first = opened(chooser, lane)
        assert 1 <= first <= 6
        wait_for(lambda: server.kept <= 2, timeout=5, what="the connections not kept closed")
        for n in range(10):
            assert enqueue(chooser, lane, 1000 + n) == [1000 + n]
        assert opened(chooser, lane) == first  # one after another: kept ones serve them
    finally:
        chooser.close()
        server.stop()


@pytest.mark.parametrize("how", ["restarted", "idle-closed"])
def test_a_kept_connection_the_server_closed_is_no_error_and_the_peer_stays_on_its_lane(
    how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The server restarted on its port, or closed the connection after KEEP_SECONDS idle: the
    client finds its kept connection closed before using it and opens another; the call
    succeeds and the peer is not moved to gRPC."""
    if how == "idle-closed":
        monkeypatch.setattr(lane_module, "KEEP_SECONDS", 0.3)
    handler = Stored()
    server = lane_server(handler)
    port = server.port
    chooser = peers()
    lane = f"127.0.0.1:{port}"
    try:
        with caplog.at_level(logging.WARNING):
            assert enqueue(chooser, lane, 1) == [1]
            if how == "restarted":
                server.stop()
                server = lane_server(handler, port=port)
            else:
                wait_for(
                    lambda: server.kept == 0 and server.open_calls == 0, timeout=5, what="the idle connection closed"
                )
            assert pull(chooser, lane, 2) == 2
            assert enqueue(chooser, lane, 2) == [2]
        assert server.accepted == (1 if how == "restarted" else 2)
        assert opened(chooser, lane) == 2
        assert not [r for r in caplog.records if MOVED in r.getMessage()]
    finally:
        chooser.close()
        server.stop()


def test_a_kept_connection_that_breaks_as_it_is_used_is_tried_again_or_sent_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When the server closes a kept connection just as a call begins on it (here: the check
    before use is skipped, so the client uses a connection the restarted server closed), a
    download, whose request can be sent as it is, is tried again at once on a new connection;
    an upload, whose frames were taken already, fails as a broken lane (``transport``, nothing
    receipted) for its caller to send again, and the peer stays on its lane either way."""
    monkeypatch.setattr(payload, "quiet", lambda sock: True)
    handler = Stored()
    server = lane_server(handler)
    port = server.port
    chooser = peers()
    lane = f"127.0.0.1:{port}"
    try:
        with caplog.at_level(logging.WARNING):
            assert enqueue(chooser, lane, 1) == [1]
            server.stop()
            server = lane_server(handler, port=port)
            assert pull(chooser, lane, 3) == 3  # the kept connection broke; a new one carried it
            assert opened(chooser, lane) == 2
            assert enqueue(chooser, lane, 2) == [2]  # kept from the pull
            server.stop()
            server = lane_server(handler, port=port)
            with pytest.raises(LaneError) as broke:
                enqueue(chooser, lane, 3)
            assert broke.value.transport
            assert enqueue(chooser, lane, 3) == [3]  # sent again: on the lane, a new connection
        assert handler.tuples == [1, 2, 3]
        assert chooser.get(PEER, lane).kind == "lane"
        assert not [r for r in caplog.records if MOVED in r.getMessage()]
    finally:
        chooser.close()
        server.stop()


def test_a_crowded_server_closes_its_longest_idle_connection_for_a_new_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server of two connections, both kept idle by two clients: a third client is served
    (the connection idle the longest makes room), and the first client's next call opens a
    new connection without an error; no client is moved to gRPC."""
    handler = Stored()
    server = lane_server(handler, max_connections=2)
    lane = f"127.0.0.1:{server.port}"
    first, second, third = peers(), peers(), peers()
    try:
        with caplog.at_level(logging.WARNING):
            assert enqueue(first, lane, 1) == [1]
            assert enqueue(second, lane, 2) == [2]
            wait_for(lambda: server.kept == 2, timeout=5, what="both connections kept")
            assert enqueue(third, lane, 3) == [3]
            assert enqueue(first, lane, 4) == [4]
            assert enqueue(third, lane, 5) == [5]
        assert handler.tuples == [1, 2, 3, 4, 5]
        assert opened(first, lane) == 2 and opened(third, lane) == 1
        assert server.accepted == 4
        assert not [r for r in caplog.records if MOVED in r.getMessage()]
    finally:
        for chooser in (first, second, third):
            chooser.close()
        server.stop()


def test_a_failed_or_cancelled_call_s_connection_is_not_kept() -> None:
    """A call that ended with the server's error, or was cancelled, closes its connection: the
    next call opens a new one (the server has closed it after the error, and a cancelled
    call's stream is cut mid-way)."""
    handler = Stored(refuse=13)
    server = lane_server(handler)
    chooser = peers()
    lane = f"127.0.0.1:{server.port}"
    try:
        assert enqueue(chooser, lane, 11) == [11]
        with pytest.raises(LaneError) as refused:
            enqueue(chooser, lane, 12, 13)
        assert refused.value.code() == grpc.StatusCode.DATA_LOSS and not refused.value.transport
        assert enqueue(chooser, lane, 14) == [14]
        assert opened(chooser, lane) == 2

        data = os.urandom(20_000_000)  # long enough to cancel while it goes out
        call, _reading = chooser.upload(PEER, lane, "Enqueue", iter([(meta_of(15, data), data)]), timeout=30)
        call.cancel()
        with pytest.raises(LaneError) as cancelled:
            list(call)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
        assert enqueue(chooser, lane, 16) == [16]
        assert opened(chooser, lane) == 3
        assert handler.tuples == [11, 12, 14, 16]
        assert server.accepted == 3
    finally:
        chooser.close()
        server.stop()


class _ChattyServer:
    """A hostile lane server: answers each connection's first call (a receipt per tuple, OK),
    then sends three bytes more where nothing may follow a status, and keeps the connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            reader = conn.makefile("rb")
            _magic, size = HELLO.unpack(reader.read(HELLO.size))
            reader.read(size)
            replies = b""
            while (prefix := reader.read(FRAME_PREFIX.size)) != END_OF_INPUT:
                head_size, data_size = FRAME_PREFIX.unpack(prefix)
                frame = TupleFrame.FromString(reader.read(head_size))
                reader.read(data_size)
                receipt = TupleReceipt(tuple_id=frame.meta.tuple_id, state=TupleReceipt.STORED).SerializeToString()
                replies += REPLY_PREFIX.pack(1, len(receipt)) + receipt
            status = LaneStatus(code=0).SerializeToString()
            conn.sendall(replies + REPLY_PREFIX.pack(STATUS, len(status)) + status + b"???")

    def close(self) -> None:
        self.sock.close()
        for conn in self._conns:
            conn.close()


def test_a_connection_with_bytes_past_the_status_is_not_kept() -> None:
    """The server sends nothing between calls; a client that read bytes past a status keeps
    its call's receipts and OK but does not start another call on that connection."""
    chatty = _ChattyServer()
    chooser = peers()
    try:
        assert enqueue(chooser, chatty.address, 1) == [1]
        assert enqueue(chooser, chatty.address, 2) == [2]
        assert opened(chooser, chatty.address) == 2 and chatty.accepted == 2
    finally:
        chooser.close()
        chatty.close()


def test_connections_idle_past_the_client_s_reuse_time_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "REUSE_SECONDS", 0.2)
    server = lane_server(Stored())
    chooser = peers()
    lane = f"127.0.0.1:{server.port}"
    try:
        assert enqueue(chooser, lane, 1) == [1]
        wait_for(lambda: server.kept == 1, timeout=5, what="the connection kept")
        threading.Event().wait(0.3)
        assert enqueue(chooser, lane, 2) == [2]
        assert opened(chooser, lane) == 2
        wait_for(lambda: server.kept == 1 and server.open_calls == 0, timeout=5, what="the aged connection closed")
    finally:
        chooser.close()
        server.stop()


def _read_reply(reader: Any) -> tuple[int, bytes]:
    prefix = reader.read(REPLY_PREFIX.size)
    assert len(prefix) == REPLY_PREFIX.size, "closed without a reply"
    kind, size = REPLY_PREFIX.unpack(prefix)
    return kind, reader.read(size)


def _call_bytes(version: int, tuple_id: int) -> bytes:
    """A whole Enqueue of one tuple as a client of lane ``version`` sends it."""
    body = LaneHello(method="Enqueue").SerializeToString()
    data = b"v" * 300
    head = TupleFrame(meta=meta_of(tuple_id, data), last=True).SerializeToString()
    frame = FRAME_PREFIX.pack(len(head), len(data)) + head + data
    return HELLO.pack(magic(version), len(body)) + body + frame + END_OF_INPUT


def test_on_the_wire_version_2_calls_follow_each_other_and_version_1_gets_one_call_then_the_close() -> None:
    """Raw bytes as docs/lane.md says: a version-2 client sends its next hello on the same
    connection after the OK status; a version-1 client (HIOLANE1) is served as version 1
    says: its call, then the server closes, without the client closing first."""
    handler = Stored()
    server = lane_server(handler)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            reader = sock.makefile("rb")
            for tuple_id in (1, 2, 3):
                sock.sendall(_call_bytes(2, tuple_id))
                kind, body = _read_reply(reader)
                assert kind == 1 and TupleReceipt.FromString(body).tuple_id == tuple_id
                kind, body = _read_reply(reader)
                assert kind == STATUS and LaneStatus.FromString(body).code == 0
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            reader = sock.makefile("rb")
            sock.sendall(_call_bytes(1, 4))
            assert _read_reply(reader)[0] == 1
            kind, body = _read_reply(reader)
            assert kind == STATUS and LaneStatus.FromString(body).code == 0
            assert reader.read(1) == b"", "a version-1 connection is closed after its call"
        assert handler.tuples == [1, 2, 3, 4] and server.accepted == 2
    finally:
        server.stop()


def test_a_lane_that_cannot_be_opened_sends_the_call_over_grpc_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No connection is made just to probe a lane: the first call finds it closed and goes to
    gRPC at once (nothing of it was sent); the lane is tried again after LANE_RETRY_SECONDS."""
    monkeypatch.setattr(payload, "LANE_RETRY_SECONDS", 0.3)
    port = free_port()
    lane = f"127.0.0.1:{port}"
    grpc_calls: list[str] = []

    def grpc_channel(address: str) -> grpc.Channel:
        grpc_calls.append(address)
        return _grpc_nowhere(address)

    chooser = peers(grpc_channel=grpc_channel)
    with caplog.at_level(logging.WARNING):
        with pytest.raises(grpc.RpcError) as failed:
            enqueue(chooser, lane, 1)
        assert not isinstance(failed.value, LaneError), "the call went to gRPC"
        assert grpc_calls == [PEER] and chooser.get(PEER, lane).kind == "grpc"
    assert [r.getMessage() for r in caplog.records] == [f"payload lane unreachable; {MOVED}"]
    server = lane_server(Stored(), port=port)
    try:
        threading.Event().wait(0.4)
        assert enqueue(chooser, lane, 2) == [2]
        assert chooser.get(PEER, lane).kind == "lane"
    finally:
        chooser.close()
        server.stop()


def test_a_lane_of_another_version_moves_the_peer_to_grpc(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that speaks version 1 only refuses the version-2 hello with UNIMPLEMENTED: the
    client takes it as the lane's failure (nothing receipted), not the tuples' verdict, and
    the peer uses gRPC."""
    monkeypatch.setattr(lane_module, "_SPOKEN", {magic(1): 1})
    handler = Stored()
    server = lane_server(handler)
    chooser = peers(grpc_channel=_grpc_nowhere)
    lane = f"127.0.0.1:{server.port}"
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(LaneError) as refused:
            enqueue(chooser, lane, 1)
        assert refused.value.transport and "speaks version 1" in refused.value.details()
        assert chooser.get(PEER, lane).kind == "grpc"
        assert [r.getMessage() for r in caplog.records] == [f"payload lane broke; {MOVED}"]
        assert handler.tuples == [] and server.calls == 0
    finally:
        chooser.close()
        server.stop()


def test_the_peer_of_a_lane_that_closes_every_connection_moves_to_grpc(caplog: pytest.LogCaptureFixture) -> None:
    """A listener that accepts and closes at once (a crowded server, a middlebox): the call
    breaks before any answer on a new connection, and the peer moves to gRPC."""
    from tests.worker.test_lane import _ClosingListener

    closing = _ClosingListener()
    chooser = peers(grpc_channel=_grpc_nowhere)
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(LaneError) as broke:
            enqueue(chooser, closing.address, 1)
        assert broke.value.transport
        assert chooser.get(PEER, closing.address).kind == "grpc"
        assert [r.getMessage() for r in caplog.records] == [f"payload lane broke; {MOVED}"]
        assert closing.accepted == 1
    finally:
        closing.close()


def test_lanes_off_choose_grpc_for_every_peer() -> None:
    made: list[str] = []

    def grpc_channel(address: str) -> grpc.Channel:
        made.append(address)
        return _grpc_nowhere(address)

    off = PayloadPeers(ClusterSettings(), lanes=False, channel=grpc_channel, logger=logging.getLogger("test"))
    assert off.get(PEER, "127.0.0.1:9").kind == "grpc" and off.get(PEER, "").kind == "grpc"
    assert made == [PEER], "one gRPC adapter per peer"
