"""The in-memory index of the feature log, kept compact.

Offsets are dense (1..latest), so offset -> location is two growing typed
arrays indexed by ``offset - 1`` (12 bytes a record) plus the first offset of
each segment (found by bisection).

tuple id -> offset is two sorted numpy arrays (ids, and the offset of each: 16
bytes a record) searched by bisection, and a dict of the ids added since they
were last merged into the arrays. A dict of every id costs about ten times as
much (an entry, a key object and a value object each): at ten million records,
more than a gigabyte. Merging copies the arrays, so it waits until the dict
holds an eighth of what they do (at least ``MERGE_MIN`` ids), and a put pays
for it in proportion. Ids stored twice in the log (never written by the log
itself) keep their first offset, as ``dict.setdefault`` would.

Not thread safe: the feature log guards it with its lock.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

MERGE_MIN = 1 << 16  # ids kept in the dict before a merge, at least
MAX_ID = 2**64 - 1

U64 = npt.NDArray[np.uint64]


class Location(NamedTuple):
    """Where one record lives: its segment (by the offset of the segment's first record, which
    names the file), byte position, record length."""

    segment: int
    position: int
    length: int


class OffsetIndex:
    """tuple id -> offset, and offset -> (segment, position, length)."""

    __slots__ = ("_lengths", "_offsets", "_positions", "_recent", "_segment_firsts", "_sorted_ids")

    def __init__(self) -> None:
        self._sorted_ids: U64 = np.empty(0, dtype=np.uint64)
        self._offsets: U64 = np.empty(0, dtype=np.uint64)  # the offset of each of _sorted_ids
        self._recent: dict[int, int] = {}  # ids indexed since the last merge
        self._positions = array("Q")
        self._lengths = array("I")
        self._segment_firsts: list[int] = []

    @property
    def latest(self) -> int:
        """Highest offset indexed (0 when empty); equals the number of records."""
        return len(self._positions)

    @property
    def segments(self) -> int:
        return len(self._segment_firsts)

    def longest(self) -> int:
        """Length of the longest record indexed (0 when empty)."""
        return int(np.frombuffer(self._lengths, dtype=np.uint32).max()) if self._lengths else 0

    def begin_segment(self, first_offset: int) -> None:
        """Records added from now on live in a new segment starting at ``first_offset``."""
        if first_offset != self.latest + 1:
            raise ValueError(f"segment must begin at offset {self.latest + 1}, not {first_offset}")
        self._segment_firsts.append(first_offset)

    def add(self, tuple_id: int, position: int, length: int) -> int:
        """Index the next record (in the last segment); returns its offset. An id indexed
        already keeps its offset: the log looks each id up before it writes (:meth:`offset_of`),
        so only ids added since the last merge are checked again here."""
        self._positions.append(position)
        self._lengths.append(length)
        offset = len(self._positions)
        self._recent.setdefault(tuple_id, offset)
        if len(self._recent) >= max(MERGE_MIN, len(self._sorted_ids) // 8):
            self._merge_recent()
        return offset

    def extend(self, tuple_ids: Iterable[int], positions: array[int], lengths: array[int]) -> None:
        """Index many records of the last segment at once (the rebuild path)."""
        first = self.latest + 1
        self._positions.extend(positions)
        self._lengths.extend(lengths)
        ids = np.fromiter(tuple_ids, dtype=np.uint64)
        self._merge_recent()
        self._merge(ids, np.arange(first, first + len(ids), dtype=np.uint64))

    def offset_of(self, tuple_id: int) -> int:
        """Offset of ``tuple_id``, or 0 if it is not stored."""
        offset = self._recent.get(tuple_id)
        if offset is not None:
            return offset
        ids = self._sorted_ids
        if not ids.size or not 0 < tuple_id <= MAX_ID:
            return 0
        i = int(ids.searchsorted(np.uint64(tuple_id)))
        return int(self._offsets[i]) if i < ids.size and int(ids[i]) == tuple_id else 0

    def _merge_recent(self) -> None:
        if self._recent:
            ids = np.fromiter(self._recent.keys(), dtype=np.uint64, count=len(self._recent))
            offsets = np.fromiter(self._recent.values(), dtype=np.uint64, count=len(self._recent))
            self._recent = {}
            self._merge(ids, offsets)

    def _merge(self, ids: U64, offsets: U64) -> None:
        """Merge (id, offset) pairs into the sorted arrays; an id already there, or repeated
        among the pairs, keeps its lowest offset."""
        if not ids.size:
            return
        order = np.lexsort((offsets, ids))  # by id, then offset: unique's first of equal ids is the lowest
        ids, first = np.unique(ids[order], return_index=True)
        offsets = offsets[order][first]
        known = self._sorted_ids
        at = known.searchsorted(ids)
        if known.size:
            there = known[np.minimum(at, known.size - 1)] == ids
            ids, offsets, at = ids[~there], offsets[~there], at[~there]
        self._sorted_ids = np.insert(known, at, ids)
        self._offsets = np.insert(self._offsets, at, offsets)

    def locations(self, first: int, last: int) -> list[Location]:
        """Locations of offsets ``first..last`` inclusive, all within 1..latest."""
        firsts = self._segment_firsts
        segment = bisect.bisect_right(firsts, first) - 1
        out = []
        for offset in range(first, last + 1):
            while segment + 1 < len(firsts) and firsts[segment + 1] <= offset:
                segment += 1
            out.append(Location(firsts[segment], self._positions[offset - 1], self._lengths[offset - 1]))
        return out
