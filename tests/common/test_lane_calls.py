"""Sessions of unary calls on the payload lane (hio.common.lane: LaneServer's ``unaries``,
LaneCalls), over real loopback sockets: many calls on one kept connection, errors that
answer one call, per-call authorization, and what a client does when the server goes."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Iterator

import grpc
import pytest

from hio.common.errors import ResourceExhausted
from hio.common.lane import CALLS, MAGIC, LaneCalls, LaneError, LaneServer, LaneSkips
from hio.common.net import TokenTable
from hio.proto.engine_pb2 import LaneHello, LaneStatus

POLICY = {"Echo": {"gateway"}, "Slow": {"gateway"}, "Busy": {"gateway"}}
log = logging.getLogger("test")


def _busy(body: bytes) -> bytes:
    raise ResourceExhausted("queue full", retry_after=2.5)


def _slow(body: bytes) -> bytes:
    time.sleep(float(body.decode()))
    return b"late"


def serve(port: int = 0, table: TokenTable | None = None) -> LaneServer:
    server = LaneServer(f"127.0.0.1:{port}", service="Test", uploads={}, table=table, policy=POLICY,
                        unaries={"Echo": lambda body: body[::-1], "Busy": _busy, "Slow": _slow},
                        idle_seconds=5, max_head_bytes=1024, max_data_bytes=1024)
    server.start()
    return server


@pytest.fixture
def server() -> Iterator[LaneServer]:
    s = serve()
    yield s
    s.stop()


def client(server: LaneServer, token: str = "") -> LaneCalls:
    return LaneCalls(f"127.0.0.1:{server.port}", LaneSkips(log, "lane unusable"), token=token)


def test_many_calls_share_one_kept_connection(server: LaneServer) -> None:
    calls = client(server)
    try:
        answers = [calls.call("Echo", f"call {n}".encode(), timeout=5) for n in range(20)]
    finally:
        calls.close()
    assert answers == [f"call {n}".encode()[::-1] for n in range(20)]
    assert server.methods["Echo"] == 20
    assert server.sessions == 1


def test_callers_at_once_get_connections_of_their_own(server: LaneServer) -> None:
    calls = client(server)
    results: list[bytes | None] = []
    threads = [threading.Thread(target=lambda: results.append(calls.call("Slow", b"0.3", timeout=5)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [b"late"] * 3
    assert server.sessions == 3
    assert calls.call("Echo", b"ab", timeout=5) == b"ba"   # a kept one is used again
    assert server.sessions == 3
    calls.close()


def test_an_error_answers_its_call_and_the_session_goes_on(server: LaneServer) -> None:
    calls = client(server)
    with pytest.raises(LaneError) as busy:
        calls.call("Busy", b"", timeout=5)
    assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and busy.value.details() == "queue full"
    assert not busy.value.transport
    assert dict(busy.value.trailing_metadata())["hio-retry-after"] == "2.500"
    with pytest.raises(LaneError) as unknown:
        calls.call("Nope", b"", timeout=5)
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "answers Busy and Echo and Slow only, not 'Nope'" in unknown.value.details()
    assert calls.call("Echo", b"xy", timeout=5) == b"yx"
    assert server.sessions == 1
    calls.close()


def test_each_call_is_authorized_by_the_hellos_token_and_the_methods_roles() -> None:
    table = TokenTable([("gw", "gateway", "gw1"), ("view", "viewer", "v1")])
    server = serve(table=table)
    try:
        for token, code in (("", grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED),
                            ("view", grpc.StatusCode.PERMISSION_DENIED)):
            calls = client(server, token)
            with pytest.raises(LaneError) as refused:
                calls.call("Echo", b"x", timeout=5)
            assert refused.value.code() == code, token
            calls.close()
        calls = client(server, "gw")
        assert calls.call("Echo", b"ok", timeout=5) == b"ko"
        calls.close()
        assert server.methods["Echo"] == 1   # refused calls are not counted as answered
    finally:
        server.stop()


def test_a_kept_connection_serves_only_its_own_clients_calls() -> None:
    """A session is authorized by its hello, and a client presents one token: calls of a
    client with another token, to the same server at the same time, open sessions of their
    own and are refused there."""
    table = TokenTable([("gw", "gateway", "gw1"), ("view", "viewer", "v1")])
    server = serve(table=table)
    try:
        calls = client(server, "gw")
        assert calls.call("Echo", b"ok", timeout=5) == b"ko"
        for token, code in (("view", grpc.StatusCode.PERMISSION_DENIED), ("wrong", grpc.StatusCode.UNAUTHENTICATED)):
            other = client(server, token)
            with pytest.raises(LaneError) as refused:
                other.call("Echo", b"x", timeout=5)
            assert refused.value.code() == code, token
            other.close()
        assert calls.call("Echo", b"ok", timeout=5) == b"ko"
        calls.close()
        assert server.methods["Echo"] == 2
        assert server.sessions == 2, "gw's session, kept and used twice, and view's; 'wrong' is refused at its hello"
    finally:
        server.stop()


def test_a_restarted_server_is_reached_on_a_new_connection_without_a_failed_call() -> None:
    first = serve()
    port = first.port
    calls = client(first)
    assert calls.call("Echo", b"1", timeout=5) == b"1"
    first.stop()
    second = serve(port)
    try:
        time.sleep(0.1)   # the kept connection's end has arrived
        assert calls.call("Echo", b"12", timeout=5) == b"21"
        assert second.sessions == 1
    finally:
        calls.close()
        second.stop()


def test_a_server_that_is_gone_leaves_the_caller_to_grpc(caplog: pytest.LogCaptureFixture) -> None:
    gone = serve()
    port = gone.port
    gone.stop()
    calls = LaneCalls(f"127.0.0.1:{port}", LaneSkips(log, "lane unusable"))
    with caplog.at_level(logging.WARNING):
        assert calls.call("Echo", b"x", timeout=5) is None
        assert calls.call("Echo", b"x", timeout=5) is None   # skipped a while: no new attempt
    assert sum("lane unusable" in r.getMessage() for r in caplog.records) == 1


def test_a_call_past_its_deadline_fails_and_its_connection_is_not_used_again(server: LaneServer) -> None:
    calls = client(server)
    with pytest.raises(LaneError) as late:
        calls.call("Slow", b"1.0", timeout=0.2)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert calls.call("Echo", b"ab", timeout=5) == b"ba"   # not the late answer of Slow
    assert server.sessions == 2
    calls.close()


def test_a_request_over_the_limit_is_refused_and_ends_the_session(server: LaneServer) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    hello = LaneHello(method=CALLS).SerializeToString()
    sock.sendall(MAGIC + struct.pack(">I", len(hello)) + hello)
    sock.sendall(struct.pack(">HI", 4, 5000) + b"Echo")
    kind, size = struct.unpack(">BI", sock.recv(5, socket.MSG_WAITALL))
    status = LaneStatus.FromString(sock.recv(size, socket.MSG_WAITALL))
    assert kind == 2 and status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "as gRPC's message limit"
    assert "over the limit" in status.message
    assert sock.recv(1) == b""   # the server closed the session
    sock.close()


def test_a_server_without_unary_calls_refuses_a_session() -> None:
    server = LaneServer("127.0.0.1:0", service="Test", uploads={"Deliver": lambda frames: iter(())}, table=None,
                        policy={}, idle_seconds=5, max_head_bytes=1024, max_data_bytes=1024)
    server.start()
    try:
        calls = client(server)
        with pytest.raises(LaneError) as refused:
            calls.call("Echo", b"x", timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "serves Deliver only, not 'Calls'" in refused.value.details()
        calls.close()
    finally:
        server.stop()

