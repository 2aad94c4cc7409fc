"""Tuple ids: 64-bit, unique, strictly increasing, also across restarts.

The allocator persists a high-water mark: before it hands out an id above
the mark it reserves a whole block (default 100 000 ids) with one fsync'd
write. After a crash the next id starts above the old mark, so ids issued
before the crash are never issued again; at most one block is skipped.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from hio.storage.files import atomic_write, clean_temporaries
from hio.transport.frames import crc32

_RECORD = struct.Struct(">QI")  # high-water mark, CRC-32 of the mark
MAX_ID = 2**64 - 1
DEFAULT_BLOCK = 100_000


class IdFileError(RuntimeError):
    """The id file exists but cannot be trusted; refusing to start beats reusing ids."""


class TupleIdAllocator:
    """Issues tuple ids; not thread-safe (the master calls it under its lock)."""

    def __init__(self, path: str | os.PathLike[str], block: int = DEFAULT_BLOCK) -> None:
        if block < 1:
            raise ValueError("block must be positive")
        self._path = Path(path)
        self._block = block
        self._mark = self._load()
        # Everything up to the old mark may have been issued before a restart.
        self._last = self._mark

    @property
    def last_issued(self) -> int:
        """The highest id that may have been issued (ids above it are unknown)."""
        return self._last

    def allocate(self, count: int = 1) -> list[int]:
        """``count`` fresh ids in increasing order."""
        if count < 1:
            return []
        first = self._last + 1
        last = self._last + count
        if last > MAX_ID:
            raise OverflowError("tuple id space exhausted")
        if last > self._mark:
            self._reserve(last)
        self._last = last
        return list(range(first, last + 1))

    def issued(self, tuple_id: int) -> bool:
        """True if ``tuple_id`` may have been handed out by this allocator."""
        return 0 < tuple_id <= self._last

    def _reserve(self, needed: int) -> None:
        mark = min(MAX_ID, max(needed, self._mark + self._block))
        atomic_write(self._path, _RECORD.pack(mark, crc32(struct.pack(">Q", mark))))
        self._mark = mark

    def _load(self) -> int:
        clean_temporaries(self._path.parent)
        try:
            raw = self._path.read_bytes()
        except FileNotFoundError:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            return 0
        if len(raw) != _RECORD.size:
            raise IdFileError(f"{self._path}: expected {_RECORD.size} bytes, found {len(raw)}")
        mark, check = _RECORD.unpack(raw)
        if crc32(struct.pack(">Q", mark)) != check:
            raise IdFileError(
                f"{self._path}: checksum mismatch; restore it or remove it only if "
                "no gateway holds ids from this master"
            )
        return mark
