"""Payload bytes to and from one peer: one interface, two adapters, chosen once per peer.

A :class:`PayloadChannel` carries the calls that move payloads: the uploads
``Engine.Deliver`` and ``Master.Enqueue`` (frames in, receipts out) and the
download ``Master.PullTuple``. Its adapters are :class:`LanePayload` (the
peer's payload lane, ``hio.transport.lane``: a payload goes from the spool file
with ``sendfile``, one frame a tuple) and :class:`GrpcPayload` (gRPC chunks).
Every other call (routes, reports, heartbeats, feature stores, status) is a
gRPC call on the peer's kept channel.

:class:`PayloadPeers` picks a peer's adapter when it first connects to it: the
lane when the peer offers one, lanes are on and a connection to it
opens within ``LANE_CONNECT_SECONDS``; else gRPC. A lane that breaks under a
call before the peer answered (it cannot be opened, it closes, it sends
garbage) is that peer's connection lost: :meth:`PayloadPeers.broken` moves
the peer to gRPC, and the next connection after ``LANE_RETRY_SECONDS`` chooses
again. No tuple is lost on the way: the gateway sends what the broken call
left unanswered again at once, uncharged, on the peer's gRPC channel; a pull
that breaks voids its lease at the master, which hands the tuples out again.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, Generic, Protocol, TypeVar

import grpc

from hio.config import split_address
from hio.proto.master_pb2 import PullTupleRequest
from hio.transport.frames import TupleMeta, TupleReceipt, WireFrame, tuple_frames
from hio.transport.lane import (
    LANE_CONNECT_SECONDS,
    LaneCall,
    LaneDownload,
    LaneError,
    LaneFrame,
    lane_frames,
    open_lane,
)
from hio.transport.net import pull_frames, send_frames

LANE_RETRY_SECONDS = 60.0  # a peer moved to gRPC (its lane unreachable or broken) chooses again after this
Payloads = Iterator[tuple[TupleMeta, "bytes | BinaryIO"]]
_SERVICES = {"Deliver": "Engine", "Enqueue": "Master"}


class Upload(Protocol):
    """An upload in progress, used like a gRPC stream-stream call."""

    def __iter__(self) -> Iterator[TupleReceipt]: ...

    def cancel(self) -> object: ...


class Download(Protocol):
    """A download in progress, used like a gRPC server-streaming call."""

    def __iter__(self) -> Iterator[object]: ...

    def cancel(self) -> object: ...


class PayloadChannel(Protocol):
    """How payload bytes travel between this process and one peer."""

    kind: str  # "lane" or "grpc"
    max_chunk_bytes: int  # the largest frame payload a download may bring

    def upload(self, method: str, payloads: Payloads, *, timeout: float) -> tuple[Upload, GuardedFrames[object]]:
        """Stream ``payloads`` to ``method`` ("Deliver" or "Enqueue"); the call and its frames
        (whose ``failure`` says why a payload could not be read)."""

    def download(self, request: PullTupleRequest, *, timeout: float, on_broken: Callable[[str], None]) -> Download:
        """Open a PullTuple; ``on_broken`` hears of a lane that broke before it answered."""


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

    def download(self, request: PullTupleRequest, *, timeout: float, on_broken: Callable[[str], None]) -> Download:
        return pull_frames(self._channel)(request, timeout=timeout)


class LanePayload:
    """Payloads on the peer's payload lane, a connection a call (introduced with ``token``)."""

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
    ) -> None:
        self.lane = lane
        self._token = token
        self._tls = tls  # the lane's TLS (lanetls.client_context), None for plain TCP
        self._chunk = chunk_bytes
        self._pack = pack_bytes
        self._max_head = max_head_bytes
        self.max_chunk_bytes = max_data_bytes  # the lane sends a tuple as one frame

    def _open(self, method: str, request: bytes = b"") -> socket.socket:
        try:
            return open_lane(
                self.lane,
                self._token,
                connect_seconds=LANE_CONNECT_SECONDS,
                method=method,
                request=request,
                tls=self._tls,
            )
        except (OSError, ValueError) as exc:
            raise LaneError(
                grpc.StatusCode.UNAVAILABLE, f"payload lane {self.lane} unreachable: {exc}", transport=True
            ) from None

    def upload(self, method: str, payloads: Payloads, *, timeout: float) -> tuple[Upload, GuardedFrames[LaneFrame]]:
        sock = self._open(method)
        reading = GuardedFrames(lane_frames(payloads, self._chunk, self._pack), cancels=False)
        try:
            return LaneCall(sock, iter(reading), timeout=timeout), reading
        except BaseException:
            sock.close()
            raise

    def download(self, request: PullTupleRequest, *, timeout: float, on_broken: Callable[[str], None]) -> Download:
        sock = self._open("PullTuple", request.SerializeToString())
        return LaneDownload(
            sock,
            timeout=timeout,
            max_head_bytes=self._max_head,
            max_data_bytes=self.max_chunk_bytes,
            on_broken=on_broken,
        )


class PayloadPeers:
    """The :class:`PayloadChannel` of each peer, chosen when first connected (see the module's
    words). ``lane(address)`` and ``grpc(address)`` make the adapters; ``lanes`` false (turned
    off) chooses gRPC for every peer. Thread-safe."""

    def __init__(
        self,
        *,
        lanes: bool,
        lane: Callable[[str], LanePayload],
        grpc: Callable[[str], GrpcPayload],
        logger: logging.Logger,
    ) -> None:
        self._lanes = lanes
        self._make_lane = lane
        self._make_grpc = grpc
        self._log = logger
        self._lock = threading.Lock()
        self._chosen: dict[tuple[str, str], tuple[PayloadChannel, float]] = {}  # (peer, lane) -> (adapter, until)

    def get(self, address: str, lane: str) -> PayloadChannel:
        """The channel of the peer at ``address`` (its gRPC address) whose lane is ``lane`` ('' = none)."""
        key = (address, lane if self._lanes else "")
        with self._lock:
            chosen = self._chosen.get(key)
        if chosen is not None and time.monotonic() < chosen[1]:
            return chosen[0]
        if not key[1]:
            channel: PayloadChannel = self._make_grpc(address)
            until = float("inf")
        else:
            try:
                socket.create_connection(split_address(lane), timeout=LANE_CONNECT_SECONDS).close()
                channel, until = self._make_lane(lane), float("inf")
            except (OSError, ValueError) as exc:
                self._log.warning(
                    "payload lane unreachable; this peer uses gRPC",
                    extra={"peer": address, "lane": lane, "error": str(exc)},
                )
                channel, until = self._make_grpc(address), time.monotonic() + LANE_RETRY_SECONDS
        with self._lock:
            self._chosen[key] = (channel, until)
        return channel

    def broken(self, address: str, lane: str, why: str) -> None:
        """The peer's lane broke under a call: the peer uses gRPC, and chooses again later
        (said once, though calls at once on the lane all break)."""
        grpc_channel = self._make_grpc(address)
        with self._lock:
            was = self._chosen.get((address, lane))
            self._chosen[(address, lane)] = (grpc_channel, time.monotonic() + LANE_RETRY_SECONDS)
        if was is None or was[0].kind == "lane":
            self._log.warning(
                "payload lane broke; this peer uses gRPC", extra={"peer": address, "lane": lane, "error": why}
            )


F = TypeVar("F", covariant=True)  # read only: a channel's frames are objects to its callers


class GuardedFrames(Generic[F]):
    """A stream's frames, read from the spool, keeping the reason in ``failure`` when a
    payload cannot be read. Attached to a gRPC call, it cancels the call, where gRPC
    would log a traceback and end it with nothing but "Exception iterating requests!";
    unattached (the lane), it raises on, and the lane call ends with the error."""

    def __init__(self, frames: Iterable[F], *, cancels: bool) -> None:
        self._frames = frames
        self._cancels = cancels
        self._cancel: Callable[[], object] | None = None
        self._attached = threading.Event()
        self.failure = ""

    def attach(self, cancel: Callable[[], object]) -> None:
        self._cancel = cancel
        self._attached.set()

    def __iter__(self) -> Iterator[F]:
        try:
            yield from self._frames
        except OSError as exc:
            self.failure = str(exc) or type(exc).__name__
            if not self._cancels or not self._attached.wait(10.0):  # attached as the call starts
                raise
            assert self._cancel is not None  # set before _attached is
            self._cancel()
