"""The payload lane over TLS (hio.transport.lanetls), with real certificates over loopback: frames
and receipts both ways at once, refusals of clients the server must not trust (and of
servers the client must not), plaintext against TLS, tokens, and version negotiation."""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from hio.proto.engine_pb2 import LaneHello, LaneStatus
from hio.settings import ClusterSettings
from hio.transport.certs import generate
from hio.transport.frames import TupleMeta, TupleReceipt, crc32
from hio.transport.lane import (
    HELLO,
    MAGIC_PREFIX,
    REPLY_PREFIX,
    STATUS,
    LaneCall,
    LaneError,
    LaneServer,
    lane_frames,
    lane_hello,
    magic,
    open_lane,
)
from hio.transport.lanetls import client_context, server_context
from hio.transport.net import TokenTable

TOKEN = "tls-s3cret"
POLICY = {"Deliver": {"gateway"}}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("certs")
    paths = generate(root / "good", ("server", "gateway"), ("localhost", "127.0.0.1"))
    other = generate(root / "other", ("stranger",), ("localhost", "127.0.0.1"))  # another CA's
    named = generate(root / "named", ("elsewhere",), ("db.example.org",))  # not this host
    return {
        **paths,
        "stranger": other["stranger"],
        "stranger-key": other["stranger-key"],
        "elsewhere": named["elsewhere"],
        "elsewhere-key": named["elsewhere-key"],
        "named-ca": named["ca"],
    }


def server_settings(
    certs: dict[str, Path], *, client_auth: bool = False, name: str = "server", ca: str = "ca"
) -> ClusterSettings:
    return ClusterSettings(
        tls_cert=str(certs[name]), tls_key=str(certs[f"{name}-key"]), tls_ca=str(certs[ca]), tls_client_auth=client_auth
    )


def client_settings(certs: dict[str, Path], *, name: str | None = "gateway", ca: str | None = "ca") -> ClusterSettings:
    return ClusterSettings(
        tls_ca=str(certs[ca]) if ca else "",
        tls_cert=str(certs[name]) if name else "",
        tls_key=str(certs[f"{name}-key"]) if name else "",
    )


class Received:
    """The upload handler: checks each tuple's size and CRC-32 as an engine would, and says STORED."""

    def __init__(self) -> None:
        self.tuples: list[tuple[int, int]] = []  # (tuple id, crc32) in order

    def __call__(self, frames: Iterator[Any]) -> Iterator[TupleReceipt]:
        for frame in frames:
            meta, data = frame.meta, bytes(frame.data)
            assert len(data) == meta.size and crc32(data) == meta.crc32, f"tuple {meta.tuple_id} damaged"
            self.tuples.append((meta.tuple_id, crc32(data)))
            yield TupleReceipt(tuple_id=meta.tuple_id, state=TupleReceipt.STORED)


def serve(settings: ClusterSettings | None, handler: Received, *, table: TokenTable | None = None) -> LaneServer:
    server = LaneServer(
        dataclasses.replace(settings or ClusterSettings(), stream_idle_seconds=10, max_tuple_bytes=64 << 20),
        service="Engine",
        uploads={"Deliver": handler},
        table=table,
        policy=POLICY,
    )
    server.start("127.0.0.1:0")
    return server


def meta_of(tuple_id: int, data: bytes) -> TupleMeta:
    return TupleMeta(tuple_id=tuple_id, source="test", image="i", size=len(data), crc32=crc32(data), attempt=1)


def deliver(
    port: int,
    tuples: list[tuple[TupleMeta, Any]],
    *,
    settings: ClusterSettings | None,
    token: str = "",
    host: str = "127.0.0.1",
) -> list[TupleReceipt]:
    tls = client_context(settings) if settings else None
    sock = open_lane(f"{host}:{port}", lane_hello(token, "Deliver"), connect_seconds=5, tls=tls)
    call = LaneCall(sock, lane_frames(iter(tuples), chunk_bytes=1 << 20, pack_bytes=0), timeout=60)
    return list(call)


@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mutual-tls"])
def test_a_tls_lane_carries_tuples_from_memory_and_from_files(
    certs: dict[str, Path], tmp_path: Path, client_auth: bool
) -> None:
    """Receipts flow back while frames still go out (the sender and the reader share one TLS
    connection from two threads); every payload arrives whole, in order."""
    handler = Received()
    server = serve(server_settings(certs, client_auth=client_auth), handler)
    try:
        spooled = os.urandom(3_000_000)
        path = tmp_path / "spool.bin"
        path.write_bytes(b"h" * 1000 + spooled + b"t" * 10)  # inside a larger file, as in the spool
        tuples: list[tuple[TupleMeta, Any]] = []
        for n in range(300):
            data = os.urandom(70_000 + n * 37)
            tuples.append((meta_of(n + 1, data), data))
        fh = open(path, "rb")  # noqa: SIM115 - the lane closes it once sent
        fh.seek(1000)
        tuples.insert(150, (meta_of(1000, spooled), fh))
        big = os.urandom(12_000_000)
        tuples.append((meta_of(2000, big), big))
        receipts = deliver(server.port, tuples, settings=client_settings(certs))
        assert fh.closed
    finally:
        server.stop()
    assert [r.tuple_id for r in receipts] == [m.tuple_id for m, _ in tuples]
    assert all(r.state == TupleReceipt.STORED for r in receipts)
    assert handler.tuples == [(m.tuple_id, m.crc32) for m, _ in tuples]


def test_tokens_and_roles_are_checked_over_tls(certs: dict[str, Path]) -> None:
    table = TokenTable([(TOKEN, "gateway", "g1"), ("viewer-token", "viewer", "v1")])
    handler = Received()
    server = serve(server_settings(certs), handler, table=table)
    data = b"x" * 100
    try:
        for token, code in (
            ("", grpc.StatusCode.UNAUTHENTICATED),
            ("wrong", grpc.StatusCode.UNAUTHENTICATED),
            ("viewer-token", grpc.StatusCode.PERMISSION_DENIED),
        ):
            with pytest.raises(LaneError) as err:
                deliver(server.port, [(meta_of(1, data), data)], settings=client_settings(certs), token=token)
            assert err.value.code() == code and not err.value.transport
        assert handler.tuples == []
        assert (
            deliver(server.port, [(meta_of(2, data), data)], settings=client_settings(certs), token=TOKEN)[0].state
            == TupleReceipt.STORED
        )
    finally:
        server.stop()


def test_a_client_that_cannot_verify_the_server_refuses_it(certs: dict[str, Path]) -> None:
    """The server's certificate is checked as gRPC checks it: signed by tls_ca (a client
    given another CA, or none: the system's, refuses it) and naming the host connected to."""
    server = serve(server_settings(certs), Received())
    try:
        for settings in (client_settings(certs, ca="named-ca"), client_settings(certs, ca=None)):
            with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
                open_lane(
                    f"127.0.0.1:{server.port}",
                    lane_hello("", "Deliver"),
                    connect_seconds=5,
                    tls=client_context(settings),
                )
    finally:
        server.stop()
    named = serve(server_settings(certs, name="elsewhere", ca="named-ca"), Received())
    try:  # signed by the CA the client trusts, but for db.example.org, not 127.0.0.1
        with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
            open_lane(
                f"127.0.0.1:{named.port}",
                lane_hello("", "Deliver"),
                connect_seconds=5,
                tls=client_context(client_settings(certs, name=None, ca="named-ca")),
            )
        assert named.calls == 0
    finally:
        named.stop()


@pytest.mark.parametrize("name", [None, "stranger"], ids=["no-certificate", "another-ca"])
def test_mutual_tls_refuses_a_client_without_a_certificate_of_its_ca(certs: dict[str, Path], name: str | None) -> None:
    handler = Received()
    server = serve(server_settings(certs, client_auth=True), handler)
    data = b"y" * 1000
    try:
        with pytest.raises((LaneError, ssl.SSLError)) as err:
            deliver(server.port, [(meta_of(1, data), data)], settings=client_settings(certs, name=name))
        text = str(err.value)
        assert "ALERT" in text.upper() or "certificate" in text, text  # OpenSSL's alert names the reason
        if isinstance(err.value, LaneError):
            assert err.value.transport and err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert handler.tuples == [] and server.calls == 0
    finally:
        server.stop()


def test_a_plaintext_client_of_a_tls_lane_fails_cleanly(certs: dict[str, Path]) -> None:
    handler = Received()
    server = serve(server_settings(certs), handler)
    data = b"z" * 1000
    try:
        with pytest.raises(LaneError) as err:
            deliver(server.port, [(meta_of(1, data), data)], settings=None)
        assert err.value.transport and err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "speaks TLS and this client does not: set tls_ca" in err.value.details()
        assert handler.tuples == [] and server.calls == 0
        # and the server is unharmed
        assert deliver(server.port, [(meta_of(2, data), data)], settings=client_settings(certs))[0].tuple_id == 2
    finally:
        server.stop()


def test_a_tls_client_of_a_plain_lane_fails_its_handshake(certs: dict[str, Path]) -> None:
    server = serve(None, Received())
    try:
        with pytest.raises(ssl.SSLError):
            open_lane(
                f"127.0.0.1:{server.port}",
                lane_hello("", "Deliver"),
                connect_seconds=5,
                tls=client_context(client_settings(certs)),
            )
        assert server.calls == 0
    finally:
        server.stop()


def _raw_status(port: int, send: bytes) -> LaneStatus:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(send)
        reader = sock.makefile("rb")
        kind, size = REPLY_PREFIX.unpack(reader.read(REPLY_PREFIX.size))
        assert kind == STATUS
        return LaneStatus.FromString(reader.read(size))


def test_an_unknown_version_is_answered_unimplemented_in_version_1() -> None:
    """A client proposing a version the server does not speak gets a version-1 status
    (UNIMPLEMENTED, naming the versions spoken) and may propose another."""
    server = serve(None, Received())
    try:
        body = LaneHello(method="Deliver").SerializeToString()
        status = _raw_status(server.port, HELLO.pack(magic(3), len(body)) + body)
        assert status.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
        assert "speaks version 1 or 2" in status.message and "'3'" in status.message
        status = _raw_status(server.port, b"GET / HTTP/1.1\r\n\r\n")
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "HIOLANE2" in status.message
        assert magic() == MAGIC_PREFIX + b"2"
    finally:
        server.stop()


def test_lane_tls_follows_the_grpc_settings(certs: dict[str, Path]) -> None:
    assert server_context(ClusterSettings()) is None and client_context(ClusterSettings()) is None
    assert server_context(server_settings(certs)).verify_mode == ssl.CERT_NONE
    assert server_context(server_settings(certs, client_auth=True)).verify_mode == ssl.CERT_REQUIRED
    client = client_context(client_settings(certs))
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    assert client_context(ClusterSettings(tls_ca=str(certs["ca"]))) is not None  # a client without a certificate


def test_the_headers_are_laid_out_as_docs_lane_md_says() -> None:
    from hio.transport.lane import END_OF_INPUT, FRAME_PREFIX, MAGIC

    assert MAGIC == b"HIOLANE2" and HELLO.pack(MAGIC, 3) == b"HIOLANE2\x00\x00\x00\x03"
    assert HELLO.unpack(b"HIOLANE1\x00\x01\x00\x00") == (b"HIOLANE1", 65536)
    assert FRAME_PREFIX.pack(5, 2**40) == b"\x00\x00\x00\x05" + (2**40).to_bytes(8, "big")
    assert FRAME_PREFIX.unpack(bytes(12)) == (0, 0) and bytes(12) == END_OF_INPUT
    assert REPLY_PREFIX.pack(STATUS, 258) == b"\x02\x00\x00\x01\x02" and REPLY_PREFIX.size == 5
