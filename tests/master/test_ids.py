"""TupleIdAllocator: unique and strictly increasing, also across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from hio.master.ids import IdFileError, TupleIdAllocator


def test_ids_increase_and_blocks_persist(tmp_path: Path) -> None:
    path = tmp_path / "ids"
    ids = TupleIdAllocator(path, block=10)
    assert ids.allocate(3) == [1, 2, 3]
    assert ids.allocate(0) == []
    batch = ids.allocate(15)  # crosses a block boundary
    assert batch == list(range(4, 19))
    assert ids.last_issued == 18 and ids.issued(18) and not ids.issued(19) and not ids.issued(0)


def test_restart_never_reissues(tmp_path: Path) -> None:
    path = tmp_path / "ids"
    first = TupleIdAllocator(path, block=100).allocate(5)
    second = TupleIdAllocator(path, block=100)  # "crash": the block was never used up
    assert second.issued(5) and second.issued(100)  # anything below the mark may exist out there
    fresh = second.allocate(2)
    assert min(fresh) > max(first) and fresh == [101, 102]
    third = TupleIdAllocator(path, block=100)
    assert third.allocate(1)[0] > max(fresh)


def test_corrupt_id_file_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "ids"
    TupleIdAllocator(path).allocate(1)
    path.write_bytes(b"\x00" * 12)
    with pytest.raises(IdFileError, match="checksum"):
        TupleIdAllocator(path)
    path.write_bytes(b"short")
    with pytest.raises(IdFileError, match="expected"):
        TupleIdAllocator(path)
