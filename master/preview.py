"""The knowledge preview the master's status page shows: what KD last wrote to the repository,
fetched on a thread of its own and cached (docs/monitoring.md, "The master's status page"). A
look never waits for the repository, and the repository is asked only while someone looks, at
most once per :data:`REFRESH_SECONDS`, with the master's own token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from hio.proto import features_pb2, repository_pb2, repository_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.net import create_channel, rpc_status

log = logging.getLogger("hio.master")

FETCH_TIMEOUT = 2.0  # seconds one call to the repository may take
REFRESH_SECONDS = 10.0  # a cached preview older than this is fetched again when looked at
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@dataclasses.dataclass(frozen=True)
class Preview:
    """The preview as last fetched. ``state``: ``waiting`` (not answered yet), ``none`` (no
    knowledge yet), ``ok``, ``unreachable`` (the repository did not answer or refused: the
    last preview fetched, if any, is kept). ``version`` changes with the image."""

    state: str
    message: str
    checked_unix: float = 0.0  # the last answer, or the last failure
    since_unix: float = 0.0  # unreachable: since when
    summary: dict[str, Any] | None = None
    png: bytes | None = None
    version: str = ""
    digest: bytes = b""  # of the knowledge the summary and image are of


def summarize(knowledge: features_pb2.Knowledge) -> dict[str, Any]:
    """What the page shows of the knowledge: when, how many tuples, each group's clustering."""
    groups: list[features_pb2.Knowledge | features_pb2.KnowledgeGroup] = [*knowledge.groups] or [knowledge]
    return {
        "computed_unix": knowledge.computed_unix,
        "tuples": sum(g.tuple_count for g in groups),
        "up_to_offset": knowledge.up_to_offset,
        "new_records": knowledge.new_records,
        "interval_seconds": knowledge.interval_seconds,
        "groups": [
            {
                "image": getattr(g, "image", ""),  # the main clustering (no groups) has no image
                "features": list(g.feature_names),
                "tuples": g.tuple_count,
                "clusters": len(g.clusters),
                "algorithm": g.algorithm,
            }
            for g in groups
        ],
    }


class KnowledgePreview:
    """The cached :class:`Preview` of the repository at ``address`` (see the module's doc)."""

    def __init__(self, settings: ClusterSettings, address: str) -> None:
        self.address = address
        self._settings = settings
        self._lock = threading.Lock()
        self._preview = Preview("waiting", f"asking the repository at {address}")
        self._fetched = -REFRESH_SECONDS  # time.monotonic() at the last fetch's end
        self._fetching: threading.Thread | None = None
        self._closed = False
        self._channel: grpc.Channel | None = None

    def current(self) -> Preview:
        """The cached preview; starts a fetch (on its own thread) when it is stale."""
        with self._lock:
            due = time.monotonic() - self._fetched >= REFRESH_SECONDS
            if due and self._fetching is None and not self._closed:
                self._fetching = threading.Thread(target=self._fetch, name="hio-master-preview", daemon=True)
                self._fetching.start()
            return self._preview

    def cached(self) -> Preview:
        """The cached preview, fetching nothing."""
        with self._lock:
            return self._preview

    def close(self) -> None:
        """Stop fetching: a fetch under way ends within :data:`FETCH_TIMEOUT`."""
        with self._lock:
            self._closed = True
            fetching, channel = self._fetching, self._channel
        if fetching is not None:
            fetching.join(2 * FETCH_TIMEOUT + 1)
        if channel is not None:
            channel.close()

    def _fetch(self) -> None:
        previous = self.cached()
        try:
            fetched = self._ask(previous)
        except grpc.RpcError as exc:
            fetched = self._failed(previous, exc)
        except Exception as exc:  # a fetch ends by saying what went wrong, whatever it was (logged)
            log.exception("knowledge preview fetch failed")
            fetched = dataclasses.replace(previous, state="unreachable", message=f"fetching the preview failed: {exc}")
        with self._lock:
            self._preview = fetched
            self._fetched = time.monotonic()
            self._fetching = None

    def _stub(self) -> repository_pb2_grpc.RepositoryStub:
        with self._lock:
            if self._channel is None:
                self._channel = create_channel(self.address, self._settings)
            return repository_pb2_grpc.RepositoryStub(self._channel)

    def _ask(self, previous: Preview) -> Preview:
        stub = self._stub()
        reply = stub.GetKnowledge(repository_pb2.GetKnowledgeRequest(), timeout=FETCH_TIMEOUT)
        now = time.time()
        if not reply.knowledge:
            return Preview("none", "no knowledge yet: KD has not written any to the repository", now)
        try:
            knowledge = features_pb2.Knowledge.FromString(reply.knowledge)
        except DecodeError:
            return Preview("none", "the repository's knowledge cannot be read", now)
        digest = hashlib.sha256(reply.knowledge).digest()
        png = previous.png if digest == previous.digest else None
        if png is None and reply.has_preview:
            png = stub.GetPreview(repository_pb2.GetPreviewRequest(), timeout=FETCH_TIMEOUT).png or None
        message = "" if png is not None else "KD wrote knowledge without a preview image"
        return Preview("ok", message, now, 0.0, summarize(knowledge), png, digest.hex()[:16], digest)

    def _failed(self, previous: Preview, exc: grpc.RpcError) -> Preview:
        code, details = rpc_status(exc)
        name = code.name if code is not None else "error"
        now = time.time()
        why = f"refuses the master's token ({name}: {details})" if code in _REFUSED else f"does not answer ({name})"
        since = previous.since_unix if previous.state == "unreachable" else now
        message = f"the repository at {self.address} {why}"
        return dataclasses.replace(previous, state="unreachable", message=message, checked_unix=now, since_unix=since)
