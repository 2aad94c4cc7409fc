"""The append-only log of feature records: segments on disk, index in memory.

Durability (``fsync``):

* ``batch`` (default): a put returns only after an fsync covering its records
  (and any duplicate it reports); concurrent puts share one fsync (group
  commit), at most one every ``fsync_interval`` seconds. An acknowledged put
  survives a power loss, and the engine may answer ``STORED``.
* ``always``: every put fsyncs while holding the append lock (simplest
  ordering, lowest throughput under concurrency).
* ``never``: data reaches the OS before a put returns (survives a crash of
  this process); the OS writes it when it will.

The segments, their torn-tail cut, roll and fsync rounds are a
:class:`~hio.storage.segmentlog.SegmentLog`; this module keeps the record offsets,
the id index, group commit and the reads. A failed fsync (a folder's included)
is final: after such a failure the kernel may have dropped the dirty pages, so
a later fsync succeeding proves nothing; every put is refused
(``FailedPrecondition`` naming the disk, the error and the time) until the
repository restarts.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import shutil
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hio.repository.index import Location, OffsetIndex
from hio.repository.segments import HEADER, MAGIC, NAMING, decode_record, encode_record, record_follows, scan_segment
from hio.storage.files import DiskFailure, atomic_write, clean_temporaries, lock_folder
from hio.storage.segmentlog import Segment, SegmentLog
from hio.transport.errors import DataLoss, FailedPrecondition, InvalidArgument, Unavailable

log = logging.getLogger("hio.repository")

_LOOKUP_CHUNK = 1024  # offsets resolved per lock acquisition when reading
_READ_RUN_BYTES = 4 * 1024 * 1024  # adjacent records fetched with one pread, up to this much
WANTED_CHECK_SECONDS = 1.0  # a waiting wait_beyond asks this often whether its caller still wants the answer
NEWEST_SEGMENT = "newest-segment"  # beside the segments: the first offset of the newest one made


def read_offset_file(path: Path, what: str) -> int | None:
    """The offset a file written atomically holds; None when there is no such file. Anything
    else is outside damage: the start stops, naming the file, rather than guess an offset."""
    try:
        offset = int(path.read_text().strip())
        if offset < 0:
            raise ValueError(f"{offset} is below 0")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"{what} {path} is unreadable ({exc}); fix or remove it") from None
    return offset


class CorruptSegment(DataLoss):
    """A segment other than the last is damaged, or segments are missing: the
    repository refuses to start rather than serve or renumber wrong data."""


@dataclasses.dataclass(frozen=True)
class Appended:
    """The outcome of one record of a put: its offset, and whether it was already there."""

    offset: int
    duplicate: bool


class DurableTimes:
    """When each of the latest ``capacity`` (or more) records became readable: the highest
    offset and the wall-clock time of each fsync round (each append with 'never'), in memory.

    Why: a record's own bytes cannot say when the fsync that covers it ended, and that is the
    moment its features are stored for good (the end of a tuple's latency, and the moment
    ``latest`` counts it). Rounds are kept, not records, so group commit keeps it small; the
    oldest are forgotten in halves. Not under any lock of its own: :class:`FeatureLog` holds
    its lock around every call."""

    def __init__(self, floor: int, capacity: int = 1 << 17) -> None:
        self._floor = floor  # offsets up to here became readable before what is remembered
        self._offsets = array("Q")
        self._times = array("d")
        self._capacity = capacity

    def add(self, offset: int, unix: float) -> None:
        """Records up to ``offset`` are readable as of ``unix``."""
        if offset <= (self._offsets[-1] if self._offsets else self._floor):
            return
        self._offsets.append(offset)
        self._times.append(unix)
        if len(self._offsets) > 2 * self._capacity:
            self._floor = self._offsets[-self._capacity - 1]
            del self._offsets[: -self._capacity]
            del self._times[: -self._capacity]

    def of(self, offset: int) -> float:
        """When ``offset`` became readable (Unix seconds); 0.0 when not remembered."""
        if offset <= self._floor:
            return 0.0
        n = bisect.bisect_left(self._offsets, offset)
        return self._times[n] if n < len(self._offsets) else 0.0


class FeatureLog:
    """Append-only, idempotent-by-tuple-id record log on a :class:`SegmentLog`. Thread safe."""

    def __init__(
        self, folder: Path, disk: DiskFailure, *, segment_bytes: int, fsync: str = "batch", fsync_interval: float = 0.0
    ) -> None:
        self._segment_bytes = segment_bytes
        self._lock = threading.Lock()  # the index and every append
        self._grew = threading.Condition(self._lock)  # what readers may see grew (wait_beyond)
        self._index = OffsetIndex()
        self._closed = False
        self._log = SegmentLog(folder, NAMING, fsync=fsync, disk=disk, header=MAGIC)
        self._durable = 0  # the highest offset an fsync covers (under the lock)
        self.appended = 0  # records this process appended (under the lock)
        self.duplicates = 0  # records put whose id was stored already: nothing written (under the lock)
        self._sync_lock = threading.Lock()  # one fsync round at a time: puts waiting here ride on the next
        self._fsync_interval = fsync_interval
        self._last_sync = 0.0
        folder.mkdir(parents=True, exist_ok=True)
        # two writers would interleave records
        self._lock_fd = lock_folder(folder, FailedPrecondition(f"{folder} is in use by another repository process"))
        try:
            self._recover()
        except BaseException:
            self._log.close()
            os.close(self._lock_fd)
            raise

    def _recover(self) -> None:
        """Rebuild the index from the segments (the log cuts a torn tail of the last one)."""
        started = time.monotonic()
        clean_temporaries(self._log.folder)
        made = read_offset_file(self._log.folder / NEWEST_SEGMENT, "the newest segment's mark") or 0
        found = self._log.open(self._load_segment)
        newest = max(self._log.segments, default=0)
        self._check_newest(made, newest)
        if not found:
            self._new_segment(1)
        else:
            self._log.resume()
            if made != newest:
                self._mark_newest(newest)
        self._durable = self._index.latest
        self._durable_times = DurableTimes(self._durable)
        log.info(
            "feature log opened",
            extra={
                "records": self._index.latest,
                "segments": self._index.segments,
                "rebuild_s": round(time.monotonic() - started, 3),
            },
        )

    def _load_segment(self, segment: Segment, last: bool) -> int:
        """Index one segment's records; where its last whole record ends.

        A torn tail of the last segment is kept aside for the log to cut off; damage
        anywhere else stops the start, as does damage in the last segment with good records
        after it (a flipped bit, not a crash: cutting there would throw away features
        already answered STORED)."""
        first, path = segment.id, segment.path
        if first != self._index.latest + 1:
            raise CorruptSegment(
                f"segment {path.name} starts at offset {first} but the segments before it "
                f"end at {self._index.latest}: a segment is missing or misnamed"
            )
        scan = scan_segment(path, first)
        problem, at = scan.problem, scan.valid_end
        damaged = first + len(scan.tuple_ids)  # the next good record is one of the few after it
        if problem and last and record_follows(path, at, range(damaged + 1, damaged + 9)):
            raise CorruptSegment(
                f"segment {path} is damaged at byte {at} ({problem}), and stored "
                "records follow the damage, so it is not a torn tail; not cutting them "
                "off. Restore the segment from a backup, or move it aside"
            )
        if problem and (not last or (at == 0 and scan.file_size >= len(MAGIC))):
            raise CorruptSegment(
                f"segment {path} is damaged at byte {at} ({problem}); restore it from a backup or move it aside"
            )
        if problem:
            kept = self._keep_torn_tail(path, at)
            log.warning(
                "truncating torn tail of feature segment",
                extra={
                    "segment": path.name,
                    "at_byte": at,
                    "dropped_bytes": scan.file_size - at,
                    "problem": problem,
                    "kept_in": kept,
                },
            )
        self._index.begin_segment(first)
        self._index.extend(scan.tuple_ids, scan.positions, scan.lengths)
        return at

    def _keep_torn_tail(self, path: Path, valid_end: int) -> str:
        """Copy the bytes about to be cut to ``torn/`` so an operator can inspect them."""
        folder = self._log.folder / "torn"
        folder.mkdir(exist_ok=True)
        target = folder / f"{path.name}.{int(time.time())}.{valid_end}.tail"
        with open(path, "rb") as src, open(target, "wb") as dst:
            src.seek(valid_end)
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
        return str(target)

    def _new_segment(self, first: int) -> None:
        """Seal the current segment and start the one whose first record is ``first``."""
        try:
            self._log.roll(first)
        except OSError as exc:
            raise Unavailable(f"the repository cannot start a new segment: {exc.strerror}") from None
        self._index.begin_segment(first)
        self._mark_newest(first)

    # -- the newest segment made ---------------------------------------------------------
    #
    # Segments are never deleted, so the newest one made must be there at the next start.
    # The segments alone cannot show that ones at the end are gone (deleted, or the folder
    # restored from an older copy): the log would end early, its next records would take
    # offsets consumers have read past, and features answered STORED would be lost unseen.

    def _check_newest(self, made: int, newest: int) -> None:
        if made > newest:
            path = self._log.folder / NEWEST_SEGMENT
            found = f"the newest segment here starts at offset {newest}" if newest else "no segment is here"
            raise CorruptSegment(
                f"segments at the end of the feature log are missing: segment {NAMING.name(made)} was made "
                f"({path} says so), but {found}, so the stored records from offset {self._index.latest + 1} "
                f"on are gone. Restore the missing segments from a backup; to start without them, "
                f"accepting the loss, remove {path}"
            )

    def _mark_newest(self, first: int) -> None:
        """Mark the segment starting at ``first`` as the newest made. A failure weakens only
        the check at the next start (the next roll or start marks again): logged, not raised."""
        try:
            atomic_write(
                self._log.folder / NEWEST_SEGMENT,
                f"{first}\n".encode(),
                disk=self._log.disk,
                durable=self._log.fsync != "never",
            )
        except (OSError, FailedPrecondition) as exc:
            log.warning("the newest segment could not be marked", extra={"first_offset": first, "error": str(exc)})

    def _append(self, items: Sequence[tuple[int, bytes]]) -> list[Appended]:
        """Append (tuple_id, payload) records whose ids are not stored yet (checked by
        :meth:`~hio.repository.store.FeatureStore.put` first).

        Ids already stored (or repeated within ``items``) get their existing
        offset and ``duplicate=True``; nothing is written for them. Returns
        once the outcome is as durable as the fsync mode promises.
        """
        with self._lock:
            self._check_writable()
            results, fresh = self._plan(items)
            self.appended += len(fresh)
            self.duplicates += len(results) - len(fresh)
            if fresh:
                self._write(fresh)
                if self._log.fsync == "always":
                    self._durable = self._index.latest
                if self._log.fsync != "batch":  # 'always': synced now; 'never': readable now
                    self._durable_times.add(self._index.latest, time.time())
                    self._grew.notify_all()
        highest = max((r.offset for r in results), default=0)
        if self._log.fsync != "never":
            self._wait_durable(highest)
        return results

    def _wait_durable(self, offset: int) -> None:
        """Return once an fsync covers ``offset`` (group commit): one caller at a time runs a
        round, at least ``fsync_interval`` after the last, and the puts that arrive meanwhile
        ride on the next."""
        while True:
            with self._lock:
                if self._durable >= offset:
                    return
            with self._sync_lock:
                with self._lock:
                    if self._durable >= offset:
                        return
                delay = self._last_sync + self._fsync_interval - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                try:
                    covered = self._sync_current()
                finally:
                    self._last_sync = time.monotonic()
                with self._lock:
                    self._durable = max(self._durable, covered)
                    self._durable_times.add(covered, time.time())
                    self._grew.notify_all()

    def _check_writable(self) -> None:
        if self._closed:
            raise Unavailable("the repository is shutting down")
        self._log.disk.check()  # after a failed fsync: no new record until restart (DiskFailure)

    def _plan(self, items: Sequence[tuple[int, bytes]]) -> tuple[list[Appended], list[tuple[int, int, bytes]]]:
        """Offsets for each item; the (offset, tuple_id, payload) list of those to write."""
        results: list[Appended] = []
        fresh: list[tuple[int, int, bytes]] = []
        in_batch: dict[int, int] = {}
        next_offset = self._index.latest + 1
        for tuple_id, payload in items:
            existing = self._index.offset_of(tuple_id) or in_batch.get(tuple_id, 0)
            if existing:
                results.append(Appended(existing, True))
                continue
            in_batch[tuple_id] = next_offset
            fresh.append((next_offset, tuple_id, payload))
            results.append(Appended(next_offset, False))
            next_offset += 1
        return results, fresh

    def _write(self, fresh: list[tuple[int, int, bytes]]) -> None:
        """Write records in order, sealing segments that would outgrow ``segment_bytes``; the
        records for one segment are framed into one buffer, appended in one piece."""
        chunk = bytearray()
        records: list[tuple[int, int]] = []  # (tuple id, record length) of what chunk holds
        for offset, tuple_id, payload in fresh:
            active = self._log.active
            used = (active.size if active is not None else 0) + len(chunk)
            if used + HEADER.size + len(payload) > self._segment_bytes and used > len(MAGIC):
                self._write_chunk(chunk, records)
                chunk, records = bytearray(), []
                self._new_segment(offset)
            records.append((tuple_id, encode_record(chunk, offset, tuple_id, payload)))
        self._write_chunk(chunk, records)

    def _write_chunk(self, chunk: bytearray, records: list[tuple[int, int]]) -> None:
        """One append of framed records ((tuple id, length) each) to the current segment,
        indexed only once written whole (and, with 'always', synced)."""
        if not chunk:
            return
        try:
            _, position = self._log.append([chunk])
        except OSError as exc:
            log.error("feature write failed; cut off", extra={"error": exc.strerror})
            raise Unavailable(f"the repository cannot write features: {exc.strerror}") from None
        for tuple_id, length in records:
            self._index.add(tuple_id, position, length)
            position += length

    def _sync_current(self) -> int:
        """One fsync round of the log, outside the lock; returns the offset now durable."""
        with self._lock:
            target = self._index.latest
            if self._closed:
                return target  # close() synced everything
            self._check_writable()
        try:
            self._log.flush()
        except OSError as exc:
            self._log.disk.check()  # the fsync failed: the refusal that names it
            raise Unavailable(f"the repository cannot persist features: {exc.strerror}") from None
        return target

    def latest(self) -> int:
        """Highest offset readers may see; 0 when empty.

        With ``batch`` or ``always`` that is the highest durable offset: a record
        a reader (KD) has seen must not vanish in a power loss and its offset
        go to another record. Records in an fsync still running become visible
        when it ends (within ``fsync_interval``). With ``never``, every record
        written."""
        with self._lock:
            return self._readable_locked()

    def wait_beyond(self, offset: int, seconds: float, wanted: Callable[[], bool] = lambda: True) -> int:
        """:meth:`latest` once it passes ``offset``, when ``seconds`` pass, or once ``wanted()``
        (asked every :data:`WANTED_CHECK_SECONDS`) says the caller has gone: a follower's long
        poll, woken by the append or fsync round that makes a record readable. Unavailable when
        the log closes first."""
        deadline = time.monotonic() + seconds
        while True:
            with self._lock:  # wanted() is asked outside it: the caller's check takes gRPC's locks
                if (latest := self._readable_locked()) > offset:
                    return latest
                if self._closed:
                    raise Unavailable("the repository is shutting down")
                left = deadline - time.monotonic()
                if left > 0:
                    self._grew.wait(min(left, WANTED_CHECK_SECONDS))
                latest = self._readable_locked()
            if latest > offset or left <= 0 or not wanted():
                return latest

    def _readable_locked(self) -> int:
        if self._log.fsync == "never":
            return self._index.latest
        return min(self._index.latest, self._durable)

    def largest_payload(self) -> int:
        """Bytes of the largest record stored (0 when empty)."""
        with self._lock:
            return max(self._index.longest() - HEADER.size, 0)

    def offset_of(self, tuple_id: int) -> int:
        """Offset of ``tuple_id``, 0 if not stored."""
        with self._lock:
            return self._index.offset_of(tuple_id)

    def durable_unix(self, offsets: Sequence[int]) -> list[float]:
        """When each offset became readable (its fsync ended; with 'never', its write), Unix
        seconds by this machine's clock; 0.0 for a record stored before this process opened the
        log, or too long ago to be remembered (:class:`DurableTimes`)."""
        with self._lock:
            return [self._durable_times.of(offset) for offset in offsets]

    def stats(self) -> dict[str, int]:
        """records, segments, bytes on disk; records readable, appended and put as duplicates."""
        with self._lock:
            return {
                "records": self._index.latest,
                "segments": self._index.segments,
                "bytes": self._log.bytes_on_disk(),
                "readable": self._readable_locked(),
                "appended": self.appended,
                "duplicates": self.duplicates,
            }

    def read(self, after: int = 0, until: int = 0, max_records: int = 0) -> Iterator[tuple[int, int, bytes]]:
        """(offset, tuple_id, payload) for ``after < offset <= until`` (0 = latest), in
        order, at most ``max_records`` (0 = no limit). Arguments are checked now;
        records are read from disk as the iterator advances."""
        if after < 0 or until < 0 or max_records < 0:
            raise InvalidArgument("after, until and max_records must not be negative")
        if until and until < after:
            raise InvalidArgument(f"until ({until}) is below after ({after})")
        with self._lock:
            if self._closed:
                raise Unavailable("the repository is shutting down")
            readable = self._readable_locked()
            last = readable if until == 0 else min(until, readable)
        if max_records:
            last = min(last, after + max_records)
        return self._iterate(after + 1, last)

    def _iterate(self, first: int, last: int) -> Iterator[tuple[int, int, bytes]]:
        fds: dict[int, int] = {}
        try:
            for start in range(first, last + 1, _LOOKUP_CHUNK):
                stop = min(start + _LOOKUP_CHUNK - 1, last)
                with self._lock:
                    locations = self._index.locations(start, stop)
                for run_first, run in _runs(start, locations):
                    path = self._log.folder / NAMING.name(run[0].segment)
                    fd = fds.get(run[0].segment)
                    if fd is None:
                        fd = fds[run[0].segment] = os.open(path, os.O_RDONLY)
                    yield from _read_run(fd, path, run_first, run)
        finally:
            for fd in fds.values():
                os.close(fd)

    def close(self) -> None:
        """Flush to disk (unless 'never') and stop accepting writes. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._log.close()
            except OSError as exc:
                log.error("fsync at close failed", extra={"error": exc.strerror})
            finally:
                os.close(self._lock_fd)  # releases the folder lock
            if self._log.fsync != "never" and not self._log.disk.failure:
                self._durable = self._index.latest
                self._durable_times.add(self._durable, time.time())
            self._grew.notify_all()  # a wait_beyond ends with the log


def _runs(first: int, locations: list[Location]) -> Iterator[tuple[int, list[Location]]]:
    """Group adjacent records of one segment so each group is one pread: (its first offset, the group)."""
    run: list[Location] = []
    run_bytes = 0
    for offset, loc in enumerate(locations, first):
        if run and (
            loc.segment != run[-1].segment
            or loc.position != run[-1].position + run[-1].length
            or run_bytes + loc.length > _READ_RUN_BYTES
        ):
            yield offset - len(run), run
            run, run_bytes = [], 0
        run.append(loc)
        run_bytes += loc.length
    if run:
        yield first + len(locations) - len(run), run


def _read_run(fd: int, path: Path, first: int, run: list[Location]) -> Iterator[tuple[int, int, bytes]]:
    start = run[0].position
    size = run[-1].position + run[-1].length - start
    buf = os.pread(fd, size, start)
    view = memoryview(buf)
    for offset, loc in enumerate(run, first):
        piece = view[loc.position - start : loc.position - start + loc.length]
        decoded = decode_record(piece, offset)
        if decoded is None:
            log.error("damaged feature record on disk", extra={"segment": path.name, "offset": offset})
            raise DataLoss(f"the record at offset {offset} is damaged on disk ({path.name})")
        yield offset, decoded[0], decoded[1]
