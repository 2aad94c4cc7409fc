"""The accumulated Parquet store: exactly once across replays, restarts and compaction."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from hio.kd import store as store_mod
from hio.kd.model import plan
from hio.kd.records import Row
from hio.kd.store import AccumulatedStore
from hio.transport.errors import FailedPrecondition
from tests.harness import FsyncDisk
from tests.kd.helpers import to_table


def rows(first_offset: int, first_id: int, count: int, image: str = "img", names=("a", "b")) -> list[Row]:
    return [
        Row(
            offset=first_offset + i,
            tuple_id=first_id + i,
            image=image,
            names=names,
            values=tuple(float(first_id + i + j) for j in range(len(names))),
        )
        for i in range(count)
    ]


def test_append_persists_and_reopens_identically(tmp_path: Path) -> None:
    store = AccumulatedStore(tmp_path).open()
    bad = Row(offset=11, tuple_id=11, error="kd feature 'x' is missing")
    result = store.append(to_table([*rows(1, 1, 10), bad]), 100.0)
    assert (result.accepted, result.malformed, result.duplicates) == (10, 1, 0)
    assert "offset 11 tuple 11" in result.examples[0]
    again = AccumulatedStore(tmp_path).open()
    assert (again.total, again.malformed, again.max_offset) == (10, 1, 11)
    group = plan(again.ordered(), "", 1)[0]
    assert group is not None and group.names == ("a", "b")
    np.testing.assert_array_equal(group.values, plan(store.ordered(), "", 1)[0].values)  # type: ignore[union-attr] - the group exists
    assert again.history() == [(100.0, 10)]


def test_replayed_batch_and_known_ids_count_once(tmp_path: Path) -> None:
    store = AccumulatedStore(tmp_path).open()
    batch = to_table(rows(1, 1, 5))
    store.append(batch, 1.0)
    replay = store.append(batch, 2.0)  # Spark replays a batch after a crash
    assert (replay.accepted, replay.duplicates) == (0, 5)
    moved = store.append(to_table(rows(6, 3, 4)), 3.0)  # ids 3..6 under new offsets: 3..5 known
    assert (moved.accepted, moved.duplicates) == (1, 3)
    assert store.total == 6
    assert len(list(tmp_path.glob("part-*.parquet"))) == 2
    assert AccumulatedStore(tmp_path).open().total == 6


def test_groups_by_image_and_feature_set(tmp_path: Path) -> None:
    store = AccumulatedStore(tmp_path).open()
    store.append(
        to_table(rows(1, 1, 3, image="small") + rows(4, 4, 5, image="big") + rows(9, 9, 2, image="big", names=("z",))),
        1.0,
    )
    assert plan(store.ordered(), "", 1)[0].image == "big"  # type: ignore[union-attr] - the group exists
    assert plan(store.ordered(), "", 1)[0].count == 5  # type: ignore[union-attr] - the group exists
    assert plan(store.ordered(), "small", 1)[0].names == ("a", "b")  # type: ignore[union-attr] - the group exists
    assert plan(store.ordered(), "absent", 1)[0] is None


def test_leftover_tmp_removed_and_many_files_compacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "COMPACT_AT_FILES", 4)
    store = AccumulatedStore(tmp_path).open()
    for i in range(5):
        store.append(to_table(rows(1 + 10 * i, 1 + 10 * i, 10)), float(i))
    (tmp_path / "part-x.parquet.tmp").write_bytes(b"half a file")
    reopened = AccumulatedStore(tmp_path).open()
    assert not list(tmp_path.glob("*.tmp"))
    assert len(list(tmp_path.glob("part-*.parquet"))) == 1
    assert (reopened.total, reopened.max_offset) == (50, 50)
    assert [n for _, n in reopened.history()] == [10, 20, 30, 40, 50]


def test_interrupted_compaction_overlap_counts_once(tmp_path: Path) -> None:
    store = AccumulatedStore(tmp_path).open()
    store.append(to_table(rows(1, 1, 10)), 1.0)
    store.append(to_table(rows(11, 11, 10)), 2.0)
    # a compaction that wrote the merged file and died before deleting the parts
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = sorted(tmp_path.glob("part-*.parquet"))
    merged = pa.concat_tables([pq.read_table(p) for p in parts])
    pq.write_table(merged, tmp_path / f"part-{1:020d}-{20:020d}.parquet")
    assert AccumulatedStore(tmp_path).open().total == 20


def test_a_failed_fsync_refuses_every_later_interval_until_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed fsync a later one may report success for bytes the disk dropped: the
    interval whose fsync failed and every later one are refused until KD restarts; the
    intervals stored before stay."""
    disk = FsyncDisk(monkeypatch)
    store = AccumulatedStore(tmp_path).open()
    store.append(to_table(rows(1, 1, 3)), 1.0)
    disk.error = OSError(errno.EIO, "Input/output error")
    with pytest.raises(FailedPrecondition, match="KD's disk failed to sync"):
        store.append(to_table(rows(4, 4, 3)), 2.0)
    disk.error = None
    with pytest.raises(FailedPrecondition, match="restart the kd"):
        store.append(to_table(rows(7, 7, 3)), 3.0)
    assert store.total == 3
    again = AccumulatedStore(tmp_path).open()  # the restart takes intervals again
    assert again.total == 3
    assert again.append(to_table(rows(4, 4, 3)), 4.0).accepted == 3


def test_a_failed_folder_fsync_is_final_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part file's rename reaches the disk with the folder's fsync; when that fails the
    rows renamed in stay indexed, and the next interval is refused."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    store = AccumulatedStore(tmp_path).open()
    monkeypatch.setattr(os, "fsync", fsync)
    assert store.append(to_table(rows(1, 1, 3)), 1.0).accepted == 3
    monkeypatch.setattr(os, "fsync", real_fsync)
    with pytest.raises(FailedPrecondition, match="restart the kd"):
        store.append(to_table(rows(4, 4, 3)), 2.0)
