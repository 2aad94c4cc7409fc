"""Feature records of a Deliver stream stored in batches, against a real repository."""

from __future__ import annotations

import threading
import time

import pytest
import zstandard

from hio.proto import features_pb2
from hio.transport.frames import TupleMeta, TupleReceipt
from hio.worker import engine as engine_module
from hio.worker.cluster import ClusterLink
from hio.worker.engine import _BatchStorer, _Slot
from tests.harness import free_port, wait_for
from tests.worker.conftest import Repo, RunningEngine, engine_config, make_tuple


def test_long_stream_answers_every_tuple_in_order_once_stored(repo: Repo) -> None:
    engine = RunningEngine(engine_config(master=f"127.0.0.1:{free_port()}", repository=repo.address))
    try:
        tuples = [make_tuple(100 + n, bytes([n]) * n) for n in range(60)]
        receipts = engine.deliver(tuples)
    finally:
        engine.close()
    assert [(r.index, r.tuple_id, r.state) for r in receipts] == [(n, 100 + n, TupleReceipt.STORED) for n in range(60)]
    records = repo.records()
    assert set(records) == {100 + n for n in range(60)}
    assert all(records[100 + n].features["size"].number == n for n in range(60))


def _slot(index: int, tuple_id: int, blob: bytes | None = None) -> _Slot:
    if blob is None:
        record = features_pb2.FeatureRecord(tuple_id=tuple_id)
        record.features["x"].number = float(tuple_id)
        blob = zstandard.ZstdCompressor().compress(record.SerializeToString())
    return _Slot(index, TupleMeta(tuple_id=tuple_id, image="test/echo"), blob=blob)


def test_a_refused_record_fails_alone_and_the_others_are_stored(repo: Repo) -> None:
    """Only the bad record fails (with the repository's words); the stream goes on."""
    link = ClusterLink(engine_config(master=f"127.0.0.1:{free_port()}", repository=repo.address), rpc_deadline=5)
    stored: list[tuple[int, bool]] = []
    refused: list[tuple[int, str]] = []
    woke = threading.Event()

    def on_stored(slots: list[_Slot], duplicates: list[bool]) -> None:
        stored.extend((s.meta.tuple_id, d) for s, d in zip(slots, duplicates, strict=True))

    storer = _BatchStorer(
        link.store_many,
        on_stored,
        woke.set,
        max_records=64,
        max_bytes=1 << 20,
        max_pending=64,
        on_refused=lambda slot, why: refused.append((slot.meta.tuple_id, why)),
    )
    storer._cond.acquire()  # hold the storer so all four records go in one batch
    try:
        for slot in (_slot(0, 1), _slot(1, 2), _slot(2, 3, blob=b"not zstd"), _slot(3, 4)):
            storer._waiting.append(slot)
        storer._cond.notify_all()
    finally:
        storer._cond.release()
    assert woke.wait(10)
    wait_for(lambda: len(stored) == 3, timeout=10, what="the three good records stored")
    assert storer.error is None
    assert stored == [(1, False), (2, False), (4, False)]
    assert [t for t, _ in refused] == [3] and "tuple 3" in refused[0][1]
    assert set(repo.records()) == {1, 2, 4}
    storer.close(1)
    link.close()


def _batches_of_three(repo: Repo, pause: float) -> tuple[list[list[int]], list[float]]:
    """Submit records 1, 2, 3 ``pause`` s apart to a storer on the real repository; the ids of
    each PutFeatures it made, and for each record the seconds from its submit to the
    PutFeatures that carried it."""
    link = ClusterLink(engine_config(master=f"127.0.0.1:{free_port()}", repository=repo.address), rpc_deadline=5)
    batches: list[list[int]] = []
    submitted: dict[int, float] = {}
    waited: dict[int, float] = {}
    done = threading.Event()

    def store_many(records: list[tuple[int, bytes]]) -> list[bool]:
        batches.append([tuple_id for tuple_id, _ in records])
        now = time.monotonic()
        waited.update((tuple_id, now - submitted[tuple_id]) for tuple_id, _ in records)
        return link.store_many(records)

    def on_stored(slots: list[_Slot], duplicates: list[bool]) -> None:
        if slots[-1].meta.tuple_id == 3:
            done.set()

    storer = _BatchStorer(
        store_many,
        on_stored,
        lambda: None,
        max_records=64,
        max_bytes=1 << 20,
        max_pending=64,
        on_refused=lambda slot, why: None,
    )
    try:
        for n in (1, 2, 3):
            submitted[n] = time.monotonic()
            storer.submit(_slot(n - 1, n))
            time.sleep(pause)
        assert done.wait(10)
    finally:
        storer.close(1)
        link.close()
    return batches, [waited[n] for n in (1, 2, 3)]


def test_records_that_arrive_fast_wait_for_each_other_and_slow_ones_go_at_once(
    repo: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small tuples: one PutFeatures for records that come close together (the gRPC work of a call
    costs more than storing a few records); a record that came apart from the one before it (the
    first of a stream too) is not held back, not even for the gap that tells the two apart."""
    monkeypatch.setattr(engine_module, "STORE_GAP", 0.5)  # "close together": within 0.5 s
    monkeypatch.setattr(engine_module, "STORE_LINGER", 3.0)
    batches, waited = _batches_of_three(repo, pause=0.1)
    assert batches == [[1], [2, 3]]
    assert waited[0] < 0.3, waited  # the first goes at once; the second waits for the third
    batches, waited = _batches_of_three(repo, pause=0.7)
    assert batches == [[1], [2], [3]]
    assert max(waited) < 0.3, waited  # none waited the 0.5 s gap to learn that nothing followed
