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

from hio.master.backlog import Placement
from hio.master.core import PULL_PACK_BYTES, ImageStatus, Master, Outcome, RouteItem, Status
from hio.master.deadletters import DeadLetter
from hio.master.registry import ChannelSpec
from hio.master.routing import DirectRoute
from hio.master.scaler import ScalingReport
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


class MasterService(master_pb2_grpc.MasterServicer):
    """Thin adapter between the wire contract and the domain."""

    def __init__(self, master: Master) -> None:
        self._master = master

    @grpc_errors
    def RegisterWorker(
        self, request: master_pb2.RegisterWorkerRequest, context: grpc.ServicerContext
    ) -> master_pb2.RegisterWorkerResponse:
        specs = [_channel_spec(c) for c in request.channels]
        self._master.register_worker(request.worker_id, request.host, request.cpus, specs, elastic=request.elastic)
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
        channels = [_channel_spec(c) for c in request.channels] if request.complete else None
        answer = self._master.heartbeat(request.worker_id, down, cpu, channels)
        reply = master_pb2.HeartbeatResponse(known=answer.known, stop_channels=answer.stop)
        if answer.plan is not None:
            reply.plan.CopyFrom(
                master_pb2.EnginePlan(
                    engines=[master_pb2.ImageCount(image=i, count=n) for i, n in sorted(answer.plan.items())]
                )
            )
        return reply

    @grpc_errors
    def RouteTuples(
        self, request: master_pb2.RouteTuplesRequest, context: grpc.ServicerContext
    ) -> master_pb2.RouteTuplesResponse:
        items = [RouteItem(size=i.size, tuple_id=i.tuple_id) for i in request.items]
        routed = self._master.route(
            source=request.source,
            image=request.image,
            items=items,
            force_queue=request.force_queue,
            wait_seconds=request.wait_seconds,
        )
        reply = master_pb2.RouteTuplesResponse(tuple_ids=routed.tuple_ids, tickets=routed.tickets)
        if isinstance(routed.route, DirectRoute):
            reply.channel.CopyFrom(
                master_pb2.ChannelRoute(
                    channel_id=routed.route.channel_id,
                    address=routed.route.address,
                    reservation_seconds=routed.route.reservation_seconds,
                    lane_address=routed.route.lane_address,
                )
            )
        else:
            reply.queue.CopyFrom(
                master_pb2.QueueRoute(queue_length=routed.route.queue_length, lane_port=self._master.lane_port)
            )
        return reply

    @grpc_errors
    def Enqueue(self, request_iterator: Iterable[TupleFrame], context: grpc.ServicerContext) -> Iterator[TupleReceipt]:
        frames = idle_bounded(request_iterator, self._master.config.stream_idle_seconds, context.cancel)
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
            )

    def pull_for_lane(self, request_bytes: bytes, alive: Callable[[], bool]) -> Iterator[LaneFrame]:
        """PullTuple on the payload lane: the leased tuples as lane frames (a payload on disk is
        sent from its backlog segment with ``sendfile``). A stream that breaks voids the lease,
        charged, as over gRPC; a caller gone before the lease is given charges nothing."""
        try:
            request = master_pb2.PullTupleRequest.FromString(request_bytes)
        except DecodeError as exc:
            raise InvalidArgument(f"unreadable PullTupleRequest: {exc}") from None
        pulled = self._master.pull(
            request.channel_id,
            request.wait_seconds,
            max_tuples=request.max_tuples,
            max_bytes=request.max_bytes,
            alive=alive,
        )
        if pulled is None:
            return
        if not alive():
            pulled.abandon("pull call already ended", charge=False)
            return
        finished = False
        try:
            yield from lane_frames(pulled.payloads(), self._master.config.chunk_bytes, PULL_PACK_BYTES)
            finished = True
        finally:
            if not finished:
                pulled.abandon("pull stream cancelled")

    @grpc_errors
    def PullTuple(self, request: master_pb2.PullTupleRequest, context: grpc.ServicerContext) -> Iterator[WireFrame]:
        pulled = self._master.pull(
            request.channel_id,
            request.wait_seconds,
            max_tuples=request.max_tuples,
            max_bytes=request.max_bytes,
            alive=context.is_active,
        )
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
        outcomes = [
            Outcome(
                tuple_id=o.tuple_id,
                ok=o.ok,
                message=o.message,
                from_queue=o.from_queue,
                size=o.size,
                processing_seconds=o.processing_seconds,
                accepted_unix=o.accepted_unix,
                stored_unix=o.stored_unix,
            )
            for o in request.outcomes
        ]
        pull = self._master.report(
            request.channel_id, outcomes, request.release, processing=request.processing, pull_done=request.pull_done
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
        return _encode_status(self._master.status())

    @grpc_errors
    def ListDeadLetters(
        self, request: master_pb2.ListDeadLettersRequest, context: grpc.ServicerContext
    ) -> master_pb2.ListDeadLettersResponse:
        return master_pb2.ListDeadLettersResponse(dead_letters=[_encode_dead(d) for d in self._master.dead_letters()])

    @grpc_errors
    def GetScaling(
        self, request: master_pb2.GetScalingRequest, context: grpc.ServicerContext
    ) -> master_pb2.GetScalingResponse:
        return master_pb2.GetScalingResponse(scaling=_encode_scaling(self._master.scaling()))

    @grpc_errors
    def SetScaling(
        self, request: master_pb2.SetScalingRequest, context: grpc.ServicerContext
    ) -> master_pb2.SetScalingResponse:
        report = self._master.set_scaling(
            min_workers=request.min_workers if request.HasField("min_workers") else None,
            max_workers=request.max_workers if request.HasField("max_workers") else None,
            pin={p.image: p.count for p in request.pin},
            unpin=list(request.unpin),
            reset_bounds=request.reset_bounds,
        )
        return master_pb2.SetScalingResponse(scaling=_encode_scaling(report))

    @grpc_errors
    def RetryDeadLetter(
        self, request: master_pb2.RetryDeadLetterRequest, context: grpc.ServicerContext
    ) -> master_pb2.RetryDeadLetterResponse:
        self._master.retry_dead_letter(request.tuple_id)
        return master_pb2.RetryDeadLetterResponse()


def _encode_scaling(report: ScalingReport) -> master_pb2.Scaling:
    def counts(table: dict[str, int]) -> list[master_pb2.ImageCount]:
        return [master_pb2.ImageCount(image=image, count=n) for image, n in sorted(table.items()) if n]

    return master_pb2.Scaling(
        mode=report.mode,
        provisioner=report.provisioner,
        min_workers=report.min_workers,
        max_workers=report.max_workers,
        bounds_set=report.bounds_set,
        workers_wanted=report.workers_wanted,
        workers_present=report.workers_present,
        workers=[
            master_pb2.WorkerPlan(
                worker_id=w.worker_id,
                rank=w.rank,
                state=w.state,
                cpus=w.cpus,
                load=w.load,
                planned=counts(w.planned),
                running=counts(w.running),
                retiring=w.retiring,
                provisioned=w.provisioned,
                elastic=w.elastic,
            )
            for w in report.workers
        ],
        images=[encode_image(i) for i in report.images],
        unplaced=counts(report.unplaced),
        decisions=[
            master_pb2.ScalingDecision(unix=d.unix, subject=d.subject, action=d.action, reason=d.reason)
            for d in report.decisions
        ],
    )


def _channel_spec(c: master_pb2.ChannelInfo) -> ChannelSpec:
    return ChannelSpec(
        channel_id=c.channel_id,
        image=c.image,
        address=c.address,
        lane_address=c.lane_address,
        down=c.state == master_pb2.DOWN,
        detail=c.detail,
    )


def _encode_dead(letter: DeadLetter) -> master_pb2.DeadLetter:
    return master_pb2.DeadLetter(meta=letter.meta, reason=letter.reason, failed_unix=letter.failed_unix)


def _encode_status(status: Status) -> master_pb2.GetStatusResponse:
    workers = [
        master_pb2.WorkerStatus(
            worker_id=worker.worker_id,
            host=worker.host,
            last_heartbeat_age_seconds=age,
            channels=[
                master_pb2.ChannelInfo(
                    channel_id=c.channel_id,
                    image=c.image,
                    address=c.address,
                    lane_address=c.lane_address,
                    # the registry's ChannelState has the proto enum's numbers
                    state=cast("master_pb2.ChannelState", int(c.state)),
                    detail=c.detail,
                    tuples_done=c.tuples_done,
                    processing=c.processing,
                    retiring=c.retiring,
                )
                for c in channels
            ],
        )
        for worker, age, channels in status.workers
    ]
    queues = [
        master_pb2.QueueStatus(image=q.image, length=q.length, bytes=q.bytes, leased=q.leased) for q in status.queues
    ]
    return master_pb2.GetStatusResponse(
        uptime_seconds=status.uptime_seconds,
        workers=workers,
        queues=queues,
        channels_free=status.channels_free,
        channels_busy=status.channels_busy,
        channels_down=status.channels_down,
        routed_direct=status.routed_direct,
        routed_queue=status.routed_queue,
        tuples_done=status.tuples_done,
        tuples_failed=status.tuples_failed,
        bytes_done=status.bytes_done,
        tuples_per_second=status.tuples_per_second,
        bytes_per_second=status.bytes_per_second,
        queue_bytes_limit=status.queue_bytes_limit,
        dead_letters=status.dead_letters,
        warnings=status.warnings,
        last_tuple_id=status.last_tuple_id,
        engines=[encode_image(e) for e in status.engines],
    )


def encode_image(engines: ImageStatus) -> master_pb2.ImageEngines:
    return master_pb2.ImageEngines(
        image=engines.image,
        running=engines.running,
        wanted=engines.wanted,
        pinned=engines.pinned,
        cpu_share=engines.cpu_share or 0.0,
        seconds_per_tuple=engines.seconds_per_tuple or 0.0,
        tuples_per_second=engines.tuples_per_second,
    )
