"""The Repository gRPC service: decode, call the FeatureStore, encode.

Every method is wrapped with ``@grpc_errors`` so domain errors become statuses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc

from hio.proto import repository_pb2 as pb
from hio.proto import repository_pb2_grpc
from hio.repository.store import FeatureStore
from hio.transport.errors import InvalidArgument, NotFound, grpc_errors

log = logging.getLogger("hio.repository")

# Which caller roles may call which method (see hio.transport.net: 'admin' and 'any' pass everywhere).
POLICY: dict[str, set[str]] = {
    "PutFeatures": {"worker"},
    "StoreFeatures": {"worker"},
    "ReadFeatures": {"kd"},
    "GetOffsets": {"kd"},
    "CommitOffset": {"kd"},
    "PutKnowledge": {"kd"},
    "GetKnowledge": {"kd", "gateway", "viewer", "worker"},
    "GetPreview": {"kd", "gateway", "viewer", "worker"},
}


MAX_OFFSETS_WAIT_SECONDS = 60.0  # GetOffsets' longest wait for a new record


class RepositoryService(repository_pb2_grpc.RepositoryServicer):
    """Thin servicer over a :class:`FeatureStore`."""

    def __init__(
        self, store: FeatureStore, *, read_batch_records: int, read_batch_bytes: int, max_waiters: int = 8
    ) -> None:
        self._store = store
        self._batch_records = read_batch_records
        self._batch_bytes = read_batch_bytes
        # GetOffsets calls waiting for a record at once: each holds a server thread, and
        # PutFeatures must always find one
        self._max_waiters = max_waiters
        self._waiters = 0
        self._waiters_lock = threading.Lock()

    @grpc_errors
    def PutFeatures(self, request: pb.PutFeaturesRequest, context: grpc.ServicerContext) -> pb.PutFeaturesResponse:
        return self._put(request)

    @grpc_errors
    def StoreFeatures(
        self, requests: Iterator[pb.PutFeaturesRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.PutFeaturesResponse]:
        for request in requests:
            yield self._put(request)

    def _put(self, request: pb.PutFeaturesRequest) -> pb.PutFeaturesResponse:
        if not request.records:
            raise InvalidArgument("PutFeatures carries no records")
        results = self._store.put((r.tuple_id, r.record_zstd, r.crc32) for r in request.records)
        stored = sum(not r.duplicate for r in results)
        log.debug("features stored", extra={"records": len(results), "new": stored})
        return pb.PutFeaturesResponse(offsets=[r.offset for r in results], duplicate=[r.duplicate for r in results])

    @grpc_errors
    def GetOffsets(self, request: pb.GetOffsetsRequest, context: grpc.ServicerContext) -> pb.GetOffsetsResponse:
        if not 0.0 <= request.wait_seconds <= MAX_OFFSETS_WAIT_SECONDS:  # NaN too
            raise InvalidArgument(
                f"wait_seconds must be from 0 to {MAX_OFFSETS_WAIT_SECONDS:g}, got {request.wait_seconds}"
            )
        latest = self._store.latest()
        if request.wait_seconds and latest <= request.wait_after:
            latest = self._wait_beyond(request.wait_after, request.wait_seconds, context)
        return pb.GetOffsetsResponse(latest=latest, committed=self._store.committed(request.consumer), records=latest)

    def _wait_beyond(self, offset: int, seconds: float, context: grpc.ServicerContext) -> int:
        """The latest offset once past ``offset`` or after ``seconds``; at once when
        :attr:`_max_waiters` calls wait already, or when the caller has gone."""
        with self._waiters_lock:
            if self._waiters >= self._max_waiters:
                return self._store.latest()
            self._waiters += 1
        try:
            return self._store.wait_beyond(offset, seconds, context.is_active)
        finally:
            with self._waiters_lock:
                self._waiters -= 1

    @grpc_errors
    def ReadFeatures(
        self, request: pb.ReadFeaturesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ReadFeaturesResponse]:
        batch: list[pb.StoredRecord] = []
        batch_bytes = 0
        for offset, tuple_id, data in self._store.read(request.after, request.until, request.max_records):
            if batch and (len(batch) >= self._batch_records or batch_bytes + len(data) > self._batch_bytes):
                yield self._response(batch)
                batch, batch_bytes = [], 0
            batch.append(pb.StoredRecord(offset=offset, tuple_id=tuple_id, record_zstd=data))
            batch_bytes += len(data)
        if batch:
            yield self._response(batch)

    def _response(self, batch: list[pb.StoredRecord]) -> pb.ReadFeaturesResponse:
        """One batch of records, each with when it became durable."""
        for record, unix in zip(batch, self._store.durable_unix([r.offset for r in batch]), strict=True):
            record.durable_unix = unix
        return pb.ReadFeaturesResponse(records=batch)

    @grpc_errors
    def CommitOffset(self, request: pb.CommitOffsetRequest, context: grpc.ServicerContext) -> pb.CommitOffsetResponse:
        self._store.commit(request.consumer, request.offset)
        return pb.CommitOffsetResponse()

    @grpc_errors
    def PutKnowledge(self, request: pb.PutKnowledgeRequest, context: grpc.ServicerContext) -> pb.PutKnowledgeResponse:
        knowledge = self._store.put_knowledge(request.knowledge, request.preview_png or None)
        log.info(
            "knowledge stored",
            extra={
                "tuples": knowledge.tuple_count,
                "clusters": len(knowledge.clusters),
                "up_to_offset": knowledge.up_to_offset,
                "preview": bool(request.preview_png),
            },
        )
        return pb.PutKnowledgeResponse()

    @grpc_errors
    def GetKnowledge(self, request: pb.GetKnowledgeRequest, context: grpc.ServicerContext) -> pb.GetKnowledgeResponse:
        knowledge, preview = self._store.get_knowledge_and_preview()
        return pb.GetKnowledgeResponse(knowledge=knowledge or b"", has_preview=preview is not None)

    @grpc_errors
    def GetPreview(self, request: pb.GetPreviewRequest, context: grpc.ServicerContext) -> pb.GetPreviewResponse:
        png = self._store.get_knowledge_and_preview()[1]
        if png is None:
            raise NotFound("no preview yet: knowledge discovery has not written one")
        return pb.GetPreviewResponse(png=png)
