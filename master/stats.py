"""Counters and throughput over the last minute. Not thread-safe (master lock)."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

WINDOW_SECONDS = 60


@dataclasses.dataclass(frozen=True)
class Rates:
    tuples_per_second: float
    bytes_per_second: float
    mean_latency_seconds: float  # accepted at a gateway -> features stored, last minute (0 if unknown)


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
        # second -> [tuples, bytes, latency sum, latency count]
        self._buckets: collections.OrderedDict[int, list[float]] = collections.OrderedDict()

    def routed(self, *, direct: bool, count: int, size: int, image: str = "") -> None:
        """A route for ``count`` tuples of ``image`` and ``size`` payload bytes in all."""
        if direct:
            self.routed_direct += count
            self.bytes_routed_direct += size
        else:
            self.routed_queue += count
        self.routed_by["direct" if direct else "queue", image] += count

    def enqueued(self, size: int) -> None:
        """A tuple's payload received into the queue."""
        self.bytes_enqueued += size

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
            bucket[2] += latency
            bucket[3] += 1
            self.latency_sum += latency
            self.latency_count += 1

    def rates(self) -> Rates:
        now = self._clock()
        self._trim(now)
        tuples = sum(b[0] for b in self._buckets.values())
        size = sum(b[1] for b in self._buckets.values())
        lat_sum = sum(b[2] for b in self._buckets.values())
        lat_n = sum(b[3] for b in self._buckets.values())
        span = min(float(WINDOW_SECONDS), max(1.0, now - self.started))
        return Rates(
            tuples_per_second=tuples / span,
            bytes_per_second=size / span,
            mean_latency_seconds=lat_sum / lat_n if lat_n else 0.0,
        )

    def uptime(self) -> float:
        return self._clock() - self.started

    def _bucket(self) -> list[float]:
        now = self._clock()
        second = int(now)
        bucket = self._buckets.get(second)
        if bucket is None:
            bucket = self._buckets[second] = [0.0, 0.0, 0.0, 0.0]
            self._trim(now)
        return bucket

    def _trim(self, now: float) -> None:
        oldest = int(now) - WINDOW_SECONDS
        while self._buckets and next(iter(self._buckets)) <= oldest:
            self._buckets.popitem(last=False)
