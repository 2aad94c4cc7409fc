"""The backlog's on-disk formats: segment records and the journal.

A segment record::

    head    ">4sIQ"  b"HIOR", meta length, payload length
    meta    serialized TupleMeta
    payload the tuple's bytes
    tail    ">4sQI"  b"HIOE", sequence number, CRC-32 of head + meta + sequence

A record without a valid tail is torn (a crash mid-write) or damaged, and is
cut off with everything after it in its segment. The payload is covered by
``meta.crc32``. A journal entry is ``">BQqII"``: kind (ACK: the record is done
for good; MOVE: it moved in its queue), sequence, order, attempt, CRC-32.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
from pathlib import Path
from typing import BinaryIO

from hio.common.errors import InvalidArgument, Unavailable
from hio.common.frames import TupleMeta, crc32
from hio.master.storage import Durability, Pending, write_all

log = logging.getLogger("hio.master")

_HEAD = struct.Struct(">4sIQ")     # magic, meta length, payload length
_TAIL = struct.Struct(">4sQI")     # magic, sequence number, CRC-32 of head + meta + sequence
_SEQ = struct.Struct(">Q")
_ENTRY = struct.Struct(">BQqII")   # kind, sequence, order, attempt, CRC-32
_ENTRY_BODY = struct.Struct(">BQqI")
_HEAD_MAGIC = b"HIOR"
_TAIL_MAGIC = b"HIOE"
ACK, MOVE = 1, 2

MAX_META_BYTES = 1024 * 1024
READ_BLOCK = 1024 * 1024


@dataclasses.dataclass(eq=False)
class Segment:
    id: int
    path: Path
    size: int
    fd: int | None = None       # open for appending while not sealed
    in_use: bool = False        # a writer owns it right now
    live: int = 0               # records not yet done
    acked: list[int] = dataclasses.field(default_factory=list)
    retired: Pending | None = None   # sealed: the durability policy's handle on its descriptor

    @property
    def sealed(self) -> bool:
        return self.fd is None


class RecordWriter:
    """Writes one record into a segment the writer owns until it is finished or discarded."""

    def __init__(self, segment: Segment, meta: TupleMeta, cache: bool) -> None:
        assert segment.fd is not None
        self.segment = segment
        self.meta = meta
        self.cache = cache
        self.ended = False    # reservations settled and segment handed back
        self.admitted = 0     # bytes the durability policy counts for this record until it is written
        self._fd = segment.fd
        self._start = segment.size
        self._chunks: list[bytes] = []
        meta_bytes = meta.SerializeToString()
        if len(meta_bytes) > MAX_META_BYTES:
            raise InvalidArgument(f"tuple {meta.tuple_id}: metadata of {len(meta_bytes)} bytes is too large")
        self._head = _HEAD.pack(_HEAD_MAGIC, len(meta_bytes), meta.size) + meta_bytes
        self._write(self._head)
        self.payload_offset = segment.size

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            write_all(self._fd, data)
        finally:
            self.segment.size = os.lseek(self._fd, 0, os.SEEK_CUR)

    def write(self, data: bytes) -> None:
        self._write(data)
        if self.cache:  # an immutable chunk (bytes, or a view of a received message) is kept as is
            immutable = isinstance(data, bytes) or (isinstance(data, memoryview) and isinstance(data.obj, bytes))
            self._chunks.append(data if immutable else bytes(data))

    def finish(self, seq: int) -> None:
        seq_bytes = _SEQ.pack(seq)
        self._write(_TAIL.pack(_TAIL_MAGIC, seq, crc32(seq_bytes, crc32(self._head))))

    def discard(self) -> None:
        """Cut the record off its segment, as if it had never been written."""
        os.ftruncate(self._fd, self._start)
        os.lseek(self._fd, self._start, os.SEEK_SET)
        self.segment.size = self._start
        self._chunks.clear()

    def cached(self) -> bytes | None:
        if not self.cache:
            return None
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


class Journal:
    """Append-only ACK/MOVE entries, each with its own CRC."""

    def __init__(self, path: Path, durability: Durability) -> None:
        self.path = path
        self._durable = durability
        self.fd: int | None = None
        self.size = 0

    def load(self) -> tuple[set[int], dict[int, tuple[int, int]]]:
        """(acknowledged sequences, moves seq -> (order, attempt)); a torn tail is cut off."""
        acked: set[int] = set()
        moves: dict[int, tuple[int, int]] = {}
        raw = self.path.read_bytes() if self.path.exists() else b""
        good = 0
        for pos in range(0, len(raw) - _ENTRY.size + 1, _ENTRY.size):
            kind, seq, order, attempt, check = _ENTRY.unpack_from(raw, pos)
            if crc32(raw[pos:pos + _ENTRY.size - 4]) != check or kind not in (ACK, MOVE):
                break
            if kind == ACK:
                acked.add(seq)
                moves.pop(seq, None)
            elif seq not in acked:
                moves[seq] = (order, attempt)
            good = pos + _ENTRY.size
        if good != len(raw):
            log.warning("journal tail torn, truncated", extra={"path": str(self.path), "bytes": len(raw) - good})
        self._open(good)
        return acked, moves

    def _open(self, size: int) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, size)
        os.lseek(self.fd, size, os.SEEK_SET)
        self.size = size

    def append(self, kind: int, seq: int, order: int, attempt: int) -> None:
        if self.fd is None:
            raise Unavailable("the master is shutting down")
        body = _ENTRY_BODY.pack(kind, seq, order, attempt)
        try:
            write_all(self.fd, body + struct.pack(">I", crc32(body)))
        except OSError:   # a partial entry would end the journal at the next start: cut it off
            os.ftruncate(self.fd, self.size)
            os.lseek(self.fd, self.size, os.SEEK_SET)
            raise
        self.size += _ENTRY.size

    def rewrite(self, lines: list[tuple[int, int, int, int]]) -> None:
        """Atomically replace the journal with ``lines``."""
        data = bytearray()
        for kind, seq, order, attempt in lines:
            body = _ENTRY_BODY.pack(kind, seq, order, attempt)
            data += body + struct.pack(">I", crc32(body))
        replaced = False
        try:   # the old file stays the journal until the new one has replaced it
            self._durable.replace(self.path.with_suffix(".tmp"), self.path, bytes(data))
            replaced = True
        finally:   # append to whichever file is the journal now (the new one, or still the old)
            self.close(replaced=replaced)
            self._open(self.path.stat().st_size)

    def close(self, *, replaced: bool = False) -> None:
        """Hand the descriptor to the durability policy: it syncs and closes it (without the
        caller's lock), or only closes it when a durable rewrite has ``replaced`` the file."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            if not replaced:   # entries not reported yet (a MOVE's) are synced with the rest
                self._durable.written(fd)
            pending = self._durable.retire(fd)
            if replaced:
                self._durable.discard(pending)


def scan_segment(path: Path) -> tuple[list[tuple[int, TupleMeta, int]], int]:
    """The complete records of a segment, cutting off a torn tail.

    A damaged record with good ones after it (a flipped bit, not a crash: a crash
    only tears the end) costs only itself: the scan finds the next record by its
    magic and checks, and says which bytes it skipped. Only what follows the
    last good record is cut off."""
    records: list[tuple[int, TupleMeta, int]] = []
    total = path.stat().st_size
    pos = 0
    with open(path, "rb") as fh:
        while pos < total:
            parsed = _read_record(fh, pos, total)
            if parsed is None:
                found = _next_record(fh, pos + 1, total)
                if found is None:
                    break
                start, parsed = found
                log.error("damaged record in a backlog segment skipped; the tuple in it is lost",
                          extra={"segment": path.name, "offset": pos, "bytes": start - pos})
            seq, meta, offset, end = parsed
            records.append((seq, meta, offset))
            pos = end
    if pos != total:
        log.warning("segment tail torn, truncated",
                    extra={"segment": path.name, "offset": pos, "bytes": total - pos})
        with open(path, "r+b") as fh:
            fh.truncate(pos)
            fh.flush()
            os.fsync(fh.fileno())
    return records, pos


def _next_record(fh: BinaryIO, start: int,
                 total: int) -> tuple[int, tuple[int, TupleMeta, int, int]] | None:
    """(where it starts, the record) of the first good record at or after ``start`` (found
    by its head magic), or None."""
    block = 1 << 20
    pos = start
    while pos < total:
        fh.seek(pos)
        data = fh.read(block + len(_HEAD_MAGIC) - 1)
        at = data.find(_HEAD_MAGIC)
        while at != -1 and at < block:
            parsed = _read_record(fh, pos + at, total)
            if parsed is not None:
                return pos + at, parsed
            at = data.find(_HEAD_MAGIC, at + 1)
        pos += block
    return None


def _read_record(fh: BinaryIO, pos: int, total: int) -> tuple[int, TupleMeta, int, int] | None:
    """(seq, meta, payload offset, end) of the record at ``pos``, or None if it is incomplete or damaged."""
    fh.seek(pos)
    head = fh.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None
    magic, meta_len, size = _HEAD.unpack(head)
    if magic != _HEAD_MAGIC or meta_len > MAX_META_BYTES:
        return None
    meta_bytes = fh.read(meta_len)
    offset = pos + _HEAD.size + meta_len
    end = offset + size + _TAIL.size
    if len(meta_bytes) < meta_len or end > total:
        return None
    fh.seek(offset + size)
    tail = fh.read(_TAIL.size)
    if len(tail) < _TAIL.size:
        return None
    tail_magic, seq, check = _TAIL.unpack(tail)
    if tail_magic != _TAIL_MAGIC or crc32(_SEQ.pack(seq), crc32(head + meta_bytes)) != check:
        return None
    try:
        meta = TupleMeta.FromString(meta_bytes)
    except Exception:  # noqa: BLE001 - protobuf raises DecodeError; covered by the CRC anyway
        return None
    if meta.size != size:
        return None
    return seq, meta, offset, end


def payload_intact(path: Path, offset: int, meta: TupleMeta) -> bool:
    """True if the payload at ``offset`` matches ``meta``'s CRC-32."""
    value, remaining = 0, meta.size
    with open(path, "rb") as fh:
        fh.seek(offset)
        while remaining:
            block = fh.read(min(READ_BLOCK, remaining))
            if not block:
                return False
            value = crc32(block, value)
            remaining -= len(block)
    return value == meta.crc32
