"""The engine's data path against a real repository (and a real master when built)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from hio.proto import master_pb2
from hio.transport.frames import TupleMeta, TupleReceipt, frames_for_bytes
from tests.harness import FsyncDisk, free_port, wait_for
from tests.worker.conftest import (
    SETTINGS,
    TEST_IMAGE,
    Master,
    Repo,
    RunningEngine,
    engine_config,
    make_tuple,
    register_channel,
)


@pytest.fixture
def engine(repo: Repo) -> Iterator[RunningEngine]:
    """An engine whose master is absent: reports retry in the background, the data path goes on."""
    e = RunningEngine(engine_config(master=f"127.0.0.1:{free_port()}", repository=repo.address))
    yield e
    e.close()


def test_deliver_stores_each_tuple_and_answers_in_order(engine: RunningEngine, repo: Repo) -> None:
    big = bytes(range(256)) * 20  # 5120 bytes: five chunks of 1 KiB
    receipts = engine.deliver([make_tuple(11, b"aab"), make_tuple(12, big), make_tuple(13, b"")])
    assert [(r.index, r.tuple_id, r.state) for r in receipts] == [
        (0, 11, TupleReceipt.STORED),
        (1, 12, TupleReceipt.STORED),
        (2, 13, TupleReceipt.STORED),
    ]
    records = repo.records()
    assert set(records) == {11, 12, 13}
    first = records[11]
    assert first.features["size"].number == 3 and list(first.features["histogram"].array.values) == [2.0, 1.0]
    assert first.features["name"].text == "t11" and first.features["setup_calls"].number >= 1
    assert list(first.kd_features) == ["size"] and first.engine == "w1/0" and first.meta.image == TEST_IMAGE
    assert records[12].features["size"].number == len(big) and records[13].features["first"].number == -1


def test_redelivery_stores_features_once(engine: RunningEngine, repo: Repo) -> None:
    for _ in range(2):
        receipts = engine.deliver([make_tuple(21, b"same")])
        assert receipts[0].state == TupleReceipt.STORED
    assert list(repo.records()) == [21]


def test_tuple_of_another_image_is_refused_naming_both(engine: RunningEngine, repo: Repo) -> None:
    with pytest.raises(grpc.RpcError) as err:
        engine.deliver([make_tuple(31, b"x", image="hio/other")])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "hio/other" in err.value.details() and TEST_IMAGE in err.value.details()
    assert repo.records() == {}


def test_corrupt_tuple_ends_the_stream_after_the_good_ones(engine: RunningEngine, repo: Repo) -> None:
    good = make_tuple(41, b"fine")
    bad_meta, bad_data = make_tuple(42, b"damaged")
    bad_meta.crc32 ^= 1
    frames = [f for meta, data in (good, (bad_meta, bad_data)) for f in frames_for_bytes(meta, data, 1024)]
    call = engine.stub.Deliver(iter(frames), timeout=10)
    first = next(call)
    assert (first.tuple_id, first.state) == (41, TupleReceipt.STORED)
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "42" in err.value.details()
    assert list(repo.records()) == [41]


def test_tuple_without_id_is_refused(engine: RunningEngine) -> None:
    meta, data = make_tuple(0, b"x")
    with pytest.raises(grpc.RpcError) as err:
        engine.deliver([(meta, data)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no tuple id" in err.value.details()


def _deliver_in_thread(engine: RunningEngine, tuples: list, results: list) -> threading.Thread:
    def run() -> None:
        try:
            results.append(engine.deliver(tuples))
        except grpc.RpcError as exc:
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_stream_with_tuples_left_keeps_the_channel_busy(engine: RunningEngine, repo: Repo) -> None:
    results: list[object] = []
    slow = _deliver_in_thread(
        engine,
        [make_tuple(51, b"slow", mode="sleep", seconds="2.0"), make_tuple(53, b"slow", mode="sleep", seconds="0.2")],
        results,
    )
    wait_for(
        lambda: engine.engine._active is not None and engine.engine.processing,
        timeout=10,
        interval=0.01,
        what="the slow stream processing its first tuple",
    )
    with pytest.raises(grpc.RpcError) as err:
        engine.deliver([make_tuple(52, b"fast")])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in err.value.details()
    slow.join(10)
    assert [r.state for r in results[0]] == [TupleReceipt.STORED] * 2  # type: ignore[union-attr]
    assert engine.deliver([make_tuple(52, b"fast")])[0].state == TupleReceipt.STORED


def test_next_stream_is_received_while_the_last_tuple_is_processed(engine: RunningEngine, repo: Repo) -> None:
    """A stream whose input ended hands the channel over: one stream more is taken, a third is refused."""
    first: list[object] = []
    second: list[object] = []
    a = _deliver_in_thread(engine, [make_tuple(61, b"slow", mode="sleep", seconds="3.0")], first)
    wait_for(lambda: engine.engine._tails == 1, timeout=10, interval=0.01, what="the first stream handing over")
    b = _deliver_in_thread(
        engine, [make_tuple(62, b"next", mode="sleep", seconds="0.2"), make_tuple(63, b"next")], second
    )
    wait_for(lambda: engine.engine._active is not None, timeout=10, interval=0.01, what="the second stream's claim")
    with pytest.raises(grpc.RpcError) as err:  # the second stream waits for the slot and holds the claim
        engine.deliver([make_tuple(64, b"third")])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in err.value.details()
    a.join(10)
    b.join(10)
    assert [r.state for r in first[0]] == [TupleReceipt.STORED]  # type: ignore[union-attr]
    assert [r.state for r in second[0]] == [TupleReceipt.STORED] * 2  # type: ignore[union-attr]
    stored = list(repo.records())
    assert sorted(stored) == [61, 62, 63]
    assert stored.index(61) < stored.index(62)  # processed one at a time, in order


def test_repository_down_breaks_the_stream_unavailable(repo: Repo) -> None:
    engine = RunningEngine(
        engine_config(master=f"127.0.0.1:{free_port()}", repository=f"127.0.0.1:{free_port()}", rpc_deadline=0.5)
    )
    try:
        with pytest.raises(grpc.RpcError) as err:
            engine.deliver([make_tuple(61, b"x")])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "repository" in err.value.details()
        from hio.transport.errors import retry_after  # the engine's state: a gateway retries uncharged

        assert retry_after(err.value) is not None and "repository unreachable" in err.value.details()
    finally:
        engine.close()


# ---- with a real master ------------------------------------------------------------------------


def _route(master: Master, size: int, force_queue: bool = False) -> master_pb2.RouteTuplesResponse:
    return master.stub.RouteTuples(
        master_pb2.RouteTuplesRequest(
            source="test", image=TEST_IMAGE, items=[master_pb2.RouteItem(size=size)], force_queue=force_queue
        ),
        timeout=5,
    )


@contextlib.contextmanager
def _serving(master: Master, repo: Repo, **settings: object) -> Iterator[RunningEngine]:
    """An engine on the real master and repository, its channel registered; closed after."""
    engine = RunningEngine(engine_config(master=master.address, repository=repo.address, **settings))
    try:
        register_channel(master, engine)
        yield engine
    finally:
        engine.close()


def _routed(master: Master, data: bytes, *, force_queue: bool = False, **attributes: str) -> tuple[TupleMeta, bytes]:
    """A tuple the master routed (its id and ticket), ready to deliver or enqueue."""
    route = _route(master, len(data), force_queue=force_queue)
    meta, data = make_tuple(route.tuple_ids[0], data, **attributes)
    meta.ticket = route.tickets[0]
    return meta, data


def test_failing_pipeline_hands_the_tuple_to_the_master(master: Master, repo: Repo) -> None:
    with _serving(master, repo, max_attempts=3) as engine:
        route = _route(master, 4)
        assert route.WhichOneof("route") == "channel" and route.channel.channel_id == "w1/0"
        meta, data = make_tuple(route.tuple_ids[0], b"oops", mode="fail")
        meta.ticket = route.tickets[0]
        receipt = engine.deliver([(meta, data)])[0]
        assert receipt.state == TupleReceipt.ENQUEUED and "ValueError: cannot analyse" in receipt.message
        # the idle engine pulls it again, fails again, until the master gives up on it
        letters = wait_for(
            lambda: master.stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=5).dead_letters,
            timeout=30,
            what="a dead letter",
        )
        assert letters[0].meta.tuple_id == meta.tuple_id
        assert "ValueError" in letters[0].meta.attributes["hio.last_error"] or "ValueError" in letters[0].reason
        assert repo.records() == {}
        assert master.status().tuples_failed >= 1


def test_a_tuple_the_master_keeps_as_a_dead_letter_on_hand_back_is_receipted_so(repo: Repo, tmp_path: Path) -> None:
    """A master allowing one attempt keeps the handed-back tuple (attempt 2) as a dead letter:
    the engine's receipt says so, so the gateway (whose own max_attempts may be higher) does
    not tell its caller the queue will try the tuple again."""
    master = Master(tmp_path / "strict-master", max_attempts=1)
    try:
        with _serving(master, repo, max_attempts=1) as engine:
            meta, data = _routed(master, b"oops", mode="fail")
            receipt = engine.deliver([(meta, data)])[0]
            assert receipt.state == TupleReceipt.ENQUEUED and "ValueError: cannot analyse" in receipt.message
            assert receipt.dead_lettered
            [letter] = master.stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=5).dead_letters
            assert letter.meta.tuple_id == meta.tuple_id and "ValueError" in letter.reason
            ok, ok_data = _routed(master, b"ok")
            assert not engine.deliver([(ok, ok_data)])[0].dead_lettered
    finally:
        master.close()


def test_a_pipeline_raising_a_base_exception_fails_its_tuple_and_the_engine_goes_on(master: Master, repo: Repo) -> None:
    """asyncio.CancelledError (a BaseException, not an Exception) from user code: the tuple fails
    with that error, directly and from the queue, and the engine keeps serving and pulling."""
    with _serving(master, repo, max_attempts=2) as engine:
        meta, data = _routed(master, b"oops", mode="cancel")
        receipt = engine.deliver([(meta, data)])[0]
        assert receipt.state == TupleReceipt.ENQUEUED and "CancelledError: task cancelled" in receipt.message
        letters = wait_for(
            lambda: master.stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=5).dead_letters,
            timeout=30,
            what="the tuple dead-lettered after its pulled attempt",
        )
        assert "CancelledError" in letters[0].meta.attributes["hio.last_error"] + letters[0].reason
        assert engine.engine._puller.is_alive()
        ok, ok_data = _routed(master, b"ok", force_queue=True)  # an ordinary tuple after it is still pulled
        list(master.stub.Enqueue(frames_for_bytes(ok, ok_data, SETTINGS.chunk_bytes), timeout=10))
        wait_for(lambda: ok.tuple_id in repo.records(), timeout=20, what="the next queued tuple stored")


def test_features_over_the_repository_limit_fail_their_tuple_alone(master: Master, repo: Repo) -> None:
    """Features that compress small but are over the repository's decompressed limit: the tuple
    is handed back with the reason, and the stream goes on with the next ones."""
    with _serving(master, repo) as engine:
        route = master.stub.RouteTuples(
            master_pb2.RouteTuplesRequest(source="test", image=TEST_IMAGE, items=[master_pb2.RouteItem(size=4)] * 3),
            timeout=5,
        )
        tuples = [
            make_tuple(tid, b"data", **({"mode": "huge"} if n == 1 else {})) for n, tid in enumerate(route.tuple_ids)
        ]
        for (meta, _), ticket in zip(tuples, route.tickets, strict=True):
            meta.ticket = ticket
        receipts = engine.deliver(tuples)
        assert [r.state for r in receipts] == [TupleReceipt.STORED, TupleReceipt.ENQUEUED, TupleReceipt.STORED]
        assert "over the repository's limit" in receipts[1].message
        assert sorted(repo.records()) == [route.tuple_ids[0], route.tuple_ids[2]]


def test_a_failing_tuple_with_attributes_at_the_bound_is_still_handed_back(master: Master, repo: Repo) -> None:
    """256 user attributes is allowed; the engine's hio.last_error must still fit beside them."""
    with _serving(master, repo) as engine:
        meta, data = _routed(master, b"oops", mode="fail", **{f"k{i}": "v" for i in range(255)})
        assert len(meta.attributes) == 256
        receipt = engine.deliver([(meta, data)])[0]
        assert receipt.state == TupleReceipt.ENQUEUED and "ValueError: cannot analyse" in receipt.message


def test_idle_engine_pulls_a_queued_tuple_and_stores_it(master: Master, repo: Repo) -> None:
    with _serving(master, repo):
        route = _route(master, 6, force_queue=True)
        assert route.WhichOneof("route") == "queue"
        meta, data = make_tuple(route.tuple_ids[0], b"queued")
        meta.ticket = route.tickets[0]
        receipts = list(master.stub.Enqueue(frames_for_bytes(meta, data, SETTINGS.chunk_bytes), timeout=10))
        assert receipts[0].state == TupleReceipt.ENQUEUED
        wait_for(lambda: meta.tuple_id in repo.records(), timeout=20, what="the queued tuple's features")
        wait_for(
            lambda: (
                master.status().tuples_done >= 1
                and all(q.length == 0 and q.leased == 0 for q in master.status().queues)
            ),
            timeout=10,
            what="the lease acknowledged",
        )
        assert repo.records()[meta.tuple_id].features["size"].number == 6


def test_packed_stream_is_answered_with_packed_receipts(engine: RunningEngine, repo: Repo) -> None:
    from hio.transport.frames import TupleFrame, packed, unpacked_receipts

    singles = []
    for tuple_id in range(71, 91):
        meta, data = make_tuple(tuple_id, bytes([tuple_id]) * 50)
        singles.append(TupleFrame(meta=meta, data=data, last=True))
    message = packed(singles)
    assert len(message.packed) == 19
    answers = list(engine.stub.Deliver(iter([message]), timeout=30))
    receipts = [r for a in answers for r in unpacked_receipts(a)]
    assert len(answers) < len(receipts)  # several receipts per message
    assert [(r.index, r.tuple_id, r.state) for r in receipts] == [(i, 71 + i, TupleReceipt.STORED) for i in range(20)]
    assert sorted(repo.records()) == list(range(71, 91))
    plain = engine.deliver([make_tuple(95, b"plain"), make_tuple(96, b"plain")])
    assert [len(r.packed) for r in plain] == [0, 0]  # a sender that does not pack gets plain receipts


def test_storage_failure_with_the_input_still_open_frees_the_channel_once(repo: Repo) -> None:
    """The stream fails while the sender keeps its side open: no late hand-over, no second release."""
    engine = RunningEngine(
        engine_config(master=f"127.0.0.1:{free_port()}", repository=f"127.0.0.1:{free_port()}", rpc_deadline=0.5)
    )
    hold = threading.Event()

    def frames() -> Iterator:  # type: ignore[type-arg]
        meta, data = make_tuple(81, b"x")
        yield from frames_for_bytes(meta, data, 1 << 20)
        hold.wait(10)

    try:
        with pytest.raises(grpc.RpcError) as err:
            list(engine.stub.Deliver(frames(), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        hold.set()
        time.sleep(0.5)  # a late hand-over, if any, would have fired by now
        state = engine.engine
        assert (state._active, state._tails) == (None, 0)  # stop() waits for tails: none may be left
    finally:
        hold.set()
        engine.close()


def test_cheap_queued_tuples_are_pulled_several_at_a_time(master: Master, repo: Repo) -> None:
    engine = RunningEngine(
        engine_config(master=master.address, repository=repo.address, pull_batch_seconds=0.5)
    )  # big batches even on a loaded machine
    asked: list[int] = []
    link = engine.engine._cluster
    real_pull = link.pull

    def counted_pull(channel_id: str, wait_seconds: float, **sizes: int):  # type: ignore[no-untyped-def]
        asked.append(sizes.get("max_tuples", 1))
        return real_pull(channel_id, wait_seconds, **sizes)

    link.pull = counted_pull  # the real call, counted
    try:
        register_channel(master, engine)
        n = 300
        route = master.stub.RouteTuples(
            master_pb2.RouteTuplesRequest(
                source="test", image=TEST_IMAGE, items=[master_pb2.RouteItem(size=8)] * n, force_queue=True
            ),
            timeout=5,
        )
        tuples = []
        for k, (tuple_id, ticket) in enumerate(zip(route.tuple_ids, route.tickets, strict=True)):
            meta, data = make_tuple(tuple_id, f"tuple{k:03d}".encode(), **({"mode": "fail"} if k == 150 else {}))
            meta.ticket = ticket
            tuples.append((meta, data))
        frames = (f for meta, data in tuples for f in frames_for_bytes(meta, data, SETTINGS.chunk_bytes))
        receipts = list(master.stub.Enqueue(frames, timeout=30))
        assert [r.state for r in receipts] == [TupleReceipt.ENQUEUED] * n
        wait_for(lambda: len(repo.records()) == n - 1, timeout=60, what="every good tuple's features")
        wait_for(
            lambda: master.status().dead_letters == 1 and not master.status().queues,
            timeout=30,
            what="the failing tuple dead-lettered after its attempts, the queue empty",
        )
        records = repo.records()
        assert all(
            records[meta.tuple_id].features["name"].text == meta.name for k, (meta, _) in enumerate(tuples) if k != 150
        )
        assert max(asked) > 1 and len(asked) < n // 4, f"{len(asked)} pulls for {n} tuples"
    finally:
        engine.close()


def test_a_pull_that_turns_out_costly_returns_the_rest_to_the_queue_uncharged(master: Master, repo: Repo) -> None:
    """Batch size comes from the last tuples' cost: when the next ones cost more, the engine
    stops after about three times pull_batch_seconds and gives the rest back, not charged."""
    engine = RunningEngine(engine_config(master=master.address, repository=repo.address, pull_batch_seconds=0.5))
    try:
        register_channel(master, engine)

        def enqueue(count: int, **attributes: str) -> list[int]:
            route = master.stub.RouteTuples(
                master_pb2.RouteTuplesRequest(
                    source="test", image=TEST_IMAGE, items=[master_pb2.RouteItem(size=4)] * count, force_queue=True
                ),
                timeout=5,
            )
            tuples = []
            for tuple_id, ticket in zip(route.tuple_ids, route.tickets, strict=True):
                meta, data = make_tuple(tuple_id, b"data", **attributes)
                meta.ticket = ticket
                tuples.append((meta, data))
            frames = (f for meta, data in tuples for f in frames_for_bytes(meta, data, SETTINGS.chunk_bytes))
            assert all(r.state == TupleReceipt.ENQUEUED for r in master.stub.Enqueue(frames, timeout=30))
            return list(route.tuple_ids)

        cheap = enqueue(40)
        wait_for(lambda: len(repo.records()) == 40, timeout=30, what="the cheap tuples stored")
        # Hold the channel with a direct stream whose input stays open, so the slow tuples are
        # all queued before the engine pulls again: then it asks for them all at once.
        route = _route(master, 4)
        assert route.WhichOneof("route") == "channel"
        direct, _ = make_tuple(route.tuple_ids[0], b"data")
        direct.ticket = route.tickets[0]
        input_open = threading.Event()

        def held_frames() -> Iterator[Any]:
            yield from frames_for_bytes(direct, b"data", SETTINGS.chunk_bytes)
            input_open.wait(30)

        holder = threading.Thread(target=lambda: list(engine.stub.Deliver(held_frames(), timeout=60)))
        holder.start()
        wait_for(lambda: direct.tuple_id in repo.records(), timeout=30, what="the direct tuple stored")
        queue = master.domain.queue
        real_void, returned = queue.void_leases, []

        def recorded_void(channel_id: str, reason: str, *, charge: bool = True) -> list[int]:
            voided = real_void(channel_id, reason, charge=charge)
            returned.append((len(voided), charge))
            return voided

        queue.void_leases = recorded_void  # the real call, recorded
        # Batched as if cheap (any cheap cost under ~0.1 s gives at least 4), but 0.6 s each:
        # the pull stops after 3 of them (1.5 s) and gives the rest back.
        slow = enqueue(6, mode="sleep", seconds="0.6")
        input_open.set()
        holder.join(30)
        wait_for(lambda: len(repo.records()) == 47, timeout=30, what="the slow tuples stored")
        records = repo.records()
        assert [records[t].meta.attempt for t in cheap + slow] == [1] * 46, "nothing was charged"
        # a queued tuple's outcome reaches the master after its features are stored (within 50 ms)
        wait_for(lambda: not master.status().queues, timeout=10, what="the last pulled tuple reported")
        status = master.status()
        assert status.dead_letters == 0 and status.tuples_failed == 0 and not status.queues
        gave_back = [n for n, charge in returned if n]
        assert gave_back and all(charge is False for _, charge in returned), (
            f"the slow pull stopped early and gave tuples back uncharged: {returned}"
        )
    finally:
        engine.close()


def test_pulled_tuples_go_back_uncharged_while_the_repository_is_unreachable(master: Master) -> None:
    engine = RunningEngine(
        engine_config(master=master.address, repository=f"127.0.0.1:{free_port()}", rpc_deadline=0.5)
    )
    try:
        register_channel(master, engine)
        route = master.stub.RouteTuples(
            master_pb2.RouteTuplesRequest(
                source="test", image=TEST_IMAGE, items=[master_pb2.RouteItem(size=4)] * 3, force_queue=True
            ),
            timeout=5,
        )
        tuples = []
        for tuple_id, ticket in zip(route.tuple_ids, route.tickets, strict=True):
            meta, data = make_tuple(tuple_id, b"data")
            meta.ticket = ticket
            tuples.append((meta, data))
        frames = (f for meta, data in tuples for f in frames_for_bytes(meta, data, SETTINGS.chunk_bytes))
        assert all(r.state == TupleReceipt.ENQUEUED for r in master.stub.Enqueue(frames, timeout=30))
        time.sleep(4.0)  # several pulls, each failing to store after rpc_deadline
        status = master.status()
        assert (status.tuples_failed, status.dead_letters) == (0, 0), "not the tuples' fault: nothing charged"
        assert sum(q.length for q in status.queues) == 3, "all three still queued"
    finally:
        engine.close()
    wait_for(
        lambda: all(q.leased == 0 for q in master.status().queues),
        timeout=10,
        what="the stopped engine's pull given back",
    )
    pulled = master.stub.PullTuple(master_pb2.PullTupleRequest(channel_id="w1/0", wait_seconds=1), timeout=10)
    assert [f.meta.attempt for f in pulled if f.HasField("meta")] == [1]


def test_pulled_tuples_the_repository_cannot_store_are_not_pulled_again_at_once(
    master: Master, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A repository whose disk failed refuses at once (FAILED_PRECONDITION, until it
    restarts): the pulled tuple goes back uncharged, and the engine waits by the hint before
    it pulls and processes it again, instead of doing so in a loop."""
    import hio.worker.engine as engine_module

    repo_dir = tmp_path / "repo"
    real_fsync = os.fsync
    failing = threading.Event()

    def fsync(fd: int) -> None:  # the repository's disk fails once it is open; the master's does not
        if failing.is_set() and str(repo_dir) in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    repo = Repo(repo_dir, fsync="always")
    failing.set()
    try:
        with caplog.at_level(logging.WARNING, logger="hio.worker.engine"), _serving(master, repo):
            meta, data = _routed(master, b"data", force_queue=True)
            frames = frames_for_bytes(meta, data, SETTINGS.chunk_bytes)
            assert [r.state for r in master.stub.Enqueue(frames, timeout=30)] == [TupleReceipt.ENQUEUED]

            def refusals() -> int:
                return sum("cannot store features" in r.getMessage() for r in list(caplog.records))

            wait_for(lambda: refusals() >= 1, timeout=30, what="the first refused store")
            before = refusals()
            window = 3 * engine_module.ENGINE_STATE_RETRY
            time.sleep(window)
            again = refusals() - before
            status = master.status()
        # at most one pull per hint in the window (a loop refused over a thousand in it)
        assert again <= window / engine_module.ENGINE_STATE_RETRY + 1, f"pulled and refused {again} times"
        assert (status.tuples_failed, status.dead_letters) == (0, 0), "not the tuple's fault"
        assert sum(q.length for q in status.queues) == 1
    finally:
        repo.close()


def _enqueue_slow(master: Master, count: int, seconds: str) -> list[int]:
    """``count`` queued tuples whose processing sleeps ``seconds`` each; their ids."""
    tuples = [_routed(master, b"slow", force_queue=True, mode="sleep", seconds=seconds) for _ in range(count)]
    frames = (f for meta, data in tuples for f in frames_for_bytes(meta, data, SETTINGS.chunk_bytes))
    assert all(r.state == TupleReceipt.ENQUEUED for r in master.stub.Enqueue(frames, timeout=30))
    return [meta.tuple_id for meta, _ in tuples]


def _leased(master: Master) -> int:
    return sum(q.leased for q in master.status().queues)


def _most_leased_until_stored(master: Master, repo: Repo, count: int) -> int:
    """The most tuples leased at once, watched until ``count`` records are stored (30 s at most)."""
    most = 0
    deadline = time.monotonic() + 30
    while len(repo.records()) < count and time.monotonic() < deadline:
        most = max(most, _leased(master))
        time.sleep(0.05)
    return most


@pytest.mark.parametrize("pull_ahead", [True, False])
def test_a_busy_queue_channel_fetches_its_next_pull_while_it_processes(
    master: Master, repo: Repo, pull_ahead: bool
) -> None:
    """With ``pull_ahead`` the next queued tuple is in the engine before the current one is done;
    without, one at a time. Either way each is stored once, uncharged."""
    with _serving(master, repo, pull_ahead=pull_ahead):
        ids = _enqueue_slow(master, 3, "0.8")
        most = _most_leased_until_stored(master, repo, 3)
        records = repo.records()
        assert sorted(records) == sorted(ids) and [records[t].meta.attempt for t in ids] == [1, 1, 1]
        # ahead: the one processed and the next; a third for the moment the last one's outcome
        # is on its way to the master (its features are stored beside the processing)
        assert (2 <= most <= 3) if pull_ahead else most == 1, f"at most {most} tuples leased at once"
        wait_for(lambda: not master.status().queues, timeout=10, what="every queued tuple acknowledged")
        assert master.status().tuples_failed == 0


def test_tuples_longer_than_the_ahead_bound_are_not_pulled_ahead(
    master: Master, repo: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tuple held ahead waits for the one processed: behind a long one it would be kept from
    a channel that frees up meanwhile, so tuples known to take long are pulled one at a time."""
    import hio.worker.engine as engine_module

    monkeypatch.setattr(engine_module, "AHEAD_MAX_SECONDS", 0.2)
    with _serving(master, repo):
        ids = _enqueue_slow(master, 3, "0.5")
        most = _most_leased_until_stored(master, repo, 3)
        assert sorted(repo.records()) == sorted(ids) and most == 1


def test_a_pull_ahead_held_when_the_engine_stops_goes_back_uncharged(master: Master, repo: Repo) -> None:
    engine = RunningEngine(engine_config(master=master.address, repository=repo.address))
    try:
        register_channel(master, engine)
        # the first tuple's cost is not known yet: it comes alone; the third is pulled ahead beside the second
        first, second, held = _enqueue_slow(master, 3, "0.5")
        wait_for(
            lambda: _leased(master) == 2 and first in repo.records(),
            timeout=20,
            interval=0.02,
            what="the third tuple pulled ahead while the second is processed",
        )
    finally:
        engine.close()  # the second tuple finishes within the grace; the held one goes back
    wait_for(lambda: _leased(master) == 0, timeout=10, what="the held pull given back")
    assert second in repo.records() and held not in repo.records()
    pulled = master.stub.PullTuple(master_pb2.PullTupleRequest(channel_id="w1/0", wait_seconds=1), timeout=10)
    metas = [f.meta for f in pulled if f.HasField("meta")]
    assert [(m.tuple_id, m.attempt) for m in metas] == [(held, 1)], "given back at the head, not charged"


def test_a_repository_whose_disk_failed_is_the_engine_s_state_so_its_sender_retries_uncharged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repository refuses records after a failed fsync (FAILED_PRECONDITION, until it
    restarts). That is the repository's state, not the tuple's: the stream ends UNAVAILABLE
    with a retry hint, as when the repository is unreachable, so a gateway holds the tuple
    and routes it again later without charging an attempt (it would become a dead letter)."""
    from hio.transport.errors import retry_after

    disk = FsyncDisk(monkeypatch)
    repo = Repo(tmp_path / "repo", fsync="always")
    engine = RunningEngine(engine_config(master=f"127.0.0.1:{free_port()}", repository=repo.address))
    try:
        disk.error = OSError(errno.EIO, "Input/output error")
        with pytest.raises(grpc.RpcError) as err:
            engine.deliver([make_tuple(71, b"x")])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert retry_after(err.value) is not None
        assert "repository refuses records" in err.value.details()
        assert "disk failed to sync" in err.value.details()
    finally:
        engine.close()
        repo.close()


def test_a_failed_tuple_the_master_cannot_take_back_fails_alone_and_the_stream_goes_on(
    repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tuple whose processing failed goes back to the master's queue; when that queue takes
    no tuples (its disk failed to sync), the tuple fails to its sender with both reasons (the
    sender counts the attempt and sends it again) and the tuples after it in the stream are
    processed: the stream does not break, so the sender charges no attempt to the others."""
    disk = FsyncDisk(monkeypatch)
    master = Master(tmp_path / "master", fsync="batch")
    try:
        route = master.stub.RouteTuples(
            master_pb2.RouteTuplesRequest(  # an image no engine here pulls
                source="test", image="hio/synthetic", items=[master_pb2.RouteItem(size=1)] * 2, force_queue=True
            ),
            timeout=5,
        )
        for n, tuple_id in enumerate(route.tuple_ids):
            if n == 1:  # the first opened a segment
                disk.error = OSError(errno.EIO, "Input/output error")
            queued, queued_data = make_tuple(tuple_id, b"q", image="hio/synthetic")
            [receipt] = master.stub.Enqueue(frames_for_bytes(queued, queued_data, SETTINGS.chunk_bytes), timeout=10)
            assert receipt.state == TupleReceipt.ENQUEUED  # 'batch': before its round
        wait_for(
            lambda: [w for w in master.status().warnings if "failed to sync" in w],
            timeout=10,
            what="the master's failed fsync",
        )
        disk.error = None
        with _serving(master, repo) as engine:  # default rpc_deadline: no wait
            failing, failing_data = _routed(master, b"oops", mode="fail")
            ok, ok_data = _routed(master, b"fine")
            first, second = engine.deliver([(failing, failing_data), (ok, ok_data)])
            assert first.state == TupleReceipt.FAILED
            assert "ValueError: cannot analyse" in first.message
            assert "the backlog's disk failed to sync" in first.message
            assert second.state == TupleReceipt.STORED and ok.tuple_id in repo.records()
    finally:
        master.close()
