"""The repository as KD uses it: offsets, reading a range, committing,
writing knowledge. Every call retries an unavailable repository (a restart)
for up to ``deadline`` seconds, so a repository restart delays an interval
instead of failing it.

Spark's Python workers build their own client from plain string options
(``connection_options`` / ``from_options``): a gRPC channel cannot travel to
an executor, but its address, token and TLS paths can.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import Any, Self

import grpc

from hio.proto import repository_pb2, repository_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.errors import retry_after
from hio.transport.net import create_channel
from hio.transport.retry import RETRYABLE, Backoff, call_with_retry

_OPTION_FIELDS = ("repository_address", "token", "token_file", "tls_ca", "tls_cert", "tls_key", "chunk_bytes")


def connection_options(settings: ClusterSettings, deadline: float) -> dict[str, str]:
    """What a Python worker needs to reach the repository, as string options."""
    options = {name: str(getattr(settings, name)) for name in _OPTION_FIELDS}
    options["token"] = settings.presented_token()
    options["token_file"] = ""
    options["rpc_deadline"] = str(deadline)
    return options


class RepositoryClient:
    """A thin, retrying client of ``hio.proto.Repository``. Close it (or use ``with``)."""

    def __init__(self, settings: ClusterSettings, deadline: float = 30.0) -> None:
        self._channel = create_channel(settings.repository_address, settings)
        self._stub = repository_pb2_grpc.RepositoryStub(self._channel)
        self.deadline = deadline

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> RepositoryClient:
        fields: dict[str, Any] = {name: options.get(name, "") for name in _OPTION_FIELDS}
        fields["chunk_bytes"] = int(fields["chunk_bytes"] or ClusterSettings.chunk_bytes)
        settings = dataclasses.replace(ClusterSettings(), **fields)
        return cls(settings, float(options.get("rpc_deadline") or 30.0))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def offsets(self, consumer: str = "", timeout: float | None = None) -> repository_pb2.GetOffsetsResponse:
        """GetOffsets, retried; with ``timeout``, one call within it, not retried (a metrics scrape's)."""
        request = repository_pb2.GetOffsetsRequest(consumer=consumer)
        if timeout is not None:
            return self._stub.GetOffsets(request, timeout=timeout)
        return call_with_retry(lambda: self._stub.GetOffsets(request, timeout=10.0), deadline=self.deadline)

    def read(self, after: int, until: int) -> Iterator[repository_pb2.StoredRecord]:
        """Records with after < offset <= until, in order. A stream broken by an
        unavailable repository resumes after the last record received, until
        ``deadline`` seconds pass without progress."""
        position = after
        backoff = Backoff(cap=2.0)
        stalled_since = time.monotonic()
        while position < until:
            request = repository_pb2.ReadFeaturesRequest(after=position, until=until)
            try:
                for batch in self._stub.ReadFeatures(request, timeout=300.0):
                    for record in batch.records:
                        position = record.offset
                        stalled_since = time.monotonic()
                        yield record
                return
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in RETRYABLE or time.monotonic() - stalled_since > self.deadline:
                    raise
                backoff.sleep(retry_after(exc))

    def commit(self, consumer: str, offset: int) -> None:
        request = repository_pb2.CommitOffsetRequest(consumer=consumer, offset=offset)
        call_with_retry(lambda: self._stub.CommitOffset(request, timeout=10.0), deadline=self.deadline)

    def put_knowledge(self, knowledge: bytes, preview_png: bytes) -> None:
        request = repository_pb2.PutKnowledgeRequest(knowledge=knowledge, preview_png=preview_png)
        call_with_retry(lambda: self._stub.PutKnowledge(request, timeout=30.0), deadline=self.deadline)
