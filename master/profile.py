"""What one engine of each image costs: its CPU share, and its processing rate
(docs/elasticity.md, "The loop", step 1).

An image's share is its engines' CPU seconds (used and waited for) over the engine-seconds they
were watched within the window, so one busy and one idle engine count as half a core each; an
image not measured yet has the default share. Not thread-safe: the master calls it under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class ImageProfile:
    """One image, as measured over the window; None where nothing was measured."""

    cpu_share: float | None  # cores per engine
    seconds_per_tuple: float | None
    tuples_per_second: float


class Profile:
    """CPU shares and processing rates per image over a moving window of ``window`` seconds."""

    def __init__(self, window: float, default_share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.default_share = default_share
        self._clock = clock
        self._last: dict[str, tuple[str, float, float]] = {}  # channel -> its previous (image, cpu s, at)
        self._cpu: dict[str, collections.deque[tuple[float, float, float]]] = {}  # image -> (at, cpu s, wall s)
        self._done: dict[str, collections.deque[tuple[float, float]]] = {}  # image -> (at, processing s)
        self._known: dict[str, float] = {}  # image -> last measured share (outlives the window)
        self._started = clock()

    def cpu(self, channel_id: str, image: str, cpu_seconds: float) -> None:
        """A heartbeat's reading of one engine. A reading lower than the last one is a new
        engine process (restarted, or a channel id used again): only the next difference counts."""
        now = self._clock()
        last = self._last.get(channel_id)
        self._last[channel_id] = (image, cpu_seconds, now)
        if last is None or last[0] != image:
            return
        used, wall = cpu_seconds - last[1], now - last[2]
        if used < 0 or wall <= 0:
            return
        samples = self._cpu.setdefault(image, collections.deque())
        samples.append((now, used, wall))
        self._trim(samples, now)

    def forget(self, channel_id: str) -> None:
        """The channel is gone (its engine stopped, its worker left)."""
        self._last.pop(channel_id, None)

    def outcome(self, image: str, processing_seconds: float) -> None:
        """One tuple processed by an engine of ``image``, in that many CPU seconds."""
        now = self._clock()
        done = self._done.setdefault(image, collections.deque())
        done.append((now, processing_seconds))
        self._trim(done, now)

    def share(self, image: str) -> float:
        """The size of one engine of ``image`` for packing: measured, else last measured,
        else the default share."""
        measured = self.image(image).cpu_share
        if measured is not None:
            return measured
        return self._known.get(image, self.default_share)

    def remember(self, shares: dict[str, float]) -> None:
        """Shares measured before (the scaler's saved state): used until measured again."""
        self._known.update(shares)

    def known_shares(self) -> dict[str, float]:
        """Every image's last measured share (what the scaler saves)."""
        for image in list(self._cpu):
            self.image(image)
        return dict(self._known)

    def image(self, image: str) -> ImageProfile:
        now = self._clock()
        share = None
        samples = self._cpu.get(image)
        if samples:
            self._trim(samples, now)
            wall = sum(w for _, _, w in samples)
            if wall > 0:
                share = sum(u for _, u, _ in samples) / wall
                self._known[image] = share
        done = self._done.get(image)
        per_tuple, rate = None, 0.0
        if done:
            self._trim(done, now)
            if done:
                per_tuple = sum(s for _, s in done) / len(done)
                rate = len(done) / max(1.0, min(self.window, now - self._started))
        return ImageProfile(cpu_share=share, seconds_per_tuple=per_tuple, tuples_per_second=rate)

    def images(self) -> set[str]:
        return set(self._cpu) | set(self._done)

    def _trim(self, samples: collections.deque, now: float) -> None:  # type: ignore[type-arg]  # either deque of tuples
        while samples and samples[0][0] < now - self.window:
            samples.popleft()
