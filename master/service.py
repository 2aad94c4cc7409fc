"""The Master gRPC service: decode, call :class:`hio.master.core.Master`, encode.

Every method is wrapped with ``@grpc_errors``: domain errors become their
status, anything else ``INTERNAL`` with a log reference.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import grpc
from google.protobuf.message import DecodeError

from hio.master.backlog import LAST_ERROR_ATTRIBUTE, Placement, Stored
from hio.master.core import PULL_PACK_BYTES, Master, Pulled
from hio.master.deadletters import DeadLetter
from hio.proto import master_pb2, master_pb2_grpc
from hio.transport.errors import InvalidArgument, grpc_errors
from hio.transport.frames import ChunkFrame, TupleFrame, TupleReceipt, WireFrame, idle_bounded
from hio.transport.lane import LaneFrame, lane_frames

# Method name -> roles allowed (passed to hio.transport.net.create_server as `policy`).
POLICY: dict[str, set[str]] = {
    "RegisterWorker": {"worker"},
    "Heartbeat": {"worker"},
    "PullTuple": {"worker"},
    "ReportTuples": {"worker"},
    "RouteTuples": {"gateway", "worker"},
    "Enqueue": {"gateway", "worker"},
    "GetStatus": {"gateway", "worker", "kd", "admin", "viewer"},
    "ListDeadLetters": {"gateway", "worker", "kd", "admin", "viewer"},
    "RetryDeadLetter": {"admin"},
    "GetScaling": {"admin", "viewer"},
    "SetScaling": {"admin"},
}

_RECEIPT_MESSAGES = {
    Placement.ENQUEUED: "",
    Placement.DUPLICATE: "already in the queue",
    Placement.DEAD_LETTER: "attempts exhausted: stored as a dead letter",
}


def _queued(stored: Stored) -> TupleReceipt.Queued:
    """A receipt's word on why the tuple is queued: a tuple that failed before carries the
    error (``hio.last_error``, from the engine or gateway that handed it back)."""
    if stored.placement is Placement.DEAD_LETTER:
        return TupleReceipt.DEAD_LETTER
    return TupleReceipt.RETRYING if LAST_ERROR_ATTRIBUTE in stored.meta.attributes else TupleReceipt.WAITING


class MasterService(master_pb2_grpc.MasterServicer):
    """Thin adapter between the wire contract and the domain."""

    def __init__(self, master: Master) -> None:
        self._master = master

    @grpc_errors
    def RegisterWorker(
        self, request: master_pb2.RegisterWorkerRequest, context: grpc.ServicerContext
    ) -> master_pb2.RegisterWorkerResponse:
        self._master.register_worker(
            request.worker_id, request.host, request.cpus, request.channels, elastic=request.elastic
        )
        config = self._master.config
        return master_pb2.RegisterWorkerResponse(
            heartbeat_interval_seconds=config.heartbeat_interval, expiry_seconds=config.expiry_seconds
        )

    @grpc_errors
    def Heartbeat(
        self, request: master_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> master_pb2.HeartbeatResponse:
        down = {c.channel_id: c.detail for c in request.channels if c.state == master_pb2.DOWN}
        cpu = {
            c.channel_id: c.cpu_seconds + (c.cpu_wait_seconds if c.HasField("cpu_wait_seconds") else 0.0)
            for c in request.channels
            if c.HasField("cpu_seconds")
        }
        channels = list(request.channels) if request.complete else None
        return self._master.heartbeat(request.worker_id, down, cpu, channels)

    @grpc_errors
    def RouteTuples(
        self, request: master_pb2.RouteTuplesRequest, context: grpc.ServicerContext
    ) -> master_pb2.RouteTuplesResponse:
        return self._master.route(
            source=request.source,
            image=request.image,
            items=request.items,
            force_queue=request.force_queue,
            wait_seconds=request.wait_seconds,
        )

    @grpc_errors
    def Enqueue(self, request_iterator: Iterable[TupleFrame], context: grpc.ServicerContext) -> Iterator[TupleReceipt]:
        frames = idle_bounded(request_iterator, self._master.config.stream_idle_seconds, cut=self._master.enqueue_cut)
        yield from self.enqueue(frames)

    def enqueue(self, frames: Iterable[TupleFrame | ChunkFrame]) -> Iterator[TupleReceipt]:
        """Enqueue's receipts, for gRPC and the payload lane (which hands frames on in pieces
        of ``chunk_bytes``, so both take the same chunk bound)."""
        # A ChunkFrame reads like a TupleFrame to the FrameReader the backlog reads with.
        for stored in self._master.enqueue(cast("Iterable[TupleFrame]", frames)):
            yield TupleReceipt(
                index=stored.index,
                tuple_id=stored.meta.tuple_id,
                state=TupleReceipt.ENQUEUED,
                message=_RECEIPT_MESSAGES[stored.placement],
                dead_lettered=stored.placement is Placement.DEAD_LETTER,
                queued=_queued(stored),
            )

    def pull_for_lane(self, request_bytes: bytes, alive: Callable[[], bool]) -> Iterator[LaneFrame]:
        """PullTuple on the payload lane: the leased tuples as lane frames (a payload on disk is
        sent from its backlog segment with ``sendfile``). A stream that breaks voids the lease,
        charged, as over gRPC; a caller gone before the lease is given charges nothing."""
        try:
            request = master_pb2.PullTupleRequest.FromString(request_bytes)
        except DecodeError as exc:
            raise InvalidArgument(f"unreadable PullTupleRequest: {exc}") from None
        pulled = self._pull(request, alive)
        if pulled is None:
            return
        if not alive():
            pulled.abandon("pull call already ended", charge=False)
            return
        try:
            yield from lane_frames(pulled.payloads(), self._master.config.chunk_bytes, PULL_PACK_BYTES)
        except BaseException:  # the stream broke, or its reader closed it (GeneratorExit)
            pulled.abandon("pull stream cancelled")
            raise

    def _pull(self, request: master_pb2.PullTupleRequest, alive: Callable[[], bool]) -> Pulled | None:
        return self._master.pull(
            request.channel_id,
            request.wait_seconds,
            max_tuples=request.max_tuples,
            max_bytes=request.max_bytes,
            alive=alive,
        )

    @grpc_errors
    def PullTuple(self, request: master_pb2.PullTupleRequest, context: grpc.ServicerContext) -> Iterator[WireFrame]:
        pulled = self._pull(request, context.is_active)
        if pulled is None:
            return
        finished = threading.Event()

        def on_end() -> None:
            # Runs when the call ends either way; void the lease only if the stream broke.
            if not finished.is_set():
                pulled.abandon("pull stream cancelled")

        if not context.add_callback(on_end):  # ended while leasing: nothing was sent, nothing charged
            pulled.abandon("pull call already ended", charge=False)
            return
        yield from pulled.frames()
        finished.set()

    @grpc_errors
    def ReportTuples(
        self, request: master_pb2.ReportTuplesRequest, context: grpc.ServicerContext
    ) -> master_pb2.ReportTuplesResponse:
        pull = self._master.report(
            request.channel_id,
            request.outcomes,
            request.release,
            processing=request.processing,
            pull_done=request.pull_done,
        )
        config = self._master.config
        return master_pb2.ReportTuplesResponse(
            pull_queue=pull,
            reservation_seconds=config.reservation_seconds,
            lease_seconds=config.lease_seconds,
            lane_port=self._master.lane_port,
        )

    @grpc_errors
    def GetStatus(
        self, request: master_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> master_pb2.GetStatusResponse:
        return self._master.status()

    @grpc_errors
    def ListDeadLetters(
        self, request: master_pb2.ListDeadLettersRequest, context: grpc.ServicerContext
    ) -> master_pb2.ListDeadLettersResponse:
        return master_pb2.ListDeadLettersResponse(
            dead_letters=[dead_letter_message(d) for d in self._master.dead.list(self._master.config.dead_list_limit)]
        )

    @grpc_errors
    def GetScaling(
        self, request: master_pb2.GetScalingRequest, context: grpc.ServicerContext
    ) -> master_pb2.GetScalingResponse:
        return master_pb2.GetScalingResponse(scaling=self._master.scaling())

    @grpc_errors
    def SetScaling(
        self, request: master_pb2.SetScalingRequest, context: grpc.ServicerContext
    ) -> master_pb2.SetScalingResponse:
        scaling = self._master.set_scaling(
            min_workers=request.min_workers if request.HasField("min_workers") else None,
            max_workers=request.max_workers if request.HasField("max_workers") else None,
            pin={p.image: p.count for p in request.pin},
            unpin=list(request.unpin),
            reset_bounds=request.reset_bounds,
        )
        return master_pb2.SetScalingResponse(scaling=scaling)

    @grpc_errors
    def RetryDeadLetter(
        self, request: master_pb2.RetryDeadLetterRequest, context: grpc.ServicerContext
    ) -> master_pb2.RetryDeadLetterResponse:
        self._master.queue.retry_dead(request.tuple_id)
        return master_pb2.RetryDeadLetterResponse()


def dead_letter_message(letter: DeadLetter) -> master_pb2.DeadLetter:
    return master_pb2.DeadLetter(
        meta=letter.meta,
        reason=letter.reason,
        failed_unix=letter.failed_unix,
        attempts=letter.attempts,
    )
