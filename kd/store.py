"""KD's accumulated features: Parquet files that are the single source of truth.

Each interval appends one file, ``part-<first offset>-<last offset>.parquet``,
written to a temporary name, fsynced and renamed: the rename is the commit
point of an interval. Everything else (the high-water offset, the malformed
count, the groups' feature matrices, the history) is derived from the files
when KD starts and kept up to date in memory, so nothing can disagree with it.

Exactly once: a row is accepted only if its offset is above every stored
offset and its tuple id was never stored. A micro-batch that Spark replays
after a crash (its commit log entry missing), a query whose checkpoint was
lost, or a compaction interrupted half-way therefore never counts a tuple
twice, whatever the order of failures.

A failed fsync (a folder's included) is final (:class:`~hio.storage.files.DiskFailure`):
every later interval is refused until KD restarts; Spark replays them then.

Cost: an append touches only the new rows (plus one sorted-array merge of the
known ids, a memory copy). The whole store is read once, at start.
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hio.kd.records import to_unsigned
from hio.storage.files import DiskFailure, atomic_write, clean_temporaries, fsync_dir

log = logging.getLogger("hio.kd")

PART_RE = re.compile(r"^part-(\d{20})-(\d{20})\.parquet$")
KEY_SEP = "\x1f"
COMPACT_AT_FILES = 64


class Group:
    """Features of one image with one feature set: what one clustering runs over.

    Rows live in arrays that grow by half their size when full, and the per-feature
    mean and sum of squared deviations are kept as rows arrive (Chan et al.'s
    pairwise update), so adding an interval's rows costs what they are, not what
    was stored before: no copy of the whole group and no pass over it to normalise."""

    def __init__(self, image: str, names: tuple[str, ...]) -> None:
        self.image = image
        self.names = names
        self.count = 0
        width = len(names)
        self._ids = np.empty(0, dtype=np.uint64)
        self._offsets = np.empty(0, dtype=np.int64)
        self._values = np.empty((0, width), dtype=np.float64)
        self._mean = np.zeros(width)
        self._m2 = np.zeros(width)  # sum of squared deviations from the mean, per feature

    def add(self, ids: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> None:
        added = len(ids)
        if not added:
            return
        self._reserve(self.count + added)
        end = self.count + added
        self._ids[self.count : end] = ids
        self._offsets[self.count : end] = offsets
        self._values[self.count : end] = values
        batch_mean = values.mean(axis=0)
        batch_m2 = ((values - batch_mean) ** 2).sum(axis=0)
        delta = batch_mean - self._mean
        self._mean = self._mean + delta * (added / end)
        self._m2 = self._m2 + batch_m2 + delta**2 * (self.count * added / end)
        self.count = end

    def _reserve(self, rows: int) -> None:
        if rows <= len(self._ids):
            return
        capacity = max(rows, len(self._ids) * 3 // 2, 1024)  # amortised O(1) a row; at most a third unused
        for name in ("_ids", "_offsets", "_values"):
            old = getattr(self, name)
            grown = np.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            grown[: self.count] = old[: self.count]
            setattr(self, name, grown)

    @property
    def ids(self) -> np.ndarray:
        """Tuple ids (uint64), in offset order."""
        return self._ids[: self.count]

    @property
    def offsets(self) -> np.ndarray:
        return self._offsets[: self.count]

    @property
    def values(self) -> np.ndarray:
        """(count, len(names)) float64 matrix, in offset order."""
        return self._values[: self.count]

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        """Per feature, the mean and the (population) standard deviation of every row so
        far; std 1 where a feature is constant, so it neither explodes nor matters."""
        std = np.sqrt(self._m2 / max(self.count, 1))
        return self._mean.copy(), np.where(std > 1e-12, std, 1.0)


@dataclass(frozen=True)
class Appended:
    """What one interval added to the store."""

    accepted: int
    malformed: int
    duplicates: int
    examples: tuple[str, ...] = ()  # a few malformed records: "offset N tuple T: why"


def _examples(table: pa.Table, limit: int = 3) -> tuple[str, ...]:
    bad = table.filter(table.column("error").is_valid()).slice(0, limit)
    return tuple(
        f"offset {o} tuple {to_unsigned(t)}: {e}"
        for o, t, e in zip(
            bad.column("offset").to_pylist(),
            bad.column("tuple_id").to_pylist(),
            bad.column("error").to_pylist(),
            strict=True,
        )
    )


def _merge_sorted(known: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``known`` (sorted, unique) with ``ids`` added. Ids grow over time, so the
    common case is an append: a copy, not a sort of everything known."""
    ids = np.unique(ids)
    if not len(known) or (len(ids) and ids[0] > known[-1]):
        return np.concatenate([known, ids])
    return np.union1d(known, ids)


class AccumulatedStore:
    """The Parquet folder plus its in-memory index. Driver-side, one writer."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.max_offset = 0
        self.total = 0
        self.malformed = 0
        self.groups: dict[tuple[str, tuple[str, ...]], Group] = {}
        self._known = np.empty(0, dtype=np.uint64)
        self._history: dict[float, int] = {}
        self._disk = DiskFailure(disk="KD's disk", owner="kd")

    def open(self) -> AccumulatedStore:
        """Read every part file once; drop leftovers of interrupted writes."""
        self.path.mkdir(parents=True, exist_ok=True)
        clean_temporaries(self.path)
        for part in self._parts():
            self._ingest(pq.read_table(part))
        self._compact_if_needed()
        log.info(
            "store opened",
            extra={
                "path": str(self.path),
                "records": self.total,
                "malformed": self.malformed,
                "max_offset": self.max_offset,
            },
        )
        return self

    def _parts(self) -> list[Path]:
        found = [(PART_RE.match(p.name), p) for p in self.path.iterdir()]
        return [p for m, p in sorted((m.groups(), p) for m, p in found if m)]

    def _compact_if_needed(self) -> None:
        """Merge many small interval files into one so a start opens few files.
        Written before the old files go: a crash in between leaves overlapping
        files, which the offset/id filter reads as the same rows once."""
        parts = self._parts()
        if len(parts) < COMPACT_AT_FILES:
            return
        self._write(pa.concat_tables([pq.read_table(p) for p in parts]))
        for part in parts:
            part.unlink()
        fsync_dir(self.path, self._disk)

    def append(self, table: pa.Table, interval_unix: float) -> Appended:
        """Keep the rows not stored yet; persist them (atomic), then index them."""
        self._disk.check()
        fresh, duplicates = self._fresh(table)
        if fresh.num_rows == 0:
            return Appended(0, 0, duplicates)
        malformed = fresh.num_rows - fresh.column("error").null_count
        fresh = fresh.append_column("interval_unix", pa.array(np.full(fresh.num_rows, interval_unix)))
        self._write(fresh)
        self._ingest(fresh)
        return Appended(fresh.num_rows - malformed, malformed, duplicates, _examples(fresh))

    def _fresh(self, table: pa.Table) -> tuple[pa.Table, int]:
        """Rows above the high-water offset whose ids are new, first of each id."""
        if table.num_rows == 0:
            return table, 0
        table = table.sort_by("offset")
        offsets = table.column("offset").to_numpy()
        ids = table.column("tuple_id").to_numpy().view(np.uint64)
        keep = offsets > self.max_offset
        _, first = np.unique(ids, return_index=True)
        unique = np.zeros(len(ids), dtype=bool)
        unique[first] = True
        keep &= unique & ~self._is_known(ids)
        duplicates = int(len(ids) - keep.sum())
        if duplicates:
            log.warning("skipped records already accumulated", extra={"count": duplicates})
        return table.filter(pa.array(keep)), duplicates

    def _is_known(self, ids: np.ndarray) -> np.ndarray:
        if not len(self._known):
            return np.zeros(len(ids), dtype=bool)
        pos = np.searchsorted(self._known, ids).clip(max=len(self._known) - 1)
        return self._known[pos] == ids

    def _write(self, table: pa.Table) -> None:
        offsets = table.column("offset").to_numpy()
        atomic_write(
            self.path / f"part-{int(offsets.min()):020d}-{int(offsets.max()):020d}.parquet",
            lambda fh: pq.write_table(table, fh, compression="zstd"),
            disk=self._disk,
        )

    def _ingest(self, table: pa.Table) -> None:
        """Index rows (already persisted) into groups, counters and history."""
        table, _ = self._fresh(table)
        if table.num_rows == 0:
            return
        ok = table.filter(table.column("error").is_null())
        self._index_groups(ok)
        ids = table.column("tuple_id").to_numpy().view(np.uint64)
        self._known = _merge_sorted(self._known, ids)
        self.max_offset = max(self.max_offset, int(pc.max(table.column("offset")).as_py()))
        self.malformed += table.num_rows - ok.num_rows
        self.total += ok.num_rows
        if ok.num_rows and "interval_unix" in ok.column_names:
            when, counts = np.unique(ok.column("interval_unix").to_numpy(), return_counts=True)
            for t, n in zip(when.tolist(), counts.tolist(), strict=True):
                self._history[t] = self._history.get(t, 0) + n

    def _index_groups(self, ok: pa.Table) -> None:
        if ok.num_rows == 0:
            return
        joined = pc.binary_join(ok.column("names"), KEY_SEP).to_pylist()
        images = ok.column("image").to_pylist()
        keys = np.array([f"{i}{KEY_SEP * 2}{j}" for i, j in zip(images, joined, strict=True)], dtype=object)
        uniq, inverse = np.unique(keys, return_inverse=True)
        ids = ok.column("tuple_id").to_numpy().view(np.uint64)
        offsets = ok.column("offset").to_numpy()
        values = ok.column("values").combine_chunks()
        for index, key in enumerate(uniq):
            rows = np.flatnonzero(inverse == index)
            image, _, joined_names = str(key).partition(KEY_SEP * 2)
            names = tuple(joined_names.split(KEY_SEP))
            matrix = pc.list_flatten(values.take(pa.array(rows))).to_numpy().reshape(len(rows), len(names))
            group = self.groups.setdefault((image, names), Group(image, names))
            group.add(ids[rows], offsets[rows], matrix)

    def ordered(self) -> list[Group]:
        """Every non-empty group, most tuples first (ties: by image, then feature names)."""
        groups = [g for g in self.groups.values() if g.count]
        return sorted(groups, key=lambda g: (-g.count, g.image, g.names))

    def history(self) -> list[tuple[float, int]]:
        """(interval time, cumulative accepted records), oldest first."""
        times = sorted(self._history)
        return list(zip(times, itertools.accumulate(self._history[t] for t in times), strict=True))
