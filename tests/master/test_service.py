"""The Master service over real gRPC on loopback (in-process server on port 0)."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import grpc
import pytest

from hio.gateway import Gateway
from hio.proto import master_pb2, master_pb2_grpc
from hio.settings import ClusterSettings
from hio.storage import files
from hio.transport.errors import retry_after
from hio.transport.frames import TupleFrame, TupleReceipt
from hio.transport.net import create_channel
from tests.harness import FsyncDisk, free_port, health_of, wait_for
from tests.master.helpers import frames, pull, register, report, route, running_master

IMAGE = "hio/synthetic"


def enqueue(stub: master_pb2_grpc.MasterStub, stream: list) -> list[TupleReceipt]:  # type: ignore[type-arg]
    return list(stub.Enqueue(iter(stream), timeout=10))


def status(stub: master_pb2_grpc.MasterStub) -> master_pb2.GetStatusResponse:
    return stub.GetStatus(master_pb2.GetStatusRequest(), timeout=5)


def test_route_direct_then_queue_and_enqueue_receipts(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        a = register(m.stub, "wa")[0]
        b = register(m.stub, "wb")[0]
        first, second = route(m.stub, [10]), route(m.stub, [10])
        assert {first.channel.channel_id, second.channel.channel_id} == {a, b}
        assert first.channel.reservation_seconds == m.config.reservation_seconds
        third = route(m.stub, [10, 20])
        assert third.WhichOneof("route") == "queue" and len(third.tuple_ids) == 2
        stream = frames(third.tuple_ids[0], b"a" * 10) + frames(third.tuple_ids[1], b"b" * 20)
        receipts = enqueue(m.stub, stream)
        assert [(r.index, r.tuple_id, r.state) for r in receipts] == [
            (0, third.tuple_ids[0], TupleReceipt.ENQUEUED),
            (1, third.tuple_ids[1], TupleReceipt.ENQUEUED),
        ]
        again = enqueue(m.stub, frames(third.tuple_ids[0], b"a" * 10))  # duplicate: idempotent
        assert again[0].state == TupleReceipt.ENQUEUED and "already" in again[0].message
        st = status(m.stub)
        assert st.routed_direct == 2 and st.routed_queue == 2 and st.last_tuple_id == 4
        assert st.bytes_routed_direct == 20, "the payload of the direct routes, which never reaches the master"
        assert st.bytes_enqueued == 40, "every payload the master received, the duplicate's too"
        assert [(q.image, q.length, q.bytes, q.leased) for q in st.queues] == [(IMAGE, 2, 30, 0)]
        assert st.channels_busy == 2 and st.channels_free == 0 and st.queue_bytes_limit == m.config.queue_bytes


def test_enqueue_refusals_store_nothing(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        ids = list(route(m.stub, [1000, 1000], force_queue=True).tuple_ids)
        corrupt = frames(ids[0], b"x" * 1000)
        corrupt[0].meta.crc32 ^= 0xFF
        with pytest.raises(grpc.RpcError) as err:
            enqueue(m.stub, corrupt)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and str(ids[0]) in err.value.details()
        truncated = frames(ids[1], b"y" * 1000, chunk=100)[:-1]
        with pytest.raises(grpc.RpcError) as err:
            enqueue(m.stub, truncated)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        for tuple_id, code in [(0, grpc.StatusCode.INVALID_ARGUMENT), (999, grpc.StatusCode.INVALID_ARGUMENT)]:
            with pytest.raises(grpc.RpcError) as err:
                enqueue(m.stub, frames(tuple_id, b"z"))
            assert err.value.code() == code
        with pytest.raises(grpc.RpcError) as err:
            enqueue(m.stub, frames(ids[0], b"z", image="no/such"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert status(m.stub).queues == []
        assert enqueue(m.stub, frames(ids[0], b"x" * 1000))[0].state == TupleReceipt.ENQUEUED


def test_queue_full_is_resource_exhausted_with_hint(tmp_path: Path) -> None:
    with running_master(tmp_path, queue_bytes=1500) as m:
        ids = list(route(m.stub, [1000, 1000], force_queue=True).tuple_ids)
        enqueue(m.stub, frames(ids[0], b"x" * 1000))
        with pytest.raises(grpc.RpcError) as err:
            enqueue(m.stub, frames(ids[1], b"y" * 1000))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1000 of 1500 bytes" in err.value.details() and retry_after(err.value) == pytest.approx(1.0)


def test_pull_long_poll_wakes_on_enqueue(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        ch = register(m.stub, "w1")[0]
        got: dict[str, object] = {}

        def poll() -> None:
            start = time.monotonic()
            got["result"] = pull(m.stub, ch, wait=10)
            got["took"] = time.monotonic() - start

        thread = threading.Thread(target=poll)
        thread.start()
        time.sleep(0.3)
        tuple_id = route(m.stub, [5], force_queue=True).tuple_ids[0]
        enqueue(m.stub, frames(tuple_id, b"hello"))
        thread.join(10)
        meta, data = got["result"]  # type: ignore[misc]
        assert meta.tuple_id == tuple_id and data == b"hello" and got["took"] < 5  # type: ignore[operator]
        st = status(m.stub)
        assert st.queues[0].leased == 1 and st.workers[0].channels[0].state == master_pb2.QUEUE
        with pytest.raises(grpc.RpcError) as err:
            pull(m.stub, "nobody/0")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            pull(m.stub, ch, wait=31)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_pull_times_out_empty_and_keeps_waiting_while_the_channel_is_routed_direct(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        ch = register(m.stub, "w1")[0]
        start = time.monotonic()
        assert pull(m.stub, ch, wait=0.3) == (None, b"")
        assert time.monotonic() - start >= 0.25
        got: dict[str, object] = {}
        thread = threading.Thread(target=lambda: got.update(r=pull(m.stub, ch, wait=10)))
        thread.start()
        time.sleep(0.3)
        direct = route(m.stub, [5])
        assert direct.channel.channel_id == ch
        queued = route(m.stub, [3], force_queue=True).tuple_ids[0]
        enqueue(m.stub, frames(queued, b"abc"))
        thread.join(0.5)
        assert thread.is_alive(), "a reserved channel leases nothing, and its pull waits on"
        assert report(m.stub, ch, direct.tuple_ids[0], from_queue=False), "released: the queue has work"
        thread.join(5)
        meta, data = got["r"]  # type: ignore[misc]
        assert (meta.tuple_id, data) == (queued, b"abc"), "the same pull leases it once the stream released"


def test_fifo_drain_with_reports(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        ids = list(route(m.stub, [3] * 5, force_queue=True).tuple_ids)
        stream = [f for t in ids for f in frames(t, str(t).encode().rjust(3, b"0"))]
        enqueue(m.stub, stream)
        ch = register(m.stub, "w1")[0]
        order = []
        while True:
            meta, data = pull(m.stub, ch)
            if meta is None:
                break
            order.append(meta.tuple_id)
            assert data == str(meta.tuple_id).encode().rjust(3, b"0")
            more = report(m.stub, ch, meta.tuple_id, size=3)
            assert more == (len(order) < len(ids))
        assert order == ids
        st = status(m.stub)
        assert st.tuples_done == 5 and st.bytes_done == 15 and st.queues == [] and st.tuples_per_second > 0
        assert st.workers[0].channels[0].tuples_done == 5 and st.channels_free == 1
        assert (st.workers[0].channels[0].bytes_pulled, st.workers[0].channels[0].bytes_direct) == (15, 0)


def test_lease_expiry_redelivers_to_another_channel(tmp_path: Path) -> None:
    with running_master(tmp_path, lease_seconds=0.5) as m:
        a, b = register(m.stub, "w1", n=2)
        tuple_id = route(m.stub, [4], force_queue=True).tuple_ids[0]
        enqueue(m.stub, frames(tuple_id, b"data"))
        meta, _ = pull(m.stub, a)
        assert meta is not None and meta.attempt == 1
        meta2, data = pull(m.stub, b, wait=5)  # wakes when a's lease expires
        assert meta2 is not None and (meta2.tuple_id, meta2.attempt, data) == (tuple_id, 2, b"data")


def test_cancelled_pull_voids_the_lease(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        tuple_id = route(m.stub, [4_000_000], force_queue=True).tuple_ids[0]
        enqueue(m.stub, frames(tuple_id, b"q" * 4_000_000, chunk=16 * 1024))
        ch = register(m.stub, "w1")[0]  # after the slow part: no heartbeats here
        call = m.stub.PullTuple(master_pb2.PullTupleRequest(channel_id=ch, wait_seconds=1), timeout=10)
        assert next(call).meta.tuple_id == tuple_id
        call.cancel()
        wait_for(lambda: status(m.stub).queues[0].leased == 0, timeout=20, what="lease voided")
        meta, data = pull(m.stub, ch)
        assert meta is not None and meta.attempt == 2 and len(data) == 4_000_000


def test_a_pull_whose_caller_has_gone_takes_nothing_and_charges_nothing(tmp_path: Path) -> None:
    """A waiting pull whose engine died (or gave up) is still blocked in the master; the next
    tuple queued must not be leased to it and charged (found killing a container mid-tuple)."""

    def waiting_pulls() -> int:
        with m.master.lock:
            return m.master._waiters  # type: ignore[attr-defined]

    with running_master(tmp_path) as m:
        ch = register(m.stub, "w1")[0]
        ghost = m.stub.PullTuple(master_pb2.PullTupleRequest(channel_id=ch, wait_seconds=10), timeout=30)
        wait_for(lambda: waiting_pulls() == 1, timeout=10, interval=0.01, what="the pull waiting in the master")
        ghost.cancel()  # its handler stays blocked in the master until something wakes it
        tuple_id = route(m.stub, [3], force_queue=True).tuple_ids[0]
        enqueue(m.stub, frames(tuple_id, b"abc"))
        wait_for(
            lambda: waiting_pulls() == 0,
            timeout=10,
            interval=0.01,
            what="the ghost's handler to wake for the tuple and leave",
        )
        st = status(m.stub)
        assert (st.queues[0].length, st.queues[0].leased) == (1, 0), "still queued, leased to no one"
        meta, data = pull(m.stub, ch)
        assert meta is not None and (meta.tuple_id, meta.attempt, data) == (tuple_id, 1, b"abc"), "not charged"


def test_dead_letters_list_and_retry(tmp_path: Path) -> None:
    with running_master(tmp_path, max_attempts=2) as m:
        ch = register(m.stub, "w1")[0]
        tuple_id = route(m.stub, [3], force_queue=True).tuple_ids[0]
        enqueue(m.stub, frames(tuple_id, b"bad"))
        for attempt in (1, 2):
            meta, _ = pull(m.stub, ch)
            assert meta is not None and meta.attempt == attempt
            report(m.stub, ch, tuple_id, ok=False, message=f"boom {attempt}")
        listed = m.stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=5).dead_letters
        assert len(listed) == 1 and listed[0].meta.tuple_id == tuple_id and "boom 2" in listed[0].reason
        assert listed[0].failed_unix > time.time() - 60
        st = status(m.stub)
        assert st.dead_letters == 1 and st.tuples_failed == 2 and any("dead letters" in w for w in st.warnings)
        m.stub.RetryDeadLetter(master_pb2.RetryDeadLetterRequest(tuple_id=tuple_id), timeout=5)
        meta, data = pull(m.stub, ch)
        assert meta is not None and (meta.tuple_id, meta.attempt, data) == (tuple_id, 1, b"bad")
        with pytest.raises(grpc.RpcError) as err:
            m.stub.RetryDeadLetter(master_pb2.RetryDeadLetterRequest(tuple_id=12345), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_direct_failure_handed_to_master_goes_dead_when_exhausted(tmp_path: Path) -> None:
    with running_master(tmp_path, max_attempts=3) as m:
        tuple_id = route(m.stub, [3]).tuple_ids[0]
        stream = frames(tuple_id, b"bad", attributes={"hio.last_error": "segfault in process()"})
        stream[0].meta.attempt = 4
        (receipt,) = enqueue(m.stub, stream)
        assert receipt.state == TupleReceipt.ENQUEUED
        (letter,) = m.stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=5).dead_letters
        assert letter.reason == "segfault in process()" and status(m.stub).queues == []


def test_heartbeat_and_register_over_grpc(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        reply = m.stub.RegisterWorker(
            master_pb2.RegisterWorkerRequest(
                worker_id="w1",
                host="h",
                cpus=2,
                channels=[
                    master_pb2.ChannelInfo(channel_id="w1/0", image=IMAGE, address="127.0.0.1:1"),
                    master_pb2.ChannelInfo(
                        channel_id="w1/1", image=IMAGE, address="127.0.0.1:2", state=master_pb2.DOWN, detail="starting"
                    ),
                ],
            ),
            timeout=5,
        )
        assert reply.heartbeat_interval_seconds == 1.0 and reply.expiry_seconds == 6.0
        st = status(m.stub)
        assert (st.channels_free, st.channels_down) == (1, 1) and st.workers[0].host == "h"
        hb = m.stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w1"), timeout=5)
        assert hb.known and status(m.stub).channels_free == 2
        assert not m.stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="ghost"), timeout=5).known
        with pytest.raises(grpc.RpcError) as err:
            m.stub.RegisterWorker(master_pb2.RegisterWorkerRequest(worker_id=""), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            route(m.stub, [1], image="no/such")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_roles_are_enforced(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-worker worker w\ntok-admin admin ops\n")
    with running_master(tmp_path, tokens_file=str(tokens), token="tok-worker") as m:
        register(m.stub, "w1")
        with pytest.raises(grpc.RpcError) as err:
            m.stub.RetryDeadLetter(master_pb2.RetryDeadLetterRequest(tuple_id=1), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with create_channel(f"127.0.0.1:{m.port}", ClusterSettings(), token="tok-admin") as channel:
            admin = master_pb2_grpc.MasterStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                admin.RetryDeadLetter(master_pb2.RetryDeadLetterRequest(tuple_id=1), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with create_channel(f"127.0.0.1:{m.port}", ClusterSettings(), token="") as channel:
            with pytest.raises(grpc.RpcError) as err:
                master_pb2_grpc.MasterStub(channel).GetStatus(master_pb2.GetStatusRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_packed_tuples_are_queued_each_and_pulled_alone(tmp_path: Path) -> None:
    from hio.transport.frames import packed

    with running_master(tmp_path) as m:
        ch = register(m.stub, "w1")[0]
        ids = list(route(m.stub, [5, 5, 5], force_queue=True).tuple_ids)
        singles = [frames(tuple_id, f"tup{n}-".encode()) for n, tuple_id in enumerate(ids)]
        receipts = enqueue(m.stub, [packed([frame for (frame,) in singles])])
        assert [(r.index, r.tuple_id, r.state) for r in receipts] == [
            (n, tuple_id, TupleReceipt.ENQUEUED) for n, tuple_id in enumerate(ids)
        ]
        assert status(m.stub).queues[0].length == 3
        meta, data = pull(m.stub, ch)
        assert meta is not None and meta.tuple_id == ids[0] and data == b"tup0-"


def _pull_many(
    stub: master_pb2_grpc.MasterStub, channel_id: str, max_tuples: int, max_bytes: int
) -> tuple[list[TupleFrame], list[tuple[int, bytes]], list[int]]:
    """One PullTuple asking for several tuples: the raw messages, (id, payload) of each, their attempts."""
    from hio.transport.frames import FrameReader

    request = master_pb2.PullTupleRequest(
        channel_id=channel_id, wait_seconds=0, max_tuples=max_tuples, max_bytes=max_bytes
    )
    messages = list(stub.PullTuple(request, timeout=10))
    reader = FrameReader(iter(messages), max_tuple_bytes=1 << 30, max_chunk_bytes=1 << 30)
    tuples, attempts = [], []
    while (item := reader.next_tuple_bytes()) is not None:
        tuples.append((item[0].tuple_id, item[1]))
        attempts.append(item[0].attempt)
    return messages, tuples, attempts


def test_pull_brings_the_first_tuples_in_order_within_count_and_bytes(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        ch = register(m.stub, "w1")[0]
        ids = list(route(m.stub, [100] * 10 + [5_000] + [100] * 3, force_queue=True).tuple_ids)
        payloads = {t: bytes([n]) * (5_000 if n == 10 else 100) for n, t in enumerate(ids)}
        enqueue(m.stub, [f for t in ids for f in frames(t, payloads[t])])
        messages, tuples, _ = _pull_many(m.stub, ch, max_tuples=4, max_bytes=1 << 20)
        assert tuples == [(t, payloads[t]) for t in ids[:4]], "the head and the next three, in order"
        assert len(messages) == 1 and len(messages[0].packed) == 3, "small tuples travel packed"
        assert status(m.stub).queues[0].leased == 4
        _, tuples, _ = _pull_many(m.stub, ch, max_tuples=100, max_bytes=700)
        assert [t for t, _ in tuples] == ids[4:10], "bytes after the head bound the pull (6 x 100 <= 700)"
        _, tuples, _ = _pull_many(m.stub, ch, max_tuples=100, max_bytes=700)
        assert [t for t, _ in tuples] == [ids[10]], "a head over max_bytes still comes, alone"
        _, tuples, _ = _pull_many(m.stub, ch, max_tuples=0, max_bytes=0)
        assert [t for t, _ in tuples] == [ids[11]], "0 asks for one tuple"
        for bad, text in (({"max_tuples": 5000}, "max_tuples"), ({"max_bytes": 1 << 40}, "max_bytes")):
            with pytest.raises(grpc.RpcError) as err:
                list(m.stub.PullTuple(master_pb2.PullTupleRequest(channel_id=ch, **bad), timeout=5))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()


def test_pull_done_sends_unreported_pulled_tuples_back_to_the_head_in_order_uncharged(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        ch = register(m.stub, "w1")[0]
        ids = list(route(m.stub, [3] * 5, force_queue=True).tuple_ids)
        enqueue(m.stub, [f for t in ids for f in frames(t, b"abc")])
        _, tuples, _ = _pull_many(m.stub, ch, max_tuples=3, max_bytes=1 << 20)
        assert [t for t, _ in tuples] == ids[:3]
        # A Deliver stream's release (say one that raced the pull) leaves the pull alone.
        report(m.stub, ch, ids[1], size=3)
        assert status(m.stub).queues[0].leased == 2, "a release without pull_done returns nothing"
        # The channel stops after the second tuple: it ends the pull, the rest goes back.
        reply = m.stub.ReportTuples(
            master_pb2.ReportTuplesRequest(channel_id=ch, release=True, pull_done=True), timeout=5
        )
        assert reply.pull_queue, "work is waiting: pull next"
        queue = status(m.stub).queues[0]
        assert (queue.length, queue.leased) == (4, 0), "nothing stays leased to a channel done with its pull"
        _, tuples, attempts = _pull_many(m.stub, ch, max_tuples=10, max_bytes=1 << 20)
        assert [t for t, _ in tuples] == [ids[0], ids[2], ids[3], ids[4]], "back at the head, in their order"
        assert attempts == [1, 1, 1, 1], "returned unprocessed: not a failed delivery"
        for tuple_id in (ids[0], ids[2], ids[3], ids[4]):
            report(m.stub, ch, tuple_id, size=3, release=False)
        assert status(m.stub).tuples_done == 5


def test_tuples_delivered_before_are_pulled_alone(tmp_path: Path) -> None:
    """A batch whose channel went down is charged; each of its tuples then travels alone, so a
    tuple that kills its engine cannot take its batch-mates to the dead letters with it."""
    with running_master(tmp_path, max_attempts=3) as m:
        ch = register(m.stub, "w1")[0]
        ids = list(route(m.stub, [3] * 4, force_queue=True).tuple_ids)
        enqueue(m.stub, [f for t in ids for f in frames(t, b"abc")])
        _, tuples, _ = _pull_many(m.stub, ch, max_tuples=10, max_bytes=1 << 20)
        assert [t for t, _ in tuples] == ids
        m.stub.Heartbeat(
            master_pb2.HeartbeatRequest(
                worker_id="w1",
                channels=[master_pb2.ChannelInfo(channel_id=ch, state=master_pb2.DOWN, detail="engine exited")],
            ),
            timeout=5,
        )
        m.stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w1"), timeout=5)
        for expected in ids:
            _, tuples, attempts = _pull_many(m.stub, ch, max_tuples=10, max_bytes=1 << 20)
            assert ([t for t, _ in tuples], attempts) == ([expected], [2])
            report(m.stub, ch, expected, size=3)


def test_cancelled_batch_pull_voids_every_lease_in_order(tmp_path: Path) -> None:
    with running_master(tmp_path) as m:
        ids = list(route(m.stub, [2_000_000] * 3, force_queue=True).tuple_ids)
        enqueue(m.stub, [f for t in ids for f in frames(t, bytes([t % 251]) * 2_000_000, chunk=16 * 1024)])
        ch = register(m.stub, "w1")[0]  # after the slow part: no heartbeats here
        request = master_pb2.PullTupleRequest(channel_id=ch, wait_seconds=1, max_tuples=3, max_bytes=8_000_000)
        call = m.stub.PullTuple(request, timeout=10)
        assert next(call).meta.tuple_id == ids[0]
        call.cancel()
        wait_for(lambda: status(m.stub).queues[0].leased == 0, timeout=5, what="leases voided")
        got: list[int] = []
        charged: list[int] = []
        while len(got) < 3:  # back at the head in order; those the stream had started are charged
            _, tuples, attempts = _pull_many(m.stub, ch, max_tuples=3, max_bytes=8_000_000)
            got += [t for t, _ in tuples]
            charged += attempts
            for t, _ in tuples:
                report(m.stub, ch, t, size=2_000_000)
        assert got == ids
        assert charged[0] == 2 and charged == sorted(charged, reverse=True), charged


def test_a_backlog_whose_fsync_failed_refuses_tuples_with_a_hint_until_the_master_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed fsync the master's queue takes no new tuple (a later fsync can report
    success for bytes the failed one lost): Enqueue is FAILED_PRECONDITION with a retry hint and
    the reason, and the status says so. A gateway told so keeps its tuples, counts no
    attempt and does not call the master unreachable; what was queued before is still
    handed out; once the master is restarted the gateway's tuple is queued."""
    monkeypatch.setattr(files, "FAILED_DISK_RETRY_SECONDS", 0.5)
    disk = FsyncDisk(monkeypatch)
    listen = f"127.0.0.1:{free_port()}"
    with running_master(tmp_path, fsync="batch", listen=listen) as m:
        ids = list(route(m.stub, [100] * 3, force_queue=True).tuple_ids)  # the id block is reserved now
        assert enqueue(m.stub, frames(ids[0], b"x" * 100))[0].state == TupleReceipt.ENQUEUED  # a segment now
        disk.error = OSError(errno.EIO, "Input/output error")
        assert enqueue(m.stub, frames(ids[1], b"w" * 100))[0].state == TupleReceipt.ENQUEUED  # before its round
        failure = wait_for(
            lambda: [w for w in status(m.stub).warnings if "failed to sync" in w],
            timeout=10,
            what="the failed fsync in the master's status",
        )
        assert "Input/output error" in failure[0] and "restart the master" in failure[0]
        address = f"127.0.0.1:{m.port}"
        wait_for(lambda: health_of(address) == "NOT_SERVING", timeout=5, what="the master no longer ready")
        assert health_of(address, "hio.proto.Master") == "NOT_SERVING" and health_of(address, "liveness") == "SERVING"
        assert m.master.metrics is not None
        assert m.master.metrics.registry.get_sample_value("hio_master_queue_sync_failed") == 1  # what alerts watch
        disk.error = None  # the disk "syncs" again: refused all the same
        with pytest.raises(grpc.RpcError) as err:
            enqueue(m.stub, frames(ids[2], b"y" * 100))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and retry_after(err.value) == pytest.approx(0.5)
        assert "the backlog's disk failed to sync" in err.value.details()
        gw = Gateway(
            master_address=listen,
            data_dir=str(tmp_path / "gw"),
            source="lab",
            image=IMAGE,
            force_queue=True,
            spool_fsync="never",
        )
        try:
            future = gw.submit(b"z" * 100, name="z.bin")
            routed = status(m.stub).routed_queue
            wait_for(
                lambda: status(m.stub).routed_queue >= routed + 3,
                timeout=20,
                what="the gateway routing its tuple again after each refusal",
            )
            assert not future.done()
            st = gw.status()
            assert st.retries == 0 and st.master_unreachable_seconds == 0 and st.spooled_tuples == 1
            assert [w for w in st.warnings() if "the master's queue takes no tuples" in w and "restart the master" in w]
            assert [e.meta.attempt for e in gw.spool.entries()] == [1]
            channel = register(m.stub, "wa")[0]
            for tuple_id, payload in ((ids[0], b"x" * 100), (ids[1], b"w" * 100)):
                meta, data = pull(m.stub, channel)  # what was queued before is still handed out
                assert meta is not None and meta.tuple_id == tuple_id and data == payload
                report(m.stub, channel, tuple_id)
        except BaseException:
            gw.close()
            raise
    with running_master(tmp_path, fsync="batch", listen=listen) as m:
        try:
            assert gw.result(future, timeout=30) > 0  # the restarted master queued it
            assert [q.length for q in status(m.stub).queues] == [1]
            assert m.master.metrics is not None
            assert m.master.metrics.registry.get_sample_value("hio_master_queue_sync_failed") == 0
        finally:
            gw.close()
