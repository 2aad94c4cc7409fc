"""The master's throughput and latency over the last hour, for its status page's charts:
one sample every :data:`SAMPLE_SECONDS`, the latest :data:`SAMPLES` of them, taken from the
counters the master keeps anyway (:class:`~hio.master.stats.Stats`). Not thread-safe
(master lock)."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from hio.master.stats import Stats

SAMPLE_SECONDS = 10.0
SAMPLES = 360  # one hour


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
