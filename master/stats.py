"""Counters, throughput over the last minute, and the last hour's throughput and latency for
the status page's charts (:class:`History`: one sample every :data:`SAMPLE_SECONDS`, the latest
:data:`SAMPLES`, taken from the counters). Not thread-safe (master lock)."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

WINDOW_SECONDS = 60
SAMPLE_SECONDS = 10.0
SAMPLES = 360  # one hour


@dataclasses.dataclass(frozen=True)
class Rates:
    tuples_per_second: float
    bytes_per_second: float


class Stats:
    """What the master counts: routes, outcomes, bytes (in all, and by image for its
    metrics), and one-second buckets for rates."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self.routed_direct = 0
        self.routed_queue = 0
        self.bytes_routed_direct = 0  # payload that goes sender -> engine, never through the master
        self.bytes_enqueued = 0  # payload the master received into its queue
        self.tuples_done = 0
        self.tuples_failed = 0
        self.bytes_done = 0
        self.latency_sum = 0.0  # seconds, over the stored tuples that carried their acceptance time
        self.latency_count = 0
        self.routed_by: collections.Counter[tuple[str, str]] = collections.Counter()  # (route, image) -> tuples
        self.done_by: collections.Counter[str] = collections.Counter()  # image -> tuples stored
        self.failed_by: collections.Counter[str] = collections.Counter()  # image -> tuples failed
        self.bytes_by: collections.Counter[str] = collections.Counter()  # image -> bytes of tuples stored
        self._buckets: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # second -> [tuples, bytes]

    def routed(self, *, direct: bool, count: int, size: int, image: str = "") -> None:
        """A route for ``count`` tuples of ``image`` and ``size`` payload bytes in all."""
        if direct:
            self.routed_direct += count
            self.bytes_routed_direct += size
        else:
            self.routed_queue += count
        self.routed_by["direct" if direct else "queue", image] += count

    def outcome(self, *, ok: bool, size: int, latency: float | None = None, image: str = "") -> None:
        """One finished tuple; ``latency`` in seconds when the tuple carried its acceptance time."""
        if not ok:
            self.tuples_failed += 1
            self.failed_by[image] += 1
            return
        self.tuples_done += 1
        self.bytes_done += size
        self.done_by[image] += 1
        self.bytes_by[image] += size
        bucket = self._bucket()
        bucket[0] += 1
        bucket[1] += size
        if latency is not None and latency >= 0:
            self.latency_sum += latency
            self.latency_count += 1

    def rates(self) -> Rates:
        now = self._clock()
        self._trim(now)
        span = min(float(WINDOW_SECONDS), max(1.0, now - self.started))
        return Rates(
            tuples_per_second=sum(b[0] for b in self._buckets.values()) / span,
            bytes_per_second=sum(b[1] for b in self._buckets.values()) / span,
        )

    def uptime(self) -> float:
        return self._clock() - self.started

    def _bucket(self) -> list[int]:
        now = self._clock()
        second = int(now)
        bucket = self._buckets.get(second)
        if bucket is None:
            bucket = self._buckets[second] = [0, 0]
            self._trim(now)
        return bucket

    def _trim(self, now: float) -> None:
        oldest = int(now) - WINDOW_SECONDS
        while self._buckets and next(iter(self._buckets)) <= oldest:
            self._buckets.popitem(last=False)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One interval's figures."""

    unix: float  # when the interval ended
    tuples_per_second: float  # tuples stored
    latency_seconds: float | None  # mean acceptance-to-stored of those tuples; None: no tuple told it


class History:
    """A ring of :class:`Sample`; :meth:`observe` is called often and samples when due."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall = wall
        self._samples: collections.deque[Sample] = collections.deque(maxlen=SAMPLES)
        self._last: tuple[float, int, float, int] | None = None  # (clock, done, latency sum, latency count)

    def observe(self, stats: Stats) -> None:
        """Take a sample if :data:`SAMPLE_SECONDS` passed since the last one (the first call
        only marks the start)."""
        now = self._clock()
        totals = (now, stats.tuples_done, stats.latency_sum, stats.latency_count)
        if self._last is None:
            self._last = totals
            return
        elapsed = now - self._last[0]
        if elapsed < SAMPLE_SECONDS:
            return
        done = totals[1] - self._last[1]
        timed = totals[3] - self._last[3]
        latency = (totals[2] - self._last[2]) / timed if timed else None
        self._samples.append(Sample(self._wall(), done / elapsed, latency))
        self._last = totals

    def samples(self) -> list[Sample]:
        """Oldest first."""
        return list(self._samples)
