"""Where engines run: online first-fit bin packing of engines onto workers (the seeds' IRM).

As docs/elasticity.md ("The loop", step 3) says: the last plan is where engines run and the
new one changes it as little as it can (every move stops one engine and starts another):
surplus engines come off the highest-ranked workers, missing ones go to the first worker with
room, largest first, then at most one worker is emptied onto lower-ranked ones. A worker with
engines of its own is a bin whose contents count but never change. Pure logic: no clock, no I/O.
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
        elastic = [b for b in bins if b.fixed is None]

        def count(image: str) -> int:
            return sum(engines.get(image, 0) for engines in placed.values())

        images = sorted(set(wanted) | {image for engines in placed.values() for image in engines})
        for image in images:  # surplus off the highest-ranked workers
            surplus = count(image) - wanted.get(image, 0)
            for b in reversed(elastic):
                if surplus <= 0:
                    break
                take = min(surplus, placed[b.worker_id].get(image, 0))
                _add(placed[b.worker_id], image, -take)
                surplus -= take
        missing = {image: n for image in images if (n := wanted.get(image, 0) - count(image)) > 0}
        unplaced = _first_fit(missing, sizes, [placed[b.worker_id] for b in elastic], [b.capacity for b in elastic])
        for n in range(len(elastic) - 1, 0, -1):  # empty the highest-ranked worker in use if lower ones take it all
            source = placed[elastic[n].worker_id]
            if not source:
                continue
            lower = [dict(placed[b.worker_id]) for b in elastic[:n]]
            if not _first_fit(source, sizes, lower, [b.capacity for b in elastic[:n]], onto_empty=False):
                placed.update(zip([b.worker_id for b in elastic[:n]], lower, strict=True))
                placed[elastic[n].worker_id] = {}
            break  # only the highest-ranked worker in use is tried: emptying one lower would not free it
        new_bins: list[dict[str, int]] = [{} for _ in range(sum(unplaced.values()))]
        _first_fit(unplaced, sizes, new_bins, [new_capacity] * len(new_bins))
        return Plan(
            engines={b.worker_id: placed[b.worker_id] for b in bins},
            load={
                b.worker_id: round(sum(sizes.get(i, 0.0) * c for i, c in placed[b.worker_id].items()), 6) for b in bins
            },
            unplaced=unplaced,
            new_bins=sum(1 for engines in new_bins if engines),
        )


def _first_fit(
    engines: Mapping[str, int],
    sizes: Mapping[str, float],
    bins: list[dict[str, int]],
    capacities: list[float],
    onto_empty: bool = True,
) -> dict[str, int]:
    """Place ``engines`` (image -> count), largest first (ties in their order), each onto the
    first of ``bins`` (changed in place) with room for it; an empty bin has room unless
    ``onto_empty`` is false. The engines that fit nowhere, per image."""
    loads = [sum(sizes.get(image, 0.0) * n for image, n in engines_of.items()) for engines_of in bins]
    unplaced: dict[str, int] = {}
    for image in sorted(engines, key=lambda i: -sizes.get(i, 0.0)):
        size = sizes.get(image, 0.0)
        for _ in range(engines[image]):
            target = next(
                (n for n, load in enumerate(loads) if (onto_empty or load > 0) and _fits(load, size, capacities[n])),
                None,
            )
            if target is None:
                unplaced[image] = unplaced.get(image, 0) + 1
            else:
                _add(bins[target], image, 1)
                loads[target] += size
    return unplaced


def _fits(load: float, size: float, capacity: float) -> bool:
    """Room for one more engine; an empty worker always has room."""
    return load <= 0 or load + size <= capacity + 1e-9


def _add(engines: dict[str, int], image: str, n: int) -> None:
    engines[image] = engines.get(image, 0) + n
    if engines[image] <= 0:
        del engines[image]


def headroom(workers: int) -> int:
    """Workers to keep beyond those in use, for load that arrives before new ones can boot
    (the seeds': 1 below 10 workers, ceil(0.5 ln n) below 100, floor(ln n) from there)."""
    if workers < 10:
        return 1
    if workers < 100:
        return math.ceil(0.5 * math.log(workers))
    return math.floor(math.log(workers))
