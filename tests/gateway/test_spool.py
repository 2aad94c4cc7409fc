"""The on-disk spool: bound, atomic entries, restart resume, hard link vs copy."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from hio.common.config import ConfigError
from hio.common.errors import InvalidArgument
from hio.gateway.spool import MoveOnDone, Spool, SpoolFull, safe_name
from hio.proto.tuple_pb2 import TupleMeta


def meta(name: str = "t", image: str = "hio/synthetic") -> TupleMeta:
    return TupleMeta(source="test", image=image, name=name, attempt=1)


def test_put_bytes_records_size_and_crc(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", 1 << 20)
    entry = spool.put_bytes(b"hello world", meta())
    assert entry.meta.size == 11
    assert entry.meta.crc32 == zlib.crc32(b"hello world") & 0xFFFFFFFF
    assert entry.data_path.read_bytes() == b"hello world"
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
        "00000000000000000001.data", "00000000000000000001.meta"]


def test_removal_frees_room_for_a_waiting_writer(tmp_path: Path) -> None:
    import threading

    spool = Spool(tmp_path / "s", 100)
    first = spool.put_bytes(b"x" * 80, meta())
    timer = threading.Timer(0.2, spool.remove, args=(first,))
    timer.start()
    second = spool.put_bytes(b"y" * 80, meta(), timeout=5.0)  # blocks until the removal
    timer.join()
    assert [e.seq for e in spool.entries()] == [second.seq]
    assert not first.data_path.exists()


def test_restart_resumes_in_order_with_updates(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", 1 << 20)
    entries = [spool.put_bytes(f"tuple {i}".encode(), meta(f"n{i}")) for i in range(5)]
    entries[1].meta.tuple_id, entries[1].meta.attempt = 77, 2
    spool.update(entries[1])
    spool.remove(entries[3])
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
    writer.write(b"half")     # a crash now leaves a temp file
    spool.close()
    (root / "00000000000000000009.data").write_bytes(b"payload whose meta never got written")
    (root / ".tmp-123").write_bytes(b"temp meta")

    again = Spool(root, 1 << 20)
    assert [e.seq for e in again.entries()] == [keep.seq]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".lock")) == [
        "00000000000000000001.data", "00000000000000000001.meta"]


def test_corrupt_meta_is_set_aside_not_sent(tmp_path: Path) -> None:
    root = tmp_path / "s"
    spool = Spool(root, 1 << 20)
    good = spool.put_bytes(b"good", meta())
    bad = spool.put_bytes(b"bad!", meta())
    spool.close()
    (root / f"{bad.seq:020d}.meta").write_bytes(b"\xff\xff not a protobuf")
    again = Spool(root, 1 << 20)
    assert [e.seq for e in again.entries()] == [good.seq]
    assert (root / f"{bad.seq:020d}.meta.bad").exists()


def test_meta_is_replaced_atomically(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", 1 << 20)
    entry = spool.put_bytes(b"abc", meta())
    meta_path = tmp_path / "s" / f"{entry.seq:020d}.meta"
    inode = meta_path.stat().st_ino
    entry.meta.tuple_id = 5
    spool.update(entry)
    assert meta_path.stat().st_ino != inode  # a new file renamed over the old, never rewritten in place
    assert TupleMeta.FromString(meta_path.read_bytes()).tuple_id == 5
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.startswith(".tmp-")]


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
