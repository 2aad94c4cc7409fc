"""The local ingest API (``hio.proto.Ingest``) for instrument software in any language.

:class:`IngestServicer` verifies incoming tuples with
:class:`~hio.transport.frames.FrameReader`, spools them chunk by chunk and reports
ACCEPTED, then (when the metadata asks ``hio.wait = stored``) the final outcome.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import grpc

from hio.gateway.client import DeliveryError, Gateway, TupleFuture
from hio.gateway.dispatch import Outcome
from hio.gateway.spool import SpoolWriter
from hio.proto import ingest_pb2, ingest_pb2_grpc
from hio.proto.tuple_pb2 import TupleFrame, TupleMeta, TupleReceipt
from hio.transport.errors import InvalidArgument, Unavailable, grpc_errors
from hio.transport.frames import FrameReader, StopDeadline, idle_bounded

WAIT_ATTRIBUTE = "hio.wait"
_POLL = 0.5


# Who may call what on the ingest API (an `admin` token may call anything).
POLICY = {"Submit": {"instrument", "gateway"}, "GetGatewayStatus": {"instrument", "gateway", "viewer"}}


class IngestServicer(ingest_pb2_grpc.IngestServicer):
    """gRPC face of the gateway: spools tuples arriving as frames and yields receipts
    (:meth:`receive`, which knows no gRPC), and tells its status. Thread-safe (one call per stream)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._stop = StopDeadline()

    def stop_accepting(self, finish_seconds: float = 0.0) -> None:
        """New streams and tuples are refused with UNAVAILABLE from now on; a tuple a stream
        is sending now may arrive within ``finish_seconds``, then its stream ends the same way
        (said by this servicer, before the server's stop cancels the call)."""
        self._stop.begin(finish_seconds)

    @grpc_errors
    def Submit(self, request_iterator: Iterator[TupleFrame], context: grpc.ServicerContext) -> Iterator[TupleReceipt]:
        yield from self.receive(request_iterator, still_wanted=context.is_active)

    @grpc_errors
    def GetGatewayStatus(
        self, request: ingest_pb2.GetGatewayStatusRequest, context: grpc.ServicerContext
    ) -> ingest_pb2.GetGatewayStatusResponse:
        s = self._gateway.status()
        wire = ingest_pb2.GetGatewayStatusResponse.DESCRIPTOR.fields_by_name  # the counters it carries
        figures = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name in wire}
        config = self._gateway.config
        return ingest_pb2.GetGatewayStatusResponse(
            **figures,
            warnings=s.warnings(),
            chunk_bytes=config.chunk_bytes,
            max_tuple_bytes=config.max_tuple_bytes,
            stream_idle_seconds=config.stream_idle_seconds,
        )

    def receive(
        self, frames: Iterable[TupleFrame], still_wanted: Callable[[], bool] = lambda: True
    ) -> Iterator[TupleReceipt]:
        """Receipts for a stream of tuples: ACCEPTED each, then final ones for waiting tuples.

        Raises InvalidArgument (bad metadata, oversized), DataLoss (size or
        CRC-32 mismatch), SpoolFull (ResourceExhausted), Unavailable (stopping).
        Tuples accepted before an error stay accepted.
        """
        config = self._gateway.config
        waiting: dict[TupleFuture, int] = {}

        def cut() -> Unavailable | None:  # a tuple still arriving once the stop's finish time is over
            return _stopping_error(waiting) if self._stop.due() else None

        bounded = idle_bounded(frames, config.stream_idle_seconds, cut=cut)
        reader = FrameReader(
            bounded, max_tuple_bytes=config.max_tuple_bytes, max_chunk_bytes=config.chunk_bytes, need_id=False
        )
        while True:
            if self._stop.begun:
                raise _stopping_error(waiting)
            index = reader.index
            future, wait = self._receive_one(reader)
            if future is None:
                break
            yield TupleReceipt(index=index, state=TupleReceipt.ACCEPTED)
            if wait:
                waiting[future] = index
            yield from self._finished(waiting, timeout=0)
        while waiting and still_wanted():
            if self._stop.begun:  # said here, not cut off by the server's stop
                raise _stopping_error(waiting)
            yield from self._finished(waiting, timeout=_POLL)

    def _receive_one(self, reader: FrameReader) -> tuple[TupleFuture | None, bool]:
        holder: list[SpoolWriter] = []
        try:
            meta = reader.next_tuple(
                lambda chunk: holder[0].write(chunk),  # noqa: PLW0108 - holder[0] exists once begin (below) ran
                lambda meta: holder.append(self._begin(meta)),
            )
            if meta is None:
                return None, False
            wait = self._prepare(meta)
            entry = holder[0].commit(meta)
        except BaseException:
            if holder:
                holder[0].abort()
            raise
        return self._gateway._track(entry), wait

    def _begin(self, meta: TupleMeta) -> SpoolWriter:
        """Room in the spool for a tuple whose metadata is checked. Fields this gateway does
        not know are dropped before it is kept: the metadata's bounds hold for the fields
        it knows, and unknown ones would be carried to every hop and stored unbounded."""
        meta.DiscardUnknownFields()
        return self._gateway.spool.writer(meta.size, timeout=0)

    def _prepare(self, meta: TupleMeta) -> bool:
        """Fill in what the gateway owns; True when the sender waits for the outcome."""
        if meta.tuple_id:
            raise InvalidArgument(f"tuple '{meta.name}': tuple_id must be 0 (the master assigns ids)")
        wait_value = meta.attributes.pop(WAIT_ATTRIBUTE, "")
        if wait_value not in ("", "stored", "accepted"):
            raise InvalidArgument(
                f"tuple '{meta.name}': attribute {WAIT_ATTRIBUTE} must be 'stored' "
                f"or 'accepted', got '{wait_value[:40]}'"
            )
        if not math.isfinite(meta.created_unix):
            raise InvalidArgument(f"tuple '{meta.name}': created_unix must be a time, got {meta.created_unix}")
        now = time.time()
        meta.source = meta.source or self._gateway.config.resolved_source()
        meta.created_unix = meta.created_unix or now
        meta.accepted_unix = now
        meta.attempt = 1
        meta.ClearField("ticket")
        return wait_value == "stored"

    @staticmethod
    def _finished(waiting: dict[TupleFuture, int], timeout: float) -> Iterator[TupleReceipt]:
        done, _ = concurrent.futures.wait(
            list(waiting), timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
        )
        for future in cast("set[TupleFuture]", done):  # wait() hands back the futures it was given
            yield _final_receipt(waiting.pop(future), future)


def _stopping_error(waiting: dict[TupleFuture, int]) -> Unavailable:
    """Why a stream ends at the gateway's stop: what was not ACCEPTED is to be sent again, and
    the ACCEPTED tuples still waiting for their final receipts are kept."""
    kept = (
        f"; the tuples this stream waits for ({len(waiting)}) are ACCEPTED, kept in its spool and "
        "delivered after its restart; their final receipts are not sent"
        if waiting
        else ""
    )
    return Unavailable(f"the gateway is stopping; submit what it did not accept to its next start{kept}")


def _final_receipt(index: int, future: TupleFuture) -> TupleReceipt:
    """STORED; ENQUEUED with why (waiting, retrying after its processing failed, or kept as a
    dead letter); or FAILED: the tuple was refused for good (docs/ingest.md, "Receipts")."""
    receipt = TupleReceipt(index=index, tuple_id=future.tuple_id, message=future.detail[:2000])
    if future.outcome == Outcome.STORED.value:
        receipt.state = TupleReceipt.STORED
    elif future.outcome == Outcome.ENQUEUED.value:
        receipt.state = TupleReceipt.ENQUEUED
        receipt.queued = TupleReceipt.RETRYING if future.detail else TupleReceipt.WAITING
    elif future.outcome == Outcome.DEAD_LETTERED.value:
        receipt.state, receipt.queued, receipt.dead_lettered = TupleReceipt.ENQUEUED, TupleReceipt.DEAD_LETTER, True
    else:
        error = future.exception()
        receipt.state, receipt.message = TupleReceipt.FAILED, str(error)[:2000]
        receipt.tuple_id = error.tuple_id if isinstance(error, DeliveryError) else 0
    return receipt
