"""How many engines each image wants: the seeds' load predictor, per image.

From each image's backlog and its rate of change since the last look, the rules of
docs/elasticity.md ("The loop", step 2) add engines, or give back those wanted for a backlog
that is gone and those idle, at most once per ``cooldown_seconds`` (the one exception: tuples
wait and no engine is wanted). Pure logic on an injected clock; the scaler calls it under the
master's lock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hio.master.config import MasterConfig


@dataclasses.dataclass(frozen=True)
class ImageLoad:
    """One image as the master sees it now."""

    backlog: int  # tuples waiting for an engine: queued, on their way to the queue, or waiting for a route
    idle: int  # engines of the image that have had no work for engine_idle_seconds
    running: int  # engines of the image that are up and take work


@dataclasses.dataclass(frozen=True)
class Change:
    image: str
    delta: int  # engines to add (positive) or give back (negative)
    reason: str


@dataclasses.dataclass
class _Seen:
    backlog: int
    at: float
    changed: float = -float("inf")  # when the image last changed


class DemandPredictor:
    """Decides changes of each image's wanted engine count (see the module's words)."""

    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config  # its thresholds, steps, cooldown_seconds and engine_idle_seconds
        self._clock = clock
        self._seen: dict[str, _Seen] = {}

    def step(self, image: str, load: ImageLoad, wanted: int) -> Change | None:
        """The change of ``image``'s wanted count (``wanted`` now) this look calls for, if any."""
        now = self._clock()
        seen = self._seen.get(image)
        first = seen is None  # a rate needs two looks: the first only counts, unless nothing serves the image
        if seen is None:
            seen = self._seen[image] = _Seen(backlog=load.backlog, at=now)
        rate = (load.backlog - seen.backlog) / max(now - seen.at, 1e-3)  # 0 at the first look
        seen.backlog, seen.at = load.backlog, now
        cooling = first or now - seen.changed < self.config.cooldown_seconds
        change = self._decide(image, load, wanted, rate, cooling=cooling)
        if change is not None:
            seen.changed = now
        return change

    def _decide(self, image: str, load: ImageLoad, wanted: int, rate: float, *, cooling: bool) -> Change | None:
        p = self.config
        if load.backlog > 0 and wanted == 0:
            return Change(image, 1, f"{load.backlog} tuples wait and no engine is wanted")
        if cooling:
            return None
        q = load.backlog
        if rate > p.upper_rate:
            return Change(image, p.large_step, f"backlog grows by {rate:.1f}/s (above {p.upper_rate:g})")
        if rate > p.lower_rate:
            return Change(image, p.small_step, f"backlog grows by {rate:.1f}/s (above {p.lower_rate:g})")
        if q > p.queue_limit and rate > p.slowdown_rate:
            return Change(
                image,
                p.large_step,
                f"backlog {q} above {p.queue_limit} and not shrinking fast ({rate:.1f}/s, limit {p.slowdown_rate:g})",
            )
        if q > p.queue_limit:
            return Change(image, p.small_step, f"backlog {q} above {p.queue_limit}")
        if q > 0 or wanted == 0:
            return None
        unstarted = max(0, wanted - load.running)
        if unstarted:
            why = f"the backlog is gone; {unstarted} {engines_word(unstarted)} wanted for it never started"
            return Change(image, -unstarted, why)
        if load.idle > 0:
            surplus = min(load.idle, wanted)
            return Change(image, -surplus, f"{surplus} {engines_word(surplus)} idle for {p.engine_idle_seconds:g} s")
        return None

    def forget(self, image: str) -> None:
        """Start afresh (an operator pinned or unpinned the image)."""
        self._seen.pop(image, None)


def engines_word(count: int) -> str:
    return "engine" if abs(count) == 1 else "engines"
