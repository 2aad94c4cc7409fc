"""The master's domain object: registry, routing, ids, backlog, stats, under one lock.

No gRPC here: :mod:`hio.master.service` decodes requests, calls these
methods, and encodes the answers (the wire's plain messages, such as the
route items, outcomes and the status, are used as they are). One condition variable guards all state
(the backlog shares it) and wakes long-polling pulls. Payload disk I/O never
happens under it: calls into the backlog that may copy payloads are made
after the lock is released.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, BinaryIO, cast

from hio.config import ConfigError, state_dir
from hio.master.backlog import BacklogQueue, Lease, Stored
from hio.master.config import MasterConfig
from hio.master.deadletters import DeadLetterStore
from hio.master.demand import ImageLoad
from hio.master.ids import TupleIdAllocator
from hio.master.metrics import MasterMetrics
from hio.master.profile import Profile
from hio.master.provisioners import open_provisioner
from hio.master.registry import NEVER, Channel, ChannelRegistry, ChannelState, Worker, check_name
from hio.master.scaler import Scaler, worker_plans
from hio.master.stats import History, Sample, Stats
from hio.master.storage import Durability
from hio.proto import master_pb2
from hio.proto.master_pb2 import RouteItem, TupleOutcome
from hio.storage.files import lock_folder
from hio.transport.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from hio.transport.frames import StopDeadline, TupleFrame, TupleMeta, WireFrame, tuple_frames
from hio.transport.tickets import load_ticket_key, make_ticket

if TYPE_CHECKING:
    from hio.transport.lane import LaneServer

log = logging.getLogger("hio.master")

MAX_ROUTE_ITEMS = 10_000
MAX_OUTCOMES = 10_000
MAX_PULL_WAIT = 30.0
MAX_PULL_TUPLES = 1024  # tuples one PullTuple may lease
MAX_PULL_BYTES = 64 * 1024 * 1024
PULL_PACK_BYTES = 1024 * 1024  # small pulled tuples travel packed, this much per message
MAINTENANCE_EVERY = (0.05, 1.0)  # maintenance (expiry of workers, reservations, leases) every tenth of the
# shortest of those timeouts, within these bounds: late by at most 10%, and no busier than that needs
QUEUE_FULL_WARNING = 0.9


class Pulled:
    """Tuples leased to a channel by :meth:`Master.pull`, head first; stream them with :meth:`frames`."""

    def __init__(self, master: Master, leases: list[Lease]) -> None:
        self._master = master
        self.leases = leases
        self.started = 0  # leases whose payload was opened to be sent (the rest never left)

    @property
    def lease(self) -> Lease:
        return self.leases[0]

    def frames(self) -> Iterator[WireFrame]:
        return tuple_frames(self.payloads(), self._master.config.chunk_bytes, PULL_PACK_BYTES, encode=True)

    def payloads(self) -> Iterator[tuple[TupleMeta, bytes | BinaryIO]]:
        """Each leased tuple's metadata and payload (in memory, or its segment file at it),
        opened when its turn comes; ``started`` counts them."""
        for item in self._master.queue.payloads(self.leases):
            self.started += 1
            yield item

    def abandon(self, reason: str = "pull stream ended early", *, charge: bool = True) -> None:
        """The stream broke before the channel got the tuples: requeue them now (to the head of
        their queue), not at lease expiry. Only those the stream had started to send are charged
        (``charge=False``: nothing was sent): the rest never left the master."""
        master = self._master
        voided = [
            lease
            for n, lease in reversed(list(enumerate(self.leases)))
            if master.queue.void_lease(lease, reason, charge=charge and n < self.started)
        ]
        if not voided:
            return
        head = self.lease
        log.info(
            "lease voided",
            extra={"tuple_id": head.tuple_id, "tuples": len(voided), "channel": head.channel_id, "reason": reason},
        )
        with master.lock:
            master._free_if_unleased(master.registry.channel(head.channel_id))
            master.lock.notify_all()


class Master:
    """The control plane's state and rules; thread-safe."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.lane: LaneServer | None = None  # the payload lane the server module starts; stopped by close()
        self.root = state_dir(config.data_dir, "master")
        self._ticket_key = load_ticket_key(config.ticket_key_file)
        lock_fd = lock_folder(
            self.root, ConfigError(f"another master uses {self.root} (data_dir); stop it or choose another data_dir")
        )  # two masters must never share a backlog
        self._lock_fd: int | None = lock_fd
        self.lock = threading.Condition(threading.RLock())  # the one lock over the state (the scaler's too)
        with contextlib.ExitStack() as undo:  # nothing stays open when a part fails (a driver refusing its options)
            undo.callback(os.close, lock_fd)
            self.durability = durability = Durability(config.fsync)
            self.ids = TupleIdAllocator(self.root / "ids")
            self.dead = DeadLetterStore(self.root / "dead", durability)
            self.queue = BacklogQueue(
                self.root / "queue",
                dead=self.dead,
                durability=durability,
                queue_bytes=config.queue_bytes,
                memory_bytes=config.queue_memory_bytes,
                segment_bytes=config.segment_bytes,
                max_attempts=config.max_attempts,
                cond=self.lock,
            )
            undo.callback(self.queue.close)
            self.registry = ChannelRegistry(
                expiry_seconds=config.expiry_seconds,
                reservation_seconds=config.reservation_seconds,
                forget_seconds=config.forget_seconds,
                concentrate=config.scaling == "elastic",
            )
            self.registry.offered_images.update(self.queue.images())
            self.pending = PendingEnqueues(config.reservation_seconds)
            self.stats = Stats()
            self.history = History()
            self.profile = Profile(config.profile_seconds, config.default_share)
            self.metrics = MasterMetrics(self) if config.metrics else None
            self._waiters = 0
            self._route_waiters: dict[str, collections.deque[_RouteWait]] = {}
            self._stop_deadline = StopDeadline()  # stopping began; when Enqueue streams still open are cut off
            self._stop = threading.Event()
            self._thread: threading.Thread | None = None
            self.listen_port = 0  # the port the server bound (set by the server module)
            self.scaler = Scaler(self, open_provisioner(config, self.root)) if config.scaling == "elastic" else None
            undo.pop_all()

    def start(self) -> Master:
        """Start the maintenance thread (expiry of workers, reservations and leases)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._maintain, name="hio-master-maintenance", daemon=True)
            self._thread.start()
            if self.scaler is not None:
                self.scaler.start()
        return self

    def worker_master_address(self) -> str:
        """Where workers the provisioner starts reach this master (the bound port when
        ``listen`` asked for any)."""
        address = self.config.worker_master_address()
        host, _, port = address.rpartition(":")
        return f"{host}:{self.listen_port}" if port == "0" and self.listen_port else address

    @property
    def lane_port(self) -> int:
        """The payload lane's port, told to senders in queue routes and to engines; 0 = none."""
        return self.lane.port if self.lane is not None else 0

    def begin_shutdown(self, finish_seconds: float = 0.0) -> None:
        """Wake every waiting pull (they return empty), refuse new waits, and stop the payload lane
        (its calls end now: senders send again, pulls void their leases). A tuple still arriving
        on a gRPC Enqueue stream may finish within ``finish_seconds``; then its stream ends with
        UNAVAILABLE, saying to send what was not ENQUEUED again (:meth:`enqueue_cut`)."""
        with self.lock:
            self._stop_deadline.begin(finish_seconds)
            self.lock.notify_all()
        if self.lane is not None:  # after: waiting pulls have returned, so its stop() need not wait for them
            self.lane.stop()

    def close(self) -> None:
        """Stop the payload lane and maintenance, seal the backlog; idempotent."""
        self.begin_shutdown()
        if self.scaler is not None:
            self.scaler.close()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.queue.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _maintain(self) -> None:
        shortest = min(self.config.expiry_seconds, self.config.reservation_seconds, self.config.lease_seconds)
        every = min(max(shortest / 10, MAINTENANCE_EVERY[0]), MAINTENANCE_EVERY[1])
        while not self._stop.wait(every):
            try:
                self.expire()
                with self.lock:
                    self.history.observe(self.stats)
            except Exception:  # the maintenance thread must survive anything
                log.exception("maintenance pass failed")

    def history_samples(self) -> list[Sample]:
        """Throughput and latency over the last hour (:class:`~hio.master.stats.History`), oldest first."""
        with self.lock:
            return self.history.samples()

    def expire(self) -> None:
        """One maintenance pass: expire workers and reservations, void their leases, expire leases."""
        with self.lock:
            result = self.registry.expire()
            self.pending.expire()
            # Void under the same lock, so no status snapshot shows a channel DOWN still holding a lease.
            for channel_id in result.down_channels:
                self.queue.void_leases(channel_id, "worker expired", settle=False)
            if result.expired_workers or result.lapsed_channels:
                self.lock.notify_all()
        self.queue.settle()  # dead-letter copies (up to a tuple's size of disk I/O) off the master lock
        for worker_id in result.expired_workers:
            log.warning("worker expired", extra={"worker": worker_id, "after_s": self.config.expiry_seconds})
        for channel_id in self.queue.expire_leases():
            with self.lock:
                self._free_if_unleased(self.registry.channel(channel_id))
                self.lock.notify_all()

    def register_worker(
        self,
        worker_id: str,
        host: str,
        cpus: int,
        channels: Iterable[master_pb2.ChannelInfo],
        *,
        elastic: bool = False,
    ) -> None:
        """Add or replace a worker; leases of its previous channels go back to the queue.
        ``elastic``: it runs the engines the plan gives it."""
        with self.lock:
            if self.scaler is not None and not self.scaler.pool.admits(worker_id):
                raise FailedPrecondition(f"worker {worker_id} was given back by the elastic scaler and is stopping")
            replaced = self.registry.register(worker_id, host, cpus, channels, elastic=elastic)
            if self.scaler is not None:
                self.scaler.pool.registered(worker_id)
            self.lock.notify_all()
        for channel_id in replaced:
            self.queue.void_leases(channel_id, "worker registered again")
        log.info("worker registered", extra={"worker": worker_id, "host": host, "elastic": elastic})

    def heartbeat(
        self,
        worker_id: str,
        down: dict[str, str],
        cpu: dict[str, float] | None = None,
        channels: list[master_pb2.ChannelInfo] | None = None,
    ) -> master_pb2.HeartbeatResponse:
        """Refresh a worker; unknown (it must register again) or what it is to do. ``cpu``: each
        engine's CPU seconds so far (used and waited for), for the profile of its image.
        ``channels``: every channel the worker has, when it says so (channels it started or
        stopped come or go)."""
        with self.lock:
            removed: list[str] = []
            if channels is not None:
                added, removed = self.registry.sync(worker_id, channels)
                for channel_id in removed:
                    self.profile.forget(channel_id)
                if added or removed:
                    log.info("channels changed", extra={"worker": worker_id, "added": added, "removed": removed})
            known, went_down = self.registry.heartbeat(worker_id, down)
            for channel_id, seconds in (cpu or {}).items() if known else ():
                channel = self.registry.channel(channel_id)
                if channel is not None and channel.worker_id == worker_id:
                    self.profile.cpu(channel_id, channel.image, seconds)
            answer = master_pb2.HeartbeatResponse(known=known)
            if known and self.scaler is not None:
                answer = self.scaler.answer(worker_id)
            self.lock.notify_all()
        for channel_id in went_down:
            log.info("channel down", extra={"channel": channel_id, "detail": down.get(channel_id, "")})
            self.queue.void_leases(channel_id, "channel down")
        for channel_id in removed:
            self.queue.void_leases(channel_id, "channel stopped by its worker")
        return answer

    def route(
        self,
        *,
        source: str,
        image: str,
        items: Sequence[RouteItem],
        force_queue: bool = False,
        wait_seconds: float = 0.0,
    ) -> master_pb2.RouteTuplesResponse:
        """Assign ids (keeping those already routed) and decide where the batch goes, after
        waiting up to ``wait_seconds`` for a busy channel (docs/architecture.md, "The data path")."""
        self._check_route(image, items)
        if not math.isfinite(wait_seconds) or not 0 <= wait_seconds <= MAX_PULL_WAIT:
            raise InvalidArgument(f"wait_seconds must be between 0 and {MAX_PULL_WAIT:g}, got {wait_seconds}")
        arrived = time.monotonic()
        with self.lock:
            self._check_known(image, [item.tuple_id for item in items if item.tuple_id])
            fresh = iter(self.ids.allocate(sum(1 for i in items if not i.tuple_id)))
            tuple_ids = [item.tuple_id or next(fresh) for item in items]
            route = self._route_waiting(image, tuple_ids, force_queue, wait_seconds)
            direct = isinstance(route, master_pb2.ChannelRoute)
            self.stats.routed(direct=direct, count=len(items), size=sum(item.size for item in items), image=image)
        if self.metrics is not None:
            self.metrics.route_wait.labels("direct" if direct else "queue").observe(time.monotonic() - arrived)
        tickets = [make_ticket(self._ticket_key, t, image) if self._ticket_key else b"" for t in tuple_ids]
        log.debug("routed", extra={"source": source, "image": image, "tuples": len(items), "route": route})
        reply = master_pb2.RouteTuplesResponse(tuple_ids=tuple_ids, tickets=tickets)
        if isinstance(route, master_pb2.ChannelRoute):
            reply.channel.CopyFrom(route)
        else:
            reply.queue.CopyFrom(route)
            reply.queue.lane_port = self.lane_port
        return reply

    def _route_waiting(
        self, image: str, tuple_ids: list[int], force_queue: bool, wait_seconds: float
    ) -> master_pb2.ChannelRoute | master_pb2.QueueRoute:
        """The route, after waiting (lock held; the wait releases it) for a channel if allowed.
        Direct only when nothing of the image is queued or on its way there: a newcomer must not
        overtake tuples that arrived first; nor a waiting batch one that waits longer."""
        deadline = time.monotonic() + wait_seconds
        waiters = self._route_waiters.setdefault(image, collections.deque())
        token = _RouteWait(len(tuple_ids))
        waiters.append(token)
        try:
            while True:
                ready, on_the_way = self.queue.ready_count(image), self.pending.count(image)
                decide_now = (
                    force_queue
                    or self._stop_deadline.begun
                    or time.monotonic() >= deadline
                    or ready > 0
                    or on_the_way > 0
                    or not self.registry.serves(image)
                    or len(waiters) > self.config.pull_waiters
                )
                if waiters[0] is token or decide_now:
                    channel = None if force_queue or ready or on_the_way else self.registry.reserve_free(image)
                    if channel is not None:
                        return master_pb2.ChannelRoute(
                            channel_id=channel.channel_id,
                            address=channel.address,
                            reservation_seconds=self.registry.reservation_seconds,
                            lane_address=channel.lane_address,
                        )
                    if decide_now:
                        self.pending.add(image, tuple_ids)
                        return master_pb2.QueueRoute(queue_length=self.queue.length(image) + on_the_way)
                self.lock.wait(max(0.0, min(deadline - time.monotonic(), 1.0)))
        finally:
            waiters.remove(token)
            if waiters:
                self.lock.notify_all()  # the next batch waiting may be first now
            else:
                del self._route_waiters[image]

    def _check_route(self, image: str, items: Sequence[RouteItem]) -> None:
        check_name("image", image)
        if not 1 <= len(items) <= MAX_ROUTE_ITEMS:
            raise InvalidArgument(f"a route request carries 1 to {MAX_ROUTE_ITEMS} items, got {len(items)}")
        for n, item in enumerate(items):
            if item.size > self.config.max_tuple_bytes:
                raise InvalidArgument(
                    f"item {n}: {item.size} bytes is over max_tuple_bytes ({self.config.max_tuple_bytes})"
                )

    def _check_known(self, image: str, tuple_ids: Sequence[int], *, enqueued: bool = False) -> None:
        """Refuse an id this master never issued, or an image it does not know (naming those it
        knows, so a misspelt one is plain to see); an enqueued tuple's refusal names the tuple
        and says how to get an id. Lock held."""
        for tuple_id in tuple_ids:
            if not self.ids.issued(tuple_id):
                last = f"(last issued {self.ids.last_issued})"
                raise InvalidArgument(
                    f"tuple {tuple_id}: id was never issued by this master {last}; route it first"
                    if enqueued
                    else f"tuple id {tuple_id} was never issued by this master {last}"
                )
        if image not in self.config.images and image not in self.registry.offered_images:
            known = sorted(set(self.config.images) | self.registry.offered_images)
            more = f" and {len(known) - 10} more" if len(known) > 10 else ""
            names = f"known: {', '.join(known[:10])}{more}" if known else "no worker has registered an image yet"
            which = f"tuple {tuple_ids[0]}: " if enqueued else ""
            raise NotFound(
                f"{which}image '{image}': no worker offers it and it is not in the master's images ({names})"
            )

    def enqueue(self, frames: Iterable[TupleFrame]) -> Iterator[Stored]:
        """Store a stream of tuples in the backlog; one receipt each (see BacklogQueue.receive)."""
        stored_any = self.queue.receive(
            frames,
            max_tuple_bytes=self.config.max_tuple_bytes,
            max_chunk_bytes=self.config.chunk_bytes,
            admit=self._admit,
        )
        for stored in stored_any:
            meta = stored.meta
            with self.lock:
                self.pending.arrived(meta.image, meta.tuple_id)
                self.stats.bytes_enqueued += meta.size
            log.debug(
                "enqueued", extra={"tuple_id": meta.tuple_id, "image": meta.image, "placement": stored.placement.value}
            )
            yield stored

    def enqueue_cut(self) -> Unavailable | None:
        """The error an Enqueue stream still open ends with once the stop's finish time is over."""
        if not self._stop_deadline.due():
            return None
        return Unavailable(
            "the master is stopping; send the tuples it did not answer ENQUEUED again once it is back",
            retry_after=1.0,
        )

    def _admit(self, meta: TupleMeta) -> None:
        with self.lock:
            self._check_known(meta.image, [meta.tuple_id], enqueued=True)

    def pull(
        self,
        channel_id: str,
        wait_seconds: float,
        *,
        max_tuples: int = 1,
        max_bytes: int = 0,
        alive: Callable[[], bool] = lambda: True,
    ) -> Pulled | None:
        """Lease the head of the channel's image queue (and up to ``max_tuples`` tuples of at
        most ``max_bytes`` in all after it), waiting up to ``wait_seconds``; None if nothing.
        ``alive`` is asked before leasing: a waiting pull whose caller has gone (its engine died,
        its deadline passed) must not take a tuple it cannot deliver."""
        if not math.isfinite(wait_seconds) or not 0 <= wait_seconds <= MAX_PULL_WAIT:
            raise InvalidArgument(f"wait_seconds must be between 0 and {MAX_PULL_WAIT:g}, got {wait_seconds}")
        if not 0 <= max_tuples <= MAX_PULL_TUPLES:
            raise InvalidArgument(f"max_tuples must be between 0 and {MAX_PULL_TUPLES}, got {max_tuples}")
        if not 0 <= max_bytes <= MAX_PULL_BYTES:
            raise InvalidArgument(f"max_bytes must be between 0 and {MAX_PULL_BYTES}, got {max_bytes}")
        deadline = time.monotonic() + wait_seconds
        waiting = False
        with self.lock:
            if self.registry.channel(channel_id) is None:
                raise NotFound(f"unknown channel '{channel_id}' (its worker must register it)")
            try:
                while not self._stop_deadline.begun:
                    channel = self.registry.channel(channel_id)
                    if channel is None or not alive():
                        return None
                    # A channel reserved for a direct stream keeps its pull waiting: it may lease
                    # once the stream releases it, and the engine need not open a new pull per stream.
                    if (
                        channel.state != ChannelState.DIRECT
                        and self.registry.takes_work(channel)
                        and not self._yields(channel)
                    ):
                        leases = self.queue.lease_many(
                            channel.image,
                            channel_id,
                            self.config.lease_seconds,
                            max_tuples=max_tuples,
                            max_bytes=max_bytes,
                        )
                        if leases:
                            self.registry.set_queue(channel, leased=True)
                            log.debug(
                                "pulled",
                                extra={"tuple_id": leases[0].tuple_id, "tuples": len(leases), "channel": channel_id},
                            )
                            return Pulled(self, leases)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._free_if_unleased(channel)
                        return None
                    if not waiting:
                        if self._waiters >= self.config.pull_waiters:
                            raise ResourceExhausted(
                                f"{self._waiters} PullTuple calls already wait "
                                f"(pull_waiters={self.config.pull_waiters})",
                                retry_after=min(1.0, wait_seconds),
                            )
                        self._waiters += 1
                        waiting = True
                    self.lock.wait(remaining)
                return None
            finally:
                if waiting:
                    self._waiters -= 1

    def _yields(self, channel: Channel) -> bool:
        """A channel that pulls while it holds leases pulls ahead (its engine fetches the next
        tuples while processing); it takes nothing while another channel of the image is
        idle, which would otherwise wait for a tuple held by a busy one. Lock held."""
        return self.queue.has_lease(channel.channel_id) and self.registry.idle_elsewhere(channel, self.queue.has_lease)

    def _free_if_unleased(self, channel: Channel | None) -> None:
        """A QUEUE channel that holds no lease (its pull ended, or its leases did) is FREE
        again. Lock held."""
        if channel is not None and channel.state == ChannelState.QUEUE and not self.queue.has_lease(channel.channel_id):
            self.registry.set_free(channel)

    def report(
        self,
        channel_id: str,
        outcomes: Sequence[TupleOutcome],
        release: bool,
        *,
        processing: bool = False,
        pull_done: bool = False,
    ) -> bool:
        """Record outcomes, settle queued tuples, release the channel; True: pull the queue next.
        ``processing``: the channel processes a tuple as it reports (routing prefers free channels
        that do not). ``pull_done`` (with ``release``): what it pulled and did not report goes back
        to the head of the queue, not charged."""
        if len(outcomes) > MAX_OUTCOMES:
            raise InvalidArgument(f"at most {MAX_OUTCOMES} outcomes per report, got {len(outcomes)}")
        for n, outcome in enumerate(outcomes):
            self._check_outcome(n, outcome)
        now = time.time()
        with self.lock:
            channel = self.registry.channel(channel_id)
            if channel is not None:
                self.registry.touch(channel)
                self.registry.set_processing(channel, processing)
            self.queue.refresh(channel_id, self.config.lease_seconds)
            image = channel.image if channel is not None else "unknown"
            for outcome in outcomes:
                ended = min(outcome.stored_unix, now) if outcome.stored_unix > 0 else now  # not after its report
                latency = max(0.0, ended - outcome.accepted_unix) if outcome.accepted_unix > 0 else None
                self.stats.outcome(ok=outcome.ok, size=outcome.size, latency=latency, image=image)
                if self.metrics is not None and outcome.ok and latency is not None:
                    self.metrics.latency.observe(latency)
                if outcome.ok and channel is not None:
                    channel.tuples_done += 1
                    if outcome.from_queue:
                        channel.bytes_pulled += outcome.size
                    else:
                        channel.bytes_direct += outcome.size
                    self.profile.outcome(channel.image, outcome.processing_seconds)
        for outcome in (o for o in outcomes if o.from_queue):
            if outcome.ok and not self.queue.ack(outcome.tuple_id, channel_id):
                ignored = "success report ignored: tuple not queued or never held by this channel"
            elif not outcome.ok and not self.queue.fail(outcome.tuple_id, channel_id, outcome.message):
                ignored = "failure report ignored: tuple not leased to this channel"
            else:
                continue
            log.info(ignored, extra={"tuple_id": outcome.tuple_id, "channel": channel_id})
        if not release:
            self._after_outcomes(channel_id)
            return False
        if pull_done:  # what it pulled and did not process goes back now, not at lease expiry
            self.queue.void_leases(channel_id, "returned unprocessed by the channel that pulled it", charge=False)
        with self.lock:
            channel = self.registry.channel(channel_id)
            if channel is None or not self.registry.routable(channel):
                return False
            # a retiring channel is released for good: it takes no more work, and its engine may stop
            pull = not channel.retiring and self.queue.ready_count(channel.image) > 0
            if pull:
                self.registry.set_queue(channel, leased=self.queue.has_lease(channel_id))
            elif not self.queue.has_lease(channel_id):
                self.registry.set_free(channel)
            self.lock.notify_all()
            return pull

    def _check_outcome(self, n: int, outcome: TupleOutcome) -> None:
        """Refuse figures no real tuple can have, so a bad report cannot poison the counters."""
        if outcome.size > self.config.max_tuple_bytes:
            raise InvalidArgument(
                f"outcome {n}: size {outcome.size} is over max_tuple_bytes "
                f"({self.config.max_tuple_bytes}); no tuple that large was routed"
            )
        for name in ("processing_seconds", "accepted_unix", "stored_unix"):
            value = getattr(outcome, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"outcome {n}: {name} must be a finite, non-negative number, got {value}")

    def _after_outcomes(self, channel_id: str) -> None:
        """A QUEUE channel whose tuple is settled but not released lapses to FREE unless it pulls again."""
        with self.lock:
            channel = self.registry.channel(channel_id)
            if (
                channel is not None
                and channel.state == ChannelState.QUEUE
                and channel.deadline == NEVER
                and not self.queue.has_lease(channel_id)
            ):
                self.registry.set_queue(channel, leased=False)

    def scaling(self) -> master_pb2.Scaling:
        """The plan, the workers, each image's engines and profile, the latest decisions."""
        with self.lock:
            images = self.engines(self.queue.status())
            if self.scaler is not None:
                return self.scaler.report(images)
            return master_pb2.Scaling(
                mode="fixed",
                workers_present=sum(1 for w in self.registry.workers() if w.live),
                workers=worker_plans(self.registry),
                images=images,
            )

    def set_scaling(
        self,
        *,
        min_workers: int | None = None,
        max_workers: int | None = None,
        pin: dict[str, int] | None = None,
        unpin: list[str] | None = None,
        reset_bounds: bool = False,
    ) -> master_pb2.Scaling:
        """An operator's change to elastic scaling; the scaling after it."""
        if self.scaler is None:
            raise FailedPrecondition("scaling is fixed: start the master with scaling = elastic to change it")
        self.scaler.change(
            min_workers=min_workers, max_workers=max_workers, pin=pin, unpin=unpin or (), reset_bounds=reset_bounds
        )
        return self.scaling()

    def image_loads(self, idle_after: float) -> dict[str, ImageLoad]:
        """Each image's backlog (queued and not leased, routed to the queue and not there yet,
        waiting for a route), its engines that take work, and those idle for ``idle_after``
        seconds; every image with a backlog or channels. Lock held."""
        idle: collections.Counter[str] = collections.Counter()
        running: collections.Counter[str] = collections.Counter()
        images: set[str] = set(self.queue.images()) | set(self._route_waiters)
        for worker in self.registry.workers():
            for channel in worker.channels.values():
                images.add(channel.image)
                if self.registry.takes_work(channel):
                    running[channel.image] += 1
                if self.registry.idle_seconds(channel, self.queue.has_lease) >= idle_after:
                    idle[channel.image] += 1
        return {
            image: ImageLoad(
                backlog=self.queue.ready_count(image)
                + self.pending.count(image)
                + sum(w.tuples for w in self._route_waiters.get(image, ())),
                idle=idle[image],
                running=running[image],
            )
            for image in images
        }

    def status(self) -> master_pb2.GetStatusResponse:
        """A consistent snapshot of everything an operator looks at."""
        with self.lock:
            free, busy, down = self.registry.counts()
            queues = self.queue.status()
            rates = self.stats.rates()
            dead = len(self.dead)
            return master_pb2.GetStatusResponse(
                uptime_seconds=self.stats.uptime(),
                workers=[_worker_status(w, self.registry.age(w)) for w in self.registry.workers()],
                queues=queues,
                channels_free=free,
                channels_busy=busy,
                channels_down=down,
                routed_direct=self.stats.routed_direct,
                routed_queue=self.stats.routed_queue,
                tuples_done=self.stats.tuples_done,
                tuples_failed=self.stats.tuples_failed,
                bytes_done=self.stats.bytes_done,
                tuples_per_second=rates.tuples_per_second,
                bytes_per_second=rates.bytes_per_second,
                queue_bytes_limit=self.config.queue_bytes,
                dead_letters=dead,
                warnings=self._warnings(queues, self.queue.used_bytes, dead),
                last_tuple_id=self.ids.last_issued,
                engines=self.engines(queues),
                bytes_routed_direct=self.stats.bytes_routed_direct,
                bytes_enqueued=self.stats.bytes_enqueued,
            )

    def engines(self, queues: list[master_pb2.QueueStatus]) -> list[master_pb2.ImageEngines]:
        """Per image with engines, a profile, a queue or a wanted count: running and wanted
        engines (fixed sizing: wanted is what the workers run). Lock held."""
        running: collections.Counter[str] = collections.Counter()
        wanted: collections.Counter[str] = collections.Counter()
        for worker in self.registry.workers():
            if not worker.live:
                continue
            for channel in worker.channels.values():
                wanted[channel.image] += 1
                if self.registry.routable(channel):
                    running[channel.image] += 1
        images = set(wanted) | self.profile.images() | {q.image for q in queues if q.length}
        if self.scaler is not None:
            images |= self.scaler.images()
            wanted = collections.Counter({image: self.scaler.wanted_count(image) for image in images})
        profiles = {image: self.profile.image(image) for image in images}
        return [
            master_pb2.ImageEngines(
                image=image,
                running=running[image],
                wanted=wanted[image],
                pinned=self.scaler is not None and image in self.scaler.pinned,
                cpu_share=profiles[image].cpu_share or 0.0,  # 0: not measured yet
                seconds_per_tuple=profiles[image].seconds_per_tuple or 0.0,
                tuples_per_second=profiles[image].tuples_per_second,
            )
            for image in sorted(images)
        ]

    def not_ready(self) -> str:
        """Why the master cannot do its job just now, '' when it can (its health's readiness):
        its backlog's disk failed to sync, or no worker runs an engine for any image while
        nothing will start one (with elastic scaling the master starts workers as tuples
        come, so it is ready without any)."""
        if self.durability.disk.failure:
            return self.durability.disk.failure
        with self.lock:
            if self.scaler is None and not self.registry.serves():
                return "no worker runs an engine for any image (start a worker: hio worker)"
        return ""

    def _warnings(self, queues: list[master_pb2.QueueStatus], used: int, dead: int) -> list[str]:
        warnings = []
        for q in queues:
            if q.length and not self.registry.serves(q.image):
                warnings.append(f"no channel offers image {q.image}; {q.length} tuples wait in its queue")
        for worker in self.registry.workers():
            if not worker.live:
                warnings.append(
                    f"worker {worker.worker_id} expired (no heartbeat for {self.registry.age(worker):.0f} s)"
                )
        if used >= QUEUE_FULL_WARNING * self.config.queue_bytes:
            warnings.append(
                f"backlog queue {100 * used / self.config.queue_bytes:.0f}% full "
                f"({used} of {self.config.queue_bytes} bytes)"
            )
        if dead:
            warnings.append(f"{dead} dead letters (see `hio dead-letters`)")
        if self.durability.disk.failure:
            warnings.append(
                f"{self.durability.disk.failure}; tuples with no free channel wait in their gateways' spools meanwhile"
            )
        return warnings


# What a status tells of a channel: every field the registry's Channel and ChannelInfo share (and its state)
_CHANNEL_FIELDS = {f.name for f in dataclasses.fields(Channel)} & set(master_pb2.ChannelInfo.DESCRIPTOR.fields_by_name)
_CHANNEL_FIELDS.remove("state")


def _worker_status(worker: Worker, age: float) -> master_pb2.WorkerStatus:
    return master_pb2.WorkerStatus(
        worker_id=worker.worker_id,
        host=worker.host,
        last_heartbeat_age_seconds=age,
        channels=[
            master_pb2.ChannelInfo(
                **{name: getattr(c, name) for name in _CHANNEL_FIELDS},
                state=cast("master_pb2.ChannelState", int(c.state)),  # the registry's has the proto enum's numbers
            )
            for c in worker.channels.values()
        ],
    )


@dataclasses.dataclass(eq=False)  # found among the waiting ones by identity
class _RouteWait:
    """A route request waiting for a channel (the predictor counts its tuples as backlog)."""

    tuples: int


class PendingEnqueues:
    """Tuples routed to the queue that have not arrived there yet: image -> tuple id -> deadline.
    An entry ends when its tuple is enqueued, or after ``ttl`` seconds (its sender gave up or
    will route it again), so a lost sender cannot keep an image off direct routing for long.
    Lock held."""

    def __init__(self, ttl: float) -> None:
        self._ttl = ttl
        self._pending: dict[str, dict[int, float]] = {}

    def add(self, image: str, tuple_ids: list[int]) -> None:
        self._pending.setdefault(image, {}).update(dict.fromkeys(tuple_ids, time.monotonic() + self._ttl))

    def arrived(self, image: str, tuple_id: int) -> None:
        self._pending.get(image, {}).pop(tuple_id, None)
        self.expire(image)  # the image's entry goes with its last tuple

    def count(self, image: str) -> int:
        self.expire(image)
        return len(self._pending.get(image, ()))

    def expire(self, *images: str) -> None:
        """Drop the entries past their deadline, of ``images`` (none: of every image)."""
        now = time.monotonic()
        for image in images or list(self._pending):
            table = self._pending.get(image, {})
            for tuple_id in [t for t, deadline in table.items() if deadline <= now]:
                del table[tuple_id]
            if not table:
                self._pending.pop(image, None)
