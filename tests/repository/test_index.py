"""The feature log's index: every id finds the offset a dict of every id would give (the first
offset it was stored at), however the ids came (added one by one, rebuilt in bulk, merged)."""

from __future__ import annotations

import random
import tracemalloc
from array import array

import pytest

from hio.repository import index as index_module
from hio.repository.index import OffsetIndex


def test_ids_added_rebuilt_and_merged_find_their_first_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_module, "MERGE_MIN", 50)  # merge often
    rng = random.Random(3)
    index, expected = OffsetIndex(), dict[int, int]()
    index.begin_segment(1)
    for _round in range(30):
        ids = [rng.choice((rng.randrange(1, 500), rng.randrange(1, 2**64))) for _ in range(rng.randrange(1, 120))]
        ids.append(2**64 - 1)  # the largest id there is
        if rng.random() < 0.3:  # a segment scanned at start, repeated ids and all
            first = index.latest + 1
            index.extend(ids, array("Q", [0] * len(ids)), array("I", [1] * len(ids)))
            for offset, tuple_id in enumerate(ids, first):
                expected.setdefault(tuple_id, offset)
        else:
            for tuple_id in ids:
                if index.offset_of(tuple_id):  # as the log does: an id stored is not written again
                    continue
                offset = index.add(tuple_id, 0, 1)
                expected.setdefault(tuple_id, offset)
    for tuple_id, offset in expected.items():
        assert index.offset_of(tuple_id) == offset
    for missing in (0, 10**6 + 1, 2**64, -1):
        assert index.offset_of(missing) == expected.get(missing, 0)


def test_an_index_of_a_million_records_holds_under_forty_bytes_a_record() -> None:
    count = 1_000_000
    positions, lengths = array("Q", range(count)), array("I", [100]) * count
    tracemalloc.start()
    try:
        index = OffsetIndex()
        index.begin_segment(1)
        index.extend(range(1, count + 1), positions, lengths)
        for tuple_id in range(count + 1, count + 20_001):  # and more, one by one
            index.add(tuple_id, 0, 100)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert index.offset_of(count) == count and index.offset_of(count + 20_000) == count + 20_000
    assert held < 40 * (count + 20_000)  # a dict of every id: over 100
