"""The master's metrics (docs/monitoring.md): its counters and state read at each scrape,
copied under the master's lock in one short look, and two distributions observed as they
happen: how long a route request waited, and each tuple's latency from its gateway to its
features stored.

Labels: ``image`` (images the master knows: its ``images`` setting and what workers
offer), ``route`` (direct, queue), ``state`` (a channel's). No worker or channel id:
a cluster's workers come and go (elastic ones too), and their figures add up per image.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from hio.metrics import LATENCY_BUCKETS, ROUTE_WAIT_BUCKETS, Scraped, counters, gauge, gauges, histogram, role_registry

if TYPE_CHECKING:
    from hio.master.core import Master

CHANNEL_STATES = ("free", "direct", "queue", "down")


class MasterMetrics:
    """The master's registry. ``route_wait`` and ``latency`` are observed by the master."""

    def __init__(self, master: Master) -> None:
        self.route_wait = histogram(
            "hio_master_route_wait_seconds",
            "Time a RouteTuples request took, its wait for a free channel included, by the route it got",
            ROUTE_WAIT_BUCKETS,
            ["route"],
        )
        self.latency = histogram(
            "hio_master_tuple_latency_seconds",
            "Seconds from a tuple's acceptance at a gateway to its features stored (the engine's clock, "
            "at most when the master learnt it)",
            LATENCY_BUCKETS,
        )
        self.registry = role_registry(Scraped(lambda: families(master)), self.route_wait, self.latency)


def families(master: Master) -> Iterator[Metric]:
    """The metric families of one look at the master: its figures are copied under its lock (no
    disk, no network), the families made after it is released. Every image the master knows
    shows in the per-image figures, 0 included."""
    with master.lock:
        stats, queues = master.stats, master.queue.status()
        images = sorted({*master.config.images, *master.registry.offered_images, *master.queue.images()})
        routed, done, failed = dict(stats.routed_by), dict(stats.done_by), dict(stats.failed_by)
        done_bytes = dict(stats.bytes_by)
        channels: collections.Counter[tuple[str, str]] = collections.Counter()
        workers: collections.Counter[str] = collections.Counter()
        for worker in master.registry.workers():
            workers["live" if worker.live else "expired"] += 1
            for channel in worker.channels.values():
                channels[channel.image, channel.state.name.lower() if worker.live else "down"] += 1
        engines = master.engines(queues)
        dead_letters = len(master.dead)
        pool = master.scaler.pool if master.scaler is not None else None
        workers_wanted_present = (pool.wanted, pool.present) if pool is not None else None
        sync_failed = bool(master.durability.disk.failure)

    def per_image(values: Mapping[str, int]) -> dict[tuple[str], int]:
        return {(image,): 0 for image in images} | {(image,): n for image, n in values.items()}

    yield counters(
        "hio_master_tuples_routed",
        "Tuples routed, by route (direct to a channel, or to the backlog queue) and image",
        ["route", "image"],
        {(route, image): 0 for route in ("direct", "queue") for image in images} | routed,
    )
    yield counters("hio_master_tuples_done", "Tuples whose features were stored, by image", ["image"], per_image(done))
    yield counters(
        "hio_master_tuples_failed",
        "Processing attempts that failed (the tuple is tried again, or kept as a dead letter), by image",
        ["image"],
        per_image(failed),
    )
    yield counters(
        "hio_master_done_bytes",
        "Bytes of the tuples whose features were stored, by image",
        ["image"],
        per_image(done_bytes),
    )
    yield gauges(
        "hio_master_queue_tuples",
        "Tuples in the backlog queue (waiting or leased), by image",
        ["image"],
        per_image({q.image: q.length for q in queues}),
    )
    yield gauges(
        "hio_master_queue_leased_tuples",
        "Tuples of the backlog queue leased to an engine, by image",
        ["image"],
        per_image({q.image: q.leased for q in queues}),
    )
    yield gauges(
        "hio_master_queue_bytes",
        "Payload bytes in the backlog queue, by image",
        ["image"],
        per_image({q.image: q.bytes for q in queues}),
    )
    yield gauge("hio_master_queue_limit_bytes", "Bound of the backlog queue (queue_bytes)", master.config.queue_bytes)
    yield gauge("hio_master_dead_letters", "Tuples kept as dead letters (hio dead-letters)", dead_letters)
    yield gauge(
        "hio_master_queue_sync_failed",
        "1 after an fsync of the master's files failed: the backlog queue takes no new tuple until the master "
        "is restarted; else 0",
        int(sync_failed),
    )
    yield gauges(
        "hio_master_channels",
        "Processing channels by image and state (free, direct, queue; down includes those of expired workers)",
        ["image", "state"],
        {(image, state): 0 for image in {i for i, _ in channels} for state in CHANNEL_STATES} | channels,
    )
    yield gauges(
        "hio_master_workers",
        "Workers by state: live, or expired (silent past expiry_seconds, not yet forgotten)",
        ["state"],
        {(state,): workers[state] for state in ("live", "expired")},
    )
    yield gauges(
        "hio_master_engines_running",
        "Engines that take work, by image",
        ["image"],
        {(e.image,): e.running for e in engines},
    )
    yield gauges(
        "hio_master_engines_wanted",
        "Engines wanted by image: the elastic plan's, or (fixed scaling) what the live workers run",
        ["image"],
        {(e.image,): e.wanted for e in engines},
    )
    if workers_wanted_present is not None:
        wanted, present = workers_wanted_present
        yield gauge("hio_master_workers_wanted", "Workers the elastic plan wants (within its bounds)", wanted)
        yield gauge(
            "hio_master_workers_present",
            "Workers present for the elastic plan: serving, or asked for and not serving yet",
            present,
        )
