"""The durable on-disk spool: every tuple the gateway accepted and has not yet
seen STORED or ENQUEUED.

Layout, one folder per gateway instance (``data_dir/gateway/spool/<source>/``)::

    .lock                      flock held by the one process using this spool
    00000000000000000042.data  the payload (hard link of the instrument's file, or a copy)
    00000000000000000042.meta  serialized TupleMeta; its presence commits the entry
    00000000000000000042.move  optional: where to move the original file once delivered (JSON)

Sequence numbers give the original order, so a restart resumes in that order.
The meta file is written last, atomically (temp file, rename): an entry
either exists whole or not at all. When the bytes reach the disk is the fsync
policy's choice: 'always' fsyncs payload, meta and folder before the entry
counts; 'batch' (the gateway's default) fsyncs them in the background about
every 100 ms, so a crash of the gateway process loses nothing and a power loss
at most the last 100 ms of submissions; 'never' leaves it to the OS. Updates after routing
(the id, the attempt) are atomic renames too; they skip fsync, so a process
crash never loses them, and an OS crash at worst gives a tuple a new id.

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
import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Iterator

from google.protobuf.message import DecodeError

from hio.common.config import ConfigError
from hio.common.errors import InvalidArgument, ResourceExhausted
from hio.common.files import atomic_write, clean_temporaries, fsync_dir, fsync_file
from hio.common.frames import crc32_of_file
from hio.proto.tuple_pb2 import TupleMeta

log = logging.getLogger("hio.gateway")

_NAME = re.compile(r"^(\d{20})\.meta$")
_READ_BLOCK = 1024 * 1024


class SpoolFull(ResourceExhausted):
    """The spool holds ``spool_bytes`` of undelivered tuples; retry once some are delivered."""


@dataclasses.dataclass
class MoveOnDone:
    """Move ``source`` to ``target`` once the tuple is delivered (watched files)."""

    source: str
    target: str


@dataclasses.dataclass
class SpoolEntry:
    """One spooled tuple. ``meta`` is the persisted metadata (id once routed)."""

    seq: int
    meta: TupleMeta
    data_path: Path
    move: MoveOnDone | None = None
    # The payload itself while it is spooled, for tuples given as bytes and within the
    # spool's memory bound: delivery then streams it without reading it back from disk.
    payload: bytes | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return int(self.meta.size)


def safe_name(text: str) -> str:
    """A folder name derived from a gateway's source name (no separators, not hidden)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "default"
    return cleaned[:100]


BATCH_FSYNC_SECONDS = 0.1
MEMORY_BYTES = 64 * 1024 * 1024  # payloads kept in memory besides the disk copy (Spool memory_bytes)


class SpoolWriter:
    """Streams one tuple's payload into the spool; ``commit`` makes it an entry.

    Obtained from :meth:`Spool.writer`, which reserved ``size`` bytes of the
    bound. Not thread-safe (one writer per tuple). Always ``commit`` or ``abort``.
    """

    def __init__(self, spool: "Spool", size: int) -> None:
        self._spool = spool
        self._reserved = size
        self.path = spool.root / f".tmp-{uuid.uuid4().hex}.data"
        self._fh = open(self.path, "wb")
        self.crc = 0
        self.written = 0

    def write(self, chunk: bytes) -> None:
        if self.written + len(chunk) > self._reserved:
            raise InvalidArgument(f"more bytes than the {self._reserved} declared for this tuple")
        self._fh.write(chunk)
        self.crc = zlib.crc32(chunk, self.crc)
        self.written += len(chunk)

    def commit(self, meta: TupleMeta, move: MoveOnDone | None = None) -> SpoolEntry:
        """Make the payload durable and record the entry; sets meta.size and meta.crc32."""
        self._fh.flush()
        if self._spool.fsync == "always":
            os.fsync(self._fh.fileno())
        self._fh.close()
        meta.size = self.written
        meta.crc32 = self.crc & 0xFFFFFFFF
        return self._spool._commit(self.path, meta, move, self._reserved)

    def abort(self) -> None:
        """Drop the partial payload and give its reservation back. Idempotent."""
        if not self._fh.closed:
            self._fh.close()
        self.path.unlink(missing_ok=True)
        if self._reserved:
            self._spool._release(self._reserved)
            self._reserved = 0


class Spool:
    """The durable, bounded spool of one gateway instance (see the module doc)."""

    def __init__(self, root: str | os.PathLike[str], limit_bytes: int, fsync: str = "always",
                 memory_bytes: int = MEMORY_BYTES) -> None:
        if fsync not in ("always", "batch", "never"):
            raise ValueError(f"unknown fsync policy {fsync!r}")
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must not be negative, got {memory_bytes}")
        self.memory_limit = int(memory_bytes)
        self._memory_used = 0
        self.fsync = fsync
        self._dirty: list[Path] = []
        self._flusher: threading.Thread | None = None
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.limit = int(limit_bytes)
        self._cond = threading.Condition()
        self._used = 0
        self._reserved = 0
        self._entries: dict[int, SpoolEntry] = {}
        self._next_seq = 1
        self._lock_fh = self._lock()
        self._load()
        if fsync == "batch":
            self._flusher = threading.Thread(target=self._flush_loop, name="spool-fsync", daemon=True)
            self._flusher.start()

    # -- lifecycle ---------------------------------------------------------

    def _lock(self):  # type: ignore[no-untyped-def]
        fh = open(self.root / ".lock", "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            fh.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"spool {self.root} is in use by another gateway process; "
                                  "give each gateway its own --source or --data-dir") from None
            raise
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        return fh

    def _flush_loop(self) -> None:
        """'batch': fsync what was committed, about every 100 ms, off the submit path."""
        while self._lock_fh is not None:
            time.sleep(BATCH_FSYNC_SECONDS)
            self.flush()

    def flush(self) -> None:
        """Make every entry committed so far durable (payloads, metas, the folder)."""
        with self._cond:
            dirty, self._dirty = self._dirty, []
        if not dirty:
            return
        for path in dirty:
            try:
                fsync_file(path)
            except FileNotFoundError:  # delivered and removed meanwhile
                continue
        fsync_dir(self.root)

    def close(self) -> None:
        """Release the folder lock. Entries stay on disk for the next start."""
        if self.fsync == "batch":
            self.flush()
        if self._lock_fh is not None:
            fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
            self._lock_fh.close()
            self._lock_fh = None

    def _load(self) -> None:
        """Pick up committed entries; remove leftovers of interrupted writes."""
        committed: set[int] = set()
        clean_temporaries(self.root)  # metadata replacements a crash interrupted
        for path in sorted(self.root.iterdir()):
            match = _NAME.match(path.name)
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)
            elif match:
                entry = self._read_entry(int(match.group(1)))
                if entry is not None:
                    self._entries[entry.seq] = entry
                    self._used += entry.size
                    committed.add(entry.seq)
        for path in self.root.iterdir():  # payloads whose meta never got written
            stem = path.name.split(".", 1)[0]
            if stem.isdigit() and int(stem) not in committed and not path.name.endswith(".bad"):
                path.unlink(missing_ok=True)
        self._next_seq = max(committed, default=0) + 1
        if self._entries:
            log.info("spool resumed", extra={"tuples": len(self._entries), "bytes": self._used,
                                             "spool": str(self.root)})

    def _read_entry(self, seq: int) -> SpoolEntry | None:
        meta_path = self._path(seq, "meta")
        data_path = self._path(seq, "data")
        try:
            meta = TupleMeta.FromString(meta_path.read_bytes())
            if data_path.stat().st_size != meta.size:
                raise ValueError(f"payload has {data_path.stat().st_size} bytes, meta says {meta.size}")
            move_path = self._path(seq, "move")
            move = MoveOnDone(**json.loads(move_path.read_text())) if move_path.exists() else None
        except (OSError, ValueError, TypeError, DecodeError) as exc:
            log.error("unreadable spool entry set aside", extra={"seq": seq, "error": str(exc)})
            for path in (meta_path, data_path):
                if path.exists():
                    path.rename(path.with_name(path.name + ".bad"))
            return None
        return SpoolEntry(seq, meta, data_path, move)

    def _path(self, seq: int, kind: str) -> Path:
        return self.root / f"{seq:020d}.{kind}"

    # -- the bound -----------------------------------------------------------

    def _reserve(self, size: int, timeout: float | None) -> None:
        """Take ``size`` bytes of the bound, waiting up to ``timeout`` s (None = forever)."""
        if size > self.limit:
            raise InvalidArgument(f"a tuple of {size} bytes can never fit in the spool "
                                  f"(spool_bytes={self.limit})")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._used + self._reserved + size > self.limit:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SpoolFull(f"spool full: {self._used + self._reserved} of {self.limit} bytes "
                                    f"(spool_bytes) hold tuples not yet delivered; retry later",
                                    retry_after=1.0)
                self._cond.wait(left)
            self._reserved += size

    def _release(self, size: int) -> None:
        with self._cond:
            self._reserved -= size
            self._cond.notify_all()

    # -- adding --------------------------------------------------------------

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
        """Spool an in-memory payload (copied to disk); returns the committed entry."""
        writer = self.writer(len(data), timeout)
        try:
            writer.write(data)
            entry = writer.commit(meta)
        except BaseException:
            writer.abort()
            raise
        self._keep_in_memory(entry, data)
        return entry

    def _keep_in_memory(self, entry: SpoolEntry, data: bytes) -> None:
        """Keep an immutable payload beside its disk copy while within ``memory_bytes``."""
        if not isinstance(data, bytes):
            return
        with self._cond:
            if entry.seq in self._entries and self._memory_used + len(data) <= self.memory_limit:
                entry.payload = data
                self._memory_used += len(data)

    def put_file(self, path: str | os.PathLike[str], meta: TupleMeta, *,
                 move: MoveOnDone | None = None, timeout: float | None = 0.0) -> SpoolEntry:
        """Spool a file: hard-linked when on the same filesystem, else copied.

        The original is never modified. Its CRC-32 and size are computed here,
        once, from the spooled bytes.
        """
        size = os.stat(path).st_size
        self._reserve(size, timeout)
        tmp = self.root / f".tmp-{uuid.uuid4().hex}.data"
        try:
            linked = self._link_or_copy(Path(path), tmp)
            crc, actual = crc32_of_file(tmp)
            if actual != size:
                raise InvalidArgument(f"{path} changed size while being spooled ({size} -> {actual} bytes)")
            meta.size, meta.crc32 = actual, crc
            entry = self._commit(tmp, meta, move, size)
        except BaseException:
            tmp.unlink(missing_ok=True)
            self._release(size)
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


    def _commit(self, tmp: Path, meta: TupleMeta, move: MoveOnDone | None, reserved: int) -> SpoolEntry:
        """Turn a written payload into an entry: rename, then the meta file last."""
        with self._cond:
            seq = self._next_seq
            self._next_seq += 1
        data_path = self._path(seq, "data")
        always = self.fsync == "always"
        try:
            if always:
                fsync_file(tmp)  # the payload is on disk before the entry names it
            os.replace(tmp, data_path)
            if move is not None:
                atomic_write(self._path(seq, "move"), json.dumps(dataclasses.asdict(move)).encode(),
                              durable=always)
            atomic_write(self._path(seq, "meta"), meta.SerializeToString(), durable=always)
        except BaseException:
            for kind in ("data", "move", "meta"):
                self._path(seq, kind).unlink(missing_ok=True)
            raise
        entry = SpoolEntry(seq, meta, data_path, move)
        with self._cond:
            if self.fsync == "batch":
                self._dirty += [data_path, self._path(seq, "meta")]
                if move is not None:
                    self._dirty.append(self._path(seq, "move"))
            self._entries[seq] = entry
            self._reserved -= reserved
            self._used += entry.size
        return entry

    # -- updating and removing ----------------------------------------------------

    def update(self, entry: SpoolEntry) -> None:
        """Persist the entry's metadata (id, ticket, attempt) atomically."""
        with self._cond:
            if entry.seq not in self._entries:
                return
        atomic_write(self._path(entry.seq, "meta"), entry.meta.SerializeToString(), durable=False)

    def remove(self, entry: SpoolEntry) -> None:
        """Forget a delivered tuple: the meta goes first, so a crash leaves no half entry."""
        with self._cond:
            if self._entries.pop(entry.seq, None) is None:
                return
        self._path(entry.seq, "meta").unlink(missing_ok=True)
        if entry.move is not None:
            self._path(entry.seq, "move").unlink(missing_ok=True)
        entry.data_path.unlink(missing_ok=True)
        with self._cond:
            self._used -= entry.size
            if entry.payload is not None:
                self._memory_used -= len(entry.payload)
                entry.payload = None
            self._cond.notify_all()

    # -- reading ---------------------------------------------------------------

    def entries(self) -> list[SpoolEntry]:
        """Committed entries in their original order."""
        with self._cond:
            return [self._entries[s] for s in sorted(self._entries)]

    def __iter__(self) -> Iterator[SpoolEntry]:
        return iter(self.entries())

    def move_sources(self) -> set[str]:
        """Original paths of spooled files that move on delivery (what the watcher took)."""
        with self._cond:
            return {e.move.source for e in self._entries.values() if e.move is not None}

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return self._used

    @property
    def reserved_bytes(self) -> int:
        with self._cond:
            return self._reserved

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)
