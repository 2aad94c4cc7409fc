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

import logging
import os
import struct
from pathlib import Path
from typing import BinaryIO

from hio.master.storage import Durability
from hio.storage.files import atomic_write
from hio.storage.segmentlog import Naming, Segment, SegmentLog
from hio.transport.errors import InvalidArgument, Unavailable
from hio.transport.frames import TupleMeta, crc32

log = logging.getLogger("hio.master")

_HEAD = struct.Struct(">4sIQ")  # magic, meta length, payload length
_TAIL = struct.Struct(">4sQI")  # magic, sequence number, CRC-32 of head + meta + sequence
_SEQ = struct.Struct(">Q")
_ENTRY = struct.Struct(">BQqII")  # kind, sequence, order, attempt, CRC-32
_ENTRY_BODY = struct.Struct(">BQqI")
_HEAD_MAGIC = b"HIOR"
_TAIL_MAGIC = b"HIOE"
ACK, MOVE = 1, 2

NAMING = Naming("seg-", 10, ".q")
MAX_META_BYTES = 1024 * 1024


class RecordWriter:
    """Streams one record into a segment of the log that the writer holds (:meth:`SegmentLog.take`)
    until it is finished or discarded."""

    def __init__(self, log: SegmentLog, segment: Segment, meta: TupleMeta, cache: bool) -> None:
        self.log = log
        self.segment = segment
        self.meta = meta
        self.cache = cache
        self.ended = False  # reservations settled and segment handed back
        self.admitted = 0  # bytes the durability policy counts for this record until it is written
        self.start = segment.size
        self._chunks: list[bytes | memoryview] = []
        meta_bytes = meta.SerializeToString()
        if len(meta_bytes) > MAX_META_BYTES:
            raise InvalidArgument(f"tuple {meta.tuple_id}: metadata of {len(meta_bytes)} bytes is too large")
        self._head = _HEAD.pack(_HEAD_MAGIC, len(meta_bytes), meta.size) + meta_bytes
        log.write(segment, self._head, self.start)
        self.payload_offset = segment.size

    def write(self, data: bytes | memoryview) -> None:
        self.log.write(self.segment, data, self.start)
        if self.cache:  # an immutable chunk (bytes, or a view of a received message) is kept as is
            immutable = isinstance(data, bytes) or isinstance(data.obj, bytes)
            self._chunks.append(data if immutable else bytes(data))

    def finish(self, seq: int) -> None:
        """Write the tail and commit the record (synced with 'always', counted with 'batch')."""
        seq_bytes = _SEQ.pack(seq)
        self.log.write(self.segment, _TAIL.pack(_TAIL_MAGIC, seq, crc32(seq_bytes, crc32(self._head))), self.start)
        self.log.commit(self.segment, self.start, self.admitted)
        self.admitted = 0

    def discard(self) -> None:
        """Cut the record off its segment, as if it had never been written."""
        self.log.cut(self.segment, self.start)
        self._chunks.clear()

    def cached(self) -> bytes | None:
        if not self.cache:
            return None
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


class Journal:
    """Append-only ACK/MOVE entries, each with its own CRC: a side file of the backlog's
    segment log, synced with its segments."""

    def __init__(self, path: Path, log: SegmentLog, durability: Durability) -> None:
        self.path = path
        self._log = log
        self._durable = durability
        self._file: Segment | None = None
        self._unreported = 0  # bytes appended and not yet reported to the log

    @property
    def size(self) -> int:
        return self._file.size if self._file is not None else 0

    def load(self) -> tuple[set[int], dict[int, tuple[int, int]]]:
        """(acknowledged sequences, moves seq -> (order, attempt)); a torn tail is cut off."""
        acked: set[int] = set()
        moves: dict[int, tuple[int, int]] = {}
        raw = self.path.read_bytes() if self.path.exists() else b""
        good = 0
        for pos in range(0, len(raw) - _ENTRY.size + 1, _ENTRY.size):
            kind, seq, order, attempt, check = _ENTRY.unpack_from(raw, pos)
            if crc32(raw[pos : pos + _ENTRY.size - 4]) != check or kind not in (ACK, MOVE):
                break
            if kind == ACK:
                acked.add(seq)
                moves.pop(seq, None)
            elif seq not in acked:
                moves[seq] = (order, attempt)
            good = pos + _ENTRY.size
        if good != len(raw):
            log.warning("journal tail torn, truncated", extra={"path": str(self.path), "bytes": len(raw) - good})
            os.truncate(self.path, good)
        self._file = self._log.attach(self.path)
        return acked, moves

    def append(self, kind: int, seq: int, order: int, attempt: int) -> None:
        """Append one entry (reported to the log, to sync it, with :meth:`written`). A partial
        entry would end the journal at the next start: it is cut off."""
        if self._file is None:
            raise Unavailable("the master is shutting down")
        self._log.write(self._file, _entry(kind, seq, order, attempt), self._file.size)
        self._unreported += _ENTRY.size

    def written(self, file: Segment | None = None) -> None:
        """Report the entries appended since the last call: synced now ('always') or by the
        next round ('batch')."""
        file = file or self._file
        if file is not None and self._unreported:
            nbytes, self._unreported = self._unreported, 0
            self._log.written(file, nbytes)

    def rewrite(self, lines: list[tuple[int, int, int, int]]) -> None:
        """Atomically replace the journal with ``lines``."""
        data = b"".join(_entry(*line) for line in lines)
        replaced = False
        try:  # the old file stays the journal until the new one has replaced it
            atomic_write(self.path, data, disk=self._durable.disk, durable=self._durable.syncs)
            replaced = True
        finally:  # append to whichever file is the journal now (the new one, or still the old)
            self.close(replaced=replaced)
            self._file = self._log.attach(self.path)

    def close(self, *, replaced: bool = False) -> None:
        """Hand the file to the log: synced with the next round (or at close), or only closed
        when a durable rewrite has ``replaced`` it."""
        if self._file is not None:
            file, self._file = self._file, None
            if replaced:
                self._log.delete(file)
            else:  # entries not reported yet (a MOVE's) are synced with the rest
                self.written(file)
                self._log.seal(file)
            self._unreported = 0


def _entry(kind: int, seq: int, order: int, attempt: int) -> bytes:
    body = _ENTRY_BODY.pack(kind, seq, order, attempt)
    return body + struct.pack(">I", crc32(body))


def scan_segment(path: Path) -> tuple[list[tuple[int, TupleMeta, int]], int]:
    """The complete records of a segment, and where the last one ends (the segment log cuts
    off what follows: a torn tail). A damaged record with good ones after it (a flipped bit,
    not a crash: a crash only tears the end) costs only itself: the scan finds the next record
    by its magic and checks, and says which bytes it skipped."""
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
                log.error(
                    "damaged record in a backlog segment skipped; the tuple in it is lost",
                    extra={"segment": path.name, "offset": pos, "bytes": start - pos},
                )
            seq, meta, offset, end = parsed
            records.append((seq, meta, offset))
            pos = end
    return records, pos


def _next_record(fh: BinaryIO, start: int, total: int) -> tuple[int, tuple[int, TupleMeta, int, int]] | None:
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
