"""Workers and their processing channels, as the master sees them.

Not thread-safe by itself: the master calls it under its one lock. Times are
monotonic seconds from the injected clock.

Routing picks the best FREE channel of an image from a heap per image, not by looking at
every channel: a look at every channel on every route takes about half of the master's CPU
at 1,000 channels (docs/benchmarks/scale.md). A channel gets an entry whenever it becomes
routable or its rank among the free ones changes; entries that no longer hold (the channel
was taken, went down, or has a later entry) are dropped as they come to the top.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator

from hio.proto import master_pb2
from hio.transport.errors import AlreadyExists, InvalidArgument

MAX_CHANNELS_PER_WORKER = 1024
MAX_NAME = 256
NEVER = math.inf


class ChannelState(enum.IntEnum):
    """Same numbers as ``hio.proto.ChannelState``."""

    FREE = 1
    DIRECT = 2
    QUEUE = 3
    DOWN = 4


@dataclasses.dataclass
class Channel:
    channel_id: str
    worker_id: str
    image: str
    address: str
    lane_address: str = ""
    state: ChannelState = ChannelState.FREE
    detail: str = ""
    tuples_done: int = 0
    bytes_direct: int = 0  # payload of its stored tuples that came straight from a gateway
    bytes_pulled: int = 0  # ... and that it pulled from the queue
    last_used: float = 0.0  # when it was last given work: free channels are chosen least recently used
    processing: bool = False  # its last report said a tuple is in progress (a FREE one finishes its last)
    deadline: float = NEVER  # DIRECT, or QUEUE before its pull: becomes FREE after this without reports
    busy_at: float = 0.0  # when it was last seen with work (given some, or reporting): its idle time starts here
    retiring: bool = False  # the elastic plan drains it: no new work; its engine stops once it holds nothing
    seq: int = 0  # order of creation: a concentrating registry fills lower ones first


@dataclasses.dataclass
class Worker:
    worker_id: str
    host: str
    cpus: int
    last_seen: float
    channels: dict[str, Channel]
    expired_at: float | None = None
    rank: int = 0  # order of joining: the packer fills lower ranks first, and routing does when concentrating
    elastic: bool = False  # runs the engines the master's plan gives it

    @property
    def live(self) -> bool:
        return self.expired_at is None


@dataclasses.dataclass(frozen=True)
class Expiry:
    """What one expiry pass changed."""

    expired_workers: list[str]
    down_channels: list[str]  # their leases must be voided
    lapsed_channels: list[str]  # reservations that ran out (now FREE)


class ChannelRegistry:
    """Registered workers, their channels and channel states."""

    def __init__(
        self,
        *,
        expiry_seconds: float,
        reservation_seconds: float,
        forget_seconds: float,
        concentrate: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``concentrate``: routing prefers the lowest-ranked worker and its first channels
        (elastic scaling: load gathers there, so idle engines and workers show); otherwise
        the least recently used channel (load spreads)."""
        self.expiry_seconds = expiry_seconds
        self.reservation_seconds = reservation_seconds
        self.forget_seconds = forget_seconds
        self.concentrate = concentrate
        self._clock = clock
        self._workers: dict[str, Worker] = {}
        self._channels: dict[str, Channel] = {}
        self._ranks: dict[str, int] = {}  # worker id -> rank, kept while the master runs
        self._next_seq = 0
        self.offered_images: set[str] = set()
        self._free: dict[str, list[tuple[tuple[object, ...], int, Channel]]] = {}  # image -> heap of candidates
        self._pushes = itertools.count()  # ties in the heap: first pushed first

    def rank(self, worker_id: str) -> int:
        """The worker's rank: given when it is first seen (or assigned), never changed."""
        if worker_id not in self._ranks:
            self._ranks[worker_id] = max(self._ranks.values(), default=-1) + 1
        return self._ranks[worker_id]

    def assign_rank(self, worker_id: str, rank: int) -> None:
        """Give a worker its rank before it registers (one the scaler asked for, or one it
        knew before the master restarted)."""
        self._ranks[worker_id] = rank
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.rank = rank
            for channel in worker.channels.values():
                self._offer(channel)

    def drop_rank(self, worker_id: str) -> None:
        """The worker is gone for good (given back): its rank is free."""
        self._ranks.pop(worker_id, None)

    def register(
        self,
        worker_id: str,
        host: str,
        cpus: int,
        specs: Iterable[master_pb2.ChannelInfo],
        *,
        elastic: bool = False,
    ) -> list[str]:
        """Add or replace a worker and its channels (as the worker announces them: DOWN with why,
        or up); the ids of replaced channels (void their leases)."""
        specs = list(specs)
        check_name("worker_id", worker_id)
        self._check_specs(worker_id, specs)
        now = self._clock()
        old = self._workers.pop(worker_id, None)
        replaced = list(old.channels) if old else []
        for channel_id in replaced:
            self._channels.pop(channel_id, None)
        channels: dict[str, Channel] = {}
        for spec in specs:
            kept = old.channels.get(spec.channel_id) if old else None  # its counters live on
            channel = channels[spec.channel_id] = self._new_channel(worker_id, spec, now, replaced)
            if kept is not None:
                for name in ("tuples_done", "bytes_direct", "bytes_pulled"):
                    setattr(channel, name, getattr(kept, name))
        self._workers[worker_id] = Worker(
            worker_id=worker_id,
            host=host[:MAX_NAME],
            cpus=cpus,
            last_seen=now,
            channels=channels,
            rank=self.rank(worker_id),
            elastic=elastic,
        )
        for channel in channels.values():
            self._offer(channel)
        return replaced

    def _check_specs(self, worker_id: str, specs: list[master_pb2.ChannelInfo]) -> None:
        if len(specs) > MAX_CHANNELS_PER_WORKER:
            raise InvalidArgument(f"worker {worker_id}: {len(specs)} channels, at most {MAX_CHANNELS_PER_WORKER}")
        seen: set[str] = set()
        for spec in specs:
            check_name("channel_id", spec.channel_id)
            check_name(f"channel {spec.channel_id}: image", spec.image)
            check_name(f"channel {spec.channel_id}: address", spec.address)
            if spec.lane_address:
                check_name(f"channel {spec.channel_id}: lane address", spec.lane_address)
            if spec.channel_id in seen:
                raise InvalidArgument(f"worker {worker_id}: channel {spec.channel_id} listed twice")
            seen.add(spec.channel_id)
            other = self._channels.get(spec.channel_id)
            if other is not None and other.worker_id != worker_id and self._workers[other.worker_id].live:
                raise AlreadyExists(f"channel {spec.channel_id} belongs to live worker {other.worker_id}")

    def _new_channel(self, worker_id: str, spec: master_pb2.ChannelInfo, now: float, replaced: list[str]) -> Channel:
        """A channel as announced, entered in the index (not yet in its worker's table); one of an
        expired worker's it takes over goes from that worker, its id to ``replaced``."""
        previous = self._channels.get(spec.channel_id)
        if previous is not None:
            self._workers[previous.worker_id].channels.pop(spec.channel_id, None)
            replaced.append(spec.channel_id)
        self._next_seq += 1
        channel = Channel(
            channel_id=spec.channel_id,
            worker_id=worker_id,
            image=spec.image,
            address=spec.address,
            lane_address=spec.lane_address,
            state=ChannelState.DOWN if spec.state == master_pb2.DOWN else ChannelState.FREE,
            detail=spec.detail if spec.state == master_pb2.DOWN else "",
            busy_at=now,
            seq=self._next_seq,
        )
        self._channels[spec.channel_id] = channel
        self.offered_images.add(spec.image)
        return channel

    def sync(self, worker_id: str, specs: list[master_pb2.ChannelInfo]) -> tuple[list[str], list[str]]:
        """A live worker's complete channel list (an elastic worker started or stopped engines):
        channels it no longer lists go, new ones come (each as its spec says, FREE or DOWN),
        known ones keep their state. (added, removed) channel ids; void the removed ones' leases."""
        worker = self._workers.get(worker_id)
        if worker is None or not worker.live:
            return [], []
        self._check_specs(worker_id, specs)
        listed = {spec.channel_id for spec in specs}
        removed = [channel_id for channel_id in worker.channels if channel_id not in listed]
        for channel_id in removed:
            del worker.channels[channel_id]
            self._channels.pop(channel_id, None)
        added = []
        now = self._clock()
        for spec in specs:
            known = worker.channels.get(spec.channel_id)
            if known is None:
                channel = worker.channels[spec.channel_id] = self._new_channel(worker_id, spec, now, removed)
                self._offer(channel)
                added.append(spec.channel_id)
            elif known.address != spec.address or known.lane_address != spec.lane_address:
                known.address, known.lane_address = spec.address, spec.lane_address
        return added, removed

    def heartbeat(self, worker_id: str, down: dict[str, str]) -> tuple[bool, list[str]]:
        """(known, channels that just went DOWN); unknown or expired workers must register again."""
        worker = self._workers.get(worker_id)
        if worker is None or not worker.live:
            return False, []
        worker.last_seen = self._clock()
        went_down = []
        for channel in worker.channels.values():
            if channel.channel_id in down:
                if channel.state != ChannelState.DOWN:
                    went_down.append(channel.channel_id)
                channel.state = ChannelState.DOWN
                channel.detail = down[channel.channel_id][:1024]
                channel.deadline = NEVER
                channel.processing = False  # a restarted engine starts idle
            elif channel.state == ChannelState.DOWN:
                channel.state = ChannelState.FREE
                channel.detail = ""
                channel.busy_at = worker.last_seen  # an engine just up has not had its chance yet
                self._offer(channel)
        return True, went_down

    def expire(self) -> Expiry:
        """Expire silent workers, lapse reservations, forget long-expired workers."""
        now = self._clock()
        expired, down, lapsed = [], [], []
        for worker in list(self._workers.values()):
            if not worker.live:
                if worker.expired_at is not None and now - worker.expired_at >= self.forget_seconds:
                    self._forget(worker)
                continue
            if now - worker.last_seen >= self.expiry_seconds:
                worker.expired_at = now
                expired.append(worker.worker_id)
                for channel in worker.channels.values():
                    channel.state = ChannelState.DOWN
                    channel.detail = "worker expired"
                    channel.deadline = NEVER
                    down.append(channel.channel_id)
                continue
            for channel in worker.channels.values():
                if channel.state in (ChannelState.DIRECT, ChannelState.QUEUE) and channel.deadline <= now:
                    self.set_free(channel)
                    lapsed.append(channel.channel_id)
        return Expiry(expired_workers=expired, down_channels=down, lapsed_channels=lapsed)

    def _forget(self, worker: Worker) -> None:
        del self._workers[worker.worker_id]
        for channel_id in worker.channels:
            if self._channels.get(channel_id) is worker.channels[channel_id]:
                del self._channels[channel_id]

    def channel(self, channel_id: str) -> Channel | None:
        """The channel, also of an expired (not yet forgotten) worker; None if unknown."""
        return self._channels.get(channel_id)

    def routable(self, channel: Channel) -> bool:
        return channel.state != ChannelState.DOWN and self._workers[channel.worker_id].live

    def takes_work(self, channel: Channel) -> bool:
        """Routable and not retiring: it may be routed to and lease queued tuples."""
        return not channel.retiring and self.routable(channel)

    def drained(self, channel: Channel, holds_lease: Callable[[str], bool]) -> bool:
        """Holds nothing: no reservation or direct stream, no lease, no tuple in progress. A
        retiring channel in this state may have its engine stopped."""
        return (
            channel.state in (ChannelState.FREE, ChannelState.DOWN)
            and not channel.processing
            and channel.deadline == NEVER
            and not holds_lease(channel.channel_id)
        )

    def reserve_free(self, image: str) -> Channel | None:
        """Reserve the first FREE channel of ``image`` by :meth:`_rank_key` (now DIRECT), if any."""
        heap = self._free.get(image)
        while heap:
            key, _, channel = heapq.heappop(heap)
            if self._routable_free(channel) and key == self._rank_key(channel):
                now = self._clock()
                channel.state = ChannelState.DIRECT
                channel.last_used = channel.busy_at = now
                channel.deadline = now + self.reservation_seconds
                return channel
        return None

    def _rank_key(self, channel: Channel) -> tuple[object, ...]:
        """Where a FREE channel stands among its image's, the lowest routed to first: one with nothing
        in progress before one still processing its last tuple (that one would make the new tuple
        wait); then, concentrating, the lowest-ranked worker's first channel, else the least
        recently used."""
        if self.concentrate:
            return (channel.processing, self._workers[channel.worker_id].rank, channel.seq)
        return (channel.processing, channel.last_used, channel.channel_id)

    def _routable_free(self, channel: Channel) -> bool:
        """The channel may be reserved: still registered, FREE, not retiring, its worker live."""
        worker = self._workers.get(channel.worker_id)
        return (
            channel.state == ChannelState.FREE
            and not channel.retiring
            and worker is not None
            and worker.live
            and self._channels.get(channel.channel_id) is channel
        )

    def _offer(self, channel: Channel) -> None:
        """Enter the channel in its image's heap if it may be reserved, under its key now. Every
        change that makes a channel routable, or moves it among the free ones, calls this."""
        if not self._routable_free(channel):
            return
        heap = self._free.setdefault(channel.image, [])
        heapq.heappush(heap, (self._rank_key(channel), next(self._pushes), channel))
        if len(heap) > 64 + 4 * len(self._channels):  # entries that no longer hold pile up: rebuild
            fresh = [c for c in self._channels.values() if c.image == channel.image and self._routable_free(c)]
            heap[:] = [(self._rank_key(c), next(self._pushes), c) for c in fresh]
            heapq.heapify(heap)

    def set_processing(self, channel: Channel, processing: bool) -> None:
        """The channel's report says whether a tuple is in progress (routing prefers one idle)."""
        if channel.processing != processing:
            channel.processing = processing
            self._offer(channel)

    def set_retiring(self, channel: Channel, retiring: bool) -> None:
        """The elastic plan drains the channel (it takes no new work), or takes it back."""
        if channel.retiring != retiring:
            channel.retiring = retiring
            self._offer(channel)

    def idle_elsewhere(self, channel: Channel, holds_lease: Callable[[str], bool]) -> bool:
        """True if another live channel of ``channel``'s image is idle: FREE and processing
        nothing, or QUEUE and holding no lease (released, its pull on the way). A pull ahead
        (from a channel still busy with its last pull) yields to it."""
        return any(
            c.image == channel.image
            and c is not channel
            and not c.retiring
            and self._workers[c.worker_id].live
            and (
                (c.state == ChannelState.FREE and not c.processing)
                or (c.state == ChannelState.QUEUE and not holds_lease(c.channel_id))
            )
            for c in self._channels.values()
        )

    def touch(self, channel: Channel) -> None:
        """A report from the channel: a reservation (not a lease-held QUEUE) lives on, and the
        channel had work until now."""
        now = self._clock()
        channel.busy_at = now
        if channel.state in (ChannelState.DIRECT, ChannelState.QUEUE) and channel.deadline != NEVER:
            channel.deadline = now + self.reservation_seconds

    def idle_seconds(self, channel: Channel, holds_lease: Callable[[str], bool]) -> float:
        """How long the channel has been idle: FREE, processing nothing, holding no lease, of a
        live worker; 0 when it is not idle (busy, DOWN, expired)."""
        if (
            channel.state != ChannelState.FREE
            or channel.processing
            or not self._workers[channel.worker_id].live
            or holds_lease(channel.channel_id)
        ):
            return 0.0
        return max(0.0, self._clock() - channel.busy_at)

    def set_queue(self, channel: Channel, *, leased: bool) -> None:
        """QUEUE state: held by a lease, or reserved until the channel pulls."""
        now = self._clock()
        channel.state = ChannelState.QUEUE
        channel.last_used = channel.busy_at = now
        channel.deadline = NEVER if leased else now + self.reservation_seconds

    def set_free(self, channel: Channel) -> None:
        if channel.state != ChannelState.DOWN:
            channel.state = ChannelState.FREE
            channel.deadline = NEVER
            self._offer(channel)

    def serves(self, image: str | None = None) -> bool:
        """True if a live, non-DOWN channel that is not retiring runs ``image`` (None: any image)."""
        return any((image is None or c.image == image) and self.takes_work(c) for c in self._channels.values())

    def workers(self) -> Iterator[Worker]:
        return iter(sorted(self._workers.values(), key=lambda w: w.worker_id))

    def worker(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def forget_worker(self, worker_id: str) -> None:
        """Remove a worker given back (its channels go with it)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._forget(worker)

    def counts(self) -> tuple[int, int, int]:
        """(free, busy, down) channels of live workers; an expired worker's channels count as down."""
        free = busy = down = 0
        for channel in self._channels.values():
            if channel.state == ChannelState.DOWN or not self._workers[channel.worker_id].live:
                down += 1
            elif channel.state == ChannelState.FREE and not channel.processing:
                free += 1
            else:
                busy += 1
        return free, busy, down

    def age(self, worker: Worker) -> float:
        return max(0.0, self._clock() - worker.last_seen)


def check_name(what: str, value: str) -> None:
    if not value:
        raise InvalidArgument(f"{what} must not be empty")
    if len(value) > MAX_NAME:
        raise InvalidArgument(f"{what} is longer than {MAX_NAME} characters")
