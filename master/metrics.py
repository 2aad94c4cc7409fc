"""The master's metrics (docs/monitoring.md): its counters and state read at each scrape
(:class:`MasterFigures`, gathered under the master's lock in one short look), and two
distributions observed as they happen: how long a route request waited, and each tuple's
latency from its gateway to its features stored.

Labels: ``image`` (images the master knows: its ``images`` setting and what workers
offer), ``route`` (direct, queue), ``state`` (a channel's). No worker or channel id:
a cluster's workers come and go (elastic ones too), and their figures add up per image.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from prometheus_client.core import Metric

from hio.metrics import (
    LATENCY_BUCKETS,
    ROUTE_WAIT_BUCKETS,
    Scraped,
    counters,
    gauge,
    gauges,
    histogram,
    role_registry,
)


@dataclasses.dataclass(frozen=True)
class MasterFigures:
    """What the master's metrics show, as one consistent look at it."""

    images: tuple[str, ...]  # every image the master knows: each shows in the per-image figures, 0 included
    routed: dict[tuple[str, str], int]  # (route, image) -> tuples routed
    done: dict[str, int]  # image -> tuples whose features were stored
    failed: dict[str, int]  # image -> processing attempts that failed
    done_bytes: dict[str, int]  # image -> bytes of the tuples stored
    queued: dict[str, int]  # image -> tuples in the backlog (waiting or leased)
    queued_bytes: dict[str, int]
    leased: dict[str, int]
    queue_limit_bytes: int
    dead_letters: int
    channels: dict[tuple[str, str], int]  # (image, state) -> channels
    workers: dict[str, int]  # live / expired -> workers
    engines_running: dict[str, int]  # image -> engines taking work
    engines_wanted: dict[str, int]  # image -> engines the plan wants (fixed: what the workers run)
    workers_wanted: int | None  # elastic scaling only
    workers_present: int | None
    sync_failed: bool = False  # an fsync of the master's files failed: the queue takes no new tuple until restart


CHANNEL_STATES = ("free", "direct", "queue", "down")


class MasterMetrics:
    """The master's registry. ``route_wait`` and ``latency`` are observed by the master."""

    def __init__(self, figures: Callable[[], MasterFigures]) -> None:
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
        self.registry = role_registry(Scraped(lambda: families(figures())), self.route_wait, self.latency)


def families(f: MasterFigures) -> Iterator[Metric]:
    """The metric families of one look at the master."""
    per_image = {(image,): 0 for image in f.images}
    yield counters(
        "hio_master_tuples_routed",
        "Tuples routed, by route (direct to a channel, or to the backlog queue) and image",
        ["route", "image"],
        {(route, image): 0 for route in ("direct", "queue") for image in f.images} | f.routed,
    )
    yield counters(
        "hio_master_tuples_done",
        "Tuples whose features were stored, by image",
        ["image"],
        per_image | {(i,): n for i, n in f.done.items()},
    )
    yield counters(
        "hio_master_tuples_failed",
        "Processing attempts that failed (the tuple is tried again, or kept as a dead letter), by image",
        ["image"],
        per_image | {(i,): n for i, n in f.failed.items()},
    )
    yield counters(
        "hio_master_done_bytes",
        "Bytes of the tuples whose features were stored, by image",
        ["image"],
        per_image | {(i,): n for i, n in f.done_bytes.items()},
    )
    yield gauges(
        "hio_master_queue_tuples",
        "Tuples in the backlog queue (waiting or leased), by image",
        ["image"],
        per_image | {(i,): n for i, n in f.queued.items()},
    )
    yield gauges(
        "hio_master_queue_leased_tuples",
        "Tuples of the backlog queue leased to an engine, by image",
        ["image"],
        per_image | {(i,): n for i, n in f.leased.items()},
    )
    yield gauges(
        "hio_master_queue_bytes",
        "Payload bytes in the backlog queue, by image",
        ["image"],
        per_image | {(i,): n for i, n in f.queued_bytes.items()},
    )
    yield gauge("hio_master_queue_limit_bytes", "Bound of the backlog queue (queue_bytes)", f.queue_limit_bytes)
    yield gauge("hio_master_dead_letters", "Tuples kept as dead letters (hio dead-letters)", f.dead_letters)
    yield gauge(
        "hio_master_queue_sync_failed",
        "1 after an fsync of the master's files failed: the backlog queue takes no new tuple until the master "
        "is restarted; else 0",
        int(f.sync_failed),
    )
    yield gauges(
        "hio_master_channels",
        "Processing channels by image and state (free, direct, queue; down includes those of expired workers)",
        ["image", "state"],
        {(image, state): 0 for image in {i for i, _ in f.channels} for state in CHANNEL_STATES} | f.channels,
    )
    yield gauges(
        "hio_master_workers",
        "Workers by state: live, or expired (silent past expiry_seconds, not yet forgotten)",
        ["state"],
        {("live",): 0, ("expired",): 0} | {(state,): n for state, n in f.workers.items()},
    )
    yield gauges(
        "hio_master_engines_running",
        "Engines that take work, by image",
        ["image"],
        {(i,): n for i, n in f.engines_running.items()},
    )
    yield gauges(
        "hio_master_engines_wanted",
        "Engines wanted by image: the elastic plan's, or (fixed scaling) what the live workers run",
        ["image"],
        {(i,): n for i, n in f.engines_wanted.items()},
    )
    if f.workers_wanted is not None and f.workers_present is not None:
        yield gauge("hio_master_workers_wanted", "Workers the elastic plan wants (within its bounds)", f.workers_wanted)
        yield gauge(
            "hio_master_workers_present",
            "Workers present for the elastic plan: serving, or asked for and not serving yet",
            f.workers_present,
        )
