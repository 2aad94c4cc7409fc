"""The engine's calls to the master and the repository, in one gRPC adapter.

Everything above this module (``Engine``, ``Reporter``) sees plain methods
that raise ``hio.common.errors`` classes, never ``grpc.RpcError``: the data
path is testable and readable without the transport. Calls that may succeed
later (``UNAVAILABLE``, ``RESOURCE_EXHAUSTED``) are retried here with
jittered backoff up to ``rpc_deadline`` seconds.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Sequence, TypeVar

import grpc

from hio.common import errors
from hio.common.frames import ChunkFrame, TupleFrame, TupleMeta, TupleReceipt, crc32, frames_for_bytes
from hio.common.lane import LaneCalls, LaneDownload, LaneSkips, LearntLane
from hio.common.lanetls import client_context
from hio.common.net import create_channel, message_limit, pull_frames, rpc_error_text, rpc_status, send_frames
from hio.common.retry import call_with_retry
from hio.common.settings import ClusterSettings
from hio.proto import master_pb2, master_pb2_grpc, repository_pb2, repository_pb2_grpc

log = logging.getLogger("hio.worker")

T = TypeVar("T")

_BY_CODE: dict[grpc.StatusCode, type[errors.HioError]] = {
    cls.code: cls for cls in (
        errors.InvalidArgument, errors.NotFound, errors.AlreadyExists, errors.FailedPrecondition,
        errors.ResourceExhausted, errors.DataLoss, errors.Unavailable, errors.Unauthenticated,
        errors.PermissionDenied, errors.Aborted, errors.DeadlineExceeded)
}

CALL_TIMEOUT = 30.0  # seconds one attempt of a unary call may take


def translate(exc: grpc.RpcError, peer: str, settings: ClusterSettings) -> errors.HioError:
    """The domain error for a failed call to ``peer`` ('master', 'repository'); a call that
    never connected says why in words (a TLS mistake is not a server that is down)."""
    code = rpc_status(exc)[0] or grpc.StatusCode.UNKNOWN
    cls = _BY_CODE.get(code, errors.HioError)
    if code == grpc.StatusCode.CANCELLED:
        cls = errors.Unavailable
    return cls(f"{peer}: {rpc_error_text(exc, settings)}")


class PullCall:
    """An open ``PullTuple`` long-poll (over gRPC, or a :class:`LaneDownload` on the master's
    payload lane): iterate its frames, or cancel it from another thread. ``max_chunk_bytes``:
    the largest frame payload it may bring (the lane sends a tuple as one frame)."""

    def __init__(self, call: "grpc.Call | LaneDownload", max_chunk_bytes: int, settings: ClusterSettings) -> None:
        self._call = call
        self.max_chunk_bytes = max_chunk_bytes
        self._settings = settings  # for the TLS advice when the pull never connected

    def frames(self) -> Iterator[TupleFrame | ChunkFrame]:
        """The frames of the pulled tuples; empty when the master had nothing."""
        try:
            yield from self._call  # type: ignore[misc]
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
        self._repo = repository_pb2_grpc.RepositoryStub(self._repo_channel)
        self._enqueue = send_frames(self._master_channel, "Master", "Enqueue")
        self._pull = pull_frames(self._master_channel)
        self._master_lane_port = 0                     # learnt from report answers
        self._use_lanes = lanes   # off: every call goes over gRPC
        self._token = settings.presented_token()             # read once, as for the gRPC channels
        tls = client_context(settings)                       # the lanes' TLS, as the channels'
        self._lanes = LaneSkips(log, "master's payload lane unusable; pulling and reporting over gRPC", tls=tls)
        self._master_calls = LearntLane(    # ReportTuples on the master's lane, once it says where
            self._lanes, server=settings.master_address, enabled=self._use_lanes, token=self._token)
        self._repository_calls = LearntLane(   # PutFeatures on the repository's lane, likewise
            LaneSkips(log, "repository's lane unusable; storing features over gRPC", tls=tls),
            server=settings.repository_address, enabled=self._use_lanes, token=self._token)

    def close(self) -> None:
        self._master_channel.close()
        self._repo_channel.close()
        self._master_calls.close()
        self._repository_calls.close()

    def _retry(self, fn: Callable[[], T], peer: str, deadline: float | None = None) -> T:
        try:
            return call_with_retry(fn, deadline=self._deadline if deadline is None else deadline)
        except grpc.RpcError as exc:
            raise translate(exc, peer, self._settings) from None

    def store(self, tuple_id: int, record_zstd: bytes) -> bool:
        """PutFeatures for one record; True when the id was already stored (idempotent)."""
        return self.store_many([(tuple_id, record_zstd)])[0]

    def store_many(self, records: Sequence[tuple[int, bytes]]) -> list[bool]:
        """One PutFeatures for (tuple_id, record_zstd) records; per record, whether it was a duplicate.

        The repository checks every record before storing any: a refused
        record (INVALID_ARGUMENT, DATA_LOSS) means none of the batch is stored.
        """
        request = repository_pb2.PutFeaturesRequest(records=[
            repository_pb2.FeaturesUpload(tuple_id=tuple_id, record_zstd=blob, crc32=crc32(blob))
            for tuple_id, blob in records])
        reply = self._retry(lambda: self._put_features(request), "repository")
        if len(reply.duplicate) != len(records):
            raise errors.HioError(f"repository: PutFeatures answered {len(reply.duplicate)} results "
                                  f"for {len(records)} records")
        return list(reply.duplicate)

    def _put_features(self, request: repository_pb2.PutFeaturesRequest) -> repository_pb2.PutFeaturesResponse:
        """One PutFeatures: on the repository's lane when it answers calls there (a kept
        connection: a gRPC call cost about 2 ms of CPU at the two ends, and an engine stores
        once per tuple when tuples come one at a time), else over gRPC. A lane that breaks
        under the call is skipped a while and the call goes over gRPC (stores are idempotent:
        a record the lost answer had stored comes back a duplicate)."""
        reply = self._repository_calls.request("PutFeatures", request, repository_pb2.PutFeaturesResponse,
                                               timeout=CALL_TIMEOUT)
        if reply is None:
            reply = self._repo.PutFeatures(request, timeout=CALL_TIMEOUT)
        self._repository_calls.learn(reply.calls_lane_port)
        return reply

    @property
    def repository_lane(self) -> LaneCalls | None:
        """The repository's lane this engine stores on, once an answer named it (for tests)."""
        return self._repository_calls.calls

    def enqueue(self, meta: TupleMeta, data: bytes, deadline: float | None = None) -> TupleReceipt:
        """Stream one tuple into the master's backlog; its receipt (ENQUEUED when durable)."""
        chunk = self._settings.chunk_bytes

        def send() -> list[TupleReceipt]:
            return list(self._enqueue(frames_for_bytes(meta, data, chunk, encode=True), timeout=CALL_TIMEOUT))

        receipts = self._retry(send, "master", deadline)
        if len(receipts) != 1:
            raise errors.HioError(f"master: Enqueue answered {len(receipts)} receipts for one tuple")
        receipt = receipts[0]
        if receipt.state != TupleReceipt.ENQUEUED:
            state = TupleReceipt.State.Name(receipt.state)
            raise errors.Unavailable(f"master: Enqueue of tuple {meta.tuple_id} answered {state}: {receipt.message}")
        return receipt

    def report(self, request: master_pb2.ReportTuplesRequest, timeout: float = CALL_TIMEOUT) -> master_pb2.ReportTuplesResponse:
        """One ReportTuples call, no retry (the reporter decides): on the master's lane when it
        answers calls there (a kept connection: a gRPC call cost about 2 ms of CPU at the two
        ends, and a channel reports once per tuple when tuples come one at a time), else over
        gRPC. Its answer names the master's payload lane, which pulls use from then on."""
        try:
            reply = self._report_on_lane(request, timeout)
            if reply is None:
                reply = self._master.ReportTuples(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise translate(exc, "master", self._settings) from None
        self._master_lane_port = reply.lane_port
        self._master_calls.learn(reply.calls_lane_port)
        return reply

    def _report_on_lane(self, request: master_pb2.ReportTuplesRequest,
                        timeout: float) -> master_pb2.ReportTuplesResponse | None:
        """The report on the master's lane; None when not usable now (then gRPC). A lane that
        breaks is skipped for a while, and this report goes over gRPC (the reporter sends
        what a lost answer leaves unsaid again, as after a gRPC call cut off)."""
        return self._master_calls.request("ReportTuples", request, master_pb2.ReportTuplesResponse, timeout=timeout)

    def pull(self, channel_id: str, wait_seconds: float, *, max_tuples: int = 1, max_bytes: int = 0) -> PullCall:
        """Open a PullTuple long-poll for ``channel_id`` (up to ``max_tuples`` tuples): on the
        master's payload lane when it offers one and it answers, else over gRPC."""
        request = master_pb2.PullTupleRequest(channel_id=channel_id, wait_seconds=wait_seconds,
                                              max_tuples=max_tuples, max_bytes=max_bytes)
        timeout = wait_seconds + 10.0
        lane = self._master_calls.beside(self._master_lane_port)   # "" when lanes are not used
        sock = self._lanes.open(lane, self._token, method="PullTuple",
                                request=request.SerializeToString()) if lane else None
        if sock is not None:
            return PullCall(LaneDownload(sock, timeout=timeout, max_head_bytes=message_limit(self._settings),
                                         max_data_bytes=self._settings.max_tuple_bytes,
                                         on_broken=lambda why: self._lanes.down(lane, why)),
                            max_chunk_bytes=self._settings.max_tuple_bytes, settings=self._settings)
        return PullCall(self._pull(request, timeout=timeout), max_chunk_bytes=message_limit(self._settings),
                        settings=self._settings)

