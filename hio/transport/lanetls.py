"""TLS on the payload lane (``docs/lane.md``, "TLS"): contexts built from the settings
gRPC's credentials come from, and a socket that speaks TLS from two threads at once.

The lane is full duplex (a gateway's sender writes frames while its reader takes
receipts), and OpenSSL does not allow two threads in one ``SSL`` object at once
(an ``ssl.SSLSocket`` read in one thread and written in another can corrupt its
state, early in a TLS 1.3 connection above all). :class:`TLSSocket` therefore
drives an :class:`ssl.SSLObject` over memory buffers: every call into it holds a
lock, held only while it encrypts or decrypts; the socket's own reads and writes
wait outside it. A payload is read from its file and encrypted in pieces
(``sendfile`` cannot be used: the kernel would send the file's bytes in the clear).
"""

from __future__ import annotations

import io
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from hio.config import ConfigError
from hio.settings import ClusterSettings

PIECE_BYTES = 256 * 1024  # bytes encrypted (and read from the socket) at a time
# A fatal protocol_version alert in a plaintext TLS record: what a server tells a peer whose
# first bytes are no TLS record at all (a plaintext lane client reads it where it expected a
# reply, and names the cause; OpenSSL itself then sends nothing).
NOT_TLS_ALERT = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 70])


def _load(what: str, load: Callable[..., None], *paths: str) -> None:
    try:
        load(*paths)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS: cannot load the {what} ({', '.join(paths)}): {exc}") from None


def server_context(settings: ClusterSettings) -> ssl.SSLContext | None:
    """A lane's (and a role's HTTP endpoint's) TLS, as its gRPC server's
    (``hio.transport.net.create_server``): its certificate and key; with ``tls_client_auth``,
    client certificates signed by ``tls_ca`` required. None without ``tls_cert`` (plain TCP,
    as gRPC then is)."""
    if not settings.tls_cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # gRPC's minimum too
    _load("certificate and key", context.load_cert_chain, settings.tls_cert, settings.tls_key)
    if settings.tls_client_auth:
        _load("CA", context.load_verify_locations, settings.tls_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(settings: ClusterSettings) -> ssl.SSLContext | None:
    """A lane client's TLS, as its gRPC channels' (``hio.transport.net.create_channel``): the
    server's certificate verified against ``tls_ca`` (else the system's CAs) and the
    host of the address connected to; its own certificate presented when it has one
    (mutual TLS). None when this process does not speak TLS."""
    if not settings.speaks_tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.tls_ca:
        _load("CA", context.load_verify_locations, settings.tls_ca)
    else:
        context.load_default_certs()
    if settings.tls_cert and settings.tls_key:
        _load("certificate and key", context.load_cert_chain, settings.tls_cert, settings.tls_key)
    return context


class TLSSocket:
    """A connected TCP socket speaking TLS; used like the socket (``sendall``, ``sendfile``,
    ``recv_into``, ``makefile('rb')``, ``settimeout``, ``shutdown``, ``close``). One thread
    may send while another receives. A client makes its handshake once per connection (a lane
    keeps its connections from call to call); a server, on the connection's own thread.

    The end of the TCP stream is the end of the TLS stream (no ``close_notify`` is sent
    or required): the lane's frames carry their own end (``END_OF_INPUT``, the final
    status), which TLS authenticates, so a cut is seen as one.
    """

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        self.raw = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._lock = threading.Lock()  # the SSLObject: one thread in it at a time
        self._send_lock = threading.Lock()  # the order of the encrypted bytes on the wire
        self._buffer = bytearray(PIECE_BYTES)  # the reading thread's (one at a time)

    # -- the handshake ----------------------------------------------------------------

    def handshake(self, seconds: float) -> None:
        """Complete the TLS handshake within ``seconds``; ssl.SSLError (an OSError) when the
        peer is refused or refuses, TimeoutError when it stays silent."""
        deadline = time.monotonic() + seconds
        first = b""  # the peer's first byte
        while True:
            failed: ssl.SSLError | None = None
            with self._lock:
                try:
                    self._tls.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                except ssl.SSLError as exc:
                    failed, done = exc, False
                out = self._out.read()
            if failed is not None and not out and first[:1] not in (b"", b"\x16"):
                out = NOT_TLS_ALERT
            if out:  # a failed handshake's alert too: the peer then learns why
                self.raw.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    self.raw.sendall(out)
                except OSError:
                    if failed is None:
                        raise
            if failed is not None:
                raise failed
            if done:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no TLS handshake within {seconds:g} s")
            self.raw.settimeout(left)
            received = self.raw.recv_into(self._buffer)
            if not received:
                raise ssl.SSLEOFError(
                    "the peer closed the connection during the TLS handshake "
                    "(it may not speak TLS, or refused this side's certificate)"
                )
            first = first or bytes(self._buffer[:1])
            with self._lock:
                self._in.write(memoryview(self._buffer)[:received])

    # -- sending ------------------------------------------------------------------------

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with self._send_lock:
            for start in range(0, len(view), PIECE_BYTES):
                with self._lock:
                    self._tls.write(view[start : start + PIECE_BYTES])
                    out = self._out.read()
                self.raw.sendall(out)

    def sendfile(self, fh: BinaryIO, offset: int = 0, count: int | None = None) -> int:
        """``count`` bytes of ``fh`` from ``offset``, read and encrypted in pieces (the
        file's position is left after them, as ``socket.sendfile`` leaves it); fewer
        when the file ends first."""
        fh.seek(offset)
        left = count if count is not None else os.fstat(fh.fileno()).st_size - offset
        piece = bytearray(min(PIECE_BYTES, max(left, 1)))
        view, sent = memoryview(piece), 0
        while left > 0:
            n = fh.readinto(view[: min(left, len(piece))])  # type: ignore[attr-defined]  # a file opened "rb": typing.BinaryIO lacks readinto
            if not n:
                break
            self.sendall(view[:n])
            sent += n
            left -= n
        return sent

    def _flush(self) -> None:
        """Send what a read left to send (a TLS 1.3 key update's answer): only when no sender
        is busy; else it goes out before that sender's next bytes."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                out = self._out.read()
            if out:
                self.raw.sendall(out)
        finally:
            self._send_lock.release()

    # -- receiving ----------------------------------------------------------------------

    def recv_into(self, buffer: bytearray | memoryview, nbytes: int = 0) -> int:
        """Up to ``nbytes`` (all of ``buffer``) decrypted bytes; 0 at the end of the stream.
        Waits (as the socket's timeout says) only when no decrypted byte is at hand."""
        view = memoryview(buffer).cast("B")
        want = nbytes or len(view)
        if not want:
            return 0
        while True:
            got, ended, pending = 0, False, False
            with self._lock:
                while got < want:
                    try:
                        n: int = self._tls.read(want - got, view[got:want])  # type: ignore[assignment]  # with a buffer: a count
                    except ssl.SSLWantReadError:
                        break
                    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                        n = 0
                    if not n:  # the end of the stream
                        ended = True
                        break
                    got += n
                pending = self._out.pending > 0
            if pending:
                self._flush()
            if got or ended:
                return got
            received = self.raw.recv_into(self._buffer)
            with self._lock:
                if received:
                    self._in.write(memoryview(self._buffer)[:received])
                else:
                    self._in.write_eof()

    def recv(self, size: int, flags: int = 0) -> bytes:
        """Decrypted bytes; with MSG_PEEK, a look at the TCP stream itself (whether the
        peer has closed it: what ``lane._peer_open`` asks)."""
        if flags:
            return self.raw.recv(size, flags)
        buf = bytearray(size)
        n = self.recv_into(buf)
        return bytes(buf[:n])

    def makefile(self, mode: str = "rb", buffering: int = io.DEFAULT_BUFFER_SIZE) -> BinaryIO:
        if mode != "rb":
            raise ValueError("a TLS lane socket reads only through makefile('rb')")
        return io.BufferedReader(_Reader(self), buffering)

    # -- the socket ---------------------------------------------------------------------

    def fileno(self) -> int:
        return self.raw.fileno()

    def settimeout(self, seconds: float | None) -> None:
        self.raw.settimeout(seconds)

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()


class _Reader(io.RawIOBase):
    def __init__(self, sock: TLSSocket) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._sock.recv_into(buffer)
