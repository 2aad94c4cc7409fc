"""The repository's metrics (docs/monitoring.md): what its store holds and how long its
fsyncs take. Label ``consumer``: the named consumers (KD's ``consumer`` setting), at
most ``max_consumers`` of them: names an operator chose, and bounded."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from hio.metrics import FSYNC_BUCKETS, Scraped, counters, gauge, gauges, histogram, role_registry
from hio.repository.store import FeatureStore


def repository_registry(store: FeatureStore) -> CollectorRegistry:
    """The repository's registry; its fsync histogram is observed by the store's disk."""
    fsync = histogram(
        "hio_repository_fsync_seconds", "Seconds each fsync of the repository's files took", FSYNC_BUCKETS
    )
    store.disk.observe = fsync.observe
    return role_registry(Scraped(lambda: families(store)), fsync)


def families(store: FeatureStore) -> Iterator[Metric]:
    """The metric families of one look at the store (its lock held while it copies counts)."""
    stats = store.stats()
    readable = stats["readable"]
    yield gauge("hio_repository_records", "Feature records stored and readable (the latest offset)", readable)
    yield gauge("hio_repository_stored_bytes", "Bytes of the feature segments on disk", stats["bytes"])
    yield gauge("hio_repository_segments", "Feature segment files", stats["segments"])
    yield gauge(
        "hio_repository_sync_failed",
        "1 after an fsync of the repository's files failed: every later put is refused until it is restarted; else 0",
        int(bool(store.disk.failure)),
    )
    yield counters(
        "hio_repository_records_put",
        "Records put since start: new (written), or duplicate (its tuple id was stored already; nothing written)",
        ["result"],
        {("new",): stats["appended"], ("duplicate",): stats["duplicates"]},
    )
    yield gauges(
        "hio_repository_consumer_lag_records",
        "Records stored past a named consumer's committed offset",
        ["consumer"],
        {(name,): max(0, readable - offset) for name, offset in store.consumers().items()},
    )
