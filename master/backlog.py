"""The backlog queue: FIFO per image, bounded in bytes, durable on disk.

Layout under ``data_dir/master/queue/``:

* ``seg-<n>.q`` -- append-only segment files of records (head, TupleMeta,
  payload, tail; see :mod:`hio.master.records`). Each tuple being received
  gets a segment of its own for the time it is written (concurrent Enqueue
  streams never interleave), so a record that fails verification is cut off
  by truncating its segment back to where it began. A torn record (crash
  mid-write) is truncated at start; the payload of every record still queued
  is checked against ``meta.crc32`` at start.

* ``journal.q`` -- append-only ACK (the record is done for good) and MOVE
  (the record moved in its queue: new order key and attempt) entries.
  Compacted by atomic rewrite.

At start every record neither acknowledged nor a dead letter is queued again,
ordered by its order key (its sequence number unless it moved), leases void.
A segment whose records are all done is deleted.

Locking: one condition (shared with the master) guards the in-memory state.
Payload bytes are written and read outside it: methods that may copy a payload
(to the dead letters) do it after releasing the lock, so they must be called
by a thread that does not hold it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from hio.master.deadletters import DeadLetterStore, DeadWriter
from hio.master.records import ACK, MOVE, NAMING, Journal, RecordWriter, scan_segment
from hio.master.storage import Durability
from hio.proto.master_pb2 import QueueStatus
from hio.storage.files import clean_temporaries, copy_exact
from hio.storage.segmentlog import Segment, SegmentLog
from hio.transport.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from hio.transport.frames import FrameReader, TupleFrame, TupleMeta, crc32_of_file

log = logging.getLogger("hio.master")

MAX_IDLE_SEGMENTS = 4  # open, partly filled segments kept for the next writers
JOURNAL_COMPACT_BYTES = 1024 * 1024
RETRY_AFTER_FULL = 1.0  # seconds: hint to a sender refused because the queue is full
LAST_ERROR_ATTRIBUTE = "hio.last_error"


class Placement(enum.Enum):
    """What happened to a received tuple (each is receipted ENQUEUED)."""

    ENQUEUED = "enqueued"
    DUPLICATE = "duplicate"  # already in the queue: stored once
    DEAD_LETTER = "dead_letter"  # attempts exhausted on arrival


@dataclasses.dataclass(frozen=True)
class Stored:
    """The receipt of one received tuple."""

    index: int
    meta: TupleMeta
    placement: Placement


@dataclasses.dataclass(eq=False)
class Entry:
    """A live record: waiting, leased, or on its way to the dead letters."""

    seq: int
    meta: TupleMeta
    segment: int
    offset: int  # where the payload starts in the segment
    order: int  # sort key at recovery (sequence number unless moved)
    moved: bool = False
    cached: bytes | None = None
    leased_to: str = ""
    lease_deadline: float = 0.0
    lease_token: int = 0
    # Channels that held it before (expired or voided leases): a late report
    # of success from one of them still counts, a stranger's never does.
    past_holders: set[str] = dataclasses.field(default_factory=set)

    @property
    def tuple_id(self) -> int:
        return self.meta.tuple_id

    @property
    def image(self) -> str:
        return self.meta.image

    @property
    def size(self) -> int:
        return self.meta.size


@dataclasses.dataclass(frozen=True)
class Lease:
    """A tuple handed to a channel; ``token`` identifies this lease among redeliveries."""

    tuple_id: int
    channel_id: str
    token: int
    meta: TupleMeta


class BacklogQueue:
    """Durable FIFO queues of tuples, one per image, bounded in total payload bytes."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        dead: DeadLetterStore,
        durability: Durability,
        queue_bytes: int,
        memory_bytes: int = 64 * 1024 * 1024,
        segment_bytes: int = 64 * 1024 * 1024,
        max_attempts: int = 3,
        cond: threading.Condition | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        clean_temporaries(self.root)  # a journal rewrite a crash interrupted
        self.dead = dead
        self.queue_bytes = queue_bytes
        self._memory_bytes = memory_bytes
        self._segment_bytes = segment_bytes
        self.max_attempts = max_attempts
        self._durable = durability
        self._cond = cond or threading.Condition(threading.RLock())
        self._clock = clock
        self._log = SegmentLog(
            self.root,
            NAMING,
            fsync=durability.policy,
            disk=durability.disk,
            unsynced_bytes=durability.unsynced_limit,
            segment_bytes=segment_bytes,
        )
        self._segments = self._log.segments  # segment id -> segment (live: seqs)
        self._acked: dict[int, list[int]] = {}  # segment id -> seqs the journal ACKs
        self._held: set[int] = set()  # ids of the segments a writer appends to right now
        self._entries: dict[int, Entry] = {}  # tuple id -> live entry
        self._ready: dict[str, collections.OrderedDict[int, Entry]] = {}
        self._leased: dict[int, Entry] = {}
        self._by_channel: dict[str, set[int]] = {}
        self._committing: set[int] = set()
        self._to_dead: list[tuple[Entry, str]] = []
        self._settling: set[int] = set()  # tuple ids being copied to the dead letters (off the lock)
        self._image_bytes: collections.Counter[str] = collections.Counter()
        self._image_len: collections.Counter[str] = collections.Counter()
        self._used = 0
        self._reserved = 0
        self._cached = 0
        self._cache_reserved = 0
        self._next_seq = 1
        self._head_order = -1
        self._next_token = 1
        self._closed = False
        self._journal = Journal(self.root / "journal.q", self._log, durability)
        self._recover()
        if durability.policy == "batch":  # the segments and the journal
            self._log.start_flusher(durability.interval, "backlog-fsync")

    def receive(
        self,
        frames: Iterable[TupleFrame],
        *,
        max_tuple_bytes: int,
        max_chunk_bytes: int,
        admit: Callable[[TupleMeta], None] = lambda meta: None,
    ) -> Iterator[Stored]:
        """Store the tuples of a frame stream one after the other; yield one receipt each. ``admit``
        sees each tuple's metadata before any payload is stored and may refuse it by raising. A tuple
        is visible to :meth:`lease_many` only once its bytes are on disk and verified; on any error
        the partial record is discarded and the error propagates (the stream ends)."""
        reader = FrameReader(frames, max_tuple_bytes=max_tuple_bytes, max_chunk_bytes=max_chunk_bytes, need_id=True)
        while True:
            index = reader.index
            job = _Receiving(self, admit)
            try:
                meta = reader.next_tuple(job.write, job.begin)
                if meta is None:
                    return
                placement = job.commit()
            except BaseException:
                job.abort()
                raise
            yield Stored(index=index, meta=meta, placement=placement)

    def _begin_record(self, meta: TupleMeta) -> RecordWriter:
        """Reserve room for ``meta.size`` bytes and a segment to write them into."""
        with self._cond:
            self._check_room(meta)  # a tuple to be refused is refused before it waits for the disk
        admitted = self._log.admit(meta.size)  # outside the lock: a disk behind the tuples holds this writer only
        try:
            writer = self._open_record(meta)
        except BaseException:
            self._log.settle(admitted)
            raise
        writer.admitted = admitted
        return writer

    def _open_record(self, meta: TupleMeta) -> RecordWriter:
        with self._cond:
            self._check_room(meta)  # again: others may have taken the room meanwhile
            segment = self._take_segment()  # first: a segment that cannot be made reserves nothing
            self._reserved += meta.size
            cache = meta.size <= self._memory_bytes - self._cached - self._cache_reserved
            if cache:
                self._cache_reserved += meta.size
        try:
            return RecordWriter(self._log, segment, meta, cache)  # a head it could not write is cut off
        except BaseException:
            with self._cond:
                self._reserved -= meta.size
                if cache:
                    self._cache_reserved -= meta.size
                self._give_back(segment)
            raise

    def _check_room(self, meta: TupleMeta) -> None:
        """Refuse a tuple the queue is closed to, that can never fit, or that does not fit now."""
        self._check_open()
        if meta.size > self.queue_bytes:
            raise InvalidArgument(
                f"tuple {meta.tuple_id}: {meta.size} bytes can never fit the backlog "
                f"queue bound of {self.queue_bytes} bytes"
            )
        if self._used + self._reserved + meta.size > self.queue_bytes:
            raise ResourceExhausted(
                f"backlog queue full: {self._used + self._reserved} of {self.queue_bytes} bytes used "
                f"({len(self._entries)} tuples); tuple {meta.tuple_id} needs {meta.size}",
                retry_after=RETRY_AFTER_FULL,
            )

    def _finish_record(self, writer: RecordWriter) -> Placement:
        """Publish a verified record, or drop it if the tuple is already queued."""
        meta = writer.meta
        with self._cond:
            self._check_open()
            duplicate = meta.tuple_id in self._entries or meta.tuple_id in self._committing
            if not duplicate:
                self._committing.add(meta.tuple_id)
                seq = self._next_seq
                self._next_seq += 1
        if duplicate:
            self._abort_record(writer)
            return Placement.DUPLICATE
        try:
            writer.finish(seq)
        except BaseException:
            with self._cond:
                self._committing.discard(meta.tuple_id)
            self._abort_record(writer)
            raise
        entry = Entry(
            seq=seq,
            meta=meta,
            segment=writer.segment.id,
            offset=writer.payload_offset,
            order=seq,
            cached=writer.cached(),
        )
        with self._cond:
            self._committing.discard(meta.tuple_id)
            self._end_record(writer, entry)
        return Placement.ENQUEUED

    def _end_record(self, writer: RecordWriter, entry: Entry | None) -> None:
        """Settle reservations, hand the segment back, publish ``entry`` if any (once per writer)."""
        with self._cond:
            if writer.ended:
                return
            writer.ended = True
            if writer.admitted:  # never written for good: what the disk was to sync is not coming
                self._log.settle(writer.admitted)
                writer.admitted = 0
            self._reserved -= writer.meta.size
            if writer.cache:
                self._cache_reserved -= writer.meta.size
            segment = writer.segment
            if entry is not None:
                segment.live.add(entry.seq)
                self._add(entry)
                self._ready.setdefault(entry.image, collections.OrderedDict())[entry.tuple_id] = entry
                self._cond.notify_all()
            self._give_back(segment)

    def _take_segment(self) -> Segment:
        """A segment for one writer alone (concurrent streams never interleave records): the
        oldest open one no writer holds, or a new one. Caller holds the lock."""
        idle = [s for s in self._segments.values() if not s.sealed and s.id not in self._held]
        segment = min(idle, key=lambda s: s.id) if idle else self._log.create()
        self._held.add(segment.id)
        return segment

    def _give_back(self, segment: Segment) -> None:
        """The writer is done with ``segment``: sealed when full, when more than
        MAX_IDLE_SEGMENTS wait for writers, or when the queue is closed."""
        self._held.discard(segment.id)
        idle = sum(1 for s in self._segments.values() if not s.sealed and s.id not in self._held)
        if segment.size >= self._segment_bytes or idle > MAX_IDLE_SEGMENTS or self._closed:
            self._log.seal(segment)
        self._maybe_delete(segment)

    def _maybe_delete(self, segment: Segment) -> None:
        """Delete a segment none of whose records is still needed (its bytes need no disk)."""
        if (
            segment.live
            or segment.id in self._held
            or (not segment.sealed and segment.size < self._segment_bytes and not self._closed)
        ):
            return
        self._log.seal(segment)
        self._log.delete(segment).unlink(missing_ok=True)
        self._acked.pop(segment.id, None)
        if self._journal.size > JOURNAL_COMPACT_BYTES and not self._closed:  # closed: the journal is too
            self._compact_journal()

    def _add(self, entry: Entry) -> None:
        self._entries[entry.tuple_id] = entry
        self._used += entry.size
        self._image_bytes[entry.image] += entry.size
        self._image_len[entry.image] += 1
        if entry.cached is not None:
            self._cached += entry.size

    def _drop(self, entry: Entry) -> None:
        """Remove a done entry for good: journal ACK, free its bytes, maybe its segment."""
        del self._entries[entry.tuple_id]
        self._used -= entry.size
        self._image_bytes[entry.image] -= entry.size
        self._image_len[entry.image] -= 1
        if not self._image_len[entry.image]:
            del self._image_len[entry.image]
            del self._image_bytes[entry.image]
        if entry.cached is not None:
            self._cached -= entry.size
            entry.cached = None
        self._journal.append(ACK, entry.seq, 0, 0)
        segment = self._segments.get(entry.segment)
        if segment is not None:
            segment.live.discard(entry.seq)
            self._acked.setdefault(segment.id, []).append(entry.seq)
            self._maybe_delete(segment)

    def _unlease(self, entry: Entry) -> None:
        self._leased.pop(entry.tuple_id, None)
        if entry.leased_to:
            entry.past_holders.add(entry.leased_to)
        held = self._by_channel.get(entry.leased_to)
        if held is not None:
            held.discard(entry.tuple_id)
            if not held:
                del self._by_channel[entry.leased_to]
        entry.leased_to = ""
        entry.lease_deadline = 0.0

    def _set_attempt(self, entry: Entry, attempt: int) -> None:
        entry.meta = copy.deepcopy(entry.meta)  # a new message: the leases handed out keep theirs
        entry.meta.attempt = attempt

    def _requeue(self, entry: Entry, *, head: bool, reason: str, charge: bool = True) -> None:
        """Take a lease back and requeue (attempt + 1 if ``charge``), or mark for the dead letters when exhausted."""
        self._unlease(entry)
        attempt = max(entry.meta.attempt, 1) + (1 if charge else 0)
        self._set_attempt(entry, attempt)
        if attempt > self.max_attempts:
            self._to_dead.append((entry, f"{reason} (attempt {attempt - 1} of {self.max_attempts})"))
            return
        if head:
            entry.order = self._head_order
            self._head_order -= 1
        else:
            entry.order = self._next_seq
            self._next_seq += 1
        entry.moved = True
        ready = self._ready.setdefault(entry.image, collections.OrderedDict())
        ready[entry.tuple_id] = entry
        if head:
            ready.move_to_end(entry.tuple_id, last=False)
        self._cond.notify_all()
        try:  # after the tuple is back: a journal that cannot be written must not strand it
            self._journal.append(MOVE, entry.seq, entry.order, attempt)
            self._durable_journal()  # synced like an ACK: a requeue survives a power loss as an ack does
        except (OSError, FailedPrecondition) as exc:
            log.error(
                "cannot journal a requeue; the tuple is queued, but after a restart it would "
                "have its earlier place and attempt count",
                extra={"tuple_id": entry.tuple_id, "error": str(exc)},
            )

    def lease_many(
        self, image: str, channel_id: str, lease_seconds: float, *, max_tuples: int = 1, max_bytes: int = 0
    ) -> list[Lease]:
        """Lease the first waiting tuples of ``image`` to ``channel_id``, in order: the head
        always, more while at most ``max_tuples`` of at most ``max_bytes`` in all, a tuple
        delivered before alone (docs/architecture.md, "Queue", says why). Empty if none waits."""
        leases: list[Lease] = []
        with self._cond:
            ready = self._ready.get(image)
            total = 0
            while ready and len(leases) < max(1, max_tuples):
                head = next(iter(ready.values()))
                if leases and (total + head.size > max_bytes or head.meta.attempt > 1 or leases[0].meta.attempt > 1):
                    break  # within the bytes; a tuple delivered before travels alone
                ready.popitem(last=False)
                total += head.size
                leases.append(self._lease_entry(head, channel_id, lease_seconds))
            if ready is not None and not ready:
                del self._ready[image]
        return leases

    def _lease_entry(self, entry: Entry, channel_id: str, lease_seconds: float) -> Lease:
        """Mark a waiting entry leased (lock held)."""
        entry.leased_to = channel_id
        entry.lease_deadline = self._clock() + lease_seconds
        entry.lease_token = self._next_token
        self._next_token += 1
        self._leased[entry.tuple_id] = entry
        self._by_channel.setdefault(channel_id, set()).add(entry.tuple_id)
        return Lease(tuple_id=entry.tuple_id, channel_id=channel_id, token=entry.lease_token, meta=entry.meta)

    def payloads(self, leases: list[Lease]) -> Iterator[tuple[TupleMeta, bytes | BinaryIO]]:
        """Each lease's metadata and payload, opened only when its turn comes."""
        return ((lease.meta, self._payload(lease)) for lease in leases)

    def _payload(self, lease: Lease) -> bytes | BinaryIO:
        """The payload of a current lease: in memory, or a file positioned at it."""
        with self._cond:
            entry = self._leased.get(lease.tuple_id)
            if entry is None or entry.lease_token != lease.token:
                raise NotFound(f"tuple {lease.tuple_id} is no longer leased to {lease.channel_id}")
            if entry.cached is not None:
                return entry.cached
            fh = open(self._segments[entry.segment].path, "rb")  # noqa: SIM115 - returned open: the stream reads and closes it
            fh.seek(entry.offset)
            return fh

    def refresh(self, channel_id: str, lease_seconds: float) -> None:
        """A report from ``channel_id``: its leases live on."""
        with self._cond:
            deadline = self._clock() + lease_seconds
            for tuple_id in self._by_channel.get(channel_id, ()):
                self._leased[tuple_id].lease_deadline = deadline

    def has_lease(self, channel_id: str) -> bool:
        with self._cond:
            return bool(self._by_channel.get(channel_id))

    def void_leases(self, channel_id: str, reason: str, *, charge: bool = True, settle: bool = True) -> list[int]:
        """The channel is gone (``charge``: each counts as a delivery attempt), or it is done
        with a pull and returns what it did not report (not charged): its tuples go back to
        the head of their queues, in the order they had. ``settle=False`` leaves copying the
        exhausted ones to the dead letters (disk I/O) to a later :meth:`settle`, for a caller
        that holds a lock of its own."""
        with self._cond:
            voided = sorted(
                (self._leased[t] for t in self._by_channel.get(channel_id, ())), key=lambda e: e.order, reverse=True
            )
            for entry in voided:
                self._requeue(entry, head=True, reason=reason, charge=charge)
        if settle:
            self.settle()
        if voided:
            log.info(
                "leases voided",
                extra={"channel": channel_id, "tuples": len(voided), "reason": reason, "charged": charge},
            )
        return [e.tuple_id for e in voided]

    def void_lease(self, lease: Lease, reason: str, *, charge: bool = True) -> bool:
        """Void one lease if it is still current (e.g. the pull stream was cancelled);
        ``charge=False`` when the tuple never left the master (no attempt is counted)."""
        with self._cond:
            entry = self._leased.get(lease.tuple_id)
            current = entry is not None and entry.lease_token == lease.token
            if current:
                assert entry is not None
                self._requeue(entry, head=True, reason=reason, charge=charge)
        self.settle()
        return current

    def expire_leases(self) -> list[str]:
        """Requeue tuples whose lease ran out; the channels that lost one."""
        with self._cond:
            now = self._clock()
            expired = [e for e in self._leased.values() if e.lease_deadline <= now]
            channels = sorted({e.leased_to for e in expired})
            for entry in expired:
                log.warning("lease expired", extra={"tuple_id": entry.tuple_id, "channel": entry.leased_to})
                self._requeue(entry, head=True, reason="lease expired")
        self.settle()
        return channels

    def ack(self, tuple_id: int, channel_id: str) -> bool:
        """``channel_id`` processed the tuple: remove it for good. False (nothing changes) if it is
        not queued, or if that channel never held it: only a holder's word removes a tuple."""
        with self._cond:
            entry = self._entries.get(tuple_id)
            if entry is None or tuple_id in self._settling or any(e is entry for e, _ in self._to_dead):
                return False
            if entry.leased_to != channel_id and channel_id not in entry.past_holders:
                return False
            if entry.leased_to:
                self._unlease(entry)
            else:
                self._remove_ready(entry)
            self._drop(entry)
        self._durable_journal()
        return True

    def fail(self, tuple_id: int, channel_id: str, reason: str) -> bool:
        """Processing failed on ``channel_id``: requeue at the tail, or dead-letter when exhausted.
        Ignored (False) unless the tuple is leased to that channel: after a redelivery only the
        current holder's word counts."""
        with self._cond:
            entry = self._leased.get(tuple_id)
            if entry is None or entry.leased_to != channel_id:
                return False
            self._requeue(entry, head=False, reason=reason or "processing failed")
        self.settle()
        return True

    def _remove_ready(self, entry: Entry) -> None:
        ready = self._ready.get(entry.image)
        if ready is not None:
            ready.pop(entry.tuple_id, None)
            if not ready:
                del self._ready[entry.image]

    def settle(self) -> None:
        """Copy entries marked for the dead letters out of the queue (disk I/O: call without the lock)."""
        while True:
            with self._cond:
                if not self._to_dead:
                    break
                entry, reason = self._to_dead.pop(0)
                self._settling.add(entry.tuple_id)  # neither ready nor leased: nobody may touch it
                cached = entry.cached
                path = self._segments[entry.segment].path
            try:
                if cached is not None:
                    self.dead.add(entry.meta, reason, cached, seq=entry.seq)
                else:
                    with open(path, "rb") as fh:
                        fh.seek(entry.offset)
                        self.dead.add(entry.meta, reason, fh, seq=entry.seq)
            except OSError as exc:
                log.error(
                    "cannot write dead letter; tuple stays queued",
                    extra={"tuple_id": entry.tuple_id, "error": str(exc)},
                )
                with self._cond:
                    self._settling.discard(entry.tuple_id)
                    ready = self._ready.setdefault(entry.image, collections.OrderedDict())
                    ready[entry.tuple_id] = entry
                    ready.move_to_end(entry.tuple_id, last=False)
                    self._cond.notify_all()
                continue
            with self._cond:
                self._settling.discard(entry.tuple_id)
                self._drop(entry)
                self._cond.notify_all()  # a retry_dead may wait for this copy
            self._durable_journal()

    def retry_dead(self, tuple_id: int) -> None:
        """Put a dead letter back at the tail of its queue with attempt 1."""
        letter = self.dead.get(tuple_id)
        if letter is None:
            raise NotFound(f"no dead letter with tuple id {tuple_id}")
        meta = copy.deepcopy(letter.meta)
        meta.attempt = 1
        meta.attributes.pop(LAST_ERROR_ATTRIBUTE, None)
        with self._cond:  # a letter still being written is not yet out of the queue: wait for it
            self._cond.wait_for(lambda: tuple_id not in self._settling, timeout=60.0)
            queued = tuple_id in self._entries or tuple_id in self._committing
        if not queued:
            writer = self._begin_record(meta)
            try:
                with self.dead.open_payload(tuple_id) as fh:
                    copy_exact(fh, writer.write, meta.size, f"dead letter {tuple_id}")
                self._finish_record(writer)
            except BaseException:
                self._abort_record(writer)
                raise
        self.dead.remove(tuple_id)
        log.info("dead letter retried", extra={"tuple_id": tuple_id, "image": meta.image})

    def _abort_record(self, writer: RecordWriter) -> None:
        """Cut an unpublished record off its segment and release what it reserved."""
        if writer.ended:
            return
        try:
            writer.discard()
        finally:
            self._end_record(writer, None)

    def ready_count(self, image: str) -> int:
        """Tuples of ``image`` waiting (not leased)."""
        with self._cond:
            return len(self._ready.get(image, ()))

    def length(self, image: str | None = None) -> int:
        """Tuples queued (waiting or leased), of one image or all."""
        with self._cond:
            return len(self._entries) if image is None else self._image_len.get(image, 0)

    def contains(self, tuple_id: int) -> bool:
        with self._cond:
            return tuple_id in self._entries or tuple_id in self._committing

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return self._used

    def images(self) -> list[str]:
        with self._cond:
            return sorted(self._image_len)

    def status(self) -> list[QueueStatus]:
        """Each image's queue: its tuples waiting or leased, their bytes, those leased."""
        with self._cond:
            leased = collections.Counter(e.image for e in self._leased.values())
            return [
                QueueStatus(image=i, length=n, bytes=self._image_bytes[i], leased=leased.get(i, 0))
                for i, n in sorted(self._image_len.items())
            ]

    def flush(self) -> None:
        """One fsync round now (what 'batch' runs every ``interval``)."""
        self._log.flush_round()

    @property
    def unsynced_bytes(self) -> int:
        """'batch': bytes admitted or appended that wait for an fsync round."""
        return self._log.unsynced

    def _durable_journal(self) -> None:
        # Under the lock so a compaction cannot swap the descriptor meanwhile; the
        # journal is a few bytes per entry, never payload.
        with self._cond:
            self._journal.written()

    def close(self) -> None:
        """Seal the open segments and the journal; the queue refuses new tuples afterwards."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for segment in list(self._segments.values()):
                if segment.id not in self._held:
                    self._log.seal(segment)
                    self._maybe_delete(segment)
            self._journal.close()
            self._cond.notify_all()
        self._log.close()

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the master is shutting down")

    def _recover(self) -> None:
        acked, moves = self._journal.load()
        dead = self.dead.origins()
        records: list[tuple[int, TupleMeta, int, int]] = []  # seq, meta, segment, payload offset
        max_seq = max([0, *acked, *moves, *(order for order, _ in moves.values()), *(seq for seq, _ in dead)])

        def recover(segment: Segment, last: bool) -> int:
            nonlocal max_seq
            found, end = scan_segment(segment.path)
            with open(segment.path, "rb") as fh:
                for seq, meta, offset in found:
                    max_seq = max(max_seq, seq)
                    fh.seek(offset)
                    if self._recovered(segment, seq, meta, fh, acked, dead):
                        records.append((seq, meta, segment.id, offset))
            return end

        self._log.open(recover)
        self._next_seq = max_seq + 1
        self._rebuild(records, moves)
        for segment in list(self._segments.values()):
            self._maybe_delete(segment)
        self._compact_journal()
        if self._entries:
            log.info("backlog recovered", extra={"tuples": len(self._entries), "bytes": self._used})

    def _recovered(
        self, segment: Segment, seq: int, meta: TupleMeta, fh: BinaryIO, acked: set[int], dead: set[tuple[int, int]]
    ) -> bool:
        """True if a record found at start is queued again; else it is done (acknowledged,
        a dead letter, or damaged: acknowledged now). ``fh``: its segment, at its payload."""
        if seq not in acked:
            if (seq, meta.tuple_id) not in dead:
                if crc32_of_file(fh, meta.size)[0] == meta.crc32:
                    return True
                log.error(
                    "queued tuple damaged on disk, dropped",
                    extra={"tuple_id": meta.tuple_id, "segment": segment.path.name},
                )
            self._journal.append(ACK, seq, 0, 0)
        self._acked.setdefault(segment.id, []).append(seq)
        return False

    def _rebuild(self, records: list[tuple[int, TupleMeta, int, int]], moves: dict[int, tuple[int, int]]) -> None:
        entries = []
        for seq, meta, seg_id, offset in records:
            order, attempt = moves.get(seq, (seq, meta.attempt))
            entry = Entry(seq=seq, meta=meta, segment=seg_id, offset=offset, order=order, moved=seq in moves)
            if attempt != meta.attempt:
                self._set_attempt(entry, attempt)
            entries.append(entry)
        entries.sort(key=lambda e: e.order)
        self._head_order = min([0, *(e.order for e in entries)]) - 1
        for entry in entries:
            if entry.tuple_id in self._entries:  # a tuple stored twice: the later record is done
                self._acked.setdefault(entry.segment, []).append(entry.seq)
                self._journal.append(ACK, entry.seq, 0, 0)
                continue
            self._segments[entry.segment].live.add(entry.seq)
            self._add(entry)
            self._ready.setdefault(entry.image, collections.OrderedDict())[entry.tuple_id] = entry

    def _compact_journal(self) -> None:
        """Rewrite the journal with only what the remaining segments still need."""
        lines: list[tuple[int, int, int, int]] = []
        for seg_id in self._segments:
            lines.extend((ACK, seq, 0, 0) for seq in self._acked.get(seg_id, ()))
        lines.extend((MOVE, e.seq, e.order, e.meta.attempt) for e in self._entries.values() if e.moved)
        self._journal.rewrite(lines)


class _Receiving:
    """One tuple on its way in: into a segment, into the dead letters, or discarded."""

    def __init__(self, queue: BacklogQueue, admit: Callable[[TupleMeta], None]) -> None:
        self._queue = queue
        self._admit = admit
        self._record: RecordWriter | None = None
        self._dead: DeadWriter | None = None

    def begin(self, meta: TupleMeta) -> None:
        """The tuple's checked metadata, before its payload: where the payload goes (nowhere
        for a duplicate)."""
        self._admit(meta)
        if self._queue.contains(meta.tuple_id):
            return
        if meta.attempt > self._queue.max_attempts:
            self._queue._durable.disk.check()  # a dead letter is receipted too: not onto a failed disk
            self._dead = DeadWriter(self._queue.dead, meta)
        else:
            self._record = self._queue._begin_record(meta)

    def write(self, data: bytes | memoryview) -> None:
        if self._record is not None:
            self._record.write(data)
        elif self._dead is not None:
            self._dead.write(data)

    def commit(self) -> Placement:
        if self._record is not None:
            return self._queue._finish_record(self._record)
        if self._dead is not None:
            meta = self._dead.meta
            reason = meta.attributes.get(LAST_ERROR_ATTRIBUTE) or f"attempt {meta.attempt} exceeds max_attempts"
            self._dead.commit(reason)
            self._dead = None
            return Placement.DEAD_LETTER
        return Placement.DUPLICATE

    def abort(self) -> None:
        if self._record is not None:
            self._queue._abort_record(self._record)
        if self._dead is not None:
            self._dead.abort()
