"""The payload lane: ``Engine.Deliver``, ``Master.Enqueue`` and ``Master.PullTuple`` over kept
TCP connections (TLS: :mod:`hio.transport.lanetls`). ``docs/lane.md`` specifies the protocol;
its wire format is declared here, once.

Why: Python gRPC copies a payload four times on its way (into the message,
into gRPC's buffer, out of it, into the joined tuple); at 10 MB a tuple spent
about two thirds of its 32 ms of CPU in the gateway's and the engine's gRPC
layers. On the lane a payload goes from the spool file to the socket with
``sendfile`` (or from memory with one ``send``) and is received straight into
the one ``bytes`` object the pipeline gets. Frames, receipts, checks and
statuses are exactly the gRPC calls': the engine runs the same ``deliver`` on both.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, BinaryIO, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError, Message

from hio.config import ConfigError, lane_beside, split_address
from hio.proto.engine_pb2 import LaneHello, LaneStatus
from hio.settings import ClusterSettings, message_limit
from hio.transport.errors import (
    BY_CODE,
    RETRY_AFTER_KEY,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    HioError,
    InvalidArgument,
    Unimplemented,
    status_of,
)
from hio.transport.frames import ChunkFrame, TupleFrame, TupleMeta, TupleReceipt, pack_small
from hio.transport.lanetls import TLSSocket, server_context
from hio.transport.net import RoleHealth, TokenTable, create_server, refuse_caller

M = TypeVar("M", bound=Message)
log = logging.getLogger("hio.lane")

# The wire format (docs/lane.md), declared once: every integer is unsigned and big-endian.
VERSION = 2  # the lane version this code's clients propose: calls one after another on a connection
VERSIONS = (1, VERSION)  # every version a server here accepts in a hello (1: one call, then it closes)
MAGIC_PREFIX = b"HIOLANE"  # a hello's first 7 bytes; the 8th is the version as an ASCII digit


def magic(version: int = VERSION) -> bytes:
    """The 8 bytes that open a connection proposing ``version`` (1-9)."""
    return MAGIC_PREFIX + str(version).encode("ascii")


MAGIC = magic()  # b"HIOLANE2"
# client -> server, opening each call: (magic, size) of the LaneHello that follows
HELLO = struct.Struct(">8sI")
# a frame, either way (uploads: client -> server; downloads: server -> client): (head_size, data_size), then head, data
FRAME_PREFIX = struct.Struct(">IQ")
END_OF_INPUT = FRAME_PREFIX.pack(0, 0)  # no frame is empty: this prefix ends the frames
# server -> client, receipts and the final status: (kind, size), then the body
REPLY_PREFIX = struct.Struct(">BI")
RECEIPT, STATUS = 1, 2  # a reply's kind: TupleReceipt, LaneStatus (3 is reserved)
TLS_RECORD_TYPES = (0x15, 0x16)  # a TLS record's first byte (alert, handshake): what a plaintext peer of TLS reads

# Limits a peer may rely on (docs/lane.md, "Limits")
MAX_HELLO_BYTES = 64 * 1024  # a LaneHello
MAX_STATUS_BYTES = 64 * 1024  # a LaneStatus that ends a download
MAX_REPLY_BYTES = 64 * 1024 * 1024  # any other reply body
HELLO_SECONDS = 10.0  # the TLS handshake and the whole hello arrive within this
DRAIN_SECONDS = 1.0  # after an error status the server reads on this long, then closes
KEEP_SECONDS = 60.0  # a server keeps a connection idle between calls this long (less only when crowded)
REUSE_SECONDS = 20.0  # a client starts a call only on a connection idle for less than this

MAX_CONNECTIONS = 16  # an engine serves one call at a time; more connections make room or are closed at once
READ_BUFFER = 256 * 1024  # larger reads go straight into their destination
REPLY_READ = 64 * 1024  # what an upload's client reads at a time of the replies
SMALL_SEND = 64 * 1024  # a frame up to this is sent with its prefix in one send
LANE_CONNECT_SECONDS = 3.0  # a lane connection not made within this (nor then its TLS handshake) is a lane failure
SENDER_JOIN_SECONDS = 30.0  # how long a finished call waits for its sender before leaving it the socket
SENDER_SETTLE_SECONDS = 1.0  # how long a call the server ended OK waits for its sender to return, to keep the socket
STOP_WAIT_SECONDS = 2.0  # how long stop() waits for the calls it ended
Payload = bytes | memoryview | BinaryIO
LaneFrame = tuple[bytes, Payload, int]  # (head, payload, payload size)
Handler = Callable[[Iterator[TupleFrame | ChunkFrame]], Iterator[TupleReceipt]]
# A download (the master's PullTuple): the hello's request and a check that the caller is
# still connected, to the frames it is sent (they end with END_OF_INPUT, then the status).
Download = Callable[[bytes, Callable[[], bool]], Iterator[LaneFrame]]


class LaneError(grpc.RpcError):
    """A lane call's failure, read like a failed gRPC call (``code()``, ``details()``).

    ``transport``: the lane itself failed (refused, closed without a status,
    garbage), not the engine's verdict: the peer's connection is lost
    (:meth:`hio.transport.payload.PayloadPeers.broken`).
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, *, transport: bool = False, retry_after: float = 0.0
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self._code = code
        self._message = message
        self.transport = transport
        self._retry_after = retry_after

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:  # type: ignore[override]  # stubs: a private type
        """The server's retry hint, where gRPC would carry it (:func:`errors.retry_after` reads it)."""
        return ((RETRY_AFTER_KEY, f"{self._retry_after:.3f}"),) if self._retry_after > 0 else ()


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _status_error(status: LaneStatus, *, answered: bool) -> LaneError | None:
    """The call's failure a server's status says, as gRPC would raise it; None for OK. A
    version refused before any other reply (a server of another lane version) is the lane's
    failure, not the call's: the client uses gRPC (docs/lane.md, "Version negotiation")."""
    if not status.code:
        return None
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    if code == grpc.StatusCode.UNIMPLEMENTED and not answered:
        return LaneError(grpc.StatusCode.UNAVAILABLE, status.message, transport=True)
    return LaneError(code, status.message, retry_after=status.retry_after_seconds)


def tune(sock: socket.socket) -> None:
    """No Nagle delay; TCP keepalive as gRPC's (20 s, then 3 probes 10 s apart), so a peer
    host that vanished ends the call instead of holding a channel or a batch."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 20), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _recv_before(conn: socket.socket, size: int, deadline: float) -> bytes:
    """Exactly ``size`` bytes from the socket before ``deadline`` (monotonic), else fewer."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        conn.settimeout(left)
        try:
            n = conn.recv_into(view[got:])
        except OSError:  # timed out, or the client is gone: a short hello either way
            break
        if not n:
            break
        got += n
    return bytes(buf[:got])


def _decoded(message: type[M], body: bytes) -> M:
    """A reply's body as ``message``; a body that does not decode is the transport's failure."""
    try:
        return message.FromString(body)
    except DecodeError as exc:
        raise LaneError(
            grpc.StatusCode.INTERNAL, f"payload lane sent an unreadable reply: {exc}", transport=True
        ) from None


def _reader(sock: socket.socket) -> BinaryIO:
    """A buffered reader of ``sock`` (of a :class:`lanetls.TLSSocket`: of what it decrypts)."""
    return cast(BinaryIO, sock.makefile("rb", buffering=READ_BUFFER))


def _read_exact(reader: BinaryIO, size: int, what: str) -> bytes:
    """``size`` bytes (one object, read straight into it when large); DataLoss when the peer stops early."""
    data = _read(reader, size)
    if len(data) != size:
        raise DataLoss(f"payload lane: connection ended inside {what} ({len(data)} of {size} bytes)")
    return data


def _read(reader: BinaryIO, size: int) -> bytes:
    """Up to ``size`` bytes; DeadlineExceeded when the socket's timeout passes without a byte."""
    try:
        return reader.read(size)
    except TimeoutError:
        raise DeadlineExceeded("no bytes within the idle bound (stream_idle_seconds): the sender stalled") from None
    except OSError as exc:  # reset, or shut by stop(): the peer is gone, as a cancelled gRPC call
        raise Cancelled(f"payload lane: connection lost: {exc}") from None


_SPEAKS_TLS = (
    "payload lane speaks TLS and this client does not: set tls_ca (and tls_cert, tls_key when "
    "the server requires client certificates), as for its gRPC address"
)


class _Lost(Exception):
    """A reply could not be written: the client is gone (nothing more to tell it)."""


# -- the engine's side ---------------------------------------------------------------


def read_frames(
    reader: BinaryIO, *, max_head_bytes: int, max_data_bytes: int, piece_bytes: int = 0
) -> Iterator[TupleFrame | ChunkFrame]:
    """The frames a client sends, until it ends its input (:data:`END_OF_INPUT`); a
    connection that ends without it is a cancelled call.

    A frame's payload is read into one ``bytes`` of its own, so a tuple sent
    as one frame reaches the pipeline without a copy (:class:`FrameReader`
    passes a lone ``bytes`` chunk through). With ``piece_bytes``, a larger
    payload is read and handed on in pieces of that size (the master writes
    them to its backlog as they come, after checking the tuple, so an upload
    holds one piece in memory, not a whole tuple).
    """
    while True:
        prefix = _read(reader, FRAME_PREFIX.size)
        if not prefix:  # gone without ending its input: cancelled, as a gRPC call would be
            raise Cancelled("payload lane: the sender went away before ending its input")
        if prefix[0] in TLS_RECORD_TYPES:  # a head of 350 MB or more: no frame, a TLS record
            raise DataLoss(_SPEAKS_TLS)
        if len(prefix) != FRAME_PREFIX.size:
            raise DataLoss("payload lane: connection ended inside a frame prefix")
        if prefix == END_OF_INPUT:
            return
        head_size, data_size = FRAME_PREFIX.unpack(prefix)
        for part, size, limit in (("head", head_size, max_head_bytes), ("data", data_size, max_data_bytes)):
            if size > limit:
                raise InvalidArgument(f"payload lane: frame {part} of {size} bytes is over the limit of {limit}")
        try:
            frame = TupleFrame.FromString(_read_exact(reader, head_size, "a frame head"))
        except DecodeError as exc:
            raise InvalidArgument(f"payload lane: unreadable frame head: {exc}") from None
        if not data_size:
            yield frame
            continue
        if frame.data or frame.packed:
            raise InvalidArgument(
                "payload lane: a frame with lane data must carry neither data nor packed tuples in its head"
            )
        if frame.HasField("meta") and data_size > frame.meta.size:
            raise DataLoss(
                f"payload lane: tuple {frame.meta.tuple_id or frame.meta.name}: frame of {data_size} "
                f"bytes, more than the {frame.meta.size} its metadata declares"
            )
        if not piece_bytes or data_size <= piece_bytes:
            yield ChunkFrame(frame, _read_exact(reader, data_size, "a frame's data"))
            continue
        yield from _pieces(reader, frame, data_size, piece_bytes)


def _pieces(reader: BinaryIO, frame: TupleFrame, size: int, piece_bytes: int) -> Iterator[ChunkFrame]:
    """One frame's data as consecutive frames of at most ``piece_bytes``: the first keeps
    the head, and only the last may end the tuple (as the frame did)."""
    done, last = 0, frame.last
    while done < size:
        step = min(piece_bytes, size - done)
        head = frame if done == 0 else TupleFrame()  # the frame is ours (just parsed): the first piece's head
        head.last = last and done + step == size
        yield ChunkFrame(head, _read_exact(reader, step, "a frame's data"))
        done += step


class LaneServer:
    """Serves calls of ``service`` on a TCP port (``docs/lane.md``), a thread per connection:
    ``uploads`` take frames and answer receipts (the engine's Deliver, the master's Enqueue);
    ``downloads`` take the hello's request and send frames (the master's PullTuple).

    Callers are refused as gRPC refuses them (the same ``table`` and ``policy``), and bounds
    and TLS are its (``settings``: :func:`net.message_limit` per head, ``max_tuple_bytes`` per
    frame's data; with ``tls_cert`` every connection speaks TLS, its handshake made on the
    connection's own thread). The idle bound ``stream_idle_seconds`` is the socket's
    timeout: it runs only while the server waits for bytes, and any byte restarts it (a
    large frame may take long on a slow link without counting as a stall).
    """

    def __init__(
        self,
        settings: ClusterSettings,
        *,
        service: str,
        uploads: dict[str, Handler],
        downloads: dict[str, Download] | None = None,
        table: TokenTable | None,
        policy: dict[str, set[str]],
        max_connections: int = MAX_CONNECTIONS,
        piece_bytes: int = 0,
    ) -> None:
        self._tls = server_context(settings)
        self._piece = piece_bytes
        self._uploads = uploads
        self._downloads = downloads or {}
        self._service = service
        self._max_connections = max_connections
        self._table = table
        self._policy = policy
        self._idle = settings.stream_idle_seconds
        self._max_head = message_limit(settings)
        self._max_data = settings.max_tuple_bytes
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._kept: dict[socket.socket, float] = {}  # connections waiting for their next call -> since (monotonic)
        self._sock: socket.socket | None = None
        self._stopping = False
        self.port = 0
        self.accepted = 0  # connections served (for status and tests: calls per connection)
        self.methods: collections.Counter[str] = collections.Counter()  # calls that passed the hello, by method

    @property
    def calls(self) -> int:
        """Calls that passed the hello (for status and tests)."""
        with self._lock:
            return sum(self.methods.values())

    @property
    def open_calls(self) -> int:
        """Connections in a call now, not waiting for their next (for status and tests)."""
        with self._lock:
            return len(self._conns) - len(self._kept)

    @property
    def kept(self) -> int:
        """Connections waiting for their client's next call (for status and tests)."""
        with self._lock:
            return len(self._kept)

    def start(self, listen: str) -> int:
        """Bind ``listen`` and accept in the background; returns the bound port."""
        host, port = split_address(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host or "0.0.0.0", port))
            sock.listen(64)
        except OSError:  # the callers say which lane (and the master's derived one gives way)
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        threading.Thread(target=self._accept, name="lane-accept", daemon=True).start()
        return self.port

    def stop(self) -> None:
        """Accept no more; end the connections in progress (their senders deliver again) and
        the kept ones, and wait up to :data:`STOP_WAIT_SECONDS` for their handlers to finish."""
        sock, self._sock = self._sock, None
        if sock is not None:
            _shutdown(sock)
            sock.close()
        with self._lock:  # from here the accepting thread closes what it still accepts
            self._stopping = True
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn)
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        while time.monotonic() < deadline:
            with self._lock:
                if not self._conns:
                    return
            time.sleep(0.02)

    def _accept(self) -> None:
        while True:
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _peer = sock.accept()
            except OSError as exc:
                if self._sock is None:
                    return
                log.warning("payload lane cannot accept", extra={"error": str(exc)})
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            with contextlib.suppress(OSError):  # a connection already gone: its thread finds that out
                tune(conn)
            if self._tls is not None:  # no I/O yet: the handshake is the connection thread's
                conn = TLSSocket(conn, self._tls, server_side=True)  # type: ignore[assignment]  # a TLSSocket is used as a socket
            with self._lock:
                stopping = self._stopping
                if len(self._conns) >= self._max_connections and not stopping:
                    self._make_room()
                crowded = len(self._conns) >= self._max_connections
                if not crowded and not stopping:
                    self._conns.add(conn)
                    self.accepted += 1
            if stopping:  # accepted as stop() began: it would not be ended
                conn.close()
                return
            if crowded:  # closed without a word: the client sends over gRPC and leaves the lane a while
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="lane-conn", daemon=True).start()
            except RuntimeError:  # cannot start a thread: close this one (as when crowded), keep accepting
                with self._lock:
                    self._conns.discard(conn)
                conn.close()

    def _make_room(self) -> None:
        """Close the connection idle the longest between calls, if any (called holding the
        lock): its thread sees it shut, and its client opens a new one when it next calls."""
        if not self._kept:
            return
        oldest = min(self._kept, key=self._kept.__getitem__)
        del self._kept[oldest]
        self._conns.discard(oldest)
        _shutdown(oldest)

    def _serve(self, conn: socket.socket) -> None:
        readers: list[BinaryIO] = []  # an upload's reader while its call runs (else closed after the shutdown below)
        try:
            deadline = time.monotonic() + HELLO_SECONDS  # the TLS handshake and the first hello
            if isinstance(conn, TLSSocket):
                try:
                    conn.handshake(HELLO_SECONDS)
                except OSError as exc:  # refused (no or a wrong certificate), not TLS, or silent
                    log.info("payload lane: TLS handshake failed", extra={"service": self._service, "error": str(exc)})
                    return
            while self._serve_call(conn, readers, deadline) and self._next_call(conn):
                deadline = time.monotonic() + HELLO_SECONDS
        except (_Lost, OSError) as exc:  # the client went away: nothing to tell it
            log.debug("payload lane connection lost", extra={"error": str(exc)})
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._kept.pop(conn, None)
            _shutdown(conn)  # ends a read still blocked on another thread before closing
            for reader in readers:
                reader.close()
            conn.close()

    def _serve_call(self, conn: socket.socket, readers: list[BinaryIO], deadline: float) -> bool:
        """Serve one call, its status included (its hello due by ``deadline``); whether the
        connection may carry another: the client speaks version 2, and the call ended OK
        (an upload's input read to its end-of-input mark)."""
        download: Download | None = None
        try:
            hello, version = self._hello(conn, deadline)
            download = self._downloads.get(hello.method)
            self._check_caller(hello.method, hello.token)
            with self._lock:
                self.methods[hello.method] += 1
            if download is None:
                again = self._upload(conn, readers, self._uploads[hello.method]) and version > 1
            elif self._download(conn, download, hello.request):
                again = version > 1
            else:  # cut inside a frame: the connection closes without a status
                return False
            status = LaneStatus(code=0)
        except _Lost:
            return False
        except Exception as exc:  # noqa: BLE001 - mapped as gRPC's servicers map theirs (a disk error: INTERNAL)
            code, message, retry = status_of(exc)  # logs an unexpected error, from here
            status, again = LaneStatus(code=code.value[0], message=message, retry_after_seconds=retry or 0.0), False
        conn.settimeout(DRAIN_SECONDS)
        # a download's status always follows its frames and the end-of-input mark
        _reply(conn, STATUS, status.SerializeToString(), after=END_OF_INPUT if download is not None else b"")
        if status.code:
            _drain(conn)
            return False
        while readers:  # the call read its input to its end: nothing is left buffered
            readers.pop().close()
        return again

    def _next_call(self, conn: socket.socket) -> bool:
        """Wait for the client's next hello to begin, at most :data:`KEEP_SECONDS`; False when
        the connection is to close instead: the client closed it or let it idle that long,
        the server stops, or it was closed to make room (:meth:`_make_room`)."""
        with self._lock:
            if self._stopping:
                return False
            self._kept[conn] = time.monotonic()
        try:
            ready = _readable(conn, KEEP_SECONDS)
        except OSError:
            ready = False
        with self._lock:
            kept = self._kept.pop(conn, None) is not None
            return ready and kept and not self._stopping

    def _upload(self, conn: socket.socket, readers: list[BinaryIO], handler: Handler) -> bool:
        """Send an upload's receipts as its handler gives them; whether it read the input to
        its end-of-input mark. Its reader goes to ``readers`` (a reader of its own, so that
        no connection waiting for its next call holds a buffer)."""
        reader = _reader(conn)
        readers.append(reader)
        ended = False

        def frames() -> Iterator[TupleFrame | ChunkFrame]:
            nonlocal ended
            yield from read_frames(
                reader, max_head_bytes=self._max_head, max_data_bytes=self._max_data, piece_bytes=self._piece
            )
            ended = True

        receipts = handler(frames())
        try:
            for message in receipts:
                _reply(conn, RECEIPT, message.SerializeToString())
        finally:
            receipts.close()  # type: ignore[attr-defined]  # a generator, typed as an iterator
        return ended

    def _download(self, conn: socket.socket, download: Download, request: bytes) -> bool:
        """Send the frames of a download (:meth:`_serve_call` then sends the end-of-input mark
        and the status, an error's too: an error raised by ``download`` falls between frames).
        False when a payload could not be read mid-frame: the connection is then cut, which
        the caller reads as a broken call."""
        frames = download(request, lambda: _peer_open(conn))
        try:
            for head, payload, size in frames:
                try:
                    write_frame(conn, head, payload, size)
                except DataLoss as exc:
                    log.warning("payload lane cannot read a tuple to send", extra={"error": str(exc)})
                    return False
                except OSError as exc:
                    raise _Lost(str(exc)) from None
        finally:
            frames.close()  # type: ignore[attr-defined]  # a generator, typed as an iterator
        return True

    def _hello(self, conn: socket.socket, deadline: float) -> tuple[LaneHello, int]:
        """Read and check a hello, all of it before ``deadline`` (a client trickling bytes
        cannot hold a connection longer); the hello and the version it proposed. A connection
        the client closed where a hello would begin is :class:`_Lost` (its normal end)."""
        head = _recv_before(conn, HELLO.size, deadline)
        if not head and time.monotonic() < deadline:
            raise _Lost("the client closed the connection")
        if head[: len(MAGIC_PREFIX)] != MAGIC_PREFIX[: len(head)]:
            tls = (
                " (this client speaks TLS; this lane is plain TCP: its server has no tls_cert)"
                if head[:1] == bytes([TLS_RECORD_TYPES[1]])
                else ""
            )
            raise InvalidArgument(
                f"payload lane: not a lane client (expected the {MAGIC.decode()} hello; "
                f"gRPC clients use the {self._service.lower()}'s gRPC address){tls}"
            )
        version = _SPOKEN.get(head[: len(MAGIC)])
        if len(head) > len(MAGIC_PREFIX) and version is None:
            raise Unimplemented(
                f"payload lane: speaks version {' or '.join(map(str, VERSIONS))}, not "
                f"{head[len(MAGIC_PREFIX) : len(MAGIC)].decode('ascii', 'replace')!r}"
            )
        if len(head) != HELLO.size or version is None:
            raise InvalidArgument(f"payload lane: no whole hello within {HELLO_SECONDS:g} s")
        _magic, size = HELLO.unpack(head)
        if size > MAX_HELLO_BYTES:
            raise InvalidArgument(f"payload lane: hello of {size} bytes is over {MAX_HELLO_BYTES}")
        body = _recv_before(conn, size, deadline)
        if len(body) != size:
            raise InvalidArgument(f"payload lane: no whole hello within {HELLO_SECONDS:g} s")
        try:
            hello = LaneHello.FromString(body)
        except DecodeError as exc:
            raise InvalidArgument(f"payload lane: unreadable hello: {exc}") from None
        conn.settimeout(self._idle if self._idle > 0 else None)  # from here: the idle bound
        if hello.method not in self._uploads and hello.method not in self._downloads:
            served = " and ".join(sorted([*self._uploads, *self._downloads]))
            raise InvalidArgument(f"payload lane: serves {served} only, not {hello.method!r}")
        return hello, version

    def _check_caller(self, method: str, token: str) -> None:
        if self._table is not None:
            refusal = refuse_caller(self._table, self._policy, f"/hio.proto.{self._service}/{method}", token)
            if refusal is not None:
                code, message = refusal
                raise BY_CODE[code](message)


_SPOKEN = {magic(version): version for version in VERSIONS}  # a hello's first 8 bytes -> its version


def _readable(sock: socket.socket, seconds: float) -> bool:
    """Whether ``sock`` has bytes or its end to read within ``seconds``; OSError or
    ValueError when it is closed."""
    poller = select.poll()  # not select(): it fails for descriptors above 1023
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(seconds * 1000))


def _peer_open(conn: socket.socket) -> bool:
    """Whether the client is still connected (a download's caller that went away while
    the server waited must not be given tuples it cannot take)."""
    try:  # readable: the end of the stream, or bytes
        return not _readable(conn, 0) or conn.recv(1, socket.MSG_PEEK) != b""
    except OSError:
        return False


def write_frame(sock: socket.socket, head: bytes, payload: Payload, size: int) -> None:
    """One frame: its prefix, head and payload. A small one goes in one send; an open file,
    from its position, with ``sendfile`` (over TLS: read and encrypted in pieces,
    :meth:`lanetls.TLSSocket.sendfile`), then closed. DataLoss when the file is shorter;
    an OSError is taken as the socket's (a spool read error after the file opened is rare,
    and the receiver then ends the call for a cut frame)."""
    start = FRAME_PREFIX.pack(len(head), size) + head
    if isinstance(payload, (bytes, memoryview)):
        if size <= SMALL_SEND:
            sock.sendall(b"".join((start, payload)))
        else:
            sock.sendall(start)
            sock.sendall(payload)
        return
    with payload:
        sock.sendall(start)
        # socket.sendfile waits as the socket's timeout says (os.sendfile would not); a count
        # of 0 would send the whole file
        sent = sock.sendfile(payload, payload.tell(), size) if size else 0
        if sent != size:
            raise DataLoss(f"payload file ended after {sent} of {size} bytes")


def _reply(conn: socket.socket, kind: int, body: bytes, *, after: bytes = b"") -> None:
    """A reply (sent ``after`` those bytes) to a client that may have gone: :class:`_Lost`
    instead of the socket's error."""
    try:
        conn.sendall(after + REPLY_PREFIX.pack(kind, len(body)) + body)
    except OSError as exc:
        raise _Lost(str(exc)) from None


def _drain(conn: socket.socket) -> None:
    """Read (from the socket itself) and throw away what the client still sends, for at most
    :data:`DRAIN_SECONDS`, so closing does not reset the connection before the client
    has read the status."""
    _shutdown(conn, socket.SHUT_WR)
    deadline = time.monotonic() + DRAIN_SECONDS
    while len(_recv_before(conn, READ_BUFFER, deadline)) == READ_BUFFER:  # fewer: its end, or the deadline
        pass


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(how)


# -- the gateway's side ---------------------------------------------------------------


def lane_frames(
    tuples: Iterable[tuple[TupleMeta, bytes | BinaryIO]], chunk_bytes: int, pack_bytes: int
) -> Iterator[LaneFrame]:
    """The lane frames of several tuples in order (as :func:`frames.tuple_frames` for gRPC):
    small ones packed in a head, each other tuple one frame whose payload is its
    bytes or its open spool file (sent with ``sendfile``, then closed)."""
    for item in pack_small(tuples, chunk_bytes, pack_bytes):
        if isinstance(item, TupleFrame):
            yield item.SerializeToString(), b"", 0
        else:
            meta, payload = item
            yield TupleFrame(meta=meta, last=True).SerializeToString(), payload, meta.size


def create_server_with_lane(
    settings: ClusterSettings,
    listen: str,
    *,
    lane_listen: str,
    lane: Callable[[TokenTable | None], LaneServer],
    derived: bool = False,
    logger: logging.Logger = log,
    **server_args: Any,
) -> tuple[grpc.Server, int, RoleHealth, LaneServer | None]:
    """A role's gRPC server (:func:`create_server`, not started) and the lane beside it:
    ``lane(table)`` started on ``lane_listen`` (None when that is '': the role offers no lane).
    One read of the tokens for both; the server is stopped (its port freed) when the lane
    cannot start. A port only ``derived`` from ``listen`` that is taken gives way to any free
    one, with a warning (the server's answers name the port it got; a firewall that opens
    only listen's port + 1 then makes callers use gRPC); a chosen one that cannot be had is
    a ConfigError naming ``lane_listen``."""
    table = TokenTable.from_settings(settings)
    server, port, health = create_server(settings, listen, table=table, **server_args)
    try:
        if not lane_listen:
            return server, port, health, None
        started = lane(table)
        try:
            started.start(lane_listen)
        except OSError as exc:
            if not derived:
                raise ConfigError(
                    f"cannot listen for the payload lane on {lane_listen}: {exc} "
                    "(set another lane_listen, or lanes = false)"
                ) from None
            logger.warning(
                "payload lane port taken; using any free port", extra={"wanted": lane_listen, "error": str(exc)}
            )
            started.start(lane_beside(lane_listen, 0))
        return server, port, health, started
    except BaseException:
        server.stop(None)
        raise


def lane_hello(token: str, method: str, request: bytes = b"") -> bytes:
    """The bytes that begin a call of ``method`` (with its ``request``: PullTuple's)."""
    hello = LaneHello(method=method, token=token, request=request).SerializeToString()
    return HELLO.pack(MAGIC, len(hello)) + hello


def open_lane(
    address: str, hello: bytes, *, connect_seconds: float, tls: ssl.SSLContext | None = None
) -> socket.socket:
    """A new lane connection, its first call begun with ``hello`` (:func:`lane_hello`). With ``tls``
    (:func:`lanetls.client_context`), a :class:`lanetls.TLSSocket` whose handshake took at most
    ``connect_seconds``. Raises OSError when unreachable, and ssl.SSLError (an OSError) when refused."""
    host, port = split_address(address)
    sock = socket.create_connection((host, port), timeout=connect_seconds)
    try:
        tune(sock)
        if tls is not None:  # the server verified for the address's host, as gRPC checks its target's
            secure = TLSSocket(sock, tls, server_side=False, server_hostname=host)
            secure.handshake(connect_seconds)
            sock = secure  # type: ignore[assignment]  # a TLSSocket is used as a socket
        sock.settimeout(None)
        sock.sendall(hello)
    except BaseException:
        sock.close()
        raise
    return sock


def quiet(sock: socket.socket) -> bool:
    """Whether a connection kept between calls is still open and silent: a server sends
    nothing between calls, so anything to read (its close above all) means it is done."""
    try:
        return not _readable(sock, 0)
    except (OSError, ValueError):  # closed already
        return False


Keep = Callable[[socket.socket], None]  # takes a connection whose call ended cleanly, for the next call


class _ClientCall:
    """What an upload and a download share: the socket, the reason the call was ended early
    (cancelled, its deadline passed), which is its failure rather than the broken lane its
    shut socket then looks like, and whether the call is over (no cancel touches the socket
    then: it is kept for the next call, or closed)."""

    def __init__(self, sock: socket.socket, keep: Keep | None) -> None:
        self._sock = sock
        self._keep = keep
        self._lock = threading.Lock()
        self._ended: LaneError | None = None  # why the call ended early
        self._ok = False  # the server's OK status was read
        self._done = False

    def cancel(self) -> None:
        self._end(LaneError(grpc.StatusCode.CANCELLED, "cancelled by the caller"))

    def _end(self, error: LaneError) -> None:
        with self._lock:
            if self._ended is not None or self._done:
                return
            self._ended = error
            _shutdown(self._sock)

    def _failure(self, message: str) -> LaneError:
        """Why the call failed: the reason it was ended early, else the lane broke (``message``)."""
        with self._lock:
            ended = self._ended
        return ended or LaneError(grpc.StatusCode.UNAVAILABLE, message, transport=True)

    def _over(self) -> bool:
        """The call is over; whether the server's OK status ended it, not ended early."""
        with self._lock:
            self._done = True
            return self._ok and self._ended is None


class LaneCall(_ClientCall):
    """One upload (Deliver, Enqueue) over a lane socket, used like a gRPC stream-stream call:
    iterate the receipt messages; :meth:`cancel` ends it; a failure raises :class:`LaneError`
    with the server's status, or UNAVAILABLE (``transport``) when the lane broke,
    DEADLINE_EXCEEDED, CANCELLED, or the reason the gateway could not send. A thread of the
    call's own sends the frames. The socket goes to ``keep`` when the call ended cleanly
    (``docs/lane.md``, section 7), else it is closed. ``broke`` hears why the lane broke
    under the call and whether the server had answered anything before."""

    def __init__(
        self,
        sock: socket.socket,
        frames: Iterable[LaneFrame],
        *,
        timeout: float | None,
        keep: Keep | None = None,
        broke: Callable[[str, bool], None] = lambda why, answered: None,
    ) -> None:
        super().__init__(sock, keep)
        self._frames = frames
        self._unread = bytearray()  # replies read from the socket and not yet taken
        self._broke = broke
        self._close_by_sender = False  # the sender outlived the call: it closes the socket
        self._input_ended = False  # every frame and the end-of-input mark were sent
        self._sender_done = False
        sock.settimeout(None)  # a kept socket may come from a download's timeout
        self._timer: threading.Timer | None = None
        if timeout:
            self._timer = threading.Timer(
                timeout, self._end, (LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"),)
            )
            self._timer.daemon = True
            self._timer.start()
        self._sender = threading.Thread(target=self._send, name="lane-sender", daemon=True)
        self._sender.start()

    def __iter__(self) -> Iterator[TupleReceipt]:
        answered = False
        try:
            while True:
                kind, body = self._reply()
                if kind == RECEIPT:
                    answered = True
                    yield _decoded(TupleReceipt, body)
                    continue
                error = _status_error(_decoded(LaneStatus, body), answered=answered)
                if error is not None:
                    raise error
                self._ok = not self._unread  # bytes past the status: not a connection to keep
                return
        except LaneError as exc:
            if exc.transport:
                self._broke(exc.details(), answered)
            raise
        finally:
            self._finish()

    def _reply(self) -> tuple[int, bytes]:
        """The next reply (what arrived past it waits in ``self._unread`` for the next)."""
        try:
            prefix = self._take(REPLY_PREFIX.size)
            if len(prefix) != REPLY_PREFIX.size:
                raise self._failure("lane connection closed without a status")
            kind, size = REPLY_PREFIX.unpack(prefix)
            if kind in TLS_RECORD_TYPES:
                raise LaneError(grpc.StatusCode.UNAVAILABLE, _SPEAKS_TLS, transport=True)
            if size > MAX_REPLY_BYTES or kind not in (RECEIPT, STATUS):
                raise LaneError(
                    grpc.StatusCode.INTERNAL,
                    f"payload lane sent an unreadable reply (kind {kind}, {size} bytes)",
                    transport=True,
                )
            body = self._take(size)
            if len(body) != size:
                raise self._failure(f"lane connection ended inside a reply ({len(body)} of {size} bytes)")
            return kind, body
        except OSError as exc:  # reset, timed out (keepalive)
            raise self._failure(f"lane connection failed: {exc}") from None

    def _take(self, size: int) -> bytes:
        """The next ``size`` bytes of the replies, fewer when the peer closes first; read from
        the socket in as few reads as they come (a buffered reader cannot tell without blocking
        whether it read past the status; the call can: ``_unread``, which must be empty for
        the socket to carry the next call)."""
        while len(self._unread) < size:
            data = self._sock.recv(max(REPLY_READ, size - len(self._unread)))
            if not data:
                break
            self._unread += data
        taken = bytes(self._unread[:size])
        del self._unread[:size]
        return taken

    def _send(self) -> None:
        """Send every frame, then end the input. A payload that cannot be read ends the
        call with the reason; a socket that fails leaves the verdict to the reader (the
        server's status, or a broken lane)."""
        sock = self._sock
        frames = iter(self._frames)
        ended = False
        try:
            while True:
                try:
                    head, payload, size = next(frames)  # opens and reads spooled payloads
                except StopIteration:
                    break
                except Exception as exc:  # noqa: BLE001 - the payload's fault, not the lane's
                    self._payload_failed(exc)
                    return
                try:
                    write_frame(sock, head, payload, size)
                except DataLoss as exc:  # a payload file shorter than its tuple (socket errors: below)
                    self._payload_failed(exc)
                    return
            sock.sendall(END_OF_INPUT)
            ended = True
        except OSError as exc:
            log.debug("lane send stopped", extra={"error": str(exc)})
        finally:
            with self._lock:
                self._input_ended = ended
                self._sender_done = True
                close = self._close_by_sender
            if close:
                sock.close()

    def _payload_failed(self, exc: BaseException) -> None:
        log.warning("gateway cannot read a tuple to send", extra={"error": str(exc)})
        code = exc.code if isinstance(exc, HioError) else grpc.StatusCode.UNKNOWN
        self._end(LaneError(code, f"gateway could not send: {exc}"))

    def _finish(self) -> None:
        """The call is over: keep the socket for the next call when it ended cleanly (its
        sender is done at once then: the server answered OK after the end-of-input mark);
        else stop the sender (the socket is shut) and close the socket once the sender no
        longer uses it."""
        clean = self._over()
        if self._timer is not None:
            self._timer.cancel()
        if clean:
            self._sender.join(SENDER_SETTLE_SECONDS)
        with self._lock:
            clean = clean and self._sender_done and self._input_ended
        if clean and self._keep is not None:
            self._keep(self._sock)
            return
        _shutdown(self._sock)
        self._sender.join(SENDER_JOIN_SECONDS)
        with self._lock:
            if not self._sender_done:  # stuck reading a payload: it closes the socket when done
                self._close_by_sender = True
                log.warning("lane sender still busy after its call ended")
                return
        self._sock.close()


class LaneDownload(_ClientCall):
    """One download (PullTuple) over a lane socket, used like a gRPC server-streaming call:
    :meth:`frames` yields the frames, then raises :class:`LaneError` if the server's status
    is an error or the lane broke. ``timeout``: the longest wait for any byte (the server's
    long-poll included). The socket goes to ``keep`` when the server's OK status was read
    and the call was not cancelled, else it is closed. ``reconnect`` (given for a socket
    kept from an earlier call) opens a new connection, its hello sent, for one more try
    when this one breaks before any answer (``docs/lane.md``, section 7). ``broke`` hears of
    a lane that broke or stayed silent before its first frame or status otherwise."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        timeout: float,
        max_head_bytes: int,
        max_data_bytes: int,
        keep: Keep | None = None,
        broke: Callable[[str], None] = lambda why: None,
        reconnect: Callable[[], socket.socket] | None = None,
    ) -> None:
        super().__init__(sock, keep)
        self._timeout = timeout
        self._max_head = max_head_bytes
        self._max_data = max_data_bytes
        self._broke = broke
        self._reconnect = reconnect
        self._started = False

    def __iter__(self) -> Iterator[TupleFrame | ChunkFrame]:
        return self.frames()

    def frames(self) -> Iterator[TupleFrame | ChunkFrame]:
        """The frames, then the server's verdict (an error status raised)."""
        with self._lock:
            self._started = True
            ended = self._ended
        try:
            if ended is not None:
                raise ended
            outcome = yield from self._read()
            while outcome is None:
                outcome = yield from self._read()
            status, framed = outcome
            error = _status_error(status, answered=framed)
            if error is not None:
                if error.transport:
                    self._broke(error.details())
                raise error
            self._ok = True
        finally:
            if self._over() and self._keep is not None:
                self._keep(self._sock)
            else:
                self._sock.close()

    def cancel(self) -> None:
        super().cancel()
        with self._lock:  # frames() never ran: nothing else will close the socket
            unstarted = not self._started and not self._done
            self._done = self._done or unstarted
        if unstarted:
            self._sock.close()

    def _read(self) -> Generator[TupleFrame | ChunkFrame, None, tuple[LaneStatus, bool] | None]:
        """The frames of one try, then its status and whether any frame came before it;
        None when a kept connection broke before any answer and a new one now carries
        the request (try again)."""
        reader = _reader(self._sock)
        self._sock.settimeout(self._timeout)
        answered = frames = False
        try:
            for frame in read_frames(reader, max_head_bytes=self._max_head, max_data_bytes=self._max_data):
                answered = frames = True
                yield frame
            answered = True
            prefix = _read(reader, REPLY_PREFIX.size)
            if len(prefix) != REPLY_PREFIX.size:
                raise Cancelled("closed without a status")
            kind, size = REPLY_PREFIX.unpack(prefix)
            if kind != STATUS or size > MAX_STATUS_BYTES:
                raise DataLoss(f"an unreadable reply (kind {kind}, {size} bytes)")
            status = LaneStatus.FromString(_read_exact(reader, size, "a status"))
        except (HioError, OSError, DecodeError) as exc:
            if self._ended is not None:  # cancelled: its shut socket is no broken lane
                raise self._ended from None
            message = exc.message if isinstance(exc, HioError) else str(exc)
            silent = isinstance(exc, (DeadlineExceeded, TimeoutError))  # a server alive but mute: no retry
            if not answered and not silent and self._try_again():
                return None
            if not answered:
                self._broke(message)
            if silent:
                raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
            raise LaneError(grpc.StatusCode.UNAVAILABLE, f"payload lane broke: {message}", transport=True) from None
        finally:
            reader.close()
        return status, frames

    def _try_again(self) -> bool:
        """Move the request to a new connection, once, when this one was kept from an
        earlier call; False when there is none to try."""
        reconnect, self._reconnect = self._reconnect, None
        if reconnect is None:
            return False
        try:
            sock = reconnect()
        except LaneError as exc:  # the lane cannot be opened now
            self._broke(exc.details())
            raise
        with self._lock:
            old, self._sock = self._sock, sock
            ended = self._ended
        old.close()
        if ended is not None:
            raise ended
        return True
