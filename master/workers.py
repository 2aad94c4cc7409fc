"""How many workers the elastic cluster has: asked for, adopted and given back through a
:class:`~hio.master.provisioners.Provisioner` (docs/elasticity.md, "The loop" step 5 and
"Restarts"). A worker asked for is recorded before the provisioner is asked, so a worker is
adopted or given back, never leaked; after a creation that failed no worker is asked for
during a back-off (:data:`RETRY_SECONDS`, doubled with each failure in a row up to
:data:`MAX_RETRY_SECONDS`), so a full quota is not asked again every poll.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hio.master.config import MasterConfig
from hio.master.packer import Plan, headroom
from hio.master.provisioners import ProvisionedWorker, Provisioner, ProvisionError, WorkerRequest, WorkerState
from hio.master.registry import ChannelRegistry

log = logging.getLogger("hio.master.scaler")

GONE_SECONDS = 600.0  # a worker given back may not register again for this long (it is being stopped)
POLL_SECONDS = 2.0  # how often the provisioner is asked about workers that have not registered
RETRY_SECONDS = 5.0  # no worker is asked for this long after a creation that failed, doubled each time in a row
MAX_RETRY_SECONDS = 300.0


@dataclasses.dataclass
class Provisioned:
    """A worker the pool asked for."""

    worker_id: str
    rank: int
    created_unix: float = dataclasses.field(default_factory=time.time)
    registered: bool = False
    empty_since: float | None = None  # monotonic: since when it runs no engine (not saved)
    lost_since: float | None = None  # monotonic: since when it is not a live worker (not saved)


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # "create" or "delete"
    worker_id: str


class WorkerPool:
    """The workers the provisioner gives the cluster (see the module's words). Its state is
    read and changed under the master's lock; the provisioner is called outside it."""

    def __init__(
        self,
        config: MasterConfig,
        registry: ChannelRegistry,
        driver: Provisioner | None,
        decide: Callable[[str, str, str], None],
        lock: threading.Condition,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = registry
        self.driver = driver
        self._decide = decide
        self._lock = lock
        self._clock = clock
        self.provisioned: dict[str, Provisioned] = {}
        self.next_worker = 1
        self.min_workers: int | None = None  # an operator's bounds, which win over the settings
        self.max_workers: int | None = None
        self.wanted = 0
        self.present = 0
        self._gone: dict[str, float] = {}
        self._polled = -float("inf")
        self._retry_seconds = 0.0  # the back-off after the latest creation that failed; 0 = none
        self._create_after = -float("inf")  # monotonic: no creation before this

    def bounds(self) -> tuple[int, int]:
        low = self.config.min_workers if self.min_workers is None else self.min_workers
        high = self.config.max_workers if self.max_workers is None else self.max_workers
        return low, high

    def room(self) -> bool:
        """More workers may still come (a provisioner, and fewer than the most allowed)."""
        return self.driver is not None and self.present < self.bounds()[1]

    def new_worker_cpus(self) -> int:
        """vCPUs of a worker still to be asked for: the driver's, else ``worker_cpus``."""
        return self.driver.worker_cpus() if self.driver is not None else self.config.new_worker_cpus()

    def size(self, plan: Plan, planned: dict[str, dict[str, int]]) -> list[Action]:
        """The target from ``plan``; the workers to ask for or give back to reach it. Lock held."""
        used = len(plan.used()) + plan.new_bins
        extra = headroom(used)
        low, high = self.bounds()
        self.wanted = max(low, min(high, used + extra))
        live = [w for w in self.registry.workers() if w.live]
        live_ids = {w.worker_id for w in live}
        now = self._clock()
        # A worker asked for and not (or no longer) serving counts until the provisioner says
        # it failed or it takes too long (poll): a replacement comes only then.
        for record in self.provisioned.values():
            if record.worker_id in live_ids:
                record.lost_since = None
            elif record.lost_since is None:
                record.lost_since = now
        self.present = len(live) + sum(1 for p in self.provisioned.values() if p.worker_id not in live_ids)
        for worker in live:
            mine = self.provisioned.get(worker.worker_id)
            if mine is None:
                continue
            if worker.channels or any(planned.get(worker.worker_id, {}).values()):
                mine.empty_since = None
            elif mine.empty_since is None:
                mine.empty_since = now
        if self.driver is None:
            return []
        why = f"{used} in use + {extra} headroom, within {low}..{high}; {self.present} present"
        if self.present < self.wanted:
            if now < self._create_after:
                return []  # the last creation failed: wait out the back-off
            return [self._create(why) for _ in range(self.wanted - self.present)]
        if self.present > self.wanted:
            return self._give_back(live, self.present - self.wanted, why, now)
        return []

    def _create(self, why: str) -> Action:
        worker_id = f"{self.config.worker_prefix}-{self.next_worker}"
        self.next_worker += 1
        rank = self.registry.rank(worker_id)  # after every worker known so far
        self.provisioned[worker_id] = Provisioned(worker_id=worker_id, rank=rank, lost_since=self._clock())
        self._decide(worker_id, "create worker", why)
        return Action("create", worker_id)

    def _give_back(self, live: list[Any], surplus: int, why: str, now: float) -> list[Action]:
        grace = self.config.worker_grace_seconds
        idle = sorted(
            (
                w
                for w in live
                if (record := self.provisioned.get(w.worker_id)) is not None
                and record.empty_since is not None
                and now - record.empty_since >= grace
            ),
            key=lambda w: -w.rank,
        )
        return [self._forget(w.worker_id, f"no engines for {grace:g} s; {why}") for w in idle[:surplus]]

    def _forget(self, worker_id: str, why: str, action: str = "delete worker") -> Action:
        """Drop a worker from the pool and the registry (lock held); its deletion is the
        returned action."""
        self.provisioned.pop(worker_id, None)
        self.registry.forget_worker(worker_id)
        self.registry.drop_rank(worker_id)
        self._gone[worker_id] = self._clock()
        self._decide(worker_id, action, why)
        return Action("delete", worker_id)

    def act(self, actions: list[Action], master_address: str, token: str) -> None:
        """Carry out the actions; a creation that fails is given back at the next poll, and
        no worker is asked for during the back-off it starts. Called without the lock: the
        provisioner's calls take their time."""
        if self.driver is None:
            return
        for action in actions:
            try:
                if action.kind == "create":
                    self.driver.create(WorkerRequest(action.worker_id, master_address, token))
                else:
                    self.driver.delete(action.worker_id)
            except Exception as exc:  # noqa: BLE001 - the loop outlives a driver's failure; the next poll sees the state
                failed(exc, action.kind, action.worker_id)
                if action.kind == "create":
                    with self._lock:
                        self._retry_seconds = min(MAX_RETRY_SECONDS, max(RETRY_SECONDS, 2 * self._retry_seconds))
                        self._create_after = self._clock() + self._retry_seconds
                        self._decide(
                            action.worker_id,
                            "creation failed",
                            f"{exc}; no worker is asked for in the next {self._retry_seconds:g} s",
                        )
            else:
                if action.kind == "create":
                    with self._lock:
                        self._retry_seconds = 0.0

    def poll(self) -> list[Action]:
        """Every few seconds, ask the provisioner about the workers that have not registered
        (or stopped heartbeating); give back those that failed, vanished or took too long.
        Called without the lock."""
        if self.driver is None or self._clock() - self._polled < POLL_SECONDS:
            return []
        self._polled = self._clock()
        with self._lock:
            waiting = [p.worker_id for p in self.provisioned.values() if p.lost_since is not None]
        states = {}
        for worker_id in waiting:
            try:
                states[worker_id] = self.driver.state(worker_id)
            except Exception as exc:  # noqa: BLE001 - as above: asked again at the next poll
                failed(exc, "state", worker_id)
        actions = []
        timeout = self.config.provision_timeout
        with self._lock:
            for worker_id, found in states.items():
                record = self.provisioned.get(worker_id)
                if record is None or record.lost_since is None:
                    continue
                if found.state in (WorkerState.FAILED, WorkerState.GONE):
                    actions.append(self._forget(worker_id, f"{found.state.value}: {found.detail}", "drop worker"))
                elif self._clock() - record.lost_since > timeout:
                    what = "expired" if record.registered else "not registered"
                    why = f"{what} for more than {timeout:g} s ({found.state.value}: {found.detail})"
                    actions.append(self._forget(worker_id, why, "drop worker"))
        return actions

    def adopt(self) -> None:
        """After a (re)start: keep the recorded workers the provisioner still has, adopt the
        ones it has that the record lacks, forget the records it has no worker for. Called
        without the lock."""
        if self.driver is None:
            return
        try:
            found: list[ProvisionedWorker] = self.driver.adopt()
        except Exception as exc:  # noqa: BLE001 - the cluster is unreachable: the records stay, polls decide
            failed(exc, "adopt", "")
            return
        with self._lock:
            there = {w.worker_id for w in found if w.state in (WorkerState.BUILDING, WorkerState.RUNNING)}
            for worker_id in sorted(set(self.provisioned) - there):
                self.provisioned.pop(worker_id)
                self.registry.drop_rank(worker_id)
                self._decide(worker_id, "forget worker", "the provisioner has no such worker any more")
            for worker_id in sorted(there - set(self.provisioned)):
                self.provisioned[worker_id] = Provisioned(
                    worker_id=worker_id, rank=self.registry.rank(worker_id), lost_since=self._clock()
                )
                self._decide(worker_id, "adopt worker", "the provisioner runs it, the saved state did not have it")
            for worker_id in sorted(there & set(self.provisioned)):
                log.info("worker adopted", extra={"worker": worker_id})

    def close(self) -> None:
        """Let the driver go (the master stops); its workers stay, for the next master."""
        if self.driver is None:
            return
        try:
            self.driver.close()
        except Exception as exc:  # noqa: BLE001 - stopping goes on whatever the driver says
            failed(exc, "close", "")

    def admits(self, worker_id: str) -> bool:
        """False for a worker given back a moment ago: it is being stopped, not joining. Lock held."""
        gone = self._gone.get(worker_id)
        if gone is not None and self._clock() - gone > GONE_SECONDS:
            del self._gone[worker_id]
            return True
        return gone is None

    def registered(self, worker_id: str) -> None:
        """A worker registered: one asked for is no longer waited for. Lock held."""
        record = self.provisioned.get(worker_id)
        if record is not None and not record.registered:
            record.registered = True
            log.info("provisioned worker registered", extra={"worker": worker_id})

    def to_state(self) -> dict[str, Any]:
        return {
            "provisioned": {
                w: {"rank": p.rank, "created_unix": p.created_unix, "registered": p.registered}
                for w, p in sorted(self.provisioned.items())
            },
            "next_worker": self.next_worker,
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
        }

    def from_state(self, state: dict[str, Any]) -> None:
        for worker_id, record in state.get("provisioned", {}).items():
            self.provisioned[worker_id] = Provisioned(
                worker_id=worker_id,
                rank=int(record["rank"]),
                created_unix=float(record["created_unix"]),
                registered=bool(record.get("registered", False)),
                lost_since=self._clock(),  # until it registers with this master
            )
            self.registry.assign_rank(worker_id, int(record["rank"]))
        self.next_worker = int(state.get("next_worker", 1))
        self.min_workers = state.get("min_workers")
        self.max_workers = state.get("max_workers")


def failed(exc: Exception, call: str, worker_id: str) -> None:
    """Log a driver call that raised: a :class:`ProvisionError` as the cloud's words (and the
    setting at fault, if one is), anything else with its traceback (a defect of the driver)."""
    extra = {"call": call, "worker": worker_id, "error": str(exc)}
    if isinstance(exc, ProvisionError):
        log.warning("provisioner call failed", extra={**extra, "setting": exc.setting} if exc.setting else extra)
    else:
        log.error(
            "provisioner call failed unexpectedly",
            extra={**extra, "error": f"{type(exc).__name__}: {exc}"},
            exc_info=exc,
        )
