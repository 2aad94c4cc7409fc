"""The worker's metrics (docs/monitoring.md): its engines by image and state, their
restarts, the CPU they use (read at each heartbeat), and how long their ``process()``
calls take, which each engine measures and the worker asks for at each scrape
(``Engine.GetEngineStats``, all at once, within :data:`ENGINE_STATS_TIMEOUT`).

Counters add up the figures of every engine of an image, restarted and removed ones
included (:class:`hio.metrics.Tally`), so they only grow. Label ``image`` only: a
channel's id names one engine of one worker, and the images an operator runs are few.
"""

from __future__ import annotations

import collections
import logging
import operator
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client.core import Metric

from hio.metrics import PROCESS_BUCKETS, BucketCounts, Scraped, Tally, counters, gauges, histograms, role_registry
from hio.proto import engine_pb2, engine_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.net import create_channel

if TYPE_CHECKING:
    from hio.worker.controller import Controller, EngineSlot

log = logging.getLogger("hio.worker")

ENGINE_STATS_TIMEOUT = 1.0  # seconds a scrape waits for its engines' answers (asked at once)
BOUNDS = (*PROCESS_BUCKETS, float("inf"))  # an engine of another hio version may have others: not added up


class WorkerMetrics:
    """The worker's registry, reading its controller (and engines) at each scrape."""

    def __init__(self, controller: Controller, settings: ClusterSettings) -> None:
        self._controller = controller
        self._settings = settings
        self._lock = threading.Lock()  # one scrape at a time: the tally and the channels are shared
        self._process: Tally[tuple[str, str], BucketCounts] = Tally(BucketCounts.empty, operator.add)
        self._channels: dict[str, grpc.Channel] = {}  # engine address -> its channel, kept between scrapes
        self.registry = role_registry(Scraped(self._families))

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def _families(self) -> Iterator[Metric]:
        slots, restarts_gone = self._controller.engine_slots()
        with self._lock:
            self._read_engines(slots)
            process = self._process.totals()
        images = {slot.image for slot in slots} | set(restarts_gone) | set(process)
        states: collections.Counter[tuple[str, str]] = collections.Counter(
            {(image, state): 0 for image in images for state in ("up", "down")}
        )
        restarts = collections.Counter({(image,): count for image, count in restarts_gone.items()})
        for slot in slots:
            states[slot.image, "up" if slot.up else "down"] += 1
            restarts[(slot.image,)] += slot.restarts
        yield gauges(
            "hio_worker_engines",
            "Engines by image and state: up (serving), down (starting, restarting, or unable to start)",
            ["image", "state"],
            states,
        )
        yield counters(
            "hio_worker_engine_restarts",
            "Times an engine of the image exited and was (or will be) started again",
            ["image"],
            {(image,): restarts.get((image,), 0) for image in images},
        )
        yield counters(
            "hio_worker_engine_cpu_seconds",
            "CPU seconds the image's engines used (their processes and what those started), read at each heartbeat",
            ["image"],
            {(image,): seconds for image, seconds in self._controller.cpu.totals().items()},
        )
        yield gauges(
            "hio_worker_engine_cpu_share",
            "Cores the image's engines used between the last two heartbeats (1.0 = one core)",
            ["image"],
            {(image,): share for image, share in self._controller.cpu_shares.items()},
        )
        yield histograms(
            "hio_worker_process_seconds",
            "Wall seconds of one process() call (failed calls included) in the image's engines",
            ["image"],
            {(image,): counts for image, counts in process.items() if counts.bounds},
        )

    def _read_engines(self, slots: list[EngineSlot]) -> None:
        """Ask every running engine for its figures at once; one that does not answer in
        time keeps its last figures."""
        addresses = {slot.channel_id: self._controller.engine_address(slot) for slot in slots}
        running = {(slot.channel_id, handle.ident): slot.image for slot in slots if (handle := slot.handle) is not None}
        calls = {
            key: self._stub(addresses[key[0]]).GetEngineStats.future(
                engine_pb2.GetEngineStatsRequest(), timeout=ENGINE_STATS_TIMEOUT
            )
            for key in running
        }
        figures: dict[tuple[str, str], BucketCounts] = {}
        for key, call in calls.items():
            try:
                reply = call.result()
            except grpc.RpcError as exc:  # starting, stopping, busy past the timeout, an older image
                log.debug("an engine did not give its figures", extra={"channel": key[0], "code": str(exc.code())})
                continue
            if tuple(reply.process_bucket_bounds) == BOUNDS and len(reply.process_bucket_counts) == len(BOUNDS):
                counts = tuple(map(float, reply.process_bucket_counts))
                figures[key] = BucketCounts(BOUNDS, counts, reply.process_seconds_sum)
        self._process.update(running, figures)
        for address in set(self._channels) - set(addresses.values()):
            self._channels.pop(address).close()

    def _stub(self, address: str) -> engine_pb2_grpc.EngineStub:
        if address not in self._channels:
            self._channels[address] = create_channel(address, self._settings)
        return engine_pb2_grpc.EngineStub(self._channels[address])
