"""The engine's calls to the master and the repository, in one gRPC adapter.

Everything above this module (``Engine``, ``Reporter``) sees plain methods
that raise ``hio.transport.errors`` classes, never ``grpc.RpcError``: the data
path is testable and readable without the transport. Calls that may succeed
later (``UNAVAILABLE``, ``RESOURCE_EXHAUSTED``) are retried here with
jittered backoff up to ``rpc_deadline`` seconds. Every call is a gRPC call on
one kept channel per peer; features go as messages of one kept StoreFeatures
stream (:class:`~hio.transport.keptstream.KeptStream`: half a unary call's
cost to the repository); payloads (pulls, and tuples handed back to the
queue) travel on the master's :class:`~hio.transport.payload.PayloadChannel`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, cast

import grpc

from hio.config import lane_beside
from hio.proto import master_pb2, master_pb2_grpc, repository_pb2, repository_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport import errors
from hio.transport.frames import ChunkFrame, TupleFrame, TupleMeta, TupleReceipt, crc32
from hio.transport.keptstream import KeptStream
from hio.transport.net import create_channel, rpc_error_text, rpc_status
from hio.transport.payload import Download, PayloadPeers
from hio.transport.retry import call_with_retry

log = logging.getLogger("hio.worker")

T = TypeVar("T")

CALL_TIMEOUT = 30.0  # seconds one attempt of a unary call (or a stored batch's answer) may take
STORE_IDLE_SECONDS = 10.0  # a features stream unused this long is closed (frees its repository thread)


def translate(exc: grpc.RpcError, peer: str, settings: ClusterSettings) -> errors.HioError:
    """The domain error for a failed call to ``peer`` ('master', 'repository'); a call that
    never connected says why in words (a TLS mistake is not a server that is down)."""
    code = rpc_status(exc)[0] or grpc.StatusCode.UNKNOWN
    cls = errors.Unavailable if code == grpc.StatusCode.CANCELLED else errors.BY_CODE.get(code, errors.HioError)
    return cls(f"{peer}: {rpc_error_text(exc, settings)}", retry_after=errors.retry_after(exc))


class PullCall:
    """An open ``PullTuple`` long-poll (on the master's payload channel): iterate its frames,
    or cancel it from another thread. ``max_chunk_bytes``: the largest frame payload it may
    bring (the lane sends a tuple as one frame)."""

    def __init__(self, call: Download, max_chunk_bytes: int, settings: ClusterSettings) -> None:
        self._call = call
        self.max_chunk_bytes = max_chunk_bytes
        self._settings = settings  # for the TLS advice when the pull never connected

    def frames(self) -> Iterator[TupleFrame | ChunkFrame]:
        """The frames of the pulled tuples; empty when the master had nothing."""
        try:
            yield from cast("Iterator[TupleFrame | ChunkFrame]", self._call)  # a stream call iterates its replies
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return
            raise translate(exc, "master", self._settings) from None

    def cancel(self) -> None:
        self._call.cancel()


class ClusterLink:
    """Stubs of the master and the repository for one engine (thread-safe)."""

    def __init__(self, settings: ClusterSettings, *, rpc_deadline: float, lanes: bool = True) -> None:
        self._settings = settings
        self._deadline = rpc_deadline
        self._master_channel = create_channel(settings.master_address, settings)
        self._repo_channel = create_channel(settings.repository_address, settings)
        self._master = master_pb2_grpc.MasterStub(self._master_channel)
        repo = repository_pb2_grpc.RepositoryStub(self._repo_channel)
        self._features: KeptStream[repository_pb2.PutFeaturesRequest, repository_pb2.PutFeaturesResponse] = KeptStream(
            repo.StoreFeatures, name="StoreFeatures", timeout=CALL_TIMEOUT, idle_seconds=STORE_IDLE_SECONDS
        )
        self._master_lane_port = 0  # learnt from report answers
        self._payload = PayloadPeers(settings, lanes=lanes, channel=lambda _address: self._master_channel, logger=log)

    def close(self) -> None:
        self._features.close()
        self._payload.close()
        self._master_channel.close()
        self._repo_channel.close()

    def _retry(self, fn: Callable[[], T], peer: str, deadline: float | None = None) -> T:
        try:
            return call_with_retry(fn, deadline=self._deadline if deadline is None else deadline)
        except grpc.RpcError as exc:
            raise translate(exc, peer, self._settings) from None

    def store_many(self, records: Sequence[tuple[int, bytes]]) -> list[bool]:
        """Store (tuple_id, record_zstd) records as one request on the engine's kept
        StoreFeatures stream; per record, whether it was a duplicate.

        The repository checks every record before storing any: a refused
        record (INVALID_ARGUMENT, DATA_LOSS) means none of the batch is stored.
        """
        request = repository_pb2.PutFeaturesRequest(
            records=[
                repository_pb2.FeaturesUpload(tuple_id=tuple_id, record_zstd=blob, crc32=crc32(blob))
                for tuple_id, blob in records
            ]
        )
        reply = self._retry(lambda: self._features.call(request), "repository")
        if len(reply.duplicate) != len(records):
            raise errors.HioError(
                f"repository: PutFeatures answered {len(reply.duplicate)} results for {len(records)} records"
            )
        return list(reply.duplicate)

    def enqueue(self, meta: TupleMeta, data: bytes, deadline: float | None = None) -> TupleReceipt:
        """Stream one tuple into the master's backlog; its receipt (ENQUEUED when durable). A lane
        that breaks moves the master to gRPC (:mod:`hio.transport.payload`), where the retry goes."""
        address, lane = self._master_peer()

        def send() -> list[TupleReceipt]:
            call, _reading = self._payload.upload(address, lane, "Enqueue", iter([(meta, data)]), timeout=CALL_TIMEOUT)
            return list(call)

        receipts = self._retry(send, "master", deadline)
        if len(receipts) != 1:
            raise errors.HioError(f"master: Enqueue answered {len(receipts)} receipts for one tuple")
        receipt = receipts[0]
        if receipt.state != TupleReceipt.ENQUEUED:
            state = TupleReceipt.State.Name(receipt.state)
            raise errors.Unavailable(f"master: Enqueue of tuple {meta.tuple_id} answered {state}: {receipt.message}")
        return receipt

    def report(
        self, request: master_pb2.ReportTuplesRequest, timeout: float = CALL_TIMEOUT
    ) -> master_pb2.ReportTuplesResponse:
        """One ReportTuples call, not retried (the reporter batches outcomes and decides on retries). Its
        answer names the master's payload lane, which pulls use from then on."""
        reply = self._retry(lambda: self._master.ReportTuples(request, timeout=timeout), "master", deadline=0)
        self._master_lane_port = reply.lane_port
        return reply

    def pull(self, channel_id: str, wait_seconds: float, *, max_tuples: int = 1, max_bytes: int = 0) -> PullCall:
        """Open a PullTuple long-poll for ``channel_id`` (up to ``max_tuples`` tuples) on the
        master's payload channel. A lane that cannot be opened moves the master to gRPC (see
        :mod:`hio.transport.payload`), and the pull goes there."""
        request = master_pb2.PullTupleRequest(
            channel_id=channel_id, wait_seconds=wait_seconds, max_tuples=max_tuples, max_bytes=max_bytes
        )
        address, lane = self._master_peer()
        call, max_chunk_bytes = self._payload.download(address, lane, request, timeout=wait_seconds + 10.0)
        return PullCall(call, max_chunk_bytes=max_chunk_bytes, settings=self._settings)

    def _master_peer(self) -> tuple[str, str]:
        """The master's gRPC address and its payload lane ('' until a report's answer names it)."""
        address = self._settings.master_address
        return address, lane_beside(address, self._master_lane_port) if self._master_lane_port else ""
