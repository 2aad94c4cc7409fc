"""Where engines run: online first-fit bin packing of engines onto workers (the seeds' IRM).

Items are engines, sized by their image's profiled CPU share (cores); bins are
workers in rank order (the order they joined), sized by their vCPUs less a
safety margin. Packing is *online*: the last plan is where engines run, and a
new plan changes it as little as it can, since every move stops one engine
(drained) and starts another:

1. Engines an image no longer wants come off the highest-ranked workers first.
2. Engines it wants and lacks go to the first worker, in rank order, with room
   for them (an empty worker always has room, so an engine larger than a whole
   worker still runs somewhere). What fits nowhere is *unplaced*, and says how
   many new workers of ``new_capacity`` would hold it.
3. Then at most one worker is emptied: the highest-ranked one whose engines all
   fit on lower-ranked workers moves them there, so it can be given back.

Load thus concentrates on the lowest-ranked workers and the highest-ranked
ones empty first. A worker that runs engines of its own (started with fixed
``--engines``) is a bin whose contents count but never change.

Pure logic: no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Bin:
    """A worker as the packer sees it."""

    worker_id: str
    capacity: float  # cores engines may use: vCPUs less the safety margin
    fixed: Mapping[str, int] | None = None  # engines it runs of its own accord: counted, never changed


@dataclasses.dataclass(frozen=True)
class Plan:
    """Engines per image per worker, and what did not fit."""

    engines: dict[str, dict[str, int]]  # worker -> image -> engines (every bin, empty ones too)
    load: dict[str, float]  # worker -> cores its engines are expected to use
    unplaced: dict[str, int]  # image -> wanted engines no worker had room for
    new_bins: int  # workers of new_capacity that would hold the unplaced engines

    def used(self) -> list[str]:
        """Workers with at least one engine, in rank order."""
        return [worker for worker, images in self.engines.items() if any(images.values())]

    def count(self, image: str) -> int:
        return sum(images.get(image, 0) for images in self.engines.values())


class Packer:
    """Online first-fit packing (see the module's words)."""

    def pack(
        self,
        current: Mapping[str, Mapping[str, int]],
        wanted: Mapping[str, int],
        sizes: Mapping[str, float],
        bins: list[Bin],
        new_capacity: float,
    ) -> Plan:
        """The next plan: ``current`` (worker -> image -> engines, the last plan) changed to
        run ``wanted`` engines per image on ``bins`` (in rank order), each engine of an image
        sized ``sizes[image]`` cores."""
        placed: dict[str, dict[str, int]] = {}
        for b in bins:
            source = b.fixed if b.fixed is not None else current.get(b.worker_id, {})
            placed[b.worker_id] = {image: n for image, n in source.items() if n > 0}
        by_id = {b.worker_id: b for b in bins}
        elastic = [b for b in bins if b.fixed is None]

        def load(worker: str) -> float:
            return sum(sizes.get(image, 0.0) * n for image, n in placed[worker].items())

        images = sorted(set(wanted) | {image for engines in placed.values() for image in engines})
        for image in images:  # 1. surplus off the highest-ranked workers
            surplus = sum(engines.get(image, 0) for engines in placed.values()) - wanted.get(image, 0)
            for b in reversed(elastic):
                if surplus <= 0:
                    break
                take = min(surplus, placed[b.worker_id].get(image, 0))
                _add(placed[b.worker_id], image, -take)
                surplus -= take
        unplaced: dict[str, int] = {}
        for image in sorted(images, key=lambda i: (-sizes.get(i, 0.0), i)):  # 2. first fit, largest first
            size = sizes.get(image, 0.0)
            missing = wanted.get(image, 0) - sum(engines.get(image, 0) for engines in placed.values())
            for _ in range(max(0, missing)):
                target = next((b for b in elastic if _fits(load(b.worker_id), size, b.capacity)), None)
                if target is None:
                    unplaced[image] = unplaced.get(image, 0) + 1
                else:
                    _add(placed[target.worker_id], image, 1)
        self._empty_one(placed, elastic, sizes)  # 3.
        return Plan(
            engines={b.worker_id: placed[b.worker_id] for b in bins},
            load={worker: round(load(worker), 6) for worker in by_id},
            unplaced=unplaced,
            new_bins=_bins_for(unplaced, sizes, new_capacity),
        )

    @staticmethod
    def _empty_one(placed: dict[str, dict[str, int]], elastic: list[Bin], sizes: Mapping[str, float]) -> None:
        """Move the engines of the highest-ranked worker whose engines all fit on lower-ranked
        workers onto them (first fit), if there is such a worker."""
        for n in range(len(elastic) - 1, 0, -1):
            source = elastic[n]
            items = sorted(
                ((image, count) for image, count in placed[source.worker_id].items() if count),
                key=lambda item: -sizes.get(item[0], 0.0),
            )
            if not items:
                continue
            trial = {b.worker_id: dict(placed[b.worker_id]) for b in elastic[:n]}
            loads = {w: sum(sizes.get(i, 0.0) * c for i, c in engines.items()) for w, engines in trial.items()}
            ok = True
            for image, count in items:
                size = sizes.get(image, 0.0)
                for _ in range(count):
                    target = next(
                        (
                            b
                            for b in elastic[:n]
                            if loads[b.worker_id] > 0 and _fits(loads[b.worker_id], size, b.capacity)
                        ),
                        None,
                    )
                    if target is None:
                        ok = False
                        break
                    _add(trial[target.worker_id], image, 1)
                    loads[target.worker_id] += size
                if not ok:
                    break
            if ok:
                placed.update(trial)
                placed[source.worker_id] = {}
            return  # only the highest-ranked worker in use is tried: emptying one lower would not free it


def _fits(load: float, size: float, capacity: float) -> bool:
    """Room for one more engine; an empty worker always has room."""
    return load <= 0 or load + size <= capacity + 1e-9


def _add(engines: dict[str, int], image: str, n: int) -> None:
    engines[image] = engines.get(image, 0) + n
    if engines[image] <= 0:
        del engines[image]


def _bins_for(unplaced: Mapping[str, int], sizes: Mapping[str, float], capacity: float) -> int:
    """How many empty workers of ``capacity`` first fit needs for the unplaced engines."""
    loads: list[float] = []
    for image in sorted(unplaced, key=lambda i: (-sizes.get(i, 0.0), i)):
        size = sizes.get(image, 0.0)
        for _ in range(unplaced[image]):
            for n, used in enumerate(loads):
                if _fits(used, size, capacity):
                    loads[n] = used + size
                    break
            else:
                loads.append(size)
    return len(loads)


def headroom(workers: int) -> int:
    """Workers to keep beyond those in use, for load that arrives before new ones can boot
    (the seeds': 1 below 10 workers, ceil(0.5 ln n) below 100, floor(ln n) from there)."""
    if workers < 10:
        return 1
    if workers < 100:
        return math.ceil(0.5 * math.log(workers))
    return math.floor(math.log(workers))
