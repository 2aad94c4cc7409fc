"""The on-disk format of feature segments, and scanning them back.

A segment is a file named after the first offset it holds
(``00000000000000000001.seg``), starting with an 8-byte magic, followed by
records::

    u32 length      bytes of the zstd payload
    u32 crc32       CRC-32 of everything after this field (offset, tuple_id, payload)
    u64 offset      1, 2, 3, ... across segments, without gaps
    u64 tuple_id
    payload         the zstd-compressed FeatureRecord, as the engine sent it

All integers little-endian. The CRC covers the offset and id as well as the
payload, so a flipped bit anywhere in a record is found when it is scanned or
read. Segments are only ever appended to; a sealed segment never changes.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from array import array
from pathlib import Path

from hio.storage.segmentlog import Naming
from hio.transport.frames import crc32

MAGIC = b"HIOFEAT1"
HEADER = struct.Struct("<IIQQ")
HEADER_SIZE = HEADER.size
_IDS = struct.Struct("<QQ")
NAMING = Naming("", 20, ".seg")  # named after the offset of the segment's first record


def encode_record(out: bytearray, offset: int, tuple_id: int, payload: bytes) -> int:
    """Frame one record onto the end of ``out`` (records are appended in runs); its length."""
    ids = _IDS.pack(offset, tuple_id)
    out += struct.pack("<II", len(payload), crc32(payload, crc32(ids)))
    out += ids
    out += payload
    return HEADER_SIZE + len(payload)


def decode_record(buf: bytes | memoryview, offset: int) -> tuple[int, bytes] | None:
    """(tuple_id, payload) of one framed record read back from disk, or None
    unless it is exactly one whole record for ``offset`` with a valid CRC."""
    if len(buf) < HEADER_SIZE:
        return None
    length, crc, got_offset, tuple_id = HEADER.unpack_from(buf, 0)
    if got_offset != offset or len(buf) != HEADER_SIZE + length:
        return None
    view = memoryview(buf)
    if crc32(view[8:]) != crc:
        return None
    return tuple_id, bytes(view[HEADER_SIZE:])


@dataclasses.dataclass
class ScanResult:
    """What scanning one segment found: the valid records and where they end."""

    valid_end: int  # byte position just after the last valid record
    file_size: int
    tuple_ids: list[int]
    positions: array[int]  # array('Q') of record start positions
    lengths: array[int]  # array('I') of whole record lengths (header + payload)
    problem: str = ""  # why scanning stopped before the end, if it did


def scan_segment(path: Path, first_offset: int) -> ScanResult:
    """Read every valid record of a segment, in order, stopping at the first
    record that is incomplete, damaged or out of sequence.

    No size limit applies here: a record stored under a larger
    ``max_record_bytes`` than today's is still valid data.

    Offsets must run ``first_offset, first_offset+1, ...``. The caller decides
    what a stop before the end means (a torn tail in the last segment, damage
    elsewhere).
    """
    size = path.stat().st_size
    result = ScanResult(len(MAGIC), size, [], array("Q"), array("I"))
    if size < len(MAGIC):
        result.valid_end, result.problem = 0, "segment shorter than its header"
        return result
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[: len(MAGIC)] != MAGIC:
            result.valid_end, result.problem = 0, "segment does not start with the segment magic"
            return result
        _scan_records(memoryview(mm), first_offset, result)
    return result


def record_follows(path: Path, start: int, offsets: range) -> bool:
    """True when a valid record numbered one of ``offsets`` lies somewhere after byte
    ``start``: the damage before it is not a torn tail (a crash tears only the end), so
    cutting the file there would throw stored records away."""
    if path.stat().st_size < start + HEADER_SIZE:  # no whole header after ``start`` (an empty file too)
        return False
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        size = len(mm)
        for offset in offsets:
            needle = offset.to_bytes(8, "little")
            hit = mm.find(needle, start + 8)
            while hit != -1:
                pos = hit - 8  # the offset follows length and CRC in the header
                if pos + HEADER_SIZE > size:  # the bytes found end the file: no whole header
                    break
                length, crc, found, _ = HEADER.unpack_from(mm, pos)
                end = pos + HEADER_SIZE + length
                if found == offset and end <= size and crc32(memoryview(mm)[pos + 8 : end]) == crc:
                    return True
                hit = mm.find(needle, hit + 1)
    return False


def _scan_records(view: memoryview, expected: int, out: ScanResult) -> None:
    """The hot loop of index rebuilds: kept flat, locals only, no per-record objects."""
    unpack = HEADER.unpack_from
    ids_append, pos_append, len_append = out.tuple_ids.append, out.positions.append, out.lengths.append
    size, pos = len(view), len(MAGIC)
    try:
        while pos < size:
            if size - pos < HEADER_SIZE:
                out.problem = "incomplete record header"
                break
            length, crc, offset, tuple_id = unpack(view, pos)
            end = pos + HEADER_SIZE + length
            if end > size:
                out.problem = "incomplete record"
                break
            if crc32(view[pos + 8 : end]) != crc:
                out.problem = "record checksum mismatch"
                break
            if offset != expected:
                out.problem = f"record offset {offset} where {expected} was expected"
                break
            ids_append(tuple_id)
            pos_append(pos)
            len_append(end - pos)
            expected += 1
            pos = end
    finally:
        view.release()
    out.valid_end = pos
