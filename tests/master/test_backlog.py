"""BacklogQueue on real files: FIFO, bounds, durability, leases, dead letters, big tuples."""

from __future__ import annotations

import errno
import threading
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Self

import pytest

from hio.master.backlog import BacklogQueue, Lease, Placement, Stored
from hio.master.deadletters import DeadLetterStore
from hio.master.storage import Durability
from hio.transport.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from hio.transport.frames import (
    ChunkFrame,
    TupleFrame,
    TupleMeta,
    WireFrame,
    crc32,
    parse_frame,
    serialize_frame,
    tuple_frames,
)
from tests.harness import FsyncDisk, wait_for
from tests.master.helpers import big_frames, frames

MiB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def open_queue(root: Path, clock: Clock | None = None, **kw: object) -> BacklogQueue:
    durability = kw.pop("durability", None) or Durability(str(kw.pop("fsync", "always")))
    assert isinstance(durability, Durability)
    dead = DeadLetterStore(root / "dead", durability)
    params: dict[str, object] = {
        "queue_bytes": 100 * MiB,
        "memory_bytes": 1 * MiB,
        "segment_bytes": 4 * MiB,
        "max_attempts": 3,
    }
    params.update(kw)
    return BacklogQueue(root / "queue", dead=dead, durability=durability, clock=clock or Clock(), **params)  # type: ignore[arg-type] - the keywords are BacklogQueue's, their values objects


def received(frames: Iterable[TupleFrame | bytes]) -> list[TupleFrame | ChunkFrame]:
    """Frames as a receiver reads them off the wire (large chunks come encoded)."""
    return [parse_frame(serialize_frame(f)) for f in frames]


def put(queue: BacklogQueue, stream: Iterable[TupleFrame]) -> list[Stored]:
    return list(queue.receive(stream, max_tuple_bytes=64 * MiB, max_chunk_bytes=2 * MiB))


def leased_frames(queue: BacklogQueue, leases: list[Lease], chunk_bytes: int) -> Iterator[WireFrame]:
    """The wire frames of leased tuples, as the master streams a pull (read lazily)."""
    return tuple_frames(queue.payloads(leases), chunk_bytes, 0, encode=True)


def lease_one(queue: BacklogQueue, image: str, channel: str, seconds: float) -> Lease | None:
    """The head's lease, or None when nothing waits."""
    leases = queue.lease_many(image, channel, seconds)
    return leases[0] if leases else None


def take(queue: BacklogQueue, image: str = "hio/synthetic", channel: str = "w/0") -> tuple[int, bytes, int]:
    """Lease the head and read it back: (tuple id, payload, attempt)."""
    lease = lease_one(queue, image, channel, 60.0)
    assert lease is not None, "expected a waiting tuple"
    data = b"".join(f.data for f in received(leased_frames(queue, [lease], 64 * 1024)))
    return lease.tuple_id, data, lease.meta.attempt


def payload(n: int, size: int = 1000) -> bytes:
    return bytes([n % 256]) * size


def test_fifo_per_image(tmp_path: Path) -> None:
    q = open_queue(tmp_path)
    for tid, image in [(1, "a"), (2, "b"), (3, "a"), (4, "b"), (5, "a")]:
        assert put(q, frames(tid, payload(tid), image))[0].placement is Placement.ENQUEUED
    assert [take(q, "a")[0] for _ in range(3)] == [1, 3, 5]
    assert [take(q, "b")[0] for _ in range(2)] == [2, 4]
    assert lease_one(q, "a", "w/0", 60) is None
    q.close()


def test_payload_round_trip_and_receipt_indexes(tmp_path: Path) -> None:
    q = open_queue(tmp_path)
    stream = frames(1, payload(1, 200_000)) + frames(2, payload(2, 10)) + frames(3, b"")
    stored = put(q, stream)
    assert [(s.index, s.meta.tuple_id) for s in stored] == [(0, 1), (1, 2), (2, 3)]
    assert take(q)[1] == payload(1, 200_000)
    assert take(q)[1] == payload(2, 10)
    assert take(q)[1] == b""
    q.close()


def test_bound_refuses_and_never_drops(tmp_path: Path) -> None:
    q = open_queue(tmp_path, queue_bytes=1500)
    put(q, frames(1, payload(1, 1000)))
    with pytest.raises(ResourceExhausted) as err:
        put(q, frames(2, payload(2, 1000)))
    assert err.value.retry_after and err.value.retry_after > 0
    assert "1000 of 1500 bytes" in err.value.message
    assert q.length() == 1 and q.used_bytes == 1000
    with pytest.raises(InvalidArgument, match="can never fit"):
        put(q, frames(3, payload(3, 2000)))
    tid, _, _ = take(q)
    assert q.ack(tid, "w/0")
    put(q, frames(2, payload(2, 1000)))
    assert take(q)[0] == 2
    q.close()


def test_corrupt_tuple_is_never_stored(tmp_path: Path) -> None:
    q = open_queue(tmp_path)
    put(q, frames(1, payload(1)))
    bad = frames(2, payload(2, 300_000))
    bad[0].meta.crc32 ^= 1
    with pytest.raises(DataLoss, match="checksum"):
        put(q, bad)
    truncated = frames(3, payload(3, 300_000))[:-1]
    with pytest.raises(DataLoss, match="stream ended"):
        put(q, truncated)
    assert q.length() == 1 and not q.contains(2) and not q.contains(3)
    put(q, frames(4, payload(4)))
    q.close()
    q = open_queue(tmp_path)  # nothing of the refused tuples survives a restart either
    assert [take(q)[0], take(q)[0]] == [1, 4]
    assert lease_one(q, "hio/synthetic", "w/0", 60) is None
    q.close()


def test_duplicate_enqueue_is_idempotent(tmp_path: Path) -> None:
    q = open_queue(tmp_path)
    put(q, frames(1, payload(1)))
    assert put(q, frames(1, payload(1)))[0].placement is Placement.DUPLICATE
    assert q.length() == 1 and q.used_bytes == 1000
    q.close()


def test_restart_recovers_unacked_in_order_and_voids_leases(tmp_path: Path) -> None:
    q = open_queue(tmp_path)
    for tid in range(1, 6):
        put(q, frames(tid, payload(tid)))
    first, _, _ = take(q)
    q.ack(first, "w/0")  # 1 done for good
    take(q)  # 2 leased, never acknowledged
    q.close()
    q = open_queue(tmp_path)
    assert q.length() == 4
    assert [take(q)[0] for _ in range(4)] == [2, 3, 4, 5]
    q.close()


def test_torn_tail_is_truncated(tmp_path: Path) -> None:
    q = open_queue(tmp_path, memory_bytes=0)
    put(q, frames(1, payload(1)))
    put(q, frames(2, payload(2)))
    q.close()
    (segment,) = sorted((tmp_path / "queue").glob("seg-*.q"))
    whole = segment.stat().st_size
    with open(segment, "r+b") as fh:  # crash in the middle of record 2
        fh.truncate(whole - 100)
    journal = tmp_path / "queue" / "journal.q"
    with open(journal, "ab") as fh:  # and a torn journal entry
        fh.write(b"\x01\x00\x00")
    q = open_queue(tmp_path)
    assert q.length() == 1 and take(q)[1] == payload(1)
    assert segment.stat().st_size < whole - 100
    put(q, frames(3, payload(3)))
    q.close()
    q = open_queue(tmp_path)
    assert [take(q)[0], take(q)[0]] == [1, 3]
    q.close()


def test_damaged_payload_is_dropped_not_served(tmp_path: Path) -> None:
    q = open_queue(tmp_path, memory_bytes=0)
    put(q, frames(1, payload(1)))
    put(q, frames(2, payload(2)))
    q.close()
    (segment,) = sorted((tmp_path / "queue").glob("seg-*.q"))
    with open(segment, "r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff\xfe")  # bit rot inside payload 1
    q = open_queue(tmp_path)
    assert q.length() == 1 and take(q) == (2, payload(2), 1)
    q.close()


def test_acked_never_reappears_and_segments_are_deleted(tmp_path: Path) -> None:
    q = open_queue(tmp_path, segment_bytes=2048)  # about one record per segment
    for tid in range(1, 7):
        put(q, frames(tid, payload(tid)))
    assert len(list((tmp_path / "queue").glob("seg-*.q"))) >= 3
    for _ in range(6):
        assert q.ack(take(q)[0], "w/0")
    q.close()
    assert list((tmp_path / "queue").glob("seg-*.q")) == []
    q = open_queue(tmp_path)
    assert q.length() == 0
    q.close()


def test_lease_expiry_requeues_at_head_with_next_attempt(tmp_path: Path) -> None:
    clock = Clock()
    q = open_queue(tmp_path, clock)
    for tid in (1, 2):
        put(q, frames(tid, payload(tid)))
    lease = lease_one(q, "hio/synthetic", "w/0", 5.0)
    assert lease is not None and lease.tuple_id == 1
    clock.now += 3
    q.refresh("w/0", 5.0)  # a report keeps the lease
    clock.now += 3
    assert q.expire_leases() == []
    clock.now += 3
    assert q.expire_leases() == ["w/0"]
    assert take(q, channel="w/1")[::2] == (1, 2)  # back at the head, attempt 2
    assert not q.ack(99, "w/0")
    assert not q.ack(1, "stranger/0"), "only a channel that held the tuple may acknowledge it"
    assert q.ack(1, "w/0"), "a late success from the earlier holder still counts"
    q.close()


def test_void_leases_of_a_channel_and_stale_lease(tmp_path: Path) -> None:
    q = open_queue(tmp_path)
    put(q, frames(1, payload(1)))
    lease = lease_one(q, "hio/synthetic", "w/0", 60)
    assert lease is not None
    assert q.void_leases("w/0", "channel down") == [1]
    assert not q.void_lease(lease, "cancelled")  # no longer the current lease
    with pytest.raises(NotFound):
        list(leased_frames(q, [lease], 1024))
    again = lease_one(q, "hio/synthetic", "w/1", 60)
    assert again is not None and again.meta.attempt == 2
    q.close()


def test_failures_requeue_at_tail_then_dead_letter(tmp_path: Path) -> None:
    q = open_queue(tmp_path, max_attempts=2)
    put(q, frames(1, payload(1)))
    put(q, frames(2, payload(2)))
    assert take(q)[0] == 1
    assert q.fail(1, "w/0", "bad pixels")
    assert not q.fail(2, "w/0", "not leased")  # only the holder's word counts
    assert take(q)[0] == 2  # 1 went to the tail
    tid, _, attempt = take(q)
    assert (tid, attempt) == (1, 2)
    assert q.fail(1, "w/0", "bad pixels again")
    assert q.length() == 1 and not q.contains(1)
    (letter,) = q.dead.list(10)
    assert letter.tuple_id == 1 and "bad pixels again" in letter.reason and letter.meta.attempt == 3
    with q.dead.open_payload(1) as fh:
        assert fh.read() == payload(1)
    q.close()
    q = open_queue(tmp_path, max_attempts=2)  # dead letters and the queue survive a restart
    assert [d.tuple_id for d in q.dead.list(10)] == [1] and q.length() == 1
    q.retry_dead(1)
    assert len(q.dead) == 0
    assert take(q)[0] == 2
    assert take(q) == (1, payload(1), 1)
    with pytest.raises(NotFound):
        q.retry_dead(1)
    q.close()


def test_enqueue_over_max_attempts_goes_to_dead_letters(tmp_path: Path) -> None:
    q = open_queue(tmp_path, max_attempts=3)
    stream = frames(7, payload(7), attributes={"hio.last_error": "engine crashed"})
    stream[0].meta.attempt = 4
    (stored,) = put(q, stream)
    assert stored.placement is Placement.DEAD_LETTER
    assert q.length() == 0
    (letter,) = q.dead.list(10)
    assert letter.reason == "engine crashed"
    q.close()


def test_moves_survive_restart(tmp_path: Path) -> None:
    q = open_queue(tmp_path)
    for tid in (1, 2, 3):
        put(q, frames(tid, payload(tid)))
    assert take(q)[0] == 1
    q.fail(1, "w/0", "flaky")  # 1 -> tail, attempt 2
    assert take(q)[0] == 2
    q.void_leases("w/0", "down")  # 2 -> head, attempt 2
    q.close()
    q = open_queue(tmp_path)
    assert [take(q)[::2] for _ in range(3)] == [(2, 2), (3, 1), (1, 2)]
    q.close()


def test_small_tuples_are_cached_big_ones_are_not(tmp_path: Path) -> None:
    q = open_queue(tmp_path, memory_bytes=5000)
    put(q, frames(1, payload(1, 4000)))
    put(q, frames(2, payload(2, 4000)))  # over the remaining memory budget: disk only
    assert q._cached == 4000
    assert take(q)[1] == payload(1, 4000)
    assert take(q)[1] == payload(2, 4000)
    q.ack(1, "w/0")
    assert q._cached == 0
    q.close()


def test_big_tuple_streams_without_holding_it_in_memory(tmp_path: Path) -> None:
    size = 20 * MiB
    q = open_queue(tmp_path, memory_bytes=1 * MiB, segment_bytes=64 * MiB, fsync="never")
    meta, stream = big_frames(1, size)
    tracemalloc.start()
    try:
        (stored,) = put(q, stream)
        _, peak_in = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        lease = lease_one(q, "hio/synthetic", "w/0", 60)
        assert lease is not None
        value, received = 0, 0
        for leased in leased_frames(q, [lease], 1 * MiB):
            frame = parse_frame(serialize_frame(leased))
            value = crc32(frame.data, value)
            received += len(frame.data)
        _, peak_out = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stored.placement is Placement.ENQUEUED and q._cached == 0
    assert (received, value) == (size, meta.crc32)
    assert peak_in < 6 * MiB, f"enqueue held {peak_in} bytes"
    assert peak_out < 6 * MiB, f"pull held {peak_out} bytes"
    q.close()


def test_new_records_never_take_a_dead_letters_sequence(tmp_path: Path) -> None:
    q = open_queue(tmp_path, max_attempts=1, segment_bytes=1024)
    put(q, frames(1, payload(1)))
    take(q)
    q.fail(1, "w/0", "boom")  # dead letter remembers the record's sequence number
    q.close()
    q = open_queue(tmp_path, max_attempts=1, segment_bytes=1024)  # segment gone, journal compacted
    put(q, frames(2, payload(2)))
    q.close()
    q = open_queue(tmp_path, max_attempts=1)
    assert q.length() == 1 and take(q)[0] == 2
    q.close()


def test_concurrent_streams_never_interleave_records(tmp_path: Path) -> None:
    import threading

    q = open_queue(tmp_path, fsync="batch", memory_bytes=0)
    errors: list[BaseException] = []

    def sender(first: int) -> None:
        try:
            stream = [f for tid in range(first, first + 20) for f in frames(tid, payload(tid, 30_000), chunk=4096)]
            assert len(put(q, stream)) == 20
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(base,)) for base in (1, 101, 201)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    q.close()
    q = open_queue(tmp_path)
    seen = {}
    while (lease := lease_one(q, "hio/synthetic", "w/0", 60)) is not None:
        seen[lease.tuple_id] = b"".join(f.data for f in received(leased_frames(q, [lease], 8192)))
    assert sorted(seen) == [b + i for b in (1, 101, 201) for i in range(20)]
    for base in (1, 101, 201):  # each stream's tuples keep their order
        mine = [tid for tid in seen if base <= tid < base + 20]
        assert mine == sorted(mine)
    assert all(data == payload(tid, 30_000) for tid, data in seen.items())
    q.close()


# ---- 'batch' durability: what reaches the disk, and how far it may lag ---------------


class _Rounds:
    """Runs flush rounds every 20 ms, more often than the queue's own every 100 ms."""

    def __init__(self, queue: BacklogQueue) -> None:
        self._queue = queue
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._queue.flush()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _segments(root: Path) -> list[str]:
    return sorted(str(p) for p in (root / "queue").glob("seg-*.q"))


def test_batch_never_syncs_a_sealed_segment_whose_tuples_were_done_before_its_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sealed segment deleted before the flush round came never goes to the disk (its
    tuples need none); a sealed segment with a tuple still queued is synced, and so is the
    open one; what they hold survives a restart. Before, sealing fsynced every segment
    on the receiving thread, done or not."""
    disk = FsyncDisk(monkeypatch)
    durability = Durability("batch", interval=3600.0)  # this test runs the rounds by hand
    q = open_queue(tmp_path, durability=durability, segment_bytes=4096)
    for tid in range(1, 6):
        put(q, frames(tid, payload(tid, 3000)))
    segments = _segments(tmp_path)
    assert len(segments) == 3  # 1 2 | 3 4 | 5: a segment is sealed past 4096 bytes
    assert 15000 < q.unsynced_bytes < 16000  # the five records, payloads and framing
    assert not [p for p in disk.synced if "/seg-" in p], "sealing does not sync on the receiving thread"
    for _ in range(2):  # tuples 1 and 2 are done: their segment is deleted
        tid, _, _ = take(q)
        assert q.ack(tid, "w/0")
    assert not Path(segments[0]).exists()
    q.flush()
    assert segments[0] not in disk.synced
    assert segments[1] in disk.synced and segments[2] in disk.synced
    assert q.unsynced_bytes == 0
    q.close()
    q = open_queue(tmp_path)
    assert [take(q)[0] for _ in range(3)] == [3, 4, 5]
    q.close()


def test_batch_holds_senders_while_the_disk_lags_and_lets_them_go_once_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tuple is admitted only while what waits for an fsync stays within ``unsynced_bytes``,
    concurrent senders included (a tuple counts when admitted, not once written), so a power
    loss never costs more than that."""
    disk = FsyncDisk(monkeypatch)
    durability = Durability("batch", unsynced_limit=7000)
    q = open_queue(tmp_path, durability=durability)
    put(q, frames(1, payload(1, 3000)))
    put(q, frames(2, payload(2, 3000)))  # 6000 <= 7000
    disk.open.clear()  # the disk stalls
    with _Rounds(q):
        senders = [threading.Thread(target=put, args=(q, frames(tid, payload(tid, 3000)))) for tid in (3, 4, 5, 6)]
        for sender in senders:
            sender.start()
        senders[0].join(0.5)
        assert all(s.is_alive() for s in senders) and q.length() == 2, "the senders wait for the disk"
        assert 6000 < q.unsynced_bytes <= 7000  # the two records, payloads and framing
        disk.open.set()
        for sender in senders:
            sender.join(10)
        assert not any(s.is_alive() for s in senders) and q.length() == 6
    q.close()


def test_batch_takes_no_new_tuple_after_a_failed_fsync_until_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender held for the disk is told why when the flush round fails (FAILED_PRECONDITION with
    a retry hint, nothing of its tuple written). The failure is final: a later fsync can
    report success for bytes the failed one lost, so no new tuple is taken until the
    master restarts, also once the disk syncs again; the tuples queued before are still
    handed out, and survive the restart, which takes new ones."""
    disk = FsyncDisk(monkeypatch)
    durability = Durability("batch", unsynced_limit=7000)
    q = open_queue(tmp_path, durability=durability)
    put(q, frames(1, payload(1, 3000)))
    put(q, frames(2, payload(2, 3000)))
    disk.error = OSError(errno.EIO, "Input/output error")
    refusal = r"backlog's disk failed to sync at .*\(Input/output error\).*restart the master"
    with _Rounds(q):
        with pytest.raises(FailedPrecondition, match=refusal) as held:
            put(q, frames(3, payload(3, 3000)))
        assert held.value.retry_after
        disk.error = None
        wait_for(lambda: q.unsynced_bytes == 0, timeout=10, what="a round that syncs")
        with pytest.raises(FailedPrecondition, match=refusal):
            put(q, frames(4, payload(4, 30)))  # well within the bound: refused all the same
    assert q.length() == 2
    assert take(q)[0] == 1  # what was queued is still handed out
    q.close()
    q = open_queue(tmp_path)
    put(q, frames(4, payload(4, 3000)))  # a restarted master takes new tuples
    assert [take(q)[0] for _ in range(3)] == [1, 2, 4]  # tuple 1's lease ended with the old master
    q.close()


# ---- races and faults: each test pins one interleaving ----------


def _pause_dead_letter_copy(q: BacklogQueue, during: Callable[[], object]) -> None:
    """Run ``during`` in another thread while settle() has written a dead letter but not yet
    dropped the queue entry (the window a concurrent report or retry can fall into)."""
    import threading
    import time

    add = q.dead.add

    def add_then_race(*args: object, **kwargs: object) -> object:
        letter = add(*args, **kwargs)  # type: ignore[arg-type] - passed on as given
        racer = threading.Thread(target=during)
        racer.start()
        time.sleep(0.3)
        q._racers.append(racer)  # type: ignore[attr-defined] - the test's own attribute on the queue
        return letter

    q._racers = []  # type: ignore[attr-defined] - the test's own attribute on the queue
    q.dead.add = add_then_race  # type: ignore[method-assign] - wrapped to race another thread


def test_a_dead_letter_retried_while_it_is_written_is_queued_not_lost(tmp_path: Path) -> None:
    clock = Clock()
    q = open_queue(tmp_path, clock, max_attempts=1)
    put(q, frames(1, payload(1)))
    assert lease_one(q, "hio/synthetic", "w/0", 10.0) is not None
    _pause_dead_letter_copy(q, lambda: q.retry_dead(1))
    clock.now += 100
    q.expire_leases()  # exhausted: on its way to the dead letters
    for racer in q._racers:  # type: ignore[attr-defined] - the test's own attribute on the queue
        racer.join(10)
    assert (q.length(), q.contains(1), q.dead.get(1)) == (1, True, None)
    q.close()
    again = open_queue(tmp_path, clock, max_attempts=1)
    assert again.length() == 1 and again.dead.get(1) is None
    assert take(again)[:2] == (1, payload(1))


def test_a_late_success_report_while_the_dead_letter_is_written_changes_nothing(tmp_path: Path) -> None:
    clock = Clock()
    q = open_queue(tmp_path, clock, max_attempts=1)
    put(q, frames(1, payload(1)))
    assert lease_one(q, "hio/synthetic", "w/0", 10.0) is not None
    acked: list[bool] = []
    _pause_dead_letter_copy(q, lambda: acked.append(q.ack(1, "w/0")))
    clock.now += 100
    q.expire_leases()  # does not raise
    for racer in q._racers:  # type: ignore[attr-defined] - the test's own attribute on the queue
        racer.join(10)
    assert acked == [False]
    assert q.length() == 0 and q.dead.get(1) is not None


def test_a_damaged_record_mid_segment_costs_only_itself(tmp_path: Path) -> None:
    """A flipped bit is not a torn tail: the records after it were receipted and stay."""
    q = open_queue(tmp_path)
    for tid in range(1, 6):
        put(q, frames(tid, payload(tid)))
    q.close()
    [segment] = list((tmp_path / "queue").glob("seg-*.q"))
    raw = bytearray(segment.read_bytes())
    second = raw.find(b"HIOR", 1)
    raw[second + 20] ^= 0x01  # in record 2's head or metadata
    segment.write_bytes(bytes(raw))
    again = open_queue(tmp_path)
    assert sorted(again._entries) == [1, 3, 4, 5]
    assert [take(again)[:2] for _ in range(4)] == [(t, payload(t)) for t in (1, 3, 4, 5)]


def test_a_journal_entry_cut_short_by_a_full_disk_does_not_hide_the_later_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    q = open_queue(tmp_path)
    for tid in range(1, 4):
        put(q, frames(tid, payload(tid)))
    journal_fd, real_write = q._journal._file.fd, os.write  # type: ignore[union-attr] - the journal is open
    calls = []

    def short_then_full(fd: int, data: bytes) -> int:
        if fd == journal_fd and not calls:
            calls.append(1)
            real_write(fd, bytes(data)[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", short_then_full)
    first = take(q)[0]
    with pytest.raises(OSError):
        q.ack(first, "w/0")  # its ACK hits the full disk
    monkeypatch.setattr(os, "write", real_write)
    for _ in range(2):  # room again: the next ones are acked
        assert q.ack(take(q)[0], "w/0")
    q.close()
    again = open_queue(tmp_path)
    assert sorted(again._entries) == [first]  # only the ACK that failed is missing


def test_a_segment_that_cannot_be_created_reserves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    q = open_queue(tmp_path, queue_bytes=10_000)
    real_open = os.open

    def no_room(path: object, flags: int, *args: object) -> int:
        if str(path).endswith(".q"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type] - passed on as given

    monkeypatch.setattr(os, "open", no_room)
    for tid in (1, 2, 3):
        with pytest.raises(OSError):
            put(q, frames(tid, payload(tid, 4000)))
    monkeypatch.setattr(os, "open", real_open)
    assert put(q, frames(9, payload(9, 4000)))[0].placement is Placement.ENQUEUED


def test_always_takes_no_new_tuple_after_a_failed_fsync_nor_a_dead_letter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 'always' a failed fsync refuses its own tuple (the sender is told) and is as
    final as in 'batch': the next tuple is refused before it is written, and so is one
    that would go straight to the dead letters (those are receipted ENQUEUED too)."""
    disk = FsyncDisk(monkeypatch)
    durability = Durability("always")
    q = open_queue(tmp_path, durability=durability, max_attempts=3)
    put(q, frames(1, payload(1)))
    disk.error = OSError(errno.EIO, "Input/output error")
    refusal = r"backlog's disk failed to sync at .*\(Input/output error\).*restart the master"
    with pytest.raises(FailedPrecondition, match=refusal):  # the tuple whose fsync failed
        put(q, frames(2, payload(2)))
    disk.error = None
    with pytest.raises(FailedPrecondition, match=refusal):
        put(q, frames(3, payload(3)))
    exhausted = frames(4, payload(4))
    exhausted[0].meta.attempt = 4
    with pytest.raises(FailedPrecondition, match=refusal):
        put(q, exhausted)
    assert q.length() == 1 and q.dead.list(10) == []
    assert take(q)[0] == 1
    q.close()


def test_batch_syncs_a_requeue_s_journal_entry_like_an_ack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed or expired tuple's MOVE (its new place and attempt) goes to the next flush
    round, as an ACK does; before, it waited unsynced for the next ACK or the close."""
    disk = FsyncDisk(monkeypatch)
    durability = Durability("batch", interval=3600.0)  # this test runs the rounds by hand
    q = open_queue(tmp_path, durability=durability)
    put(q, frames(1, payload(1)))
    q.flush()
    disk.synced.clear()
    assert take(q)[0] == 1
    assert q.fail(1, "w/0", "bad pixels")
    q.flush()
    assert str(tmp_path / "queue" / "journal.q") in disk.synced
    q.close()


def test_a_tuple_that_can_never_fit_is_refused_without_waiting_for_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cheap refusals come before the wait for the disk: a tuple larger than the queue
    bound is refused at once even while the disk is behind, holding nothing meanwhile."""
    disk = FsyncDisk(monkeypatch)
    durability = Durability("batch", unsynced_limit=7000)
    q = open_queue(tmp_path, durability=durability, queue_bytes=10_000)
    put(q, frames(1, payload(1, 6000)))
    behind = q.unsynced_bytes
    disk.open.clear()  # the disk stalls: nothing more fits the budget
    refused: list[BaseException] = []

    def send() -> None:
        try:
            put(q, frames(2, payload(2, 20_000)))
        except BaseException as exc:  # noqa: BLE001 - the refusal is the result
            refused.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(5)
    disk.open.set()
    assert not sender.is_alive() and isinstance(refused[0], InvalidArgument)
    assert "can never fit" in str(refused[0]) and q.unsynced_bytes == behind
    q.close()


def _hior(seq: int, meta: TupleMeta, data: bytes) -> bytes:
    """A backlog record in the HIOR/HIOE framing, byte by byte: head (magic, meta length,
    payload length), metadata, payload, tail (magic, sequence, CRC-32 of head, metadata and
    sequence); big-endian."""
    meta_bytes = meta.SerializeToString()
    head = b"HIOR" + len(meta_bytes).to_bytes(4, "big") + len(data).to_bytes(8, "big") + meta_bytes
    return (
        head + data + b"HIOE" + seq.to_bytes(8, "big") + crc32(seq.to_bytes(8, "big"), crc32(head)).to_bytes(4, "big")
    )


def test_a_backlog_folder_in_the_hior_format_requeues_its_tuples(tmp_path: Path) -> None:
    """Tuples queued before an upgrade are not lost: HIOR/HIOE segments and a journal whose
    ACK entry (kind, sequence, order, attempt, CRC-32) removes one are queued again."""
    folder = tmp_path / "queue"
    folder.mkdir()
    metas = {
        tid: TupleMeta(tuple_id=tid, image="hio/synthetic", size=1000, crc32=crc32(payload(tid)), attempt=1)
        for tid in (1, 2, 3)
    }
    (folder / "seg-0000000001.q").write_bytes(_hior(1, metas[1], payload(1)) + _hior(2, metas[2], payload(2)))
    (folder / "seg-0000000002.q").write_bytes(_hior(3, metas[3], payload(3)) + b"HIOR\x00")  # torn tail
    ack = bytes([1]) + (1).to_bytes(8, "big") + (0).to_bytes(8, "big") + (0).to_bytes(4, "big")
    (folder / "journal.q").write_bytes(ack + crc32(ack).to_bytes(4, "big"))
    q = open_queue(tmp_path)
    assert [take(q)[:2] for _ in range(2)] == [(2, payload(2)), (3, payload(3))]
    q.close()
