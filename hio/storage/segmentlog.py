"""One append-only segment log under the durable stores (the gateway's spool, the
master's backlog, the repository's feature log); each store keeps only its record
format and its indexes on top of it.

A log is a folder of numbered segment files (:class:`Naming`), each starting with the
store's ``header`` (a file magic; may be empty). Records are appended to the active
segment in one piece (or streamed and then committed); a record the disk did not take
whole is cut off, so a segment always ends on a whole record. At open, each segment is
scanned by the store and cut after its last whole record (a torn tail: a crash
mid-append). Segments roll at ``segment_bytes``; a store deletes one none of whose
records it needs (:meth:`SegmentLog.delete`).

When bytes reach the disk is the fsync policy's choice:

* ``always``: each record is fsynced before :meth:`SegmentLog.append` returns; one whose
  fsync failed is refused and cut off its segment.
* ``batch``: :meth:`SegmentLog.flush` (a background round, or a caller waiting for it)
  fsyncs what was appended since the last round, sealed segments and tracked files
  included. A sealed segment deleted before its round is closed unsynced: what it held
  finished and needs no disk. What waits for a round is kept within ``unsynced_bytes``
  (:meth:`SegmentLog.admit`): a store that fsyncs in background rounds answers before the
  disk has the bytes, and a disk slower than the tuples would let the rounds fall behind
  without bound, so that a power loss took seconds of receipts, not one round's.
* ``never``: the OS writes when it will.

A failed fsync is final with every policy, a folder's included (:class:`DiskFailure`
says why): every new record is refused until the role restarts.

Thread safety: the caller serialises the appends to a segment (it numbers its records
in the same step); flushes run concurrently with them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from hio.config import FSYNC_POLICIES
from hio.storage.files import DiskFailure, write_all
from hio.transport.errors import Unavailable

log = logging.getLogger("hio.segmentlog")

UNSYNCED_BYTES = 256 * 1024 * 1024  # 'batch': what may wait for the disk (about a second of it)
JOIN_BYTES = 64 * 1024  # parts of a record up to this size are written with one call


@dataclasses.dataclass(frozen=True)
class Naming:
    """How segment files are named: ``<prefix><id, zero-padded to digits><suffix>``."""

    prefix: str
    digits: int
    suffix: str

    def name(self, seg_id: int) -> str:
        return f"{self.prefix}{seg_id:0{self.digits}d}{self.suffix}"

    def parse(self, name: str) -> int | None:
        """The id a file name declares, or None for other files."""
        match = re.fullmatch(rf"{re.escape(self.prefix)}(\d{{{self.digits}}}){re.escape(self.suffix)}", name)
        return int(match.group(1)) if match else None


@dataclasses.dataclass(eq=False)
class Segment:
    """One segment file; ``live`` holds the keys of the records in it its store still needs."""

    id: int
    path: Path
    size: int = 0
    fd: int | None = None  # open while appended to, and while sealed until its round syncs it
    sealed: bool = True  # takes no more appends
    unsynced: int = 0  # 'batch': bytes appended and not yet fsynced
    live: set[int] = dataclasses.field(default_factory=set)


class SegmentLog:
    """The segment files of one store folder (see the module doc)."""

    def __init__(
        self,
        folder: Path,
        naming: Naming,
        *,
        fsync: str,
        disk: DiskFailure,
        unsynced_bytes: int = UNSYNCED_BYTES,
        segment_bytes: int = 0,
        header: bytes = b"",
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"unknown fsync policy {fsync!r}")
        self.folder = Path(folder)
        self.naming = naming
        self.fsync = fsync
        self.disk = disk
        self.unsynced_limit = unsynced_bytes
        self.unsynced = 0  # 'batch': bytes admitted or appended and not yet synced
        self.segment_bytes = segment_bytes  # 0: the store rolls (its names say where records start)
        self.header = header
        self.segments: dict[int, Segment] = {}
        self.active: Segment | None = None
        # the segments and the counts (short holds only); 'batch' writers wait on it for room
        self.lock = threading.Condition()
        self._rounds = 0  # flush rounds finished
        self._round_error = ""  # why the latest round failed ('' after a success)
        self._flush_lock = threading.Lock()  # one round at a time
        self._folder_dirty = False  # 'batch': a file was made since the last round
        self._files: list[tuple[Path, int]] = []  # 'batch': other files to sync, with the bytes they settle
        self._side: list[Segment] = []  # files beside the segments synced with them (a journal)
        self._top = 0  # the highest segment number made: never used twice
        self._closed = False
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._work = threading.Event()  # 'batch': something waits for a round (set with the count)

    def open(self, scan: Callable[[Segment, bool], int]) -> list[Segment]:
        """Scan the segments oldest first; ``scan(segment, last)`` applies a segment's records
        and returns where its last whole one ends (or raises: damage it will not cut). What
        follows is cut off (a torn tail), and a torn header written again. Returns the
        segments, oldest first."""
        self.folder.mkdir(parents=True, exist_ok=True)
        found = sorted(
            (seg_id, path) for path in self.folder.iterdir() if (seg_id := self.naming.parse(path.name)) is not None
        )
        for n, (seg_id, path) in enumerate(found, 1):
            segment = Segment(seg_id, path, size=path.stat().st_size)
            self.segments[seg_id] = segment
            self._top = seg_id
            end = scan(segment, n == len(found))
            if end < segment.size or end < len(self.header):  # an empty file has a torn header too
                self._cut_tail(segment, end)
        return list(self.segments.values())

    def _cut_tail(self, segment: Segment, end: int) -> None:
        log.warning(
            "torn segment tail cut off",
            extra={"segment": segment.path.name, "at_byte": end, "bytes": segment.size - end},
        )
        fd = os.open(segment.path, os.O_WRONLY)
        try:
            if end < len(self.header):
                os.ftruncate(fd, 0)
                write_all(fd, self.header)
                end = len(self.header)
            os.ftruncate(fd, end)
            if self.fsync != "never":
                self.disk.sync(fd)
        finally:
            os.close(fd)
        segment.size = end

    def resume(self) -> Segment:
        """Append to the newest segment again (a store whose names say where records start)."""
        segment = self.segments[max(self.segments)]
        segment.fd = os.open(segment.path, os.O_WRONLY | os.O_APPEND)
        segment.sealed = False
        self.active = segment
        return segment

    def roll(self, seg_id: int | None = None) -> Segment:
        """Start a new segment, ``seg_id`` or the next number, and seal the active one. When
        the new one cannot be made (a full disk), the active one stays as it was, so the next
        append tries again rather than finding the log closed."""
        segment = self.create(seg_id)
        if self.active is not None:
            self.seal(self.active)
        with self.lock:
            self.active = segment
        return segment

    def create(self, seg_id: int | None = None) -> Segment:
        """A new segment file (its header written) open for appending: the active one
        (:meth:`roll`), or one a store's writer appends to alone (the backlog's)."""
        with self.lock:
            seg_id = self._top + 1 if seg_id is None else seg_id
            self._top = max(self._top, seg_id)
            path = self.folder / self.naming.name(seg_id)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            segment = Segment(seg_id, path, fd=fd, sealed=False)
            self.segments[seg_id] = segment
            self._folder_dirty = True
            self._wake_flusher()
        try:
            write_all(fd, self.header)
            segment.size = len(self.header)
            if self.header:
                self.written(segment, len(self.header))
            if self.fsync == "always":
                self.disk.sync_folder(self.folder, refuse=True)
        except BaseException:
            self.delete(segment).unlink(missing_ok=True)
            raise
        return segment

    def admit(self, nbytes: int) -> int:
        """Before a record of ``nbytes`` is written: every policy refuses it after a failed
        fsync; 'batch' waits until it keeps what waits for the disk within ``unsynced_bytes``
        (one larger waits until nothing does) and counts it, so the bound holds for concurrent
        writers too. Raises Unavailable, nothing counted, when a round fails while it waits.
        Returns the bytes counted, for :meth:`append` (or :meth:`settle` if not written).
        Call it holding none of the store's locks."""
        self.disk.check()
        if self.fsync != "batch":
            return 0
        with self.lock:
            start = self._rounds
            while self.unsynced and self.unsynced + nbytes > self.unsynced_limit and not self._closed:
                if self._round_error and self._rounds > start:
                    raise Unavailable(
                        f"{self.disk.name} does not sync ({self._round_error}); "
                        f"{self.unsynced} bytes wait for it; nothing was written",
                        retry_after=1.0,
                    )
                self.lock.wait()  # every change it waits for notifies (settle, a round, close)
                self.disk.check()
            self.unsynced += nbytes
        return nbytes

    def settle(self, nbytes: int) -> None:
        """``nbytes`` no longer wait: synced, deleted before their sync, or not written after all."""
        if nbytes:
            with self.lock:
                self.unsynced -= nbytes
                self.lock.notify_all()

    def append(self, parts: Sequence[bytes | bytearray | memoryview], admitted: int = 0) -> tuple[Segment, int]:
        """Append one record (its parts in order) to the active segment, rolling it first
        when full; returns the segment and where the record starts. ``admitted``: bytes of
        it counted already (:meth:`admit`). On an error nothing stays appended (the caller gives
        ``admitted`` back); with 'always', a failed fsync is that error (the refusal)."""
        segment = self.active
        if segment is None or segment.fd is None:
            raise Unavailable("the store is closed; nothing was written")
        if self.segment_bytes and segment.size >= self.segment_bytes:
            segment = self.roll()
        start = segment.size
        total = sum(len(p) for p in parts)
        if len(parts) > 1 and total <= JOIN_BYTES:
            parts = [b"".join(parts)]  # one write: each write gives up the GIL, and getting it
            #                              back from a busy delivery thread costs more than the copy
        for part in parts:
            self.write(segment, part, start)
        self.commit(segment, start, admitted)
        return segment, start

    def write(self, segment: Segment, data: bytes | bytearray | memoryview, start: int) -> None:
        """Append part of a record that starts at ``start`` (a record streamed in pieces);
        on an error the record is cut off and the error raised."""
        assert segment.fd is not None
        try:
            write_all(segment.fd, data)
        except BaseException:
            self.cut(segment, start)
            raise
        segment.size += len(data)

    def commit(self, segment: Segment, start: int, admitted: int = 0) -> None:
        """The record from ``start`` to the segment's end is whole: :meth:`written`, and cut
        off if that fails (with 'always', refused: a restart must not bring it back)."""
        try:
            self.written(segment, segment.size - start, admitted)
        except BaseException:
            self.cut(segment, start)
            raise

    def written(self, segment: Segment, nbytes: int, admitted: int = 0) -> None:
        """``nbytes`` were appended to ``segment`` (or a side file): fsynced now ('always',
        a failure raised as the refusal that names it) or counted for the next round
        ('batch'; ``admitted`` of them counted already)."""
        if self.fsync == "always":
            assert segment.fd is not None
            self.disk.sync(segment.fd, refuse=True)
        elif self.fsync == "batch":
            with self.lock:
                segment.unsynced += nbytes
                self.unsynced += nbytes - admitted
                self._wake_flusher()

    def cut(self, segment: Segment, start: int) -> None:
        """Cut a record that is not to stay off ``segment``. If even that fails, the part
        left would end the segment's records at the next start (a torn record), so no new
        record is taken until restart; its size is what the file says."""
        assert segment.fd is not None
        try:
            os.ftruncate(segment.fd, start)
            segment.size = start
        except OSError as exc:
            segment.size = os.fstat(segment.fd).st_size
            self.disk.fail(f"a partial record could not be cut off: {exc.strerror or exc}")

    def seal(self, segment: Segment) -> None:
        """No more appends to ``segment``; 'batch' keeps it open for its round to sync."""
        with self.lock:
            segment.sealed = True
            if self.active is segment:
                self.active = None
            fd, keep = segment.fd, self.fsync == "batch" and segment.unsynced > 0 and not self._closed
            if not keep:
                segment.fd = None
                if segment in self._side:
                    self._side.remove(segment)
        if fd is not None and not keep:
            os.close(fd)

    def delete(self, segment: Segment) -> Path:
        """Forget a sealed segment none of whose records is needed; its bytes need no disk
        (closed unsynced). Returns its file for the caller to delete (it may be large:
        callers delete outside their locks)."""
        with self.lock:
            if segment in self._side:
                self._side.remove(segment)
            elif self.segments.get(segment.id) is segment:
                del self.segments[segment.id]
            fd, segment.fd = segment.fd, None
            unsynced, segment.unsynced = segment.unsynced, 0
        if fd is not None:
            os.close(fd)
        self.settle(unsynced)
        return segment.path

    def bytes_on_disk(self) -> int:
        with self.lock:
            return sum(s.size for s in self.segments.values())

    def attach(self, path: Path) -> Segment:
        """Open ``path`` (a file beside the segments, such as a journal) for appending, to be
        synced with the segments: report its appends with :meth:`written`; :meth:`seal` it
        (synced by the next round) or :meth:`delete` it (replaced: closed unsynced)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        side = Segment(-1, path, size=os.fstat(fd).st_size, fd=fd, sealed=False)
        with self.lock:
            self._side.append(side)
        return side

    def sync_path(self, path: Path, *, refuse: bool = False) -> None:
        """fsync a file by name: failing to open it is not the disk's failure, failing to
        sync is (final)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            self.disk.sync(fd, refuse=refuse)
        finally:
            os.close(fd)

    def track(self, path: Path, nbytes: int) -> None:
        """'batch': the next round syncs ``path`` (a file the store made beside its segments)
        and settles ``nbytes`` (counted by the caller's admission)."""
        with self.lock:
            self._files.append((path, nbytes))
            self._folder_dirty = True
            self._wake_flusher()

    def _wake_flusher(self) -> None:
        """A round has work ('batch'). The flag is read first: appends call this per record,
        and setting a set Event still takes its lock."""
        if not self._work.is_set():
            self._work.set()

    def flush(self) -> None:
        """One round: fsync what was appended (segments, sealed ones then closed, tracked
        files, the folder). Every step is tried; the first error is raised after them.
        The open segments and files not synced are tried again next round; a sealed
        segment whose fsync failed is not (the failure is final anyway)."""
        with self._flush_lock:
            with self.lock:
                work = [
                    (s, os.dup(s.fd), s.unsynced, s.sealed)
                    for s in [*self.segments.values(), *self._side]
                    if s.fd is not None and (s.unsynced or s.sealed)
                ]
                files, self._files = self._files, []
                folder, self._folder_dirty = self._folder_dirty, False
            errors = [e for args in work if (e := self._sync_segment(*args))]
            failed = self._sync_files(files, errors)
            if folder or files:  # a file was made or renamed in: its name needs the disk too
                try:
                    self.disk.sync_folder(self.folder)
                except OSError as exc:
                    errors.append(exc)
            if errors:
                with self.lock:
                    self._files.extend(failed)
                    self._folder_dirty = self._folder_dirty or folder
                    self._wake_flusher()  # what failed is tried again next round
                raise errors[0]

    def _sync_segment(self, segment: Segment, fd: int, covered: int, sealed: bool) -> OSError | None:
        """fsync ``segment`` through ``fd`` (a duplicate, then closed) unless it was deleted, and
        settle the bytes it ``covered``. One ``sealed`` before the round took it is settled and
        closed whatever the outcome (it gets no more bytes); one sealed since waits for the next."""
        error: OSError | None = None
        try:
            if self._kept(segment):
                self.disk.sync(fd)
        except OSError as exc:
            error = exc
        finally:
            os.close(fd)
        close = None
        kept = self._kept(segment)
        with self.lock:
            if kept and (error is None or sealed):
                covered = segment.unsynced if sealed else covered
                segment.unsynced -= covered
                self.settle(covered)
            if sealed and segment.fd is not None:
                close, segment.fd = segment.fd, None
            if sealed and segment in self._side:
                self._side.remove(segment)
        if close is not None:
            os.close(close)
        return error

    def _kept(self, segment: Segment) -> bool:
        """False once a segment was deleted (its bytes need no disk)."""
        with self.lock:
            return self.segments.get(segment.id) is segment or segment in self._side

    def _sync_files(self, files: Iterable[tuple[Path, int]], errors: list[OSError]) -> list[tuple[Path, int]]:
        """fsync tracked files; returns those that failed (to try again), adding their errors."""
        failed: list[tuple[Path, int]] = []
        for path, nbytes in files:
            try:
                self.sync_path(path)
            except FileNotFoundError:  # finished and deleted meanwhile
                pass
            except OSError as exc:
                errors.append(exc)
                failed.append((path, nbytes))
                continue
            self.settle(nbytes)
        return failed

    def start_flusher(self, interval: float, name: str) -> None:
        """'batch': run :meth:`flush` about every ``interval`` seconds in the background."""
        self._flusher = threading.Thread(target=self._flush_loop, args=(interval,), name=name, daemon=True)
        self._flusher.start()

    def _flush_loop(self, interval: float) -> None:
        """A round every ``interval`` seconds, on a fixed beat, skipping the beats with nothing
        appended since the last round: a store at rest costs no wake-up, and an append waits
        for the disk half an interval on average, as with a round at every beat."""
        beat, interval = time.monotonic(), max(interval, 0.001)
        while True:
            self._work.wait()
            if self._stop.wait(interval - (time.monotonic() - beat) % interval):
                return
            self._work.clear()  # before the round takes its work: what comes after is the next's
            self.flush_round()

    def flush_round(self) -> None:
        """:meth:`flush` for a background round: its error is logged and named to the writers
        waiting for the disk (:meth:`admit`; a failed fsync is final, but a round can fail for
        another reason, such as no descriptor left to open a file with); the next round retries."""
        error = ""
        try:
            self.flush()
        except OSError as exc:
            error = str(exc)
            log.error("fsync round failed", extra={"folder": str(self.folder), "error": error})
        with self.lock:
            self._rounds += 1
            self._round_error = error
            self.lock.notify_all()

    def close(self) -> None:
        """Stop the rounds, sync what waits (unless 'never') and close the segments but those
        a store's writer still appends to outside the active one (closed when it seals them)."""
        self._closed = True
        self._stop.set()
        self._work.set()  # the flusher's wait for work ends
        with self.lock:  # an append waiting for the disk goes on; the flush below syncs it
            self.lock.notify_all()
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.join(10.0)
        try:
            if self.fsync != "never":
                self.flush()
        finally:
            with self.lock:
                done = [
                    s
                    for s in [*self.segments.values(), *self._side]
                    if s.fd is not None and (s.sealed or s is self.active)
                ]
                fds = [s.fd for s in done if s.fd is not None]
                for segment in done:
                    segment.fd, segment.sealed = None, True
                self._side.clear()
                self.active = None
            for fd in fds:
                os.close(fd)
