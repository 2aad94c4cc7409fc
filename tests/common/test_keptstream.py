"""KeptStream: a stream-stream method used as a unary one, against a real gRPC server on
loopback. The server counts the streams it served, so each test says whether calls shared
a stream, and what a failure, a silence or a pause does to it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from hio.settings import ClusterSettings
from hio.transport.keptstream import KeptStream
from hio.transport.net import create_channel, create_server
from tests.harness import wait_for


class Echo:
    """Answers each request with itself; b'refuse' ends the stream with INVALID_ARGUMENT,
    b'hang' waits (until released) before answering. Counts the streams opened and ended."""

    def __init__(self) -> None:
        self.opened = 0
        self.ended = 0
        self.release = threading.Event()

    def serve(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        self.opened += 1
        try:
            for request in requests:
                if request == b"refuse":
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused: the request says so")
                if request == b"hang":
                    self.release.wait(10)
                yield request
        finally:
            self.ended += 1


@pytest.fixture
def echo() -> Iterator[tuple[Echo, grpc.Channel]]:
    service = Echo()
    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Serve": grpc.stream_stream_rpc_method_handler(service.serve)}
    )
    settings = ClusterSettings()
    server, port, _health = create_server(
        settings, "127.0.0.1:0", register=[lambda s: s.add_generic_rpc_handlers((handler,))]
    )
    server.start()
    channel = create_channel(f"127.0.0.1:{port}", settings)
    try:
        yield service, channel
    finally:
        service.release.set()
        channel.close()
        server.stop(0)


def kept(channel: grpc.Channel, *, timeout: float = 5.0, idle_seconds: float = 30.0) -> KeptStream[bytes, bytes]:
    return KeptStream(
        channel.stream_stream("/test.Echo/Serve"), name="Serve", timeout=timeout, idle_seconds=idle_seconds
    )


def test_calls_share_one_stream_and_each_gets_its_own_answer(echo: tuple[Echo, grpc.Channel]) -> None:
    service, channel = echo
    stream = kept(channel)
    try:
        answers = [stream.call(f"request {n}".encode()) for n in range(200)]
    finally:
        stream.close()
    assert answers == [f"request {n}".encode() for n in range(200)]
    assert service.opened == 1


def test_calls_from_many_threads_each_get_their_own_answer(echo: tuple[Echo, grpc.Channel]) -> None:
    _service, channel = echo
    stream = kept(channel)
    wrong: list[tuple[bytes, bytes]] = []

    def caller(who: int) -> None:
        for n in range(50):
            request = f"{who}/{n}".encode()
            answer = stream.call(request)
            if answer != request:
                wrong.append((request, answer))

    threads = [threading.Thread(target=caller, args=(who,)) for who in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        stream.close()
    assert wrong == []


def test_a_refusal_fails_its_call_with_the_servers_status_and_the_next_call_opens_a_new_stream(
    echo: tuple[Echo, grpc.Channel],
) -> None:
    service, channel = echo
    stream = kept(channel)
    try:
        assert stream.call(b"first") == b"first"
        with pytest.raises(grpc.RpcError) as refused:
            stream.call(b"refuse")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "refused: the request says so"
        assert stream.call(b"after") == b"after"
    finally:
        stream.close()
    assert service.opened == 2


def test_an_answer_later_than_the_timeout_fails_with_deadline_exceeded_and_the_stream_is_replaced(
    echo: tuple[Echo, grpc.Channel],
) -> None:
    service, channel = echo
    stream = kept(channel, timeout=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as late:
            stream.call(b"hang")
        waited = time.monotonic() - start
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no answer within 1 s" in late.value.details()
        assert 1.0 <= waited < 5.0, waited
        service.release.set()
        assert stream.call(b"after") == b"after"
    finally:
        stream.close()
    assert service.opened == 2


def test_a_stream_left_idle_is_closed_and_the_next_call_opens_another(echo: tuple[Echo, grpc.Channel]) -> None:
    service, channel = echo
    stream = kept(channel, idle_seconds=0.5)
    try:
        assert stream.call(b"before") == b"before"
        wait_for(lambda: service.ended == 1, timeout=5, what="the idle stream ended on the server")
        assert stream.call(b"after") == b"after"
        assert service.opened == 2
    finally:
        stream.close()


def test_a_server_gone_fails_the_call_unavailable_and_a_closed_stream_refuses_calls() -> None:
    settings = ClusterSettings()
    with create_channel("127.0.0.1:1", settings) as channel:
        stream = kept(channel)
        with pytest.raises(grpc.RpcError) as gone:
            stream.call(b"anyone?")
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
        stream.close()
        with pytest.raises(grpc.RpcError) as closed:
            stream.call(b"again")
        assert closed.value.code() == grpc.StatusCode.CANCELLED
