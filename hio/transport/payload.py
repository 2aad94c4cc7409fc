"""Payload bytes to and from one peer: one interface, two adapters, chosen per peer.

A :data:`PayloadChannel` carries the calls that move payloads (``Engine.Deliver``,
``Master.Enqueue``, ``Master.PullTuple``): :class:`LanePayload` on the peer's payload lane
(:mod:`hio.transport.lane`), or :class:`GrpcPayload` in gRPC chunks. :class:`PayloadPeers`
chooses per peer, and when a lane that cannot be opened or breaks moves the peer to gRPC
(:meth:`LanePayload._broke` says which breaks do not): ``docs/architecture.md`` ("One
transport per peer"), ``docs/lane.md`` (sections 7 and 10).
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, Generic, Protocol, TypeVar

import grpc

from hio.proto.master_pb2 import PullTupleRequest
from hio.settings import ClusterSettings, message_limit
from hio.transport.frames import TupleMeta, TupleReceipt, WireFrame, tuple_frames
from hio.transport.lane import (
    LANE_CONNECT_SECONDS,
    REUSE_SECONDS,
    LaneCall,
    LaneDownload,
    LaneError,
    LaneFrame,
    lane_frames,
    lane_hello,
    open_lane,
    quiet,
)
from hio.transport.lanetls import client_context
from hio.transport.net import pull_frames, send_frames

LANE_RETRY_SECONDS = 60.0  # a peer moved to gRPC (its lane unreachable or broken) tries its lane again after this
KEPT_CONNECTIONS = 4  # idle connections a lane client keeps per lane (a gateway's streams, by default)
Payloads = Iterator[tuple[TupleMeta, "bytes | BinaryIO"]]
_SERVICES = {"Deliver": "Engine", "Enqueue": "Master"}
T = TypeVar("T")
R = TypeVar("R", covariant=True)  # read only: a call's replies, a channel's frames (objects to its callers)


class Call(Protocol[R]):
    """A call in progress, used like a gRPC streaming call: its replies, and ``cancel``."""

    def __iter__(self) -> Iterator[R]: ...

    def cancel(self) -> object: ...


Upload = Call[TupleReceipt]  # a stream-stream call: frames in, receipts out
Download = Call[object]  # a server-streaming call: frames out


class GrpcPayload:
    """Payloads as gRPC chunks on the peer's kept channel (small tuples packed in one message)."""

    kind = "grpc"

    def __init__(self, channel: grpc.Channel, *, chunk_bytes: int, pack_bytes: int, max_chunk_bytes: int) -> None:
        self._channel = channel
        self._chunk = chunk_bytes
        self._pack = pack_bytes
        self.max_chunk_bytes = max_chunk_bytes

    def upload(self, method: str, payloads: Payloads, *, timeout: float) -> tuple[Upload, GuardedFrames[WireFrame]]:
        reading = GuardedFrames(tuple_frames(payloads, self._chunk, self._pack, encode=True), cancels=True)
        call = send_frames(self._channel, _SERVICES[method], method)(iter(reading), timeout=timeout)
        reading.attach(call.cancel)
        return call, reading

    def download(self, request: PullTupleRequest, *, timeout: float) -> Download:
        return pull_frames(self._channel)(request, timeout=timeout)

    def close(self) -> None:
        """Nothing: the gRPC channel is its owner's."""


class LanePayload:
    """Payloads on the peer's payload lane, calls one after another on kept connections
    (each call introduced with ``token``; at most :data:`KEPT_CONNECTIONS` idle at once,
    none reused after :data:`lane.REUSE_SECONDS` idle). ``on_broken`` hears why the
    lane broke under a call (:meth:`PayloadPeers.broken`). Thread-safe."""

    kind = "lane"

    def __init__(
        self,
        lane: str,
        token: str,
        *,
        chunk_bytes: int,
        pack_bytes: int,
        max_head_bytes: int,
        max_data_bytes: int,
        tls: ssl.SSLContext | None = None,
        on_broken: Callable[[str], None] = lambda why: None,
    ) -> None:
        self.lane = lane
        self._token = token
        self._tls = tls  # the lane's TLS (lanetls.client_context), None for plain TCP
        self._chunk = chunk_bytes
        self._pack = pack_bytes
        self._max_head = max_head_bytes
        self.max_chunk_bytes = max_data_bytes  # the lane sends a tuple as one frame
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._idle: list[tuple[socket.socket, float]] = []  # kept connections, oldest first, with when each went idle
        self.opened = 0  # connections opened (for status and tests: calls per connection)

    def upload(self, method: str, payloads: Payloads, *, timeout: float) -> tuple[Upload, GuardedFrames[LaneFrame]]:
        sock, kept = self._connection(lane_hello(self._token, method))
        reading = GuardedFrames(lane_frames(payloads, self._chunk, self._pack), cancels=False)
        try:
            call = LaneCall(
                sock,
                iter(reading),
                timeout=timeout,
                keep=self._keep,
                broke=functools.partial(self._broke, kept=kept),
            )
        except BaseException:
            sock.close()
            raise
        return call, reading

    def download(self, request: PullTupleRequest, *, timeout: float) -> Download:
        hello = lane_hello(self._token, "PullTuple", request.SerializeToString())
        sock, kept = self._connection(hello)
        return LaneDownload(
            sock,
            timeout=timeout,
            max_head_bytes=self._max_head,
            max_data_bytes=self.max_chunk_bytes,
            keep=self._keep,
            broke=self._on_broken,
            reconnect=functools.partial(self._open, hello) if kept else None,
        )

    def close(self) -> None:
        """Close the kept connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sock, _since in idle:
            sock.close()

    def _connection(self, hello: bytes) -> tuple[socket.socket, bool]:
        """A connection with ``hello`` sent, and whether it was kept from an earlier call: a
        kept one still open when there is one, else a new one."""
        while (sock := self._take()) is not None:
            try:
                sock.sendall(hello)
            except OSError:  # closed by the server as it was taken
                sock.close()
                continue
            return sock, True
        return self._open(hello), False

    def _open(self, hello: bytes) -> socket.socket:
        """A new connection, ``hello`` sent; the lane's failure as a ``transport`` LaneError."""
        try:
            sock = open_lane(self.lane, hello, connect_seconds=LANE_CONNECT_SECONDS, tls=self._tls)
        except (OSError, ValueError) as exc:
            raise LaneError(
                grpc.StatusCode.UNAVAILABLE, f"payload lane {self.lane} unreachable: {exc}", transport=True
            ) from None
        with self._lock:
            self.opened += 1
        return sock

    def _take(self) -> socket.socket | None:
        """The connection kept last, if one is still open and idle for less than
        :data:`REUSE_SECONDS` (the server keeps it longer); the rest of that age are closed."""
        while True:
            now = time.monotonic()
            with self._lock:
                closing = [sock for sock, since in self._idle if now - since >= REUSE_SECONDS]
                self._idle = [(sock, since) for sock, since in self._idle if now - since < REUSE_SECONDS]
                sock = self._idle.pop()[0] if self._idle else None
            for old in closing:
                old.close()
            if sock is None or quiet(sock):
                return sock
            sock.close()  # the server closed it (restarted, idle, made room) or broke the protocol

    def _keep(self, sock: socket.socket) -> None:
        """Keep a connection whose call ended cleanly, for the next call (closed when enough are kept)."""
        with self._lock:
            if len(self._idle) < KEPT_CONNECTIONS:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()

    def _broke(self, why: str, answered: bool, *, kept: bool) -> None:
        """An upload's lane broke. A kept connection that breaks before any answer had been
        closed by the server between calls: the lane is not at fault, the connections kept
        with it are let go, and the caller sends again (on a new connection)."""
        if kept and not answered:
            self.close()
            return
        self._on_broken(why)


PayloadChannel = GrpcPayload | LanePayload  # how payload bytes travel between this process and one peer


class PayloadPeers:
    """The payload calls to each peer, on its :data:`PayloadChannel`, as ``settings`` say
    (the token and the lanes' TLS read once, as for the gRPC channels; chunks, packs of
    ``pack_bytes`` and bounds as gRPC's). ``channel(address)`` is the peer's kept gRPC channel;
    ``lanes`` false (turned off) chooses gRPC for every peer. Thread-safe."""

    def __init__(
        self,
        settings: ClusterSettings,
        *,
        lanes: bool,
        channel: Callable[[str], grpc.Channel],
        pack_bytes: int = 0,
        logger: logging.Logger,
    ) -> None:
        self._lanes = lanes
        self._channel = channel
        limit = message_limit(settings)
        self._make_lane = functools.partial(
            LanePayload,
            token=settings.presented_token(),
            chunk_bytes=settings.chunk_bytes,
            pack_bytes=pack_bytes,
            max_head_bytes=limit,
            max_data_bytes=settings.max_tuple_bytes,
            tls=client_context(settings),
        )
        self._make_grpc = functools.partial(
            GrpcPayload, chunk_bytes=settings.chunk_bytes, pack_bytes=pack_bytes, max_chunk_bytes=limit
        )
        self._log = logger
        self._lock = threading.Lock()
        self._lane_channels: dict[tuple[str, str], LanePayload] = {}  # (peer, lane) -> its lane's adapter
        self._grpc_channels: dict[str, GrpcPayload] = {}  # peer -> its gRPC adapter
        self._on_grpc: dict[tuple[str, str], float] = {}  # (peer, lane) -> until when it uses gRPC

    def upload(
        self, address: str, lane: str, method: str, payloads: Payloads, *, timeout: float
    ) -> tuple[Upload, GuardedFrames[object]]:
        """Stream ``payloads`` to ``method`` ("Deliver" or "Enqueue") of the peer at ``address``
        (its gRPC address) whose lane is ``lane`` ('' = none): the call and its frames (whose
        ``failure`` says why a payload could not be read)."""
        return self._call(address, lane, lambda channel: channel.upload(method, payloads, timeout=timeout))

    def download(self, address: str, lane: str, request: PullTupleRequest, *, timeout: float) -> tuple[Download, int]:
        """Open a PullTuple from the peer: the call, and the largest frame payload it may bring."""
        return self._call(
            address, lane, lambda channel: (channel.download(request, timeout=timeout), channel.max_chunk_bytes)
        )

    def _call(self, address: str, lane: str, call: Callable[[PayloadChannel], T]) -> T:
        """``call`` on the peer's channel; on gRPC at once when its lane cannot be opened
        (nothing was sent)."""
        try:
            return call(self.get(address, lane))
        except LaneError as exc:
            self._move(address, lane, "payload lane unreachable; this peer uses gRPC", exc.details())
        return call(self.get(address, lane))

    def get(self, address: str, lane: str) -> PayloadChannel:
        """The channel of the peer at ``address`` whose lane is ``lane`` ('' = none): its lane
        unless lanes are off or the lane failed less than ``LANE_RETRY_SECONDS`` ago."""
        key = (address, lane if self._lanes else "")
        with self._lock:
            until = self._on_grpc.get(key)
            on_lane = bool(key[1]) and (until is None or time.monotonic() >= until)
            channel: PayloadChannel | None = (
                self._lane_channels.get(key) if on_lane else self._grpc_channels.get(address)
            )
        if channel is not None:
            return channel
        if on_lane:
            made_lane = self._make_lane(lane, on_broken=functools.partial(self.broken, address, lane))
            with self._lock:
                return self._lane_channels.setdefault(key, made_lane)
        made_grpc = self._make_grpc(self._channel(address))  # outside the lock: channel() may take its owner's
        with self._lock:
            return self._grpc_channels.setdefault(address, made_grpc)

    def broken(self, address: str, lane: str, why: str) -> None:
        """The peer's lane broke under a call: the peer uses gRPC, and tries its lane again later."""
        self._move(address, lane, "payload lane broke; this peer uses gRPC", why)

    def close(self) -> None:
        """Close the connections the lanes keep."""
        with self._lock:
            channels = list(self._lane_channels.values())
        for channel in channels:
            channel.close()

    def _move(self, address: str, lane: str, message: str, why: str) -> None:
        """The peer uses gRPC for ``LANE_RETRY_SECONDS`` (said once, though calls at once on
        the lane all fail); its lane's kept connections are let go."""
        key = (address, lane)
        with self._lock:
            was = self._on_grpc.get(key)
            self._on_grpc[key] = time.monotonic() + LANE_RETRY_SECONDS
            channel = self._lane_channels.get(key)
        if channel is not None:
            channel.close()
        if was is None or time.monotonic() >= was:
            self._log.warning(message, extra={"peer": address, "lane": lane, "error": why})


class GuardedFrames(Generic[R]):
    """A stream's frames, read from the spool, keeping the reason in ``failure`` when a
    payload cannot be read. Attached to a gRPC call, it cancels the call, where gRPC
    would log a traceback and end it with nothing but "Exception iterating requests!";
    unattached (the lane), it raises on, and the lane call ends with the error."""

    def __init__(self, frames: Iterable[R], *, cancels: bool) -> None:
        self._frames = frames
        self._cancels = cancels
        self._cancel: Callable[[], object] | None = None
        self._attached = threading.Event()
        self.failure = ""

    def attach(self, cancel: Callable[[], object]) -> None:
        self._cancel = cancel
        self._attached.set()

    def __iter__(self) -> Iterator[R]:
        try:
            yield from self._frames
        except OSError as exc:
            self.failure = str(exc) or type(exc).__name__
            if not self._cancels or not self._attached.wait(10.0):  # attached as the call starts
                raise
            assert self._cancel is not None  # set before _attached is
            self._cancel()
