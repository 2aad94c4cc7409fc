"""KD's metrics (docs/monitoring.md): how long each interval took and how many records
it took in (observed as it ends), what KD has stored, its query's failures, and its lag:
the records the repository holds past KD's committed offset, asked of the repository at
each scrape (one call, :data:`LAG_TIMEOUT`; no figure when it does not answer)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
from prometheus_client.core import Metric

from hio.kd.client import RepositoryClient
from hio.kd.config import KDConfig
from hio.metrics import INTERVAL_BUCKETS, RECORD_COUNT_BUCKETS, Scraped, counter, gauge, histogram, role_registry

LAG_TIMEOUT = 1.0  # seconds a scrape waits for the repository's offsets


class KDMetrics:
    """KD's registry. ``interval`` and ``records`` are observed by the job; ``stored`` and
    ``failures`` are read from it at each scrape."""

    def __init__(self, config: KDConfig, stored: Callable[[], int], failures: Callable[[], int]) -> None:
        self.interval = histogram(
            "hio_kd_interval_seconds", "Seconds one interval (micro-batch) took: read, store, learn", INTERVAL_BUCKETS
        )
        self.records = histogram(
            "hio_kd_interval_records", "Feature records one interval took in (new to KD)", RECORD_COUNT_BUCKETS
        )
        self._consumer = config.consumer
        self._client = RepositoryClient(config)
        self._stored = stored
        self._failures = failures
        self.registry = role_registry(Scraped(self._families), self.interval, self.records)

    def close(self) -> None:
        self._client.close()

    def _families(self) -> Iterator[Metric]:
        yield gauge("hio_kd_stored_records", "Feature records in KD's accumulated store", self._stored())
        yield counter(
            "hio_kd_query_failures", "Times KD's streaming query failed and was started again", self._failures()
        )
        try:
            offsets = self._client.offsets(self._consumer, LAG_TIMEOUT)
        except grpc.RpcError:
            return
        yield gauge(
            "hio_kd_lag_records",
            "Records the repository holds past KD's committed offset (its consumer's)",
            max(0, offsets.latest - offsets.committed),
        )
