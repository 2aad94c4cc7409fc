"""The elastic control loop (``scaling = "elastic"``): how many engines of each image run,
and where (docs/elasticity.md, "The loop" and "Restarts").

Each look the :class:`DemandPredictor` changes the wanted counts (an operator's pinned count
wins), the :class:`Packer` places them onto the live workers (the plan), channels the plan no
longer has are retired, and the :class:`~hio.master.workers.WorkerPool` sizes the cluster. The
scaler's state is the master's: read and changed under the master's lock, so a heartbeat answer
and a status snapshot see one consistent plan; what must survive a restart is saved in
``<data_dir>/master/scaling.json``.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from hio.master.demand import DemandPredictor, ImageLoad, engines_word
from hio.master.packer import Bin, Packer, Plan
from hio.master.provisioners import Provisioner
from hio.master.registry import Channel, ChannelRegistry, ChannelState
from hio.master.workers import Action, WorkerPool
from hio.proto import master_pb2
from hio.storage.files import atomic_write
from hio.transport.errors import InvalidArgument

if TYPE_CHECKING:
    from hio.master.core import Master

log = logging.getLogger("hio.master.scaler")

MAX_DECISIONS = 200
MAX_PINNED = 1024  # engines of one image an operator may pin
MIN_SHARE = 0.02  # the smallest size an engine is packed with: an idle one still costs something
STATE_FILE = "scaling.json"
STATE_VERSION = 1


def image_counts(table: dict[str, int]) -> list[master_pb2.ImageCount]:
    """Engines per image as the wire lists them: by image, none of zero."""
    return [master_pb2.ImageCount(image=image, count=n) for image, n in sorted(table.items()) if n]


def worker_plans(
    registry: ChannelRegistry,
    planned: dict[str, dict[str, int]] | None = None,
    load: dict[str, float] | None = None,
    provisioned: Iterable[str] = (),
) -> list[master_pb2.WorkerPlan]:
    """The registry's workers (and workers asked for that have not registered), rank order,
    with their part of the plan and its expected load."""
    planned, load = planned or {}, load or {}
    plans = []
    for worker in registry.workers():
        up = [c for c in worker.channels.values() if registry.takes_work(c)]
        plans.append(
            master_pb2.WorkerPlan(
                worker_id=worker.worker_id,
                rank=worker.rank,
                state="serving" if worker.live else "expired",
                cpus=worker.cpus,
                load=load.get(worker.worker_id, 0.0),
                planned=image_counts(planned.get(worker.worker_id, {})),
                running=image_counts(collections.Counter(c.image for c in up)),
                retiring=sum(1 for c in worker.channels.values() if c.retiring),
                provisioned=worker.worker_id in provisioned,
                elastic=worker.elastic,
            )
        )
    known = {p.worker_id for p in plans}
    for worker_id in provisioned:
        if worker_id not in known:
            plans.append(
                master_pb2.WorkerPlan(
                    worker_id=worker_id, rank=registry.rank(worker_id), state="starting", provisioned=True, elastic=True
                )
            )
    return sorted(plans, key=lambda p: p.rank)


class Scaler:
    """Wanted engines per image, decided from the load (see the module's words)."""

    def __init__(
        self, master: Master, driver: Provisioner | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._master = master
        self.config = master.config
        self.predictor = DemandPredictor(self.config, clock)
        self.wanted: dict[str, int] = {}  # the predictor's counts
        self.pinned: dict[str, int] = {}  # an operator's counts, which win
        self.decisions: collections.deque[master_pb2.ScalingDecision] = collections.deque(maxlen=MAX_DECISIONS)
        self.packer = Packer()
        self.plan: dict[str, dict[str, int]] = {}  # elastic worker -> image -> engines it is to run
        self.last_plan: Plan | None = None
        self.pool = WorkerPool(self.config, master.registry, driver, self.decide, master.lock, clock)
        self._clock = clock
        self._packed_at = -float("inf")
        self._path = master.root / STATE_FILE
        self._saved = ""
        self._save_lock = threading.Lock()
        self._settle_until = -float("inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._load()

    def start(self) -> None:
        """Adopt the provisioner's workers, then run the loop."""
        if self._thread is None:
            self.pool.adopt()
            self._thread = threading.Thread(target=self._run, name="hio-master-scaler", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the loop, then let the provisioner go (its workers stay, for the next master)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.pool.close()

    def _run(self) -> None:
        while not self._stop.wait(self.config.predict_interval):
            try:
                self.tick()
            except Exception:  # the loop must survive anything; the next look tries again
                log.exception("scaling pass failed")

    def tick(self) -> None:
        """Look at the load once and change what it calls for; pack and size the workers when
        packing is due (not while workers may still be registering after a restart)."""
        actions: list[Action] = []
        with self._master.lock:
            loads = self._master.image_loads(self.config.engine_idle_seconds)
            self._predict(loads)
            now = self._clock()
            if now >= self._settle_until and now - self._packed_at >= self.config.packing_interval:
                actions = self._replan()
        self._carry_out(actions)
        self._carry_out(self.pool.poll())  # after: a worker is asked about once it was asked for

    def replan(self) -> None:
        """Pack now, retire or take back channels to match the new plan, and size the workers
        (after a restart, once workers had the time to register again)."""
        with self._master.lock:
            actions = self._replan() if self._clock() >= self._settle_until else []
        self._carry_out(actions)

    def _replan(self) -> list[Action]:
        self._packed_at = self._clock()
        plan = self.pack()
        self._retire()
        return self.pool.size(plan, self.plan)

    def _carry_out(self, actions: list[Action]) -> None:
        """Save the state (workers asked for are recorded before they are asked for), then
        call the provisioner, outside the master's lock."""
        self.save()
        if actions:
            self.pool.act(actions, self._master.worker_master_address(), self.config.worker_token())

    def _predict(self, loads: dict[str, ImageLoad]) -> None:
        for image, load in sorted(loads.items()):
            if image in self.pinned:
                continue
            wanted = self.wanted.get(image, 0)
            change = self.predictor.step(image, load, wanted)
            if change is None:
                continue
            if change.delta > 0 and self._full(image):
                log.debug("no room for more engines", extra={"image": image, "reason": change.reason})
                continue
            self.wanted[image] = max(0, wanted + change.delta)
            action = f"{change.delta:+d} {engines_word(change.delta)} (to {self.wanted[image]})"
            self.decide(image, action, change.reason)

    def pack(self) -> Plan:
        """Place the wanted engines onto the live workers (lock held); the new plan."""
        bins = self._bins()
        registry = self._master.registry
        current = {}
        for b in bins:
            worker = registry.worker(b.worker_id)
            if b.worker_id in self.plan or worker is None:
                current[b.worker_id] = self.plan.get(b.worker_id, {})
            else:  # a worker new to the plan: what it runs is where the plan starts
                current[b.worker_id] = dict(
                    collections.Counter(c.image for c in worker.channels.values() if not c.retiring)
                )
        images = self.images() | {image for engines in current.values() for image in engines}
        wanted = {image: self.wanted_count(image) for image in images}
        sizes = {image: max(MIN_SHARE, self._master.profile.share(image)) for image in images}
        capacity = self.pool.new_worker_cpus() * (1 - self.config.pack_margin)
        plan = self.packer.pack(current, wanted, sizes, bins, capacity)
        for b in bins:
            if b.fixed is None and plan.engines[b.worker_id] != self.plan.get(b.worker_id):
                log.info(
                    "plan",
                    extra={"worker": b.worker_id, "engines": plan.engines[b.worker_id], "load": plan.load[b.worker_id]},
                )
        self.plan = {b.worker_id: plan.engines[b.worker_id] for b in bins if b.fixed is None}
        self.last_plan = plan
        return plan

    def _bins(self) -> list[Bin]:
        """Live workers in rank order, each with the cores it offers engines."""
        workers = sorted((w for w in self._master.registry.workers() if w.live), key=lambda w: w.rank)
        return [
            Bin(
                worker_id=w.worker_id,
                capacity=max(1, w.cpus) * (1 - self.config.pack_margin),
                fixed=None if w.elastic else dict(collections.Counter(c.image for c in w.channels.values())),
            )
            for w in workers
        ]

    def _retire(self) -> None:
        """Make each elastic worker's channels match its plan: retire what the plan no longer
        has (a DOWN one first, then the longest idle, then the newest), and take back retired
        ones the plan wants again before more are started. Lock held."""
        registry = self._master.registry
        for worker_id, planned in self.plan.items():
            worker = registry.worker(worker_id)
            if worker is None or not worker.live:
                continue
            by_image: dict[str, list[Channel]] = collections.defaultdict(list)
            for channel in worker.channels.values():
                by_image[channel.image].append(channel)
            for image, channels in by_image.items():
                active = [c for c in channels if not c.retiring]
                surplus = len(active) - planned.get(image, 0)
                if surplus > 0:
                    idle = {c.channel_id: registry.idle_seconds(c, self._master.queue.has_lease) for c in active}
                    active.sort(key=lambda c: (c.state != ChannelState.DOWN, -idle[c.channel_id], -c.seq))
                    for channel in active[:surplus]:
                        registry.set_retiring(channel, True)
                        log.info("retiring channel", extra={"channel": channel.channel_id, "image": image})
                elif surplus < 0:
                    for channel in sorted((c for c in channels if c.retiring), key=lambda c: -c.seq)[:-surplus]:
                        registry.set_retiring(channel, False)
                        log.info("channel taken back from retiring", extra={"channel": channel.channel_id})
        self._master.lock.notify_all()

    def answer(self, worker_id: str) -> master_pb2.HeartbeatResponse:
        """A known worker's heartbeat answer: its part of the plan and the drained channels
        to stop (an elastic worker's; nothing for one with engines of its own). Lock held."""
        worker = self._master.registry.worker(worker_id)
        if worker is None or not worker.elastic:
            return master_pb2.HeartbeatResponse(known=True)
        has_lease = self._master.queue.has_lease
        stop = sorted(
            c.channel_id for c in worker.channels.values() if c.retiring and self._master.registry.drained(c, has_lease)
        )
        planned = self.plan.get(worker_id)
        plan = None if planned is None else master_pb2.EnginePlan(engines=image_counts(planned))
        return master_pb2.HeartbeatResponse(known=True, plan=plan, stop_channels=stop)

    def report(self, images: list[master_pb2.ImageEngines]) -> master_pb2.Scaling:
        """What ``hio scale`` shows (lock held); ``images``: the master's status per image."""
        low, high = self.pool.bounds()
        plan = self.last_plan
        return master_pb2.Scaling(
            mode="elastic",
            provisioner=self.config.provisioner,
            min_workers=low,
            max_workers=high,
            bounds_set=self.pool.min_workers is not None or self.pool.max_workers is not None,
            workers_wanted=self.pool.wanted,
            workers_present=self.pool.present,
            workers=worker_plans(self._master.registry, self.plan, plan.load if plan else None, self.pool.provisioned),
            images=images,
            unplaced=image_counts(plan.unplaced) if plan else [],
            decisions=self.decisions,
        )

    def change(
        self,
        *,
        min_workers: int | None = None,
        max_workers: int | None = None,
        pin: dict[str, int] | None = None,
        unpin: Iterable[str] = (),
        reset_bounds: bool = False,
    ) -> None:
        """An operator's change (``hio scale``), checked whole before any of it applies; the
        plan is made again at once."""
        pin, unpin = dict(pin or {}), list(unpin)
        for image, count in pin.items():
            if not image or len(image) > 256:
                raise InvalidArgument(f"pin: invalid image name {image!r}")
            if not 0 <= count <= MAX_PINNED:
                raise InvalidArgument(f"pin {image}: count must be between 0 and {MAX_PINNED}, got {count}")
        with self._master.lock:
            low, high = (None, None) if reset_bounds else (self.pool.min_workers, self.pool.max_workers)
            low = min_workers if min_workers is not None else low
            high = max_workers if max_workers is not None else high
            eff_low = self.config.min_workers if low is None else low
            eff_high = self.config.max_workers if high is None else high
            if eff_high < 1:
                raise InvalidArgument(f"max_workers must be at least 1, got {eff_high}")
            if eff_low > eff_high:
                raise InvalidArgument(f"min_workers ({eff_low}) must not exceed max_workers ({eff_high})")
            if (low, high) != (self.pool.min_workers, self.pool.max_workers):
                self.pool.min_workers, self.pool.max_workers = low, high
                self.decide("workers", f"min {eff_low}, max {eff_high}", "set by an operator")
            for image in unpin:
                if image in self.pinned:
                    self.wanted[image] = self.pinned.pop(image)  # the predictor goes on from there
                    self.predictor.forget(image)
                    self.decide(image, f"unpinned at {self.wanted[image]}", "an operator: the predictor decides again")
            for image, count in sorted(pin.items()):
                self.pinned[image] = count
                self.decide(image, f"pinned to {count}", "set by an operator")
        self.replan()

    def _full(self, image: str) -> bool:
        """Engines of ``image`` already wait for room and no more workers can come. Lock held."""
        return bool(self.last_plan and self.last_plan.unplaced.get(image)) and not self.pool.room()

    def state(self) -> dict[str, Any]:
        """What a restarted master needs (lock held)."""
        return {
            "version": STATE_VERSION,
            "wanted": dict(sorted(self.wanted.items())),
            "pinned": dict(sorted(self.pinned.items())),
            "plan": {w: dict(sorted(e.items())) for w, e in sorted(self.plan.items())},
            "ranks": {w.worker_id: w.rank for w in self._master.registry.workers()},
            "shares": {i: round(v, 4) for i, v in sorted(self._master.profile.known_shares().items())},
            **self.pool.to_state(),
        }

    def save(self) -> None:
        """Write the state if it changed (atomically, durably). One writer at a time, each
        writing the state as it is when its turn comes, so an older one never lands last."""
        with self._save_lock:
            with self._master.lock:
                text = json.dumps(self.state(), sort_keys=True)
            if text != self._saved:
                atomic_write(self._path, text.encode())
                self._saved = text

    def _load(self) -> None:
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            return
        try:
            state = json.loads(text)
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"version {state.get('version')!r}, not {STATE_VERSION}")
            registry = self._master.registry
            for worker_id, rank in state.get("ranks", {}).items():
                registry.assign_rank(worker_id, int(rank))
            self.wanted = {str(i): int(n) for i, n in state.get("wanted", {}).items()}
            self.pinned = {str(i): int(n) for i, n in state.get("pinned", {}).items()}
            self.plan = {str(w): {str(i): int(n) for i, n in e.items()} for w, e in state.get("plan", {}).items()}
            self._master.profile.remember({str(i): float(v) for i, v in state.get("shares", {}).items()})
            self.pool.from_state(state)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.error(
                "saved scaling state unreadable; starting afresh", extra={"path": str(self._path), "error": str(exc)}
            )
            return
        self._saved = text
        self._settle_until = self._clock() + self.config.expiry_seconds
        log.info(
            "scaling state restored",
            extra={"path": str(self._path), "wanted": self.wanted, "workers": sorted(self.pool.provisioned)},
        )

    def wanted_count(self, image: str) -> int:
        """Engines of ``image`` wanted now: pinned, else the predictor's. Lock held."""
        return self.pinned.get(image, self.wanted.get(image, 0))

    def images(self) -> set[str]:
        """Every image the scaler wants engines of, or has pinned. Lock held."""
        return {image for image, count in self.wanted.items() if count} | set(self.pinned)

    def decide(self, subject: str, action: str, reason: str) -> None:
        self.decisions.append(
            master_pb2.ScalingDecision(unix=time.time(), subject=subject, action=action, reason=reason)
        )
        log.info("scaling", extra={"subject": subject, "action": action, "reason": reason})
