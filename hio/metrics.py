"""Prometheus metrics, one registry per role object (several roles run in one test
process; none uses the library's global registry).

Most figures are read from a role's own counters when ``/metrics`` is scraped, by a
:class:`Scraped` collector around a function that takes one short look (a lock held while
it copies numbers, no network call without a short timeout); the data path pays nothing
for them. Only a distribution needs an observation per event (a ``Histogram``): those are
few, and skipped when ``metrics = false``.

Names follow Prometheus' conventions: ``hio_<role>_<what>_<unit>``, base units
(``_seconds``, ``_bytes``), counters ending in ``_total``. Label values come from
bounded sets only: images, routes, channel states, gRPC codes; never a tuple's id or
name. docs/monitoring.md lists every metric.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Bucket bounds (seconds unless said otherwise), each for the spread its figure has.
PROCESS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
ROUTE_WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
INTERVAL_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
RECORD_COUNT_BUCKETS = (0, 1, 10, 100, 1000, 10_000, 100_000)  # records per KD interval

T = TypeVar("T")
K = TypeVar("K", bound=tuple[str, ...])  # label values, in the order of the label names
S = TypeVar("S", bound=Hashable)  # a source of a Tally


def role_registry(*collectors: Collector) -> CollectorRegistry:
    """A registry of its own for one role object: the process's figures (CPU, memory, open
    files: ``process_*``) and ``collectors``."""
    disable_created_metrics()  # no ``_created`` series beside every counter and histogram
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    for collector in collectors:
        registry.register(collector)
    return registry


class Scraped(Collector):
    """A collector that calls ``read`` at every scrape for the metric families to show."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return list(self._read())


def histogram(name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
    """A histogram observed on the data path, in no registry yet (:func:`role_registry` or
    ``registry.register`` adds it to its role's)."""
    return Histogram(name, documentation, labelnames=labels, buckets=buckets, registry=None)


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def gauges(name: str, documentation: str, labels: Sequence[str], values: Mapping[K, float]) -> GaugeMetricFamily:
    """One gauge per label-value tuple."""
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def counters(name: str, documentation: str, labels: Sequence[str], values: Mapping[K, float]) -> CounterMetricFamily:
    """One counter per label-value tuple; ``name`` without ``_total`` (added in the output)."""
    family = CounterMetricFamily(name, documentation, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


@dataclasses.dataclass(frozen=True)
class BucketCounts:
    """A histogram as counts: cumulative counts per upper bound (the last bound +Inf) and
    the sum of the observations. Adds up: several engines' histograms are one image's."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    total: float = 0.0

    @classmethod
    def empty(cls) -> BucketCounts:
        """No bounds, no counts: what adds to any histogram and changes nothing."""
        return cls((), ())

    def __add__(self, other: BucketCounts) -> BucketCounts:
        """The counts of both (the bounds must be the same; an empty histogram adds to any)."""
        if not self.bounds:
            return other
        if not other.bounds:
            return self
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets do not add up")
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return BucketCounts(self.bounds, counts, self.total + other.total)


def bucket_counts(observed: Histogram) -> BucketCounts:
    """The counts of an unlabelled histogram, as its own collector shows them."""
    bounds: list[float] = []
    counts: list[float] = []
    total = 0.0
    for sample in next(iter(observed.collect())).samples:
        if sample.name.endswith("_bucket"):
            bounds.append(float(sample.labels["le"]))
            counts.append(sample.value)
        elif sample.name.endswith("_sum"):
            total = sample.value
    return BucketCounts(tuple(bounds), tuple(counts), total)


def histograms(
    name: str, documentation: str, labels: Sequence[str], values: Mapping[K, BucketCounts]
) -> HistogramMetricFamily:
    """One histogram per label-value tuple, from counts gathered elsewhere (an engine's)."""
    family = HistogramMetricFamily(name, documentation, labels=labels)
    for key, counts in sorted(values.items()):
        buckets = [(floatToGoString(b), c) for b, c in zip(counts.bounds, counts.counts, strict=True)]
        family.add_metric(list(key), buckets, counts.total)
    return family


class Tally(Generic[S, T]):
    """Per group (an image), the sum of cumulative figures of sources that restart and go
    away (engines: their CPU seconds, their histograms), kept monotonic as a Prometheus
    counter must be: a source's last figure is kept once it is gone. Thread-safe.

    A source is a key that changes when it restarts (a channel and its process's id).
    Each :meth:`update` names the sources alive now (``live``) and the figures read from
    them (some may not have answered: their last figure stands); one no longer alive is
    folded into its group's base and forgotten.
    """

    def __init__(self, zero: Callable[[], T], add: Callable[[T, T], T]) -> None:
        self._zero = zero
        self._add = add
        self._lock = threading.Lock()
        self._last: dict[S, tuple[str, T]] = {}  # source -> (group, its last figure)
        self._base: dict[str, T] = {}  # group -> what its gone sources had

    def update(self, live: Mapping[S, str], figures: Mapping[S, T]) -> None:
        """``live``: source -> group; ``figures``: source -> its figure now."""
        with self._lock:
            for source in [s for s in self._last if s not in live]:
                group, figure = self._last.pop(source)
                self._base[group] = self._add(self._base.get(group, self._zero()), figure)
            for source, figure in figures.items():
                if source in live:
                    self._last[source] = (live[source], figure)

    def totals(self) -> dict[str, T]:
        """group -> the sum of its sources' figures, gone ones included."""
        with self._lock:
            totals = dict(self._base)
            for group, figure in self._last.values():
                totals[group] = self._add(totals.get(group, self._zero()), figure)
            return totals
