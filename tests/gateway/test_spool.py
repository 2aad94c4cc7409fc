"""The on-disk spool: bound, segments and their replay, torn records, reclaim, hard link vs copy."""

from __future__ import annotations

import errno
import os
import threading
import zlib
from pathlib import Path

import pytest

from hio.config import ConfigError
from hio.gateway import spool as spool_module
from hio.gateway.spool import MoveOnDone, Spool, SpoolFull, safe_name
from hio.proto.tuple_pb2 import TupleMeta
from hio.transport.errors import FailedPrecondition, InvalidArgument
from tests.harness import FsyncDisk, spooled_payload


def meta(name: str = "t", image: str = "hio/synthetic") -> TupleMeta:
    return TupleMeta(source="test", image=image, name=name, attempt=1)


def test_put_bytes_records_size_and_crc(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", 1 << 20)
    entry = spool.put_bytes(b"hello world", meta())
    assert entry.meta.size == 11
    assert entry.meta.crc32 == zlib.crc32(b"hello world") & 0xFFFFFFFF
    assert spooled_payload(spool, entry) == b"hello world"
    assert spool.used_bytes == 11 and len(spool) == 1


def test_bound_refuses_with_a_message_naming_it(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", 100)
    spool.put_bytes(b"x" * 60, meta())
    with pytest.raises(SpoolFull, match="spool_bytes") as info:
        spool.put_bytes(b"y" * 50, meta())
    assert info.value.retry_after and info.value.retry_after > 0
    with pytest.raises(InvalidArgument, match="never fit"):
        spool.put_bytes(b"z" * 101, meta())
    assert len(spool) == 1 and spool.used_bytes == 60 and spool.reserved_bytes == 0
    assert sorted(p.name for p in (tmp_path / "s").iterdir() if not p.name.startswith(".")) == [
        "00000000000000000001.seg"
    ]  # one segment, nothing else: refused tuples left no trace


def test_removal_frees_room_for_a_waiting_writer(tmp_path: Path) -> None:
    import threading

    spool = Spool(tmp_path / "s", 100)
    first = spool.put_bytes(b"x" * 80, meta())
    timer = threading.Timer(0.2, spool.remove_many, args=([first],))
    timer.start()
    second = spool.put_bytes(b"y" * 80, meta(), timeout=5.0)  # blocks until the removal
    timer.join()
    assert [e.seq for e in spool.entries()] == [second.seq]
    assert spool.used_bytes == 80 and spooled_payload(spool, second) == b"y" * 80


def test_restart_resumes_in_order_with_updates(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", 1 << 20)
    entries = [spool.put_bytes(f"tuple {i}".encode(), meta(f"n{i}")) for i in range(5)]
    entries[1].meta.tuple_id, entries[1].meta.attempt = 77, 2
    spool.update_many([entries[1]])
    spool.remove_many([entries[3]])
    spool.close()

    again = Spool(tmp_path / "s", 1 << 20)
    resumed = again.entries()
    assert [e.meta.name for e in resumed] == ["n0", "n1", "n2", "n4"]
    assert (resumed[1].meta.tuple_id, resumed[1].meta.attempt) == (77, 2)
    assert again.used_bytes == sum(e.size for e in resumed)
    new = again.put_bytes(b"later", meta("n5"))
    assert new.seq > resumed[-1].seq


def test_interrupted_writes_leave_no_entry(tmp_path: Path) -> None:
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20)
    keep = spool.put_bytes(b"kept", meta())
    writer = spool.writer(10)
    writer.write(b"half")  # a crash now leaves a temp file
    spool.close()
    (root / "00000000000000000009.data").write_bytes(b"payload whose record never got written")
    (root / ".tmp-123").write_bytes(b"temp meta")

    again = Spool(root, 1 << 20)
    assert [e.seq for e in again.entries()] == [keep.seq]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".lock")) == [
        "00000000000000000001.seg",
        "00000000000000000002.seg",
    ]
    assert again.put_bytes(b"next", meta()).seq == 10  # never reuses a sequence a file had


def test_torn_record_is_cut_off_and_earlier_ones_survive(tmp_path: Path) -> None:
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20)
    good = [spool.put_bytes(f"good {i}".encode(), meta(f"g{i}")) for i in range(3)]
    spool.put_bytes(b"torn" * 100, meta("torn"))
    spool.close()
    segment = root / "00000000000000000001.seg"
    size = segment.stat().st_size
    os.truncate(segment, size - 150)  # a crash in the middle of the last append
    again = Spool(root, 1 << 20)
    assert [e.meta.name for e in again.entries()] == ["g0", "g1", "g2"]
    assert [spooled_payload(again, e) for e in again.entries()] == [spool_payload(e) for e in good]
    assert segment.stat().st_size < size - 150  # the torn record is gone for good
    again.close()


def spool_payload(entry: object) -> bytes:
    return f"good {entry.meta.name[1:]}".encode()  # type: ignore[attr-defined] - a SpoolEntry, typed as object


def test_damaged_payload_is_set_aside_not_sent(tmp_path: Path) -> None:
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20)
    first = spool.put_bytes(b"A" * 1000, meta("first"))
    spool.put_bytes(b"B" * 1000, meta("second"))
    spool.close()
    segment = root / "00000000000000000001.seg"
    data = bytearray(segment.read_bytes())
    data[first.offset + 500] ^= 0xFF  # a flipped bit on the disk
    segment.write_bytes(bytes(data))
    again = Spool(root, 1 << 20)
    assert [e.meta.name for e in again.entries()] == ["second"]
    assert again.used_bytes == 1000


def test_update_is_one_append_and_survives_restart(tmp_path: Path) -> None:
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20)
    entries = [spool.put_bytes(b"abc", meta(f"n{i}")) for i in range(3)]
    before = (root / "00000000000000000001.seg").stat().st_size
    for i, entry in enumerate(entries):
        entry.meta.tuple_id, entry.meta.ticket = 100 + i, b"t" * 32
    spool.update_many(entries)
    assert (root / "00000000000000000001.seg").stat().st_size > before
    spool.close()
    assert [e.meta.tuple_id for e in Spool(root, 1 << 20).entries()] == [100, 101, 102]


def segment_files(root: Path) -> int:
    return len(list(root.glob("*.seg")))


def test_finished_segments_are_deleted_oldest_first(tmp_path: Path) -> None:
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20, segment_bytes=4096)
    entries = [spool.put_bytes(bytes([i]) * 1000, meta(f"n{i}")) for i in range(20)]
    assert segment_files(root) >= 4
    for entry in entries[1:]:
        spool.remove_many([entry])
    assert segment_files(root) >= 4  # the first tuple pins its segment and the later ones
    spool.remove_many([entries[0]])
    assert segment_files(root) == 1  # only the active one is left
    spool.close()
    assert Spool(root, 1 << 20).entries() == []


def test_a_tuple_that_stays_is_carried_forward_so_disk_use_stays_bounded(tmp_path: Path) -> None:
    root = tmp_path / "s"
    spool = Spool(root, 10_000, segment_bytes=2048)
    stuck = spool.put_bytes(b"S" * 500, meta("stuck"))
    stuck.meta.tuple_id = 7
    spool.update_many([stuck])
    for i in range(200):  # far more than the bound passes through
        spool.remove_many([spool.put_bytes(bytes([i % 256]) * 900, meta(f"n{i}"))])
    on_disk = sum(p.stat().st_size for p in root.glob("*.seg"))
    assert on_disk <= 2 * 10_000 + 3 * 2048
    [entry] = spool.entries()
    assert spooled_payload(spool, entry) == b"S" * 500
    spool.close()
    [resumed] = Spool(root, 10_000, segment_bytes=2048).entries()
    assert (resumed.meta.name, resumed.meta.tuple_id) == ("stuck", 7)


def test_file_on_same_filesystem_is_hard_linked(tmp_path: Path) -> None:
    original = tmp_path / "plate.tif"
    original.write_bytes(b"I" * 5000)
    before = original.stat()
    spool = Spool(tmp_path / "s", 1 << 20)
    entry = spool.put_file(original, meta(), move=MoveOnDone(str(original), str(tmp_path / "done" / "plate.tif")))
    assert entry.data_path.stat().st_ino == before.st_ino  # same inode: a hard link
    assert original.stat().st_mtime_ns == before.st_mtime_ns and original.read_bytes() == b"I" * 5000
    assert entry.meta.crc32 == zlib.crc32(b"I" * 5000) & 0xFFFFFFFF
    assert spool.move_sources() == {str(original)}
    spool.close()
    assert Spool(tmp_path / "s", 1 << 20).entries()[0].move.target.endswith("done/plate.tif")


def test_always_mode_syncs_a_payload_file_and_its_name_before_the_record_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power loss after the record must not find the record naming a payload file whose
    rename into ``<seq>.data`` the folder never took."""
    original = tmp_path / "plate.tif"
    original.write_bytes(b"I" * 5000)
    spool = Spool(tmp_path / "s", 1 << 20, fsync="always")
    disk = FsyncDisk(monkeypatch)
    entry = spool.put_file(original, meta())
    segment = str(spool.root / f"{entry.segment:020d}.seg")
    assert [Path(p).name.endswith(".data") for p in disk.synced[:1]] == [True]  # the payload file
    assert disk.synced[1:] == [str(spool.root), segment]  # then the folder, then the record
    spool.close()


def test_batch_mode_syncs_carried_tuples_once_before_the_originals_go(tmp_path: Path) -> None:
    """Copies carried forward are on disk before the segment holding the originals is
    deleted, by a round that settles them: the next round does not sync them again."""
    root = tmp_path / "s"
    spool = Spool(root, 4000, fsync="batch", segment_bytes=1024)
    stuck = spool.put_bytes(b"S" * 500, meta("stuck"))
    first = stuck.segment
    for i in range(40):
        spool.remove_many([spool.put_bytes(bytes([i]) * 900, meta(f"n{i}"))])
        if stuck.segment != first:
            break
    assert stuck.segment != first and not (root / f"{first:020d}.seg").exists()
    assert spool.unsynced_bytes == 0
    spool.close()
    [resumed] = Spool(root, 4000, segment_bytes=1024).entries()
    assert resumed.meta.name == "stuck"


def test_file_on_another_filesystem_is_copied(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second filesystem (/dev/shm)")
    original = shm / f"hio-test-{os.getpid()}-{tmp_path.name}.tif"
    original.write_bytes(b"C" * 3000)
    try:
        spool = Spool(tmp_path / "s", 1 << 20)
        entry = spool.put_file(original, meta())
        assert entry.data_path.stat().st_ino != original.stat().st_ino
        assert entry.data_path.read_bytes() == original.read_bytes()
        assert original.read_bytes() == b"C" * 3000
    finally:
        original.unlink()


def test_one_process_per_spool_folder(tmp_path: Path) -> None:
    first = Spool(tmp_path / "s", 1 << 20)
    # flock is per open file description: a second open in this process conflicts too.
    with pytest.raises(ConfigError, match="in use by another gateway"):
        Spool(tmp_path / "s", 1 << 20)
    first.close()
    Spool(tmp_path / "s", 1 << 20).close()


def test_safe_name() -> None:
    assert safe_name("microscope-1.lab") == "microscope-1.lab"
    assert safe_name("../etc/passwd") == "etc_passwd"
    assert safe_name("") == "default"


def test_remove_many_is_one_append_and_survives_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", 1 << 20)
    entries = [spool.put_bytes(f"tuple {i}".encode(), meta(f"n{i}")) for i in range(6)]
    segment = tmp_path / "s" / "00000000000000000001.seg"
    before = segment.stat().st_size
    gone = [entries[0], entries[2], entries[2], entries[5]]  # a repeat is forgotten once
    spool.remove_many(gone)
    added = segment.stat().st_size - before
    spool.remove_many([entries[0]])  # already gone: nothing written
    assert segment.stat().st_size - before == added
    assert [e.meta.name for e in spool.entries()] == ["n1", "n3", "n4"]
    assert spool.used_bytes == sum(e.size for e in spool.entries())
    spool.close()

    again = Spool(tmp_path / "s", 1 << 20)
    assert [e.meta.name for e in again.entries()] == ["n1", "n3", "n4"]
    assert again.used_bytes == sum(e.size for e in again.entries())


def _open_segments(root: Path) -> set[str]:
    """Segment files of the spool at ``root`` this process holds open (Linux /proc)."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)) and ".seg" in target:
            names.add(target)
    return names


def test_batch_mode_syncs_a_rolled_segment_in_the_flush_loop_not_under_the_append_lock(tmp_path: Path) -> None:
    """Filling a segment hands its fsync to the flush loop (an fsync under the append lock would
    hold every submit for the length of the fsync); the next flush syncs and closes it, and the
    tuples in it survive a restart."""
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20, fsync="batch", segment_bytes=4096)
    payloads = [bytes([n]) * 3000 for n in range(8)]
    entries = [spool.put_bytes(p, meta(f"t{n}")) for n, p in enumerate(payloads)]
    assert segment_files(root) >= 4  # three rolled, their fsyncs left to the flush loop
    spool.flush()
    assert len(_open_segments(root)) == 1  # only the active segment stays open
    spool.remove_many(entries[:2])
    spool.close()
    again = Spool(root, 1 << 20)
    assert [spooled_payload(again, e) for e in again.entries()] == payloads[2:]
    again.close()
    assert _open_segments(root) == set()


def test_a_file_that_cannot_be_spooled_gives_its_room_back(tmp_path: Path) -> None:
    folder = tmp_path / "not-a-file"  # stat works, reading it fails: as a file that vanishes or errs
    folder.mkdir()
    size = os.stat(folder).st_size
    spool = Spool(tmp_path / "s", size)
    with pytest.raises(OSError):
        spool.put_file(folder, meta())
    assert spool.reserved_bytes == 0 and len(spool) == 0
    spool.put_bytes(b"x" * size, meta(), timeout=0)  # the whole bound is there again
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.startswith(".tmp-")]


def test_an_upload_aborted_on_a_full_disk_leaves_no_file_and_no_reservation(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", 1000)
    writer = spool.writer(100)
    writer._fh.close()
    writer._fh = open("/dev/full", "wb", buffering=4096)  # noqa: SIM115 - the writer owns it: abort() closes it; every flush fails with ENOSPC
    writer.write(b"x" * 100)
    with pytest.raises(OSError):
        writer.commit(meta())
    writer.abort()  # must not raise again (closing flushes)
    assert spool.reserved_bytes == 0 and len(spool) == 0
    assert not writer.path.exists()


def test_payload_damage_names_a_spooled_file_rewritten_in_place(tmp_path: Path) -> None:
    original = tmp_path / "frame.bin"
    original.write_bytes(b"a" * 1000)
    spool = Spool(tmp_path / "s", 1 << 20)
    entry = spool.put_file(original, meta("frame.bin"))
    assert spool.payload_damage(entry) == ""
    with open(original, "r+b") as fh:  # same inode as the hard-linked spooled copy
        fh.write(b"b" * 1000)
    assert "'frame.bin' changed after it was taken" in spool.payload_damage(entry)
    inline = spool.put_bytes(b"c" * 1000, meta("inline"))
    assert spool.payload_damage(inline) == ""


def test_batch_mode_never_syncs_a_segment_whose_tuples_finished_before_its_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished segment deleted before the flush loop reached it never goes to the disk
    (its tuples need no disk); a rolled segment with a tuple not yet finished is synced,
    and so is the active one; what they hold survives a restart."""
    monkeypatch.setattr(spool_module, "BATCH_FSYNC_SECONDS", 3600.0)  # this test flushes by hand
    disk = FsyncDisk(monkeypatch)
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20, fsync="batch", segment_bytes=4096)
    payloads = [bytes([n]) * 3000 for n in range(5)]
    entries = [spool.put_bytes(p, meta(f"t{n}")) for n, p in enumerate(payloads)]
    segments = sorted({str(e.data_path) for e in entries})
    assert len(segments) == 3  # t0 t1 | t2 t3 | t4 (a segment rolls past 4096 bytes)
    assert spool.unsynced_bytes > 15000
    spool.remove_many(entries[:2])  # the first segment is finished and deleted
    assert not Path(segments[0]).exists()
    spool.flush()
    assert segments[0] not in disk.synced
    assert segments[1] in disk.synced and segments[2] in disk.synced
    assert spool.unsynced_bytes == 0
    spool.close()
    again = Spool(root, 1 << 20)
    assert [spooled_payload(again, e) for e in again.entries()] == payloads[2:]
    again.close()


def test_batch_mode_holds_appends_while_the_disk_is_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An append that would take what waits for its fsync past ``unsynced_bytes`` waits for
    the flush loop, concurrent appends included (a power loss then takes at most that much,
    however fast the submissions); they go on once the disk has caught up. Before, a tuple
    was counted once appended, so each concurrent submitter could add one past the bound."""
    disk = FsyncDisk(monkeypatch)
    spool = Spool(tmp_path / "s", 1 << 20, fsync="batch", unsynced_bytes=13_000)
    disk.open.clear()  # the disk stalls
    spool.put_bytes(b"a" * 6000, meta("t0"))
    spool.put_bytes(b"b" * 6000, meta("t1"))  # appended: 12000 and their records fit in 13000
    behind = spool.unsynced_bytes
    others = [
        threading.Thread(target=spool.put_bytes, args=(bytes([n]) * 6000, meta(f"t{n}")), daemon=True)
        for n in range(2, 5)
    ]
    for other in others:
        other.start()
    others[0].join(0.5)
    assert all(o.is_alive() for o in others) and len(spool) == 2  # held: no more fits
    assert spool.unsynced_bytes == behind <= 13_000
    disk.open.set()
    for other in others:
        other.join(10)
    assert not any(o.is_alive() for o in others) and len(spool) == 5
    spool.close()


def test_batch_mode_takes_no_new_tuple_after_a_failed_fsync_until_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed flush is final: after it, Linux may report a later fsync as a success for
    bytes it dropped, so the spool refuses every new tuple (FailedPrecondition, naming the disk
    and the restart, nothing written: no record, no payload file), also once the disk
    syncs again; the tuples it took before are still there to deliver, and a restarted
    spool has them all and takes new ones. Before, the next successful fsync let appends
    go on as if nothing had been lost."""
    disk = FsyncDisk(monkeypatch)
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20, fsync="batch", unsynced_bytes=13_000)
    disk.open.clear()  # no round ends before both are in
    disk.error = OSError(errno.EIO, "Input/output error")
    spool.put_bytes(b"a" * 6000, meta("t0"))
    spool.put_bytes(b"b" * 6000, meta("t1"))
    disk.open.set()
    refusal = r"the spool's disk failed to sync at .*\(.*Input/output error\).*restart the gateway"
    with pytest.raises(FailedPrecondition, match=refusal) as held:  # held for the disk (or refused at once)
        spool.put_bytes(b"c" * 6000, meta("t2"))
    assert held.value.retry_after and "nothing of this tuple was written" in held.value.message
    assert "Input/output error" in spool.disk_failure
    disk.error = None
    spool.flush()  # the disk "syncs" again
    assert spool.unsynced_bytes == 0
    original = tmp_path / "frame.bin"
    original.write_bytes(b"d" * 100)
    for attempt in (
        lambda: spool.put_bytes(b"c", meta("t2")),  # well within the bound: refused all the same
        lambda: spool.put_file(original, meta("frame.bin")),
    ):
        with pytest.raises(FailedPrecondition, match=refusal):
            attempt()
    assert len(spool) == 2 and spool.used_bytes == 12_000 and spool.reserved_bytes == 0
    assert not list(root.glob(".tmp-*")) and original.read_bytes() == b"d" * 100
    assert [spooled_payload(spool, e)[:1] for e in spool.entries()] == [b"a", b"b"]  # still delivered
    spool.close()
    again = Spool(root, 1 << 20, fsync="batch")
    assert again.disk_failure == ""
    assert [spooled_payload(again, e)[:1] for e in again.entries()] == [b"a", b"b"]
    again.put_bytes(b"c" * 6000, meta("t2"))
    assert len(again) == 3
    again.close()


def test_always_mode_refuses_the_tuple_whose_fsync_failed_and_every_later_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 'always' the tuple whose fsync failed is refused and cut off its segment (a
    restart does not bring back what its sender was told failed, to be sent twice), and the
    failure is as final as in 'batch': later tuples are refused before any I/O."""
    disk = FsyncDisk(monkeypatch)
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20, fsync="always")
    spool.put_bytes(b"a" * 100, meta("t0"))
    disk.error = OSError(errno.EIO, "Input/output error")
    refusal = r"the spool's disk failed to sync .*\(Input/output error\).*restart the gateway"
    with pytest.raises(FailedPrecondition, match=refusal):  # the tuple whose fsync failed
        spool.put_bytes(b"b" * 100, meta("t1"))
    disk.error = None
    with pytest.raises(FailedPrecondition, match=refusal):
        spool.put_bytes(b"c" * 100, meta("t2"))
    assert len(spool) == 1 and spool.reserved_bytes == 0
    spool.close()
    again = Spool(root, 1 << 20, fsync="always")
    assert [spooled_payload(again, e) for e in again.entries()] == [b"a" * 100]
    again.close()


def test_a_flush_that_cannot_open_a_descriptor_is_not_final_and_loses_nothing_to_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush that fails before any fsync (no descriptor left: EMFILE) is not the disk's
    failure: the spool goes on taking tuples, and the next flush syncs everything the failed
    one had taken over, so nothing it had taken over is left unsynced or counted."""
    monkeypatch.setattr(spool_module, "BATCH_FSYNC_SECONDS", 3600.0)  # this test flushes by hand
    disk = FsyncDisk(monkeypatch)
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20, fsync="batch", segment_bytes=4096)
    original = tmp_path / "frame.bin"
    original.write_bytes(b"f" * 500)
    spool.put_file(original, meta("frame.bin"))
    entries = [spool.put_bytes(bytes([n]) * 3000, meta(f"t{n}")) for n in range(3)]  # a segment rolls
    assert spool.unsynced_bytes > 9000
    real_dup = os.dup

    def no_descriptor(fd: int) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(os, "dup", no_descriptor)
    with pytest.raises(OSError, match="Too many open files"):
        spool.flush()
    monkeypatch.setattr(os, "dup", real_dup)
    assert spool.disk_failure == ""
    spool.put_bytes(b"z" * 100, meta("z"))
    spool.flush()
    assert spool.unsynced_bytes == 0
    assert str(entries[0].data_path) in disk.synced and any(p.endswith(".data") for p in disk.synced)
    spool.close()


def _hsp1(kind: int, seq: int, meta_bytes: bytes = b"", payload: bytes = b"") -> bytes:
    """A spool record in the HSP1 framing, byte by byte: magic, kind, sequence, meta, move and
    payload lengths (big-endian), CRC-32 of those, the metadata, the payload."""
    body = (
        b"HSP1"
        + bytes([kind])
        + seq.to_bytes(8, "big")
        + len(meta_bytes).to_bytes(4, "big")
        + (0).to_bytes(4, "big")
        + len(payload).to_bytes(8, "big")
    )
    return body + zlib.crc32(meta_bytes, zlib.crc32(body)).to_bytes(4, "big") + meta_bytes + payload


def test_a_spool_folder_in_the_hsp1_format_resumes_its_tuples(tmp_path: Path) -> None:
    """Tuples spooled before an upgrade are not lost: ADD, META and DONE records framed as
    HSP1 resume as the same tuples, a torn record at the end cut off."""
    root = tmp_path / "s"
    root.mkdir()
    records = b""
    for seq in (1, 2, 3):
        data = bytes([seq]) * 100
        m = TupleMeta(name=f"t{seq}", image="img", size=len(data), crc32=zlib.crc32(data))
        records += _hsp1(1, seq, m.SerializeToString(), data)
    routed = TupleMeta(name="t2", image="img", size=100, crc32=zlib.crc32(bytes([2]) * 100), tuple_id=42)
    records += _hsp1(3, 2, routed.SerializeToString()) + _hsp1(4, 1)
    (root / f"{1:020d}.seg").write_bytes(records + _hsp1(4, 3)[:10])
    spool = Spool(root, 1 << 20)
    assert [(e.meta.name, e.meta.tuple_id, spooled_payload(spool, e)) for e in spool.entries()] == [
        ("t2", 42, bytes([2]) * 100),
        ("t3", 0, bytes([3]) * 100),
    ]
    spool.close()


def test_a_partial_record_that_cannot_be_cut_off_stops_new_tuples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record the disk took only part of is cut off; when even the cut fails, what is left
    would end the segment's records at the next start, so no new tuple is taken until the
    gateway restarts (the tuples before it resume)."""
    spool = Spool(tmp_path / "s", 1 << 20)
    spool.put_bytes(b"a" * 100, meta("first"))
    real_write = os.write

    def half(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data)[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_truncate(fd: int, size: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "write", half)
    monkeypatch.setattr(os, "ftruncate", no_truncate)
    with pytest.raises(OSError):
        spool.put_bytes(b"b" * 100, meta("second"))
    monkeypatch.undo()
    with pytest.raises(FailedPrecondition, match="partial record could not be cut off"):
        spool.put_bytes(b"c" * 100, meta("third"))
    spool.close()
    again = Spool(tmp_path / "s", 1 << 20)
    assert [e.meta.name for e in again.entries()] == ["first"]
    again.close()
