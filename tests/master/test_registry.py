"""The registry's choice of a free channel: whatever happened to the channels before, it is
the one a look at every channel would choose (the rule of ``reserve_free``)."""

from __future__ import annotations

import random

import pytest

from hio.master.registry import Channel, ChannelRegistry, ChannelState
from hio.proto import master_pb2

IMAGES = ("hio/a", "hio/b")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _specs(worker: int, count: int) -> list[master_pb2.ChannelInfo]:
    return [
        master_pb2.ChannelInfo(
            channel_id=f"w{worker}/{n}", image=IMAGES[n % 2], address=f"127.0.0.1:{9000 + n}", state=master_pb2.FREE
        )
        for n in range(count)
    ]


def _expected(registry: ChannelRegistry, image: str) -> str | None:
    """The rule, by looking at every channel."""
    free = [
        (c, w.rank)
        for w in registry.workers()
        if w.live
        for c in w.channels.values()
        if c.image == image and c.state == ChannelState.FREE and not c.retiring
    ]
    if not free:
        return None
    if registry.concentrate:
        return min(free, key=lambda cr: (cr[0].processing, cr[1], cr[0].seq))[0].channel_id
    return min(free, key=lambda cr: (cr[0].processing, cr[0].last_used, cr[0].channel_id))[0].channel_id


def _channels(registry: ChannelRegistry) -> list[Channel]:
    return [c for w in registry.workers() for c in w.channels.values()]


@pytest.mark.parametrize("concentrate", [False, True])
def test_the_free_channel_reserved_is_the_one_the_rule_picks_after_any_sequence_of_changes(concentrate: bool) -> None:
    rng = random.Random(7)
    clock = Clock()
    registry = ChannelRegistry(
        expiry_seconds=5, reservation_seconds=2, forget_seconds=30, concentrate=concentrate, clock=clock
    )
    for worker in range(4):
        registry.register(f"w{worker}", "host", 4, _specs(worker, 6))
    reserved = 0
    for step in range(3000):
        clock.now += rng.choice((0.0, 0.01, 0.5))
        channels = _channels(registry)
        channel = rng.choice(channels)
        action = rng.randrange(9)
        if action <= 2:
            image = rng.choice(IMAGES)
            expected = _expected(registry, image)
            got = registry.reserve_free(image)
            assert (got.channel_id if got else None) == expected, f"step {step}"
            reserved += got is not None
        elif action == 3:
            registry.set_free(channel)
        elif action == 4:
            registry.set_processing(channel, not channel.processing)
        elif action == 5:
            registry.set_retiring(channel, rng.random() < 0.3)
        elif action == 6:  # a heartbeat: some channels down, the rest up; sometimes a worker stays silent
            worker = channel.worker_id
            if rng.random() < 0.9:
                down = {c.channel_id: "crashed" for c in channels if c.worker_id == worker and rng.random() < 0.2}
                registry.heartbeat(worker, down)
        elif action == 7:
            registry.expire()
        else:  # a worker registers again (a restart) or drops a channel
            worker = int(channel.worker_id[1:])
            if rng.random() < 0.5:
                registry.register(channel.worker_id, "host", 4, _specs(worker, rng.randint(3, 6)))
            else:
                registry.sync(channel.worker_id, _specs(worker, rng.randint(3, 6)))
            registry.assign_rank(channel.worker_id, rng.randrange(8))
    assert reserved > 300  # the sequence did route, often
