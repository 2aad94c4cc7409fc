"""FeatureStore on real files: idempotence, offsets, reads, recovery, consumers, knowledge."""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from hio.proto import features_pb2
from hio.repository.featurelog import CorruptSegment
from hio.repository.metrics import repository_registry
from hio.repository.segments import HEADER_SIZE, MAGIC
from hio.repository.store import FeatureStore, StoreOptions
from hio.transport.errors import DataLoss, FailedPrecondition, InvalidArgument, Unavailable
from hio.transport.frames import crc32
from tests.harness import FsyncDisk
from tests.repository.records import compress, decode, feature_record, knowledge, png_bytes, upload

SMALL = StoreOptions(segment_bytes=4096)


def segments(store_dir: Path) -> list[Path]:
    return sorted((store_dir / "features").glob("*.seg"))


def reopen(store: FeatureStore, options: StoreOptions = SMALL) -> FeatureStore:
    store.close()
    return FeatureStore(store.root, options)


# ------------------------------------------------------------------ features


def test_offsets_are_dense_and_put_is_idempotent(store: FeatureStore) -> None:
    first = store.put([upload(10), upload(11), upload(12)])
    assert [(r.offset, r.duplicate) for r in first] == [(1, False), (2, False), (3, False)]
    again = store.put([upload(11), upload(13), upload(13)])
    assert [(r.offset, r.duplicate) for r in again] == [(2, True), (4, False), (4, True)]
    assert store.latest() == 4
    assert store.offset_of(13) == 4 and store.offset_of(99) == 0


def test_duplicate_keeps_the_first_bytes(store: FeatureStore) -> None:
    store.put([upload(5, value=1.0)])
    store.put([upload(5, value=2.0)])
    [(_, _, data)] = list(store.read())
    assert decode(data).features["mean_intensity"].number == 1.0


def test_each_record_says_when_it_became_durable_and_older_ones_say_unknown(store: FeatureStore) -> None:
    before = time.time()
    store.put([upload(1), upload(2)])
    between = time.time()
    store.put([upload(3)])
    after = time.time()
    first, second, third = store.durable_unix([1, 2, 3])
    assert before <= first == second <= between <= third <= after  # one fsync round covered 1 and 2
    assert store.durable_unix([4]) == [0.0]  # not stored
    reopened = reopen(store)
    assert reopened.durable_unix([1, 3]) == [0.0, 0.0]  # stored before this process opened the log
    reopened.close()


def test_durable_times_keep_the_latest_rounds_and_forget_the_oldest() -> None:
    from hio.repository.featurelog import DurableTimes

    times = DurableTimes(floor=10, capacity=4)
    for n in range(1, 12):
        times.add(10 + 2 * n, float(n))  # round n covers offsets 11 + 2(n-1) .. 10 + 2n
    times.add(20, 99.0)  # an older round reported late changes nothing
    assert times.of(10) == 0.0  # readable before the log opened
    assert times.of(31) == 11.0 and times.of(32) == 11.0 and times.of(33) == 0.0
    assert times.of(21) == 6.0 and times.of(22) == 6.0  # still remembered
    assert times.of(20) == 0.0 and times.of(12) == 0.0  # forgotten: older than the latest rounds kept


def test_a_wait_for_new_records_ends_with_the_store(store: FeatureStore) -> None:
    """A follower's wait returns at once when a record is beyond its offset, and is told
    Unavailable (not left to spin or wait out its time) when the store closes under it."""
    store.put([upload(1)])
    assert store.wait_beyond(0, 30.0) == 1
    failed: list[BaseException] = []

    def follow() -> None:
        try:
            store.wait_beyond(1, 30.0)
        except Unavailable as exc:
            failed.append(exc)

    follower = threading.Thread(target=follow)
    follower.start()
    time.sleep(0.2)
    started = time.monotonic()
    store.close()
    follower.join(10)
    assert not follower.is_alive() and time.monotonic() - started < 5
    assert failed and "shutting down" in str(failed[0])


def test_read_ranges(store: FeatureStore) -> None:
    store.put([upload(100 + i) for i in range(1, 51)])

    def offsets(**kw: Any) -> list[int]:
        return [o for o, _, _ in store.read(**kw)]

    assert offsets() == list(range(1, 51))
    assert offsets(after=10, until=15) == [11, 12, 13, 14, 15]
    assert offsets(after=45) == [46, 47, 48, 49, 50]
    assert offsets(after=20, max_records=3) == [21, 22, 23]
    assert offsets(after=20, until=22, max_records=10) == [21, 22]
    assert offsets(after=50) == [] and offsets(after=70) == []
    assert offsets(after=7, until=7) == []
    for offset, tuple_id, data in store.read(after=30, until=32):
        assert tuple_id == 100 + offset and decode(data).tuple_id == tuple_id


def test_read_refuses_until_below_after(store: FeatureStore) -> None:
    with pytest.raises(InvalidArgument, match="until"):
        store.read(after=5, until=2)


def test_records_span_segments_and_survive_restart(store: FeatureStore, store_dir: Path) -> None:
    expected = {}
    for i in range(1, 201):
        tid, data, crc = upload(1000 + i, value=float(i))
        expected[i] = data
        store.put([(tid, data, crc)])
    assert len(segments(store_dir)) > 3, "small segment_bytes must roll segments"
    store = reopen(store)
    try:
        assert store.latest() == 200
        assert {o: d for o, _, d in store.read()} == expected
        assert store.put([upload(1005)])[0].duplicate
        assert store.put([upload(5000)])[0].offset == 201
        assert [o for o, _, _ in store.read(after=198)] == [199, 200, 201]
    finally:
        store.close()


def test_big_batch_rolls_within_one_put(store: FeatureStore, store_dir: Path) -> None:
    results = store.put([upload(i) for i in range(1, 301)])
    assert [r.offset for r in results] == list(range(1, 301))
    assert len(segments(store_dir)) > 1
    for path in segments(store_dir):
        assert path.stat().st_size <= 4096
    assert [t for _, t, _ in store.read()] == list(range(1, 301))


@pytest.mark.parametrize("mode", ["batch", "always", "never"])
def test_fsync_modes_store_and_reopen(tmp_path: Path, mode: str) -> None:
    options = StoreOptions(segment_bytes=4096, fsync=mode, fsync_interval_ms=5 if mode == "batch" else 0)
    with FeatureStore(tmp_path / mode, options) as s:
        for i in range(1, 61):
            s.put([upload(i)])
    with FeatureStore(tmp_path / mode, options) as s:
        assert s.latest() == 60


def test_readers_see_a_record_only_once_it_is_durable(tmp_path: Path) -> None:
    """A record KD has read must survive a power loss: with fsync 'batch' a reader sees a
    record once its group fsync is done, not while it waits for it."""
    options = StoreOptions(fsync="batch", fsync_interval_ms=4000)  # a wide window, for slow machines
    with FeatureStore(tmp_path / "s", options) as s:
        s.put([upload(1)])  # the first fsync runs at once
        second = threading.Thread(target=s.put, args=([upload(2)],))
        second.start()  # waits up to 4 s for the next fsync
        deadline = time.monotonic() + 10
        while s.stats()["records"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.stats()["records"] == 2, "the second record is written"
        assert second.is_alive(), "... and its fsync has not run yet"
        assert s.latest() == 1 and [t for _, t, _ in s.read()] == [1]
        second.join(10)
        assert s.latest() == 2 and [t for _, t, _ in s.read()] == [1, 2]


def test_puts_that_arrive_while_an_fsync_waits_share_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group commit: a put waits for an fsync round, one runs at a time (at most one every
    fsync_interval), and the puts that arrive meanwhile ride on the next: ten puts, few fsyncs."""
    with FeatureStore(tmp_path / "s", StoreOptions(fsync="batch", fsync_interval_ms=1000)) as s:
        s.put([upload(1)])  # a round now; the next waits for the interval
        disk = FsyncDisk(monkeypatch)
        puts = [threading.Thread(target=s.put, args=([upload(i)],)) for i in range(2, 12)]
        for put in puts:
            put.start()
        for put in puts:
            put.join(20)
        assert s.latest() == 11
        assert 1 <= len([p for p in disk.synced if p.endswith(".seg")]) <= 3


def test_concurrent_puts_store_each_id_once(store: FeatureStore) -> None:
    ids = list(range(1, 121))
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        try:
            order = ids[seed::3] + ids  # overlapping ids from every thread
            for start in range(0, len(order), 7):
                store.put([upload(t) for t in order[start : start + 7]])
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread, which fails on it
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert store.latest() == len(ids)
    assert sorted(t for _, t, _ in store.read()) == ids
    assert [o for o, _, _ in store.read()] == list(range(1, len(ids) + 1))


def test_one_store_per_folder(store: FeatureStore) -> None:
    with pytest.raises(FailedPrecondition, match="in use"):
        FeatureStore(store.root, SMALL)
    store.close()
    with FeatureStore(store.root, SMALL) as again:
        assert again.latest() == 0


def test_closed_store_refuses_writes(store: FeatureStore) -> None:
    store.close()
    with pytest.raises(Unavailable):
        store.put([upload(1)])


# ------------------------------------------------------------- bad uploads


def bad_uploads() -> dict[str, tuple[type[Exception], str, tuple[int, bytes, int]]]:
    tid, data, crc = upload(7)
    mismatched = compress(feature_record(8).SerializeToString())
    garbage = b"this is not zstd at all"
    not_a_record = compress(b"\xff\xff\xff\xff")
    bomb = compress(b"\x00" * (2 * 1024 * 1024))
    trailing = data + b"junk"
    return {
        "crc": (DataLoss, "checksum", (tid, data, crc ^ 1)),
        "garbage": (InvalidArgument, "not zstd", (tid, garbage, crc32(garbage))),
        "truncated": (InvalidArgument, "does not decompress", (tid, data[:-4], crc32(data[:-4]))),
        "trailing": (InvalidArgument, "does not decompress", (tid, trailing, crc32(trailing))),
        "not_a_record": (InvalidArgument, "FeatureRecord", (tid, not_a_record, crc32(not_a_record))),
        "id_mismatch": (InvalidArgument, "names tuple 8", (tid, mismatched, crc32(mismatched))),
        "bomb": (InvalidArgument, "over the limit", (tid, bomb, crc32(bomb))),
        "empty": (InvalidArgument, "empty", (tid, b"", 0)),
        "zero_id": (InvalidArgument, "not a valid id", (0, data, crc)),
    }


@pytest.mark.parametrize("case", sorted(bad_uploads()))
def test_bad_record_refused_and_nothing_stored(tmp_path: Path, case: str) -> None:
    error, message, bad = bad_uploads()[case]
    options = StoreOptions(segment_bytes=4096, max_decompressed_bytes=1024 * 1024)
    with FeatureStore(tmp_path, options) as s:
        with pytest.raises(error, match=message):
            s.put([upload(1), bad, upload(2)])
        assert s.latest() == 0 and s.offset_of(1) == 0
    with FeatureStore(tmp_path, options) as s:
        assert s.latest() == 0


def test_oversized_compressed_record_refused(tmp_path: Path) -> None:
    with FeatureStore(tmp_path, StoreOptions(max_record_bytes=64)) as s:
        tid, data, _crc = upload(1)
        big = data + b"\x00" * 64
        with pytest.raises(InvalidArgument, match="over the limit of 64"):
            s.put([(tid, big, crc32(big))])


# ---------------------------------------------------------------- recovery


def test_lowering_the_record_limit_keeps_stored_records(tmp_path: Path) -> None:
    with FeatureStore(tmp_path) as s:
        s.put([upload(1), upload(2)])
    with FeatureStore(tmp_path, StoreOptions(max_record_bytes=8)) as s:
        assert [t for _, t, _ in s.read()] == [1, 2]


def test_torn_tail_is_truncated_with_a_warning(
    store: FeatureStore, store_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store.put([upload(i) for i in range(1, 11)])
    store.close()
    last = segments(store_dir)[-1]
    good_size = last.stat().st_size
    with open(last, "ab") as fh:  # a record header promising more bytes than were written
        fh.write(bytes(upload(11)[1])[:3] + b"\x00" * (HEADER_SIZE - 3))
        fh.write(b"partial payload")
    with caplog.at_level(logging.WARNING, logger="hio.repository"):
        store = FeatureStore(store_dir, SMALL)
    try:
        assert "torn tail" in caplog.text
        assert last.stat().st_size == good_size
        [kept] = (store_dir / "features" / "torn").iterdir()
        assert kept.read_bytes().endswith(b"partial payload"), "the cut bytes are kept for inspection"
        assert store.latest() == 10
        assert store.put([upload(11)])[0].offset == 11
    finally:
        store.close()
    with FeatureStore(store_dir, SMALL) as s:
        assert [t for _, t, _ in s.read()] == list(range(1, 12))


def test_record_cut_short_is_dropped_not_served(store: FeatureStore, store_dir: Path) -> None:
    store.put([upload(i) for i in range(1, 6)])
    store.close()
    last = segments(store_dir)[-1]
    with open(last, "r+b") as fh:
        fh.truncate(last.stat().st_size - 3)
    with FeatureStore(store_dir, SMALL) as s:
        assert s.latest() == 4
        assert [t for _, t, _ in s.read()] == [1, 2, 3, 4]
        assert s.offset_of(5) == 0


def test_flipped_bit_in_tail_record_is_dropped(store: FeatureStore, store_dir: Path) -> None:
    store.put([upload(i) for i in range(1, 4)])
    store.close()
    last = segments(store_dir)[-1]
    raw = bytearray(last.read_bytes())
    raw[-2] ^= 0x40
    last.write_bytes(bytes(raw))
    with FeatureStore(store_dir, SMALL) as s:
        assert s.latest() == 2


def test_a_flipped_bit_with_stored_records_after_it_stops_the_start_and_cuts_nothing(
    store: FeatureStore, store_dir: Path
) -> None:
    """Damage in the last segment with good records after it is not a torn tail: the records
    after it were answered STORED, so they must not be cut off."""
    store.put([upload(i) for i in range(1, 6)])
    store.close()
    last = segments(store_dir)[-1]
    raw = bytearray(last.read_bytes())
    raw[len(MAGIC) + HEADER_SIZE + 2] ^= 0xFF  # inside record 1
    last.write_bytes(bytes(raw))
    with pytest.raises(CorruptSegment, match="records follow the damage"):
        FeatureStore(store_dir, SMALL)
    assert last.read_bytes() == bytes(raw), "nothing was cut off"


def test_a_consumer_past_the_latest_record_is_moved_back_so_new_records_are_read(
    store: FeatureStore, store_dir: Path
) -> None:
    """Records a consumer had read can be lost later (fsync never, a power loss); new records
    then take their offsets again, and a consumer left past them would skip them for good."""
    store.put([upload(i) for i in range(1, 6)])
    store.commit("kd", 5)
    store.close()
    last = segments(store_dir)[-1]
    raw = last.read_bytes()
    ends = []
    with FeatureStore(store_dir, SMALL) as s:  # where records 4 and 5 start: cut them off
        ends = [s._index.locations(4, 4)[0].position]
    last.write_bytes(raw[: ends[0]])
    with FeatureStore(store_dir, SMALL) as s:
        assert s.latest() == 3 and s.committed("kd") == 3
        s.put([upload(6), upload(7)])
        assert [t for _, t, _ in s.read(after=s.committed("kd"))] == [6, 7]


def test_a_torn_header_whose_last_bytes_are_a_later_offset_is_cut(store: FeatureStore, store_dir: Path) -> None:
    """The search for good records after the damage finds a later offset in the torn header's
    own last bytes, with no whole header after it: a torn tail, cut as any other."""
    store.put([upload(i) for i in range(1, 4)])
    store.close()
    last = segments(store_dir)[-1]
    good_size = last.stat().st_size
    with open(last, "ab") as fh:  # record 4's header, torn: its tuple id (5) is a later offset's bytes
        fh.write(struct.pack("<IIQQ", 100, 0, 4, 5) + b"ab")
    with FeatureStore(store_dir, SMALL) as s:
        assert s.latest() == 3
        assert last.stat().st_size == good_size


@pytest.mark.parametrize("torn", [b"", MAGIC[:3]], ids=["empty", "part-of-the-magic"])
def test_segment_torn_at_creation_is_repaired(store_dir: Path, torn: bytes) -> None:
    """A crash between creating a segment and writing its header leaves it empty or short."""
    features = store_dir / "features"
    features.mkdir(parents=True)
    (features / f"{1:020d}.seg").write_bytes(torn)
    with FeatureStore(store_dir, SMALL) as s:
        assert s.latest() == 0
        assert s.put([upload(1)])[0].offset == 1
    with FeatureStore(store_dir, SMALL) as s:
        assert s.latest() == 1


def test_damage_in_a_sealed_segment_stops_the_start(store: FeatureStore, store_dir: Path) -> None:
    store.put([upload(i) for i in range(1, 200)])
    store.close()
    first = segments(store_dir)[0]
    raw = bytearray(first.read_bytes())
    raw[len(MAGIC) + HEADER_SIZE + 2] ^= 0xFF
    first.write_bytes(bytes(raw))
    with pytest.raises(CorruptSegment, match="damaged"):
        FeatureStore(store_dir, SMALL)
    assert first.read_bytes() == bytes(raw), "a damaged sealed segment must be left as it is"


def test_missing_segment_stops_the_start(store: FeatureStore, store_dir: Path) -> None:
    store.put([upload(i) for i in range(1, 200)])
    store.close()
    segments(store_dir)[1].unlink()
    with pytest.raises(CorruptSegment, match="missing"):
        FeatureStore(store_dir, SMALL)


@pytest.mark.parametrize("lost", ["the newest segment", "every segment"])
def test_segments_missing_at_the_end_stop_the_start_until_the_loss_is_accepted(
    store: FeatureStore, store_dir: Path, lost: str
) -> None:
    """Without the mark, a log cut short at a segment's edge looks whole: its next records would
    take offsets a consumer has read past, and the lost features would go unseen."""
    store.put([upload(i) for i in range(1, 200)])
    store.commit("kd", store.latest())
    store.close()
    kept = segments(store_dir)
    gone = kept[-1:] if lost == "the newest segment" else kept
    first_gone = int(gone[0].stem)
    for path in gone:
        path.unlink()
    mark = store_dir / "features" / "newest-segment"
    with pytest.raises(CorruptSegment, match="are missing") as refused:
        FeatureStore(store_dir, SMALL)
    message = str(refused.value)
    assert f"records from offset {first_gone} on are gone" in message
    assert f"remove {mark}" in message
    assert [p.name for p in segments(store_dir)] == [p.name for p in kept if p not in gone], "nothing changed"

    mark.unlink()  # the operator accepts the loss
    with FeatureStore(store_dir, SMALL) as s:
        assert s.latest() == first_gone - 1
        assert s.committed("kd") == first_gone - 1, "the consumer is moved back to what is stored"
        assert s.put([upload(500)])[0].offset == first_gone
    assert int(mark.read_text()) == int(segments(store_dir)[-1].stem)


def test_the_newest_segment_is_marked_at_each_roll_and_a_store_without_the_mark_gets_one(
    store: FeatureStore, store_dir: Path
) -> None:
    mark = store_dir / "features" / "newest-segment"
    assert mark.read_text() == "1\n"
    store.put([upload(i) for i in range(1, 200)])
    assert int(mark.read_text()) == int(segments(store_dir)[-1].stem) > 1
    store.close()
    mark.unlink()
    with FeatureStore(store_dir, SMALL) as s:
        assert s.latest() == 199
    assert int(mark.read_text()) == int(segments(store_dir)[-1].stem)


def test_an_unreadable_mark_of_the_newest_segment_stops_the_start(store: FeatureStore, store_dir: Path) -> None:
    store.close()
    (store_dir / "features" / "newest-segment").write_text("x17\n")
    with pytest.raises(
        FailedPrecondition, match=r"newest-segment is unreadable \(invalid literal .*'x17'\); fix or remove it"
    ):
        FeatureStore(store_dir, SMALL)


def test_damage_found_on_read_is_data_loss(store: FeatureStore, store_dir: Path) -> None:
    store.put([upload(i) for i in range(1, 4)])
    path = segments(store_dir)[0]
    raw = bytearray(path.read_bytes())
    raw[len(MAGIC) + HEADER_SIZE + 1] ^= 0xFF  # inside record 1's payload, under the running store
    path.write_bytes(bytes(raw))
    with pytest.raises(DataLoss, match="offset 1"):
        list(store.read())
    assert [o for o, _, _ in store.read(after=1)] == [2, 3]


@pytest.mark.slow
def test_rebuild_of_200k_records(tmp_path: Path) -> None:
    """Index rebuild speed: printed, bounded loosely (the machine is shared)."""
    rest = feature_record(0).SerializeToString()  # id 0 is not serialized: prefixing an id is valid protobuf
    count = 200_000
    with FeatureStore(tmp_path, StoreOptions(fsync="never")) as s:
        for start in range(1, count + 1, 5000):
            batch = []
            for tid in range(start, min(start + 5000, count + 1)):
                data = compress(features_pb2.FeatureRecord(tuple_id=tid).SerializeToString() + rest)
                batch.append((tid, data, crc32(data)))
            s.put(batch)
    started = time.perf_counter()
    with FeatureStore(tmp_path) as s:
        elapsed = time.perf_counter() - started
        assert s.latest() == count and s.offset_of(count) == count
        print(f"\nrebuilt index of {count} records in {elapsed:.3f}s")
        assert elapsed < 60.0  # only a gross regression (the figure is printed); not a timing test
        started = time.perf_counter()
        assert len(list(s.read(after=150_000, max_records=1000))) == 1000
        assert time.perf_counter() - started < 10.0


# --------------------------------------------------------------- consumers


def test_consumer_commits_survive_restart(store: FeatureStore) -> None:
    store.put([upload(i) for i in range(1, 11)])
    assert store.committed("kd") == 0 and store.committed("") == 0
    store.commit("kd", 7)
    store.commit("kd.backup-2", 10)
    store = reopen(store)
    try:
        assert store.committed("kd") == 7 and store.committed("kd.backup-2") == 10
        store.commit("kd", 3)  # rewinding is allowed: the consumer re-reads
        assert store.committed("kd") == 3
    finally:
        store.close()


def test_commit_refuses_offsets_past_latest(store: FeatureStore) -> None:
    store.put([upload(1)])
    with pytest.raises(InvalidArgument, match="latest stored offset is 1"):
        store.commit("kd", 2)
    assert store.committed("kd") == 0


@pytest.mark.parametrize("name", ["", "a/b", "..", "x" * 129, "bad name", "ü"])
def test_commit_refuses_bad_names(store: FeatureStore, name: str) -> None:
    with pytest.raises(InvalidArgument, match="consumer name"):
        store.commit(name, 0)


@pytest.mark.parametrize(
    ("folder", "name", "data", "match"),
    [
        ("consumers", "kd.offset", b"-5\n", r"kd.offset is unreadable \(-5 is below 0\)"),
        ("consumers", "kd.offset", b"five\n", r"kd.offset is unreadable"),
        ("knowledge", "knowledge.pb", b"\xff\xff\xff", r"knowledge.pb is not a serialized hio.proto.Knowledge"),
        ("knowledge", "preview.png", b"GIF89a", r"preview.png is not a PNG image"),
    ],
    ids=["negative-offset", "no-number", "knowledge", "preview"],
)
def test_a_damaged_consumer_or_knowledge_file_stops_the_start_naming_it(
    store: FeatureStore, store_dir: Path, folder: str, name: str, data: bytes, match: str
) -> None:
    """These files are written atomically: one that does not read back is damage from outside,
    named at start, not served to readers as an internal error or a decode failure."""
    store.put([upload(1)])
    store.put_knowledge(knowledge().SerializeToString(), png_bytes())
    store.commit("kd", 1)
    store.close()
    (store_dir / folder / name).write_bytes(data)
    with pytest.raises(FailedPrecondition, match=match):
        FeatureStore(store_dir, SMALL)


def test_a_stored_record_larger_than_one_read_message_stops_the_start_naming_it(
    store: FeatureStore, store_dir: Path
) -> None:
    """A record stored with a larger chunk_bytes than this start's would fail every read past it."""
    record = upload(1)
    store.put([record])
    size = len(record[1])
    store.close()
    with pytest.raises(FailedPrecondition, match=rf"holds a record of {size} bytes.*start the repository with"):
        FeatureStore(store_dir, StoreOptions(segment_bytes=4096, max_read_bytes=size - 1))
    with FeatureStore(store_dir, StoreOptions(segment_bytes=4096, max_read_bytes=size)) as fits:
        assert [tuple_id for _, tuple_id, _ in fits.read()] == [1]


def test_consumer_count_is_bounded(tmp_path: Path) -> None:
    with FeatureStore(tmp_path, StoreOptions(max_consumers=2)) as s:
        s.commit("a", 0)
        s.commit("b", 0)
        s.commit("a", 0)
        with pytest.raises(FailedPrecondition, match="max_consumers"):
            s.commit("c", 0)


# --------------------------------------------------------------- knowledge


def test_knowledge_round_trip_and_restart(store: FeatureStore) -> None:
    assert store.get_knowledge_and_preview() == (None, None)
    k = knowledge().SerializeToString()
    png = png_bytes()
    parsed = store.put_knowledge(k, png)
    assert len(parsed.clusters) == 3
    store = reopen(store)
    try:
        assert store.get_knowledge_and_preview() == (k, png)
        newer = knowledge(tuple_count=20).SerializeToString()
        store.put_knowledge(newer, None)  # no preview: the stale one goes
        assert store.get_knowledge_and_preview() == (newer, None)
    finally:
        store.close()
    with FeatureStore(store.root, SMALL) as s:
        assert s.get_knowledge_and_preview() == (newer, None)
        assert not list((s.root / "knowledge").glob(".*.tmp"))


def test_knowledge_whose_preview_was_not_written_reopens_without_a_preview(
    store: FeatureStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put that stops between its two files (here the preview's fsync fails, as a crash
    there would stop it) leaves the new knowledge without a preview, never the old one's."""
    store.put_knowledge(knowledge(tuple_count=1).SerializeToString(), png_bytes())
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".preview.png"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    newer = knowledge(tuple_count=2).SerializeToString()
    with pytest.raises(FailedPrecondition, match="Input/output error"):
        store.put_knowledge(newer, png_bytes())
    monkeypatch.setattr(os, "fsync", real_fsync)
    store.close()
    with FeatureStore(store.root, SMALL) as s:
        assert s.get_knowledge_and_preview() == (newer, None)


@pytest.mark.parametrize(
    "payload, png, message",
    [
        (b"", None, "empty"),
        (b"\xff\xff\xff", None, "not a serialized"),
        (None, b"GIF89a....", "not a PNG"),
    ],
)
def test_bad_knowledge_refused_and_old_kept(
    store: FeatureStore, payload: bytes | None, png: bytes | None, message: str
) -> None:
    good = knowledge().SerializeToString()
    store.put_knowledge(good, png_bytes())
    with pytest.raises(InvalidArgument, match=message):
        store.put_knowledge(good if payload is None else payload, png)
    assert store.get_knowledge_and_preview() == (good, png_bytes())


# ------------------------------------------------------------- failed fsync


@pytest.mark.parametrize("mode", ["batch", "always"])
def test_a_segment_that_cannot_be_made_refuses_that_put_and_the_next_tries_again(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk when a segment is full: the put is refused, naming why; once there is room
    again puts are taken (the full segment stayed the active one), and nothing is lost."""
    real_open = os.open
    full = {"on": False}

    def open_(path: Any, flags: int, *args: Any) -> int:
        if full["on"] and flags & os.O_CREAT and str(path).endswith(".seg"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    options = StoreOptions(segment_bytes=4096, fsync=mode)
    s = FeatureStore(tmp_path / "s", options)
    stored = 0
    while len(segments(tmp_path / "s")) == 1:  # fill the first segment to its bound
        stored += 1
        s.put([upload(stored)])
    full["on"] = True
    with pytest.raises(Unavailable, match="cannot start a new segment: No space left on device"):
        while True:
            s.put([upload(stored + 1)])
            stored += 1
    full["on"] = False
    assert s.put([upload(stored + 1)])[0].offset == stored + 1
    s.close()
    with FeatureStore(tmp_path / "s", options) as again:
        assert [t for _, t, _ in again.read()] == list(range(1, stored + 2))


@pytest.mark.parametrize("mode", ["batch", "always"])
def test_a_failed_fsync_refuses_every_later_put_until_restart(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed fsync the kernel may report a later one as a success for bytes it
    dropped: the put whose fsync failed and every later one are refused, naming the disk,
    the error and the restart; what was stored before stays readable."""
    disk = FsyncDisk(monkeypatch)
    options = StoreOptions(segment_bytes=4096, fsync=mode)
    s = FeatureStore(tmp_path / "s", options)
    metrics = repository_registry(s)  # its sync_failed gauge is what an alert watches
    s.put([upload(1)])
    assert metrics.get_sample_value("hio_repository_sync_failed") == 0
    disk.error = OSError(errno.EIO, "Input/output error")
    with pytest.raises(FailedPrecondition, match="the repository's disk failed to sync"):
        s.put([upload(2)])
    assert metrics.get_sample_value("hio_repository_sync_failed") == 1
    disk.error = None  # a later fsync would "succeed": not trusted
    with pytest.raises(FailedPrecondition, match=r"Input/output error.*restart the repository"):
        s.put([upload(3)])
    assert [t for _, t, _ in s.read()] == [1]
    s.close()
    with FeatureStore(tmp_path / "s", options) as again:  # the restart takes puts again
        assert again.put([upload(3)])[0].offset == again.latest()
        assert repository_registry(again).get_sample_value("hio_repository_sync_failed") == 0


def test_a_failed_folder_fsync_is_final_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new segment's name reaches the disk with the folder's fsync: its failure stops puts
    like a file's."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    s = FeatureStore(tmp_path / "s", StoreOptions(segment_bytes=4096, fsync="always"))
    s.put([upload(1)])
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(FailedPrecondition, match="failed to sync"):
        for i in range(2, 300):  # until a segment rolls
            s.put([upload(i)])
    monkeypatch.setattr(os, "fsync", real_fsync)
    with pytest.raises(FailedPrecondition, match="restart the repository"):
        s.put([upload(1000)])
    s.close()


def test_a_failed_fsync_of_a_consumer_offset_is_final_for_the_whole_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer offsets and the knowledge are the repository's files as much as its
    segments: a failed fsync of one refuses the commit, and after it every put, commit and
    knowledge until the repository restarts."""
    disk = FsyncDisk(monkeypatch)
    s = FeatureStore(tmp_path / "s", StoreOptions(segment_bytes=4096, fsync="always"))
    s.put([upload(1), upload(2)])
    disk.error = OSError(errno.EIO, "Input/output error")
    with pytest.raises(FailedPrecondition, match="the repository's disk failed to sync"):
        s.commit("kd", 1)
    disk.error = None
    refusal = r"Input/output error.*restart the repository"
    for refused in (
        lambda: s.commit("kd", 2),
        lambda: s.put([upload(3)]),
        lambda: s.put_knowledge(knowledge().SerializeToString()),
    ):
        with pytest.raises(FailedPrecondition, match=refusal):
            refused()
    assert s.committed("kd") == 0 and s.latest() == 2 and s.get_knowledge_and_preview()[0] is None
    s.close()
    with FeatureStore(tmp_path / "s") as again:  # the restart takes them again
        again.commit("kd", 2)
        assert again.committed("kd") == 2


# ------------------------------------------------------- existing data on disk


def _old_record(offset: int, tuple_id: int, payload: bytes) -> bytes:
    """A record as the format's first writer framed it (u32 length, u32 CRC-32 of the rest,
    u64 offset, u64 tuple id, little-endian), written out here byte by byte."""
    body = struct.pack("<QQ", offset, tuple_id) + payload
    return struct.pack("<II", len(payload), zlib.crc32(body)) + body


def test_segments_written_in_the_hiofeat1_format_read_back_the_same(tmp_path: Path) -> None:
    """Users' long-term data: a folder of HIOFEAT1 segments opens, reads the same records
    and takes new ones after them."""
    features = tmp_path / "s" / "features"
    features.mkdir(parents=True)
    payloads = {n: compress(feature_record(n).SerializeToString()) for n in range(1, 6)}
    (features / f"{1:020d}.seg").write_bytes(b"HIOFEAT1" + b"".join(_old_record(n, n, payloads[n]) for n in (1, 2, 3)))
    (features / f"{4:020d}.seg").write_bytes(b"HIOFEAT1" + b"".join(_old_record(n, n, payloads[n]) for n in (4, 5)))
    with FeatureStore(tmp_path / "s", SMALL) as s:
        assert [(o, t, p) for o, t, p in s.read()] == [(n, n, payloads[n]) for n in range(1, 6)]
        assert s.put([upload(6)])[0].offset == 6
    with FeatureStore(tmp_path / "s", SMALL) as s:
        assert [t for _, t, _ in s.read()] == [1, 2, 3, 4, 5, 6]
