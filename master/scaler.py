"""The elastic control loop (``scaling = "elastic"``): how many engines of each image run.

Every ``predict_interval`` the scaler looks at each image's backlog and idle
engines under the master's lock, and the :class:`DemandPredictor` changes the
image's wanted engine count (an operator's pinned count overrides it). Every
decision is logged on one line with its reason and kept, the latest
:data:`MAX_DECISIONS`, for ``hio scale``.

Its state is the master's: it is read and changed under the master's lock, so
a heartbeat answer and a status snapshot see one consistent plan.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hio.master.demand import DemandPredictor, ImageLoad, PredictorPolicy

if TYPE_CHECKING:
    from hio.master.config import MasterConfig
    from hio.master.core import Master

log = logging.getLogger("hio.master.scaler")

MAX_DECISIONS = 200


@dataclasses.dataclass(frozen=True)
class Decision:
    """One thing the scaler decided, and why."""

    unix: float
    subject: str  # an image, or a worker
    action: str  # "+2 engines", "-1 engines", "create worker", "delete worker", ...
    reason: str


def predictor_policy(config: MasterConfig) -> PredictorPolicy:
    return PredictorPolicy(
        upper_rate=config.upper_rate,
        lower_rate=config.lower_rate,
        slowdown_rate=config.slowdown_rate,
        queue_limit=config.queue_limit,
        large_step=config.large_step,
        small_step=config.small_step,
        cooldown_seconds=config.cooldown_seconds,
        idle_seconds=config.engine_idle_seconds,
    )


class Scaler:
    """Wanted engines per image, decided from the load (see the module's words)."""

    def __init__(self, master: Master, clock: Callable[[], float] = time.monotonic) -> None:
        self._master = master
        self.config = master.config
        self.predictor = DemandPredictor(predictor_policy(self.config), clock)
        self.wanted: dict[str, int] = {}  # the predictor's counts
        self.pinned: dict[str, int] = {}  # an operator's counts, which win
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=MAX_DECISIONS)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hio-master-scaler", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.config.predict_interval):
            try:
                self.tick()
            except Exception:  # the loop must survive anything; the next look tries again
                log.exception("scaling pass failed")

    # ---- one look

    def tick(self) -> None:
        """Look at the load once and change what it calls for."""
        with self._master.lock:
            loads = self._master.image_loads(self.predictor.policy.idle_seconds)
            self._predict(loads)

    def _predict(self, loads: dict[str, ImageLoad]) -> None:
        """Lock held."""
        for image, load in sorted(loads.items()):
            if image in self.pinned:
                continue
            wanted = self.wanted.get(image, 0)
            change = self.predictor.step(image, load, wanted)
            if change is None:
                continue
            self.wanted[image] = max(0, wanted + change.delta)
            self.decide(image, f"{change.delta:+d} engines (to {self.wanted[image]})", change.reason)

    # ---- what it wants

    def wanted_count(self, image: str) -> int:
        """Engines of ``image`` wanted now: pinned, else the predictor's. Lock held."""
        return self.pinned.get(image, self.wanted.get(image, 0))

    def images(self) -> set[str]:
        """Every image the scaler wants engines of, or has pinned. Lock held."""
        return {image for image, count in self.wanted.items() if count} | set(self.pinned)

    def decide(self, subject: str, action: str, reason: str) -> None:
        """Record and log one decision."""
        self.decisions.append(Decision(unix=time.time(), subject=subject, action=action, reason=reason))
        log.info("scaling", extra={"subject": subject, "action": action, "reason": reason})
