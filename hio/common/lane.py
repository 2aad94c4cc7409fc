"""The payload lane: ``Engine.Deliver`` over one plain TCP connection.

Why: Python gRPC copies a payload four times on its way (into the message,
into gRPC's buffer, out of it, into the joined tuple); at 10 MB a tuple spent
about two thirds of its 32 ms of CPU in the gateway's and the engine's gRPC
layers. On the lane a payload goes from the spool file to the socket with
``sendfile`` (or from memory with one ``send``) and is received straight into
the one ``bytes`` object the pipeline gets. Frames, receipts, checks and
statuses are exactly Deliver's: the engine runs the same ``deliver`` on both.
The framing is documented in ``proto/hio/proto/engine.proto``.

Engines configured with TLS offer no lane; senders then use Deliver.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import BinaryIO, Callable, Iterable, Iterator, Union

import grpc
from google.protobuf.message import DecodeError

from hio.common.errors import DataLoss, HioError, InvalidArgument
from hio.common.frames import ChunkFrame, PackingFrames, TupleFrame, TupleMeta, TupleReceipt, idle_bounded
from hio.common.net import TokenTable, refuse_caller
from hio.proto.engine_pb2 import LaneHello, LaneStatus

log = logging.getLogger("hio.lane")

MAGIC = b"HIOLANE1"
METHOD = "Deliver"
_FRAME_PREFIX = struct.Struct(">IQ")   # head bytes, data bytes
_REPLY_PREFIX = struct.Struct(">BI")   # kind, body bytes
_HELLO_PREFIX = struct.Struct(">I")
RECEIPT, STATUS = 1, 2
MAX_HELLO_BYTES = 64 * 1024
MAX_REPLY_BYTES = 64 * 1024 * 1024
HELLO_SECONDS = 10.0        # a client must introduce itself within this
DRAIN_SECONDS = 1.0         # after an error status, how long the server reads what the client still sends
READ_BUFFER = 256 * 1024    # larger reads go straight into their destination
SMALL_SEND = 64 * 1024      # a frame up to this is sent with its prefix in one send

Payload = Union[bytes, memoryview, BinaryIO]
LaneFrame = tuple[bytes, Payload, int]   # (head, payload, payload size)
Handler = Callable[[Iterator[Union[TupleFrame, ChunkFrame]]], Iterator[TupleReceipt]]


class LaneError(grpc.RpcError):
    """A lane call's failure, read like a failed gRPC call (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self._code = code
        self._message = message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> tuple[()]:
        return ()


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def split_address(address: str) -> tuple[str, int]:
    """('host', port) of 'host:port' or '[v6]:port'."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"lane address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _read_exact(reader: BinaryIO, size: int, what: str) -> bytes:
    """``size`` bytes (one object, read straight into it when large); DataLoss when the peer stops early."""
    data = reader.read(size)
    if len(data) != size:
        raise DataLoss(f"payload lane: connection ended inside {what} ({len(data)} of {size} bytes)")
    return data


# -- the engine's side ---------------------------------------------------------------

def read_frames(reader: BinaryIO, *, max_head_bytes: int, max_data_bytes: int
                ) -> Iterator[Union[TupleFrame, ChunkFrame]]:
    """The frames a client sends, until it ends its input at a frame boundary.

    A frame's payload is read into one ``bytes`` of its own, so a tuple sent
    as one frame reaches the pipeline without a copy (:class:`FrameReader`
    passes a lone ``bytes`` chunk through).
    """
    while True:
        prefix = reader.read(_FRAME_PREFIX.size)
        if not prefix:
            return
        if len(prefix) != _FRAME_PREFIX.size:
            raise DataLoss("payload lane: connection ended inside a frame prefix")
        head_size, data_size = _FRAME_PREFIX.unpack(prefix)
        if head_size > max_head_bytes:
            raise InvalidArgument(f"payload lane: frame head of {head_size} bytes is over the limit of {max_head_bytes}")
        if data_size > max_data_bytes:
            raise InvalidArgument(f"payload lane: frame data of {data_size} bytes is over the limit of {max_data_bytes}")
        try:
            frame = TupleFrame.FromString(_read_exact(reader, head_size, "a frame head"))
        except DecodeError as exc:
            raise InvalidArgument(f"payload lane: unreadable frame head: {exc}") from None
        if not data_size:
            yield frame
            continue
        if frame.data or frame.packed:
            raise InvalidArgument("payload lane: a frame with lane data must carry neither data nor packed tuples in its head")
        yield ChunkFrame(frame, _read_exact(reader, data_size, "a frame's data"))  # type: ignore[arg-type]


class LaneServer:
    """Serves ``handler`` (the engine's ``deliver``) on a TCP port, a thread per connection.

    Callers are authenticated like gRPC callers (the hello carries the
    token; the same table and policy); statuses are the errors' gRPC codes.
    """

    def __init__(self, listen: str, handler: Handler, *, table: TokenTable | None,
                 policy: dict[str, set[str]], idle_seconds: float, max_head_bytes: int,
                 max_data_bytes: int) -> None:
        self._listen = listen
        self._handler = handler
        self._table = table
        self._policy = policy
        self._idle = idle_seconds
        self._max_head = max_head_bytes
        self._max_data = max_data_bytes
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._sock: socket.socket | None = None
        self.port = 0

    def start(self) -> int:
        """Bind and accept in the background; returns the bound port."""
        host, port = split_address(self._listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host or "0.0.0.0", port))
        sock.listen(64)
        self._sock = sock
        self.port = sock.getsockname()[1]
        threading.Thread(target=self._accept, name="lane-accept", daemon=True).start()
        return self.port

    def stop(self) -> None:
        """Accept no more; end the connections in progress (their senders deliver again)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            _shutdown(sock)
            sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn)

    def _accept(self) -> None:
        while True:
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _peer = sock.accept()
            except OSError:
                if self._sock is None:
                    return
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="lane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb", buffering=READ_BUFFER)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            status = self._run(conn, reader)
            if status is not None:
                _send_reply(conn, STATUS, status.SerializeToString())
                if status.code:
                    _drain(conn, reader)
        except OSError as exc:  # the client went away: nothing to tell it
            log.debug("payload lane connection lost", extra={"error": str(exc)})
        finally:
            with self._lock:
                self._conns.discard(conn)
            reader.close()
            conn.close()

    def _run(self, conn: socket.socket, reader: BinaryIO) -> LaneStatus | None:
        """Serve one call; its final status (None when the connection is lost)."""
        try:
            self._hello(conn, reader)
            frames = read_frames(reader, max_head_bytes=self._max_head, max_data_bytes=self._max_data)
            receipts = self._handler(idle_bounded(frames, self._idle, lambda: _shutdown(conn, socket.SHUT_RD)))
            try:
                for message in receipts:
                    _send_reply(conn, RECEIPT, message.SerializeToString())
            finally:
                receipts.close()  # type: ignore[attr-defined]
        except HioError as exc:
            return LaneStatus(code=exc.code.value[0], message=exc.message)
        except OSError:
            return None
        except Exception as exc:  # noqa: BLE001 - the one place that maps the lane's errors
            log.exception("payload lane call failed")
            return LaneStatus(code=grpc.StatusCode.INTERNAL.value[0], message=f"engine error: {exc}")
        return LaneStatus(code=0)

    def _hello(self, conn: socket.socket, reader: BinaryIO) -> None:
        conn.settimeout(HELLO_SECONDS)
        try:
            magic = reader.read(len(MAGIC) + _HELLO_PREFIX.size)
        except TimeoutError:
            raise InvalidArgument(f"payload lane: no hello within {HELLO_SECONDS:g} s") from None
        if len(magic) != len(MAGIC) + _HELLO_PREFIX.size or not magic.startswith(MAGIC):
            raise InvalidArgument("payload lane: not a lane client (expected the HIOLANE1 hello; "
                                  "gRPC clients use the engine's gRPC address)")
        (size,) = _HELLO_PREFIX.unpack(magic[len(MAGIC):])
        if size > MAX_HELLO_BYTES:
            raise InvalidArgument(f"payload lane: hello of {size} bytes is over {MAX_HELLO_BYTES}")
        try:
            hello = LaneHello.FromString(_read_exact(reader, size, "the hello"))
        except DecodeError as exc:
            raise InvalidArgument(f"payload lane: unreadable hello: {exc}") from None
        conn.settimeout(None)  # from here the idle bound and the client's deadline govern
        if hello.method != METHOD:
            raise InvalidArgument(f"payload lane: serves {METHOD} only, not {hello.method!r}")
        if self._table is not None:
            refusal = refuse_caller(self._table, self._policy, f"/hio.proto.Engine/{METHOD}", hello.token)
            if refusal is not None:
                raise _StatusError(*refusal)


class _StatusError(HioError):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _send_reply(conn: socket.socket, kind: int, body: bytes) -> None:
    conn.sendall(_REPLY_PREFIX.pack(kind, len(body)) + body)


def _drain(conn: socket.socket, reader: BinaryIO) -> None:
    """Read what the client still sends for a moment, so closing does not reset the
    connection before it has read the status."""
    _shutdown(conn, socket.SHUT_WR)
    conn.settimeout(DRAIN_SECONDS)
    try:
        while reader.read1(READ_BUFFER):  # type: ignore[attr-defined]
            pass
    except OSError:
        pass


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


# -- the gateway's side ---------------------------------------------------------------

def lane_frames(tuples: Iterable[tuple[TupleMeta, bytes | BinaryIO]], chunk_bytes: int,
                pack_bytes: int) -> Iterator[LaneFrame]:
    """The lane frames of several tuples in order (as :func:`frames.tuple_frames` for gRPC):
    small ones packed in a head, each other tuple one frame whose payload is its
    bytes or its open spool file (sent with ``sendfile``, then closed)."""
    packing = PackingFrames(pack_bytes, chunk_bytes)
    for meta, payload in tuples:
        if packing.packable(meta.size):
            if not isinstance(payload, bytes):
                with payload:
                    payload = payload.read(meta.size)
            if (message := packing.add(TupleFrame(meta=meta, data=payload, last=True))) is not None:
                yield message.SerializeToString(), b"", 0
            continue
        if (message := packing.flush()) is not None:
            yield message.SerializeToString(), b"", 0
        yield TupleFrame(meta=meta, last=True).SerializeToString(), payload, meta.size
    if (message := packing.flush()) is not None:
        yield message.SerializeToString(), b"", 0


def open_lane(address: str, token: str, *, connect_seconds: float) -> socket.socket:
    """A connected lane socket, introduced (hello sent). Raises OSError when unreachable."""
    host, port = split_address(address)
    sock = socket.create_connection((host, port), timeout=connect_seconds)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        hello = LaneHello(method=METHOD, token=token).SerializeToString()
        sock.sendall(MAGIC + _HELLO_PREFIX.pack(len(hello)) + hello)
    except BaseException:
        sock.close()
        raise
    return sock


class LaneCall:
    """One Deliver over a lane socket, used like a gRPC streaming call: iterate the
    receipt messages; :meth:`cancel` ends it; a failure raises :class:`LaneError`
    with the engine's status (or UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED)."""

    def __init__(self, sock: socket.socket, frames: Iterable[LaneFrame], *, timeout: float | None) -> None:
        self._sock = sock
        self._frames = frames
        self._lock = threading.Lock()
        self._ended: LaneError | None = None     # why the call ended early (cancel, deadline, sender)
        self._finished = False
        self._timer = threading.Timer(timeout, self._expire) if timeout else None
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()
        self._sender = threading.Thread(target=self._send, name="lane-sender", daemon=True)
        self._sender.start()

    def cancel(self) -> None:
        self._end(LaneError(grpc.StatusCode.CANCELLED, "cancelled by the sender"))

    def __iter__(self) -> Iterator[TupleReceipt]:
        reader = self._sock.makefile("rb", buffering=64 * 1024)
        try:
            while True:
                try:
                    prefix = reader.read(_REPLY_PREFIX.size)
                except OSError as exc:
                    raise self._failure(f"lane connection failed: {exc}") from None
                if len(prefix) != _REPLY_PREFIX.size:
                    raise self._failure("lane connection closed without a status")
                kind, size = _REPLY_PREFIX.unpack(prefix)
                if size > MAX_REPLY_BYTES or kind not in (RECEIPT, STATUS):
                    raise LaneError(grpc.StatusCode.INTERNAL, f"engine sent an unreadable reply (kind {kind}, {size} bytes)")
                try:
                    body = _read_exact(reader, size, "a reply")
                except (DataLoss, OSError) as exc:
                    raise self._failure(f"lane connection failed: {exc}") from None
                if kind == RECEIPT:
                    yield TupleReceipt.FromString(body)
                    continue
                status = LaneStatus.FromString(body)
                if status.code:
                    raise LaneError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message)
                return
        finally:
            reader.close()
            self._finish()

    def _failure(self, message: str) -> LaneError:
        with self._lock:
            ended = self._ended
        return ended or LaneError(grpc.StatusCode.UNAVAILABLE, message)

    def _send(self) -> None:
        sock = self._sock
        try:
            for head, payload, size in self._frames:
                prefix = _FRAME_PREFIX.pack(len(head), size)
                if not size:
                    sock.sendall(prefix + head)
                elif isinstance(payload, (bytes, memoryview)):
                    if size <= SMALL_SEND:
                        sock.sendall(b"".join((prefix, head, payload)))
                    else:
                        sock.sendall(prefix + head)
                        sock.sendall(payload)
                else:
                    sock.sendall(prefix + head)
                    _send_file(sock, payload, size)
            _shutdown(sock, socket.SHUT_WR)
        except OSError as exc:
            with self._lock:
                ended = self._ended is not None or self._finished
            if not ended:  # the engine ended the call (its status says why) or the link broke
                log.debug("lane send stopped", extra={"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - a payload that cannot be read ends the call
            code = exc.code if isinstance(exc, HioError) else grpc.StatusCode.UNKNOWN
            self._end(LaneError(code, f"gateway could not send: {exc}"))

    def _expire(self) -> None:
        self._end(LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))

    def _end(self, error: LaneError) -> None:
        with self._lock:
            if self._ended is not None or self._finished:
                return
            self._ended = error
        _shutdown(self._sock)

    def _finish(self) -> None:
        with self._lock:
            self._finished = True
        if self._timer is not None:
            self._timer.cancel()
        _shutdown(self._sock)   # stops a sender still sending after the engine's final status
        self._sender.join(5.0)
        self._sock.close()


def _send_file(sock: socket.socket, fh: BinaryIO, size: int) -> None:
    """``size`` bytes of an open file from its position, kernel to kernel; closes the file."""
    with fh:
        offset = fh.tell()
        sent = 0
        while sent < size:
            n = os.sendfile(sock.fileno(), fh.fileno(), offset + sent, size - sent)
            if n == 0:
                raise DataLoss(f"spooled payload ended after {sent} of {size} bytes")
            sent += n
