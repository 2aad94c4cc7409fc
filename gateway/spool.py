"""The durable on-disk spool: every tuple the gateway accepted and has not yet
seen STORED or ENQUEUED.

Layout, one folder per gateway instance (``data_dir/gateway/spool/<source>/``)::

    .lock                      flock held by the one process using this spool
    00000000000000000003.seg   append-only segment: the spool's log (records below)
    00000000000000000042.data  payload of a spooled *file* (hard link of the original, or a copy)

Every change is one record appended to the active segment:

* ``ADD``: a tuple with its metadata, its move-on-done target and its payload inline
  (tuples submitted as bytes), or ``ADD_FILE``: the same with the payload in
  ``<seq>.data`` (files, whose hard link costs nothing, and streamed uploads);
* ``META``: the tuple's metadata changed (routed: id and ticket; retried: attempt);
* ``DONE``: the tuple left the spool.

A record is a header (magic, kind, sequence number, lengths, CRC-32 of header,
metadata and move target) and its body; the payload is covered by
``meta.crc32``. At start the segments are replayed in order: the last ADD or
META of a sequence number gives its metadata, DONE removes it. A torn record
(a crash mid-append) ends its segment; an inline payload that fails its CRC is
set aside with a log line instead of being sent.

Why segments and not a file per tuple: a tuple then costs one append at submit,
one per route and one at the end, instead of creating, renaming and deleting
three files. That is what lets small tuples through at thousands per second.

Segments roll at ``segment_bytes``. A segment is deleted once it and every older
one hold only finished tuples (oldest first, so a META or DONE record is never
lost before the ADD it refers to). A tuple that stays long (an image no channel
offers) would pin every later segment: when segments take more than twice the
spool's bound, the oldest one's remaining tuples are copied forward into the
active segment (same sequence number, current metadata) and it is deleted.

The segments, their roll and fsync rounds are a
:class:`~hio.storage.segmentlog.SegmentLog`. 'batch' (the gateway's default)
fsyncs about every 100 ms, so a crash of the gateway process loses nothing and
a power loss at most the last 100 ms of submissions, and an append waits while
``unsynced_bytes`` wait for the disk (the disk sets the pace). A failed fsync
is final: new tuples are refused (``FailedPrecondition``) until the gateway is
restarted; the tuples held are still delivered (:attr:`Spool.disk_failure`).

Payloads given as bytes are also kept in memory while spooled, up to
``memory_bytes`` in all, so delivery does not read them back from disk; the
disk copy stays the durable one.

The spool holds at most ``limit_bytes`` of payload (committed plus being
written); a full spool refuses with :class:`SpoolFull` or makes callers wait.
Thread-safe. Does not import grpc.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from google.protobuf.message import DecodeError

from hio.config import ConfigError
from hio.proto.tuple_pb2 import TupleMeta
from hio.storage.files import DiskFailure, clean_temporaries, lock_folder
from hio.storage.segmentlog import UNSYNCED_BYTES, Naming, Segment, SegmentLog
from hio.transport.errors import InvalidArgument, ResourceExhausted, Unavailable
from hio.transport.frames import crc32, crc32_of_file

log = logging.getLogger("hio.gateway")

_NAMING = Naming("", 20, ".seg")
_DATA = re.compile(r"^(\d{20})\.data$")
_READ_BLOCK = 1024 * 1024

# magic, kind, sequence number, meta length, move length, payload length, CRC-32 of the rest
_HEAD = struct.Struct(">4sBQIIQI")
_HEAD_BODY = struct.Struct(">4sBQIIQ")
_MAGIC = b"HSP1"
ADD, ADD_FILE, META, DONE = 1, 2, 3, 4
_KINDS = frozenset({ADD, ADD_FILE, META, DONE})
MAX_META_BYTES = 1024 * 1024

# Small enough that a segment whose tuples finished within a few fsync rounds is
# deleted before it is synced (then it never reaches the disk), large enough that
# rolling (a file made and later deleted) is rare: every 160 tuples of 100 KB.
SEGMENT_BYTES = 16 * 1024 * 1024
BATCH_FSYNC_SECONDS = 0.1


class SpoolInUse(ConfigError):
    """Another process holds this spool folder (its lock)."""


class SpoolFull(ResourceExhausted):
    """The spool holds ``spool_bytes`` of undelivered tuples; retry once some are delivered."""


@dataclasses.dataclass
class MoveOnDone:
    """Move ``source`` to ``target`` once the tuple is delivered (watched files)."""

    source: str
    target: str


@dataclasses.dataclass
class SpoolEntry:
    """One spooled tuple. ``meta`` is the persisted metadata (id once routed).

    The payload is ``meta.size`` bytes at ``offset`` in ``data_path``: a segment
    (inline payloads) or the tuple's own ``<seq>.data`` file (offset 0). Read it
    with :meth:`Spool.open_payload`, which stays right while segments are compacted.
    """

    seq: int
    meta: TupleMeta
    data_path: Path
    move: MoveOnDone | None = None
    offset: int = 0
    segment: int = 0  # segment holding the entry's latest ADD record
    # The payload itself while it is spooled, for tuples given as bytes and within the
    # spool's memory bound: delivery then streams it without reading it back from disk.
    payload: bytes | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return int(self.meta.size)

    @property
    def inline(self) -> bool:
        return self.data_path.suffix == ".seg"


def safe_name(text: str) -> str:
    """A folder name derived from a gateway's source name (no separators, not hidden)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "default"
    return cleaned[:100]


def _record(kind: int, seq: int, meta: bytes = b"", move: bytes = b"", payload_len: int = 0) -> bytes:
    """A record's header and metadata (the payload, if any, follows it)."""
    body = _HEAD_BODY.pack(_MAGIC, kind, seq, len(meta), len(move), payload_len)
    check = crc32(move, crc32(meta, crc32(body)))
    return body + struct.pack(">I", check) + meta + move


class SpoolWriter:
    """Streams one tuple's payload into the spool; ``commit`` makes it an entry.

    Obtained from :meth:`Spool.writer`, which reserved ``size`` bytes of the
    bound. Not thread-safe (one writer per tuple). Always ``commit`` or ``abort``.
    The payload goes to a file of its own (it arrives in chunks, interleaved
    with other uploads), which the ADD_FILE record then names.
    """

    def __init__(self, spool: Spool, size: int) -> None:
        self._spool = spool
        self._reserved = size
        self.path = spool.root / f".tmp-{uuid.uuid4().hex}.data"
        self._fh = open(self.path, "wb")  # noqa: SIM115 - held across write() calls; commit() or abort() closes it
        self.crc = 0
        self.written = 0

    def write(self, chunk: bytes | memoryview) -> None:
        if self.written + len(chunk) > self._reserved:
            raise InvalidArgument(f"more bytes than the {self._reserved} declared for this tuple")
        self._fh.write(chunk)
        self.crc = crc32(chunk, self.crc)
        self.written += len(chunk)

    def commit(self, meta: TupleMeta, move: MoveOnDone | None = None) -> SpoolEntry:
        """Make the payload durable and record the entry; sets meta.size and meta.crc32."""
        self._fh.flush()
        self._fh.close()
        meta.size = self.written
        meta.crc32 = self.crc & 0xFFFFFFFF
        reserved, self._reserved = self._reserved, 0
        try:
            return self._spool._commit_file(self.path, meta, move, reserved)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        """Drop the partial payload and give its reservation back. Idempotent; a full disk
        (closing flushes the buffer again) does not keep the room or the file."""
        try:
            if not self._fh.closed:
                self._fh.close()
        except OSError as exc:
            log.debug("closing an aborted upload failed", extra={"path": str(self.path), "error": str(exc)})
        finally:
            self.path.unlink(missing_ok=True)
            if self._reserved:
                self._spool._release(self._reserved)
                self._reserved = 0


class Spool:
    """The durable, bounded spool of one gateway instance (see the module doc)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        limit_bytes: int,
        fsync: str = "always",
        memory_bytes: int = 64 * 1024 * 1024,
        segment_bytes: int = SEGMENT_BYTES,
        unsynced_bytes: int = UNSYNCED_BYTES,
    ) -> None:
        self._disk = DiskFailure(disk="the spool's disk", owner="gateway")
        self.root = Path(root)
        self._log = SegmentLog(
            self.root, _NAMING, fsync=fsync, disk=self._disk, unsynced_bytes=unsynced_bytes, segment_bytes=segment_bytes
        )
        self.memory_limit = int(memory_bytes)
        self._memory_used = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self.limit = int(limit_bytes)
        self._cond = threading.Condition()  # the bound, the entries, the segments' live sets
        self._append_lock = threading.Lock()  # one append at a time, in order
        self._used = 0
        self._reserved = 0
        self._entries: dict[int, SpoolEntry] = {}
        self._next_seq = 1
        in_use = SpoolInUse(
            f"spool {self.root} is in use by another gateway process; give each gateway its own --source or --data-dir"
        )
        self._lock_fd: int | None = lock_folder(self.root, in_use, ".lock")
        self._load()
        self._log.roll()
        with self._append_lock:
            finished = self._reclaim()
        for path in finished:
            path.unlink(missing_ok=True)
        if fsync == "batch":
            self._log.start_flusher(BATCH_FSYNC_SECONDS, "spool-fsync")

    def flush(self) -> None:
        """Make every record appended so far durable (segments, payload files, the folder);
        see :meth:`SegmentLog.flush`."""
        self._log.flush()

    def close(self) -> None:
        """Release the folder lock. Entries stay on disk for the next start."""
        if self._lock_fd is None:
            return
        try:
            with self._append_lock:  # no append runs while the segments close
                self._log.close()
        finally:
            os.close(self._lock_fd)  # releases the folder lock
            self._lock_fd = None

    def _load(self) -> None:
        """Replay the segments; remove leftovers of interrupted writes."""
        clean_temporaries(self.root)
        clean_temporaries(self.root, ".tmp-*")  # uploads and file copies a crash interrupted
        data_files = {int(m.group(1)): path for path in self.root.iterdir() if (m := _DATA.match(path.name))}
        self._log.open(self._replay)
        for entry in list(self._entries.values()):
            if not entry.inline and not self._file_ok(entry):
                self._set_aside(entry, f"payload file {entry.data_path.name} is missing or of the wrong size")
        for seq, path in data_files.items():
            if seq not in self._entries:  # written, but its ADD_FILE record never was
                path.unlink(missing_ok=True)
        self._entries = dict(sorted(self._entries.items()))  # in the order taken (oldest() reads the first)
        self._used = sum(e.size for e in self._entries.values())
        self._next_seq = max(self._next_seq, max(data_files, default=0) + 1)
        if self._entries:
            log.info(
                "spool resumed", extra={"tuples": len(self._entries), "bytes": self._used, "spool": str(self.root)}
            )

    def _replay(self, segment: Segment, last: bool) -> int:
        """Apply one segment's records; where its last whole record ends."""
        pos = 0
        with open(segment.path, "rb") as fh:
            for kind, seq, meta_bytes, move_bytes, payload_at, end in _records(fh):
                self._next_seq = max(self._next_seq, seq + 1)
                self._apply(segment, kind, seq, meta_bytes, move_bytes, payload_at, fh)
                pos = end
        return pos

    def _apply(
        self, segment: Segment, kind: int, seq: int, meta_bytes: bytes, move_bytes: bytes, payload_at: int, fh: BinaryIO
    ) -> None:
        if kind == DONE:
            self._forget(seq)
            return
        try:
            meta = TupleMeta.FromString(meta_bytes)
        except DecodeError as exc:
            log.error("unreadable spool metadata skipped", extra={"seq": seq, "error": str(exc)})
            return
        if kind == META:
            entry = self._entries.get(seq)
            if entry is not None:
                entry.meta = meta
            return
        try:
            move = MoveOnDone(**json.loads(move_bytes)) if move_bytes else None
        except (ValueError, TypeError) as exc:
            log.error("unreadable move target ignored", extra={"seq": seq, "error": str(exc)})
            move = None
        self._forget(seq)  # a copied-forward ADD supersedes the older one
        if kind == ADD:
            fh.seek(payload_at)
            if crc32_of_file(fh, meta.size)[0] != meta.crc32:
                log.error(
                    "spooled payload fails its CRC; set aside, not sent",
                    extra={"seq": seq, "tuple_name": meta.name, "segment": segment.path.name},
                )
                return
            entry = SpoolEntry(seq, meta, segment.path, move, offset=payload_at, segment=segment.id)
        else:
            entry = SpoolEntry(seq, meta, self._data_path(seq), move, offset=0, segment=segment.id)
        self._entries[seq] = entry
        segment.live.add(seq)

    def _forget(self, seq: int) -> None:
        entry = self._entries.pop(seq, None)
        if entry is not None:
            segment = self._log.segments.get(entry.segment)
            if segment is not None:
                segment.live.discard(seq)

    def _file_ok(self, entry: SpoolEntry) -> bool:
        try:
            return entry.data_path.stat().st_size == entry.size
        except OSError:
            return False

    def _set_aside(self, entry: SpoolEntry, reason: str) -> None:
        log.error(
            "unusable spool entry set aside", extra={"seq": entry.seq, "tuple_name": entry.meta.name, "error": reason}
        )
        self._forget(entry.seq)
        if entry.data_path.exists() and not entry.inline:
            entry.data_path.rename(entry.data_path.with_name(entry.data_path.name + ".bad"))

    def _data_path(self, seq: int) -> Path:
        return self.root / f"{seq:020d}.data"

    def _append(self, parts: list[bytes | memoryview], admitted: int = 0) -> tuple[Segment, int]:
        """:meth:`SegmentLog.append`, named for the spool when it is closed. Caller holds
        ``_append_lock``."""
        try:
            return self._log.append(parts, admitted)
        except Unavailable:
            raise Unavailable("the spool is closed (its gateway was closed); nothing was written") from None

    def _reserve(self, size: int, timeout: float | None) -> None:
        """Take ``size`` bytes of the bound, waiting up to ``timeout`` s (None = forever)."""
        if size > self.limit:
            raise InvalidArgument(f"a tuple of {size} bytes can never fit in the spool (spool_bytes={self.limit})")
        self._disk.check()  # refused before any I/O once an fsync has failed
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._used + self._reserved + size > self.limit:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SpoolFull(
                        f"spool full: {self._used + self._reserved} of {self.limit} bytes "
                        f"(spool_bytes) hold tuples not yet delivered; retry later",
                        retry_after=1.0,
                    )
                self._cond.wait(left)
            self._reserved += size

    def _release(self, size: int) -> None:
        with self._cond:
            self._reserved -= size
            self._cond.notify_all()

    def writer(self, size: int, timeout: float | None = 0.0) -> SpoolWriter:
        """A writer for a tuple of ``size`` bytes; waits up to ``timeout`` s for room.

        Raises SpoolFull when there is no room in time, InvalidArgument when it
        could never fit.
        """
        self._reserve(size, timeout)
        try:
            return SpoolWriter(self, size)
        except BaseException:
            self._release(size)
            raise

    def put_bytes(self, data: bytes, meta: TupleMeta, timeout: float | None = 0.0) -> SpoolEntry:
        """Spool an in-memory payload (one append); sets meta.size and meta.crc32."""
        size = len(data)
        self._reserve(size, timeout)
        admitted = 0
        try:
            meta.size = size
            meta.crc32 = crc32(data)
            meta_bytes = _meta_bytes(meta)
            admitted = self._log.admit(size)
            with self._append_lock:
                seq, self._next_seq = self._next_seq, self._next_seq + 1
                head = _record(ADD, seq, meta_bytes, b"", size)
                segment, start = self._append([head, data], admitted)
                admitted = 0  # appended: the segment's count holds them now
                entry = SpoolEntry(seq, meta, segment.path, None, offset=start + len(head), segment=segment.id)
                self._admit(entry, segment, size)
        except BaseException:
            self._log.settle(admitted)
            self._release(size)
            raise
        with self._cond:  # kept beside its disk copy too, while within ``memory_bytes``
            if entry.seq in self._entries and self._memory_used + size <= self.memory_limit:
                entry.payload = data
                self._memory_used += size
        return entry

    def put_file(
        self,
        path: str | os.PathLike[str],
        meta: TupleMeta,
        *,
        move: MoveOnDone | None = None,
        timeout: float | None = 0.0,
    ) -> SpoolEntry:
        """Spool a file: hard-linked when on the same filesystem, else copied.

        The original is never modified. Its CRC-32 and size are computed here,
        once, from the spooled bytes.
        """
        size = os.stat(path).st_size
        self._reserve(size, timeout)
        tmp = self.root / f".tmp-{uuid.uuid4().hex}.data"
        try:
            try:
                linked = self._link_or_copy(Path(path), tmp)
                crc, actual = crc32_of_file(tmp)
                if actual != size:
                    raise InvalidArgument(f"{path} changed size while being spooled ({size} -> {actual} bytes)")
                meta.size, meta.crc32 = actual, crc
            except BaseException:
                self._release(size)  # _commit_file was not reached: the room is given back here
                raise
            entry = self._commit_file(tmp, meta, move, size)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        log.debug("spooled file", extra={"path": str(path), "seq": entry.seq, "linked": linked})
        return entry

    @staticmethod
    def _link_or_copy(source: Path, tmp: Path) -> bool:
        try:
            os.link(source, tmp)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
        with open(source, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, _READ_BLOCK)
        return False

    def _commit_file(self, tmp: Path, meta: TupleMeta, move: MoveOnDone | None, reserved: int) -> SpoolEntry:
        """Turn a written payload file into an entry: rename it to its sequence, then the record.
        Releases ``reserved`` on failure."""
        admitted = 0
        try:
            if self._log.fsync == "always":
                self._log.sync_path(tmp, refuse=True)  # the payload is on disk before a record names it
            meta_bytes = _meta_bytes(meta)
            move_bytes = _move_bytes(move)
            admitted = self._log.admit(meta.size)
            with self._append_lock:
                seq, self._next_seq = self._next_seq, self._next_seq + 1
                data_path = self._data_path(seq)
                os.replace(tmp, data_path)
                try:
                    if self._log.fsync == "always":  # its name too is on disk before a record names it
                        self._disk.sync_folder(self.root, refuse=True)
                    segment, _ = self._append([_record(ADD_FILE, seq, meta_bytes, move_bytes)])
                except BaseException:
                    data_path.unlink(missing_ok=True)
                    raise
                if self._log.fsync == "batch":
                    self._log.track(data_path, meta.size)  # the file's sync settles them
                admitted = 0
                entry = SpoolEntry(seq, meta, data_path, move, offset=0, segment=segment.id)
                self._admit(entry, segment, reserved)
        except BaseException:
            self._log.settle(admitted)
            self._release(reserved)
            raise
        return entry

    def _admit(self, entry: SpoolEntry, segment: Segment, reserved: int) -> None:
        with self._cond:
            self._entries[entry.seq] = entry
            segment.live.add(entry.seq)
            self._reserved -= reserved
            self._used += entry.size

    def update_many(self, entries: list[SpoolEntry]) -> None:
        """Persist entries' metadata (id, ticket, attempt) with one append."""
        with self._append_lock:
            with self._cond:
                live = [e for e in entries if self._entries.get(e.seq) is e]
            if live:
                self._append([b"".join(_record(META, e.seq, _meta_bytes(e.meta)) for e in live)])

    def remove_many(self, entries: list[SpoolEntry]) -> None:
        """Forget delivered tuples: their DONE records in one append, then their payload
        files (if any) and every segment that holds only finished tuples."""
        with self._append_lock:
            with self._cond:
                live = list({e.seq: e for e in entries if self._entries.get(e.seq) is e}.values())
            if not live:
                return
            self._append([b"".join(_record(DONE, e.seq) for e in live)])
            with self._cond:
                for entry in live:
                    self._forget(entry.seq)
                    self._used -= entry.size
                    if entry.payload is not None:
                        self._memory_used -= len(entry.payload)
                        entry.payload = None
                self._cond.notify_all()
            finished = [entry.data_path for entry in live if not entry.inline]
            finished += self._reclaim()
        for path in finished:  # outside the lock: deleting a large file can take milliseconds
            path.unlink(missing_ok=True)

    def _reclaim(self) -> list[Path]:
        """Delete finished segments oldest first (a later record never outlives one it refers
        to); while segments take more than twice the bound, the oldest one's tuples are first
        copied forward into the active segment. Returns the files to delete. Caller holds
        ``_append_lock``."""
        deleted: list[Path] = []
        segments = self._log.segments
        while (oldest := segments.get(min(segments, default=0))) not in (None, self._log.active):
            if oldest.live:
                if self._log.bytes_on_disk() <= 2 * max(self.limit, self._log.segment_bytes):
                    break
                with self._cond:
                    carry = [self._entries[s] for s in sorted(oldest.live)]
                for entry in carry:
                    self._carry_forward(entry)
                if oldest.live:  # a record could not be carried (a read error): keep the segment
                    break
                if self._log.fsync == "batch":  # the copies are on disk before the originals go
                    self._log.flush()
            deleted.append(self._log.delete(oldest))
        return deleted

    def _carry_forward(self, entry: SpoolEntry) -> None:
        """Append the entry again (current metadata, same sequence) to the active segment."""
        move_bytes = _move_bytes(entry.move)
        meta_bytes = _meta_bytes(entry.meta)
        if not entry.inline:
            segment, _ = self._append([_record(ADD_FILE, entry.seq, meta_bytes, move_bytes)])
            new_path, new_offset = entry.data_path, 0
        else:
            try:
                payload = (
                    entry.payload if entry.payload is not None else _read_at(entry.data_path, entry.offset, entry.size)
                )
            except OSError as exc:
                log.error("cannot carry a spooled tuple forward", extra={"seq": entry.seq, "error": str(exc)})
                return
            head = _record(ADD, entry.seq, meta_bytes, move_bytes, entry.size)
            segment, start = self._append([head, payload])
            new_path, new_offset = segment.path, start + len(head)
        with self._cond:
            old = self._log.segments.get(entry.segment)
            if old is not None:
                old.live.discard(entry.seq)
            entry.data_path, entry.offset, entry.segment = new_path, new_offset, segment.id
            segment.live.add(entry.seq)

    def open_payload(self, entry: SpoolEntry) -> BinaryIO:
        """An open file positioned at the entry's payload (``meta.size`` bytes follow).

        Raises FileNotFoundError when the payload is gone. The open file stays
        readable even if compaction deletes the segment meanwhile.
        """
        with self._cond:
            path, offset = entry.data_path, entry.offset
            fh = open(path, "rb")  # noqa: SIM115 - returned open: the caller reads the payload and closes it
        fh.seek(offset)
        return fh

    def payload_damage(self, entry: SpoolEntry) -> str:
        """Why the entry's spooled payload no longer matches the CRC-32 it was taken with
        ('' when it does, is held in memory, or cannot be read just now). A file is
        hard-linked, so an original rewritten in place changes the spooled copy too."""
        if entry.payload is not None:
            return ""
        try:
            with self.open_payload(entry) as fh:
                crc, _ = crc32_of_file(fh, entry.size)
        except FileNotFoundError:
            return f"spooled payload {entry.data_path} is missing"
        except OSError:
            return ""
        if crc == entry.meta.crc32:
            return ""
        return (
            f"the spooled copy of '{entry.meta.name}' changed after it was taken (CRC-32 now {crc:08x}, "
            f"taken as {entry.meta.crc32:08x}): was the original rewritten in place? Write new files "
            f"under a new name (or as .part, then rename)"
        )

    def entries(self) -> list[SpoolEntry]:
        """Committed entries in their original order."""
        with self._cond:
            return [self._entries[s] for s in sorted(self._entries)]

    def oldest(self) -> SpoolEntry | None:
        """The entry taken first, or None: entries are kept in the order they were taken
        (sorted at load, then each new one has the next sequence number)."""
        with self._cond:
            return next(iter(self._entries.values()), None)

    def move_sources(self) -> set[str]:
        """Original paths of spooled files that move on delivery (what the watcher took)."""
        with self._cond:
            return {e.move.source for e in self._entries.values() if e.move is not None}

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return self._used

    @property
    def unsynced_bytes(self) -> int:
        """'batch': bytes appended that tuples not yet finished still need fsynced."""
        return self._log.unsynced

    @property
    def disk_failure(self) -> str:
        """'' while no fsync failed; else the failed fsync that stopped new tuples until
        the gateway is restarted (see :class:`DiskFailure`)."""
        return self._disk.failure

    @property
    def reserved_bytes(self) -> int:
        with self._cond:
            return self._reserved

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)


def spooled_metas(root: str | os.PathLike[str]) -> list[TupleMeta]:
    """The metadata of the tuples waiting in a spool folder, read only (the folder may be
    in use by a running gateway): for operators and tests looking at what is held."""
    entries: dict[int, TupleMeta] = {}
    for path in sorted(Path(root).glob("*.seg")):
        with open(path, "rb") as fh:
            for kind, seq, meta_bytes, _, _, _ in _records(fh):
                if kind == DONE:
                    entries.pop(seq, None)
                elif kind != META or seq in entries:
                    try:
                        entries[seq] = TupleMeta.FromString(meta_bytes)
                    except DecodeError:
                        continue
    return [entries[s] for s in sorted(entries)]


def _meta_bytes(meta: TupleMeta) -> bytes:
    data = meta.SerializeToString()
    if len(data) > MAX_META_BYTES:
        raise InvalidArgument(f"tuple metadata of {len(data)} bytes is over {MAX_META_BYTES}")
    return data


def _move_bytes(move: MoveOnDone | None) -> bytes:
    return json.dumps(dataclasses.asdict(move)).encode() if move is not None else b""


def _records(fh: BinaryIO) -> Iterator[tuple[int, int, bytes, bytes, int, int]]:
    """A segment's whole records in order, each (kind, seq, meta, move, payload offset, end);
    stops at its end or at a torn or damaged record."""
    pos = 0
    while True:
        fh.seek(pos)
        head = fh.read(_HEAD.size)
        if len(head) < _HEAD.size:
            return
        magic, kind, seq, meta_len, move_len, payload_len, check = _HEAD.unpack(head)
        if magic != _MAGIC or kind not in _KINDS or meta_len > MAX_META_BYTES or move_len > MAX_META_BYTES:
            return
        meta = fh.read(meta_len)
        move = fh.read(move_len)
        if len(meta) < meta_len or len(move) < move_len:
            return
        if crc32(move, crc32(meta, crc32(head[: _HEAD_BODY.size]))) != check:
            return
        payload_at = pos + _HEAD.size + meta_len + move_len
        pos = payload_at + payload_len
        if pos > os.fstat(fh.fileno()).st_size:
            return
        yield kind, seq, meta, move, payload_at, pos


def _read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read(size)
    if len(data) != size:
        raise OSError(f"{path}: {len(data)} of {size} bytes at {offset}")
    return data
