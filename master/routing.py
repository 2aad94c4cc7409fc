"""The routing decision: a free channel (direct) or the backlog queue.

Direct only when a FREE channel of the image exists, the image's queue has no
waiting tuple, and no tuple routed to the queue is still on its way there:
otherwise a newcomer would overtake tuples that arrived first. Among FREE
channels the least recently used wins, so load spreads across workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hio.master.registry import ChannelRegistry
from hio.proto.master_pb2 import ChannelRoute, QueueRoute

# A route as the wire says it: a channel (direct), or the queue with the tuples of the image
# ahead of these (queued or on their way); the master's server adds its lane port.
Route = ChannelRoute | QueueRoute


class PendingEnqueues:
    """Tuples routed to the queue that have not arrived there yet, per image.

    An entry ends when the tuple is enqueued, or after ``ttl`` seconds (its
    sender gave up or will route it again), so a lost sender cannot keep an
    image off direct routing for long. Not thread-safe (master lock).
    """

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._clock = clock
        self._pending: dict[str, dict[int, float]] = {}

    def add(self, image: str, tuple_ids: list[int]) -> None:
        deadline = self._clock() + self._ttl
        table = self._pending.setdefault(image, {})
        for tuple_id in tuple_ids:
            table[tuple_id] = deadline

    def arrived(self, image: str, tuple_id: int) -> None:
        table = self._pending.get(image)
        if table is not None:
            table.pop(tuple_id, None)
            if not table:
                del self._pending[image]

    def count(self, image: str) -> int:
        self.expire(image)
        return len(self._pending.get(image, ()))

    def expire(self, image: str | None = None) -> None:
        now = self._clock()
        for name in [image] if image is not None else list(self._pending):
            table = self._pending.get(name)
            if not table:
                continue
            for tuple_id in [t for t, deadline in table.items() if deadline <= now]:
                del table[tuple_id]
            if not table:
                del self._pending[name]


def route_tuples(
    registry: ChannelRegistry,
    pending: PendingEnqueues,
    *,
    image: str,
    tuple_ids: list[int],
    queue_waiting: int,
    queue_length: int,
    force_queue: bool,
    may_wait: bool = False,
) -> Route | None:
    """Decide the route of one batch; reserves the channel or records the pending enqueues.

    With ``may_wait``, None instead of a queue route when only a busy channel
    stands in the way: the caller waits for one to free up and asks again.
    """
    on_the_way = pending.count(image)
    if not force_queue and queue_waiting == 0 and on_the_way == 0:
        channel = registry.reserve_free(image)
        if channel is not None:
            return ChannelRoute(
                channel_id=channel.channel_id,
                address=channel.address,
                reservation_seconds=registry.reservation_seconds,
                lane_address=channel.lane_address,
            )
        if may_wait:
            return None
    pending.add(image, tuple_ids)
    return QueueRoute(queue_length=queue_length + on_the_way)
