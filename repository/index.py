"""The in-memory index of the feature log, kept compact.

Offsets are dense (1..latest), so offset -> location is two growing typed
arrays indexed by ``offset - 1`` (12 bytes a record) plus the first offset of
each segment (found by bisection). tuple id -> offset is one int -> int dict.
Not thread safe: the feature log guards it with its lock.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable
from typing import NamedTuple


class Location(NamedTuple):
    """Where one record lives: its segment (by the offset of the segment's first record, which
    names the file), byte position, record length."""

    segment: int
    position: int
    length: int


class OffsetIndex:
    """tuple id -> offset, and offset -> (segment, position, length)."""

    __slots__ = ("_ids", "_lengths", "_positions", "_segment_firsts")

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}
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

    def begin_segment(self, first_offset: int) -> None:
        """Records added from now on live in a new segment starting at ``first_offset``."""
        if first_offset != self.latest + 1:
            raise ValueError(f"segment must begin at offset {self.latest + 1}, not {first_offset}")
        self._segment_firsts.append(first_offset)

    def add(self, tuple_id: int, position: int, length: int) -> int:
        """Index the next record (in the last segment); returns its offset."""
        self._positions.append(position)
        self._lengths.append(length)
        offset = len(self._positions)
        self._ids.setdefault(tuple_id, offset)
        return offset

    def extend(self, tuple_ids: Iterable[int], positions: array[int], lengths: array[int]) -> None:
        """Index many records of the last segment at once (the rebuild path)."""
        first = self.latest + 1
        self._positions.extend(positions)
        self._lengths.extend(lengths)
        ids = self._ids
        for offset, tuple_id in enumerate(tuple_ids, first):
            if tuple_id not in ids:
                ids[tuple_id] = offset

    def offset_of(self, tuple_id: int) -> int:
        """Offset of ``tuple_id``, or 0 if it is not stored."""
        return self._ids.get(tuple_id, 0)

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
