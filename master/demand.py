"""How many engines each image wants: the seeds' load predictor, per image.

Every ``predict_interval`` the scaler shows the predictor each image's backlog:
the tuples waiting in its queue, those routed to the queue and not there yet,
and those whose route request waits for a channel. From the backlog ``q`` and
its rate of change ``r`` (tuples per second since the last look) it adds
engines as the seeds' resource manager did, the first rule that holds:

==========================================  =====================
``r > upper_rate`` (5)                       add ``large_step`` (2)
``r > lower_rate`` (2)                       add ``small_step`` (1)
``q > queue_limit`` (10) and ``r > slowdown_rate`` (-2)  add ``large_step``
``q > queue_limit``                          add ``small_step``
``q > 0`` and no engine wanted               add 1
==========================================  =====================

Engines it adds are given back once idle: every engine of the image that has
had no work for ``idle_seconds`` is one too many (routing fills the
lowest-ranked channels first, so the idle ones are the surplus). Once the
backlog is gone, engines wanted for it that never started (no worker had room,
or they are still starting) are given up too, so that a worker freed by the
drain does not start them for no load.

An image changes at most once per ``cooldown_seconds``, in either direction: no
scale-down right after a scale-up (the new engines have not had their chance)
and no scale-up right after a scale-down, which is what flapping would be. The
one exception is an image with tuples waiting and no engine wanted: those
tuples would otherwise wait for the cooldown with nothing to serve them.

Pure logic on an injected clock; the scaler calls it under the master's lock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class PredictorPolicy:
    upper_rate: float = 5.0
    lower_rate: float = 2.0
    slowdown_rate: float = -2.0
    queue_limit: int = 10
    large_step: int = 2
    small_step: int = 1
    cooldown_seconds: float = 10.0
    idle_seconds: float = 30.0


@dataclasses.dataclass(frozen=True)
class ImageLoad:
    """One image as the master sees it now."""

    backlog: int  # tuples waiting for an engine: queued, on their way to the queue, or waiting for a route
    idle: int  # engines of the image that have had no work for the policy's idle_seconds
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

    def __init__(self, policy: PredictorPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._seen: dict[str, _Seen] = {}

    def step(self, image: str, load: ImageLoad, wanted: int) -> Change | None:
        """The change of ``image``'s wanted count (``wanted`` now) this look calls for, if any."""
        now = self._clock()
        seen = self._seen.get(image)
        if seen is None:  # a rate needs two looks: the first only counts, unless nothing serves the image
            seen = self._seen[image] = _Seen(backlog=load.backlog, at=now)
            first = True
            rate = 0.0
        else:
            first = False
            rate = (load.backlog - seen.backlog) / max(now - seen.at, 1e-3)
            seen.backlog, seen.at = load.backlog, now
        cooling = first or now - seen.changed < self.policy.cooldown_seconds
        change = self._decide(image, load, wanted, rate, cooling=cooling)
        if change is not None:
            seen.changed = now
        return change

    def _decide(self, image: str, load: ImageLoad, wanted: int, rate: float, *, cooling: bool) -> Change | None:
        p = self.policy
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
            return Change(image, -surplus, f"{surplus} {engines_word(surplus)} idle for {p.idle_seconds:g} s")
        return None

    def forget(self, image: str) -> None:
        """Start afresh (an operator pinned or unpinned the image)."""
        self._seen.pop(image, None)


def engines_word(count: int) -> str:
    return "engine" if abs(count) == 1 else "engines"
