"""Routing decisions, channel states and expiry, on the Master domain object (no network)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hio.config import ConfigError
from hio.master.config import MasterConfig
from hio.master.core import Master
from hio.master.registry import ChannelState
from hio.proto.master_pb2 import ChannelInfo, QueueRoute, RouteItem, RouteTuplesResponse
from hio.proto.master_pb2 import ChannelRoute as DirectRoute
from hio.proto.master_pb2 import TupleOutcome as Outcome
from hio.transport.errors import InvalidArgument, NotFound
from tests.harness import wait_for
from tests.master.helpers import frames

IMAGE = "hio/synthetic"


def add_worker(master: Master, worker_id: str, n: int = 1, image: str = IMAGE) -> list[str]:
    specs = [ChannelInfo(channel_id=f"{worker_id}/{i}", image=image, address=f"127.0.0.1:{6000 + i}") for i in range(n)]
    master.register_worker(worker_id, "host", n, specs)
    return [s.channel_id for s in specs]


def route(master: Master, n: int = 1, **kw: object):  # type: ignore[no-untyped-def]
    return master.route(
        source="t",
        image=kw.pop("image", IMAGE),
        items=[RouteItem(size=10)] * n,  # type: ignore[arg-type]
        **kw,
    )  # type: ignore[arg-type]


def route_of(reply: RouteTuplesResponse) -> DirectRoute | QueueRoute:
    """The route a RouteTuples answer holds: a channel, or the queue."""
    return getattr(reply, reply.WhichOneof("route"))  # type: ignore[no-any-return] - one of the two


def enqueue(master: Master, tuple_id: int, image: str = IMAGE) -> None:
    list(master.enqueue(frames(tuple_id, b"x" * 10, image)))


def state(master: Master, channel_id: str) -> ChannelState:
    channel = master.registry.channel(channel_id)
    assert channel is not None
    return channel.state


def test_free_channel_gets_direct_route_and_is_reserved(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    (ch,) = add_worker(master, "w1")
    routed = route(master, 3)
    assert routed.tuple_ids == [1, 2, 3] and routed.tickets == [b"", b"", b""]
    assert isinstance(route_of(routed), DirectRoute) and route_of(routed).channel_id == ch
    assert state(master, ch) == ChannelState.DIRECT
    second = route(master)  # no FREE channel left
    assert isinstance(route_of(second), QueueRoute) and second.tuple_ids == [4]
    assert master.stats.routed_direct == 3 and master.stats.routed_queue == 1


def two_workers_both_routed(master: Master) -> tuple[str, str]:
    """Two one-channel workers, each given one route, in the order they were chosen."""
    a = add_worker(master, "wa")[0]
    b = add_worker(master, "wb")[0]
    first, second = route_of(route(master)), route_of(route(master))
    assert {first.channel_id, second.channel_id} == {a, b}  # type: ignore[union-attr]
    return first.channel_id, second.channel_id  # type: ignore[union-attr]


def test_least_recently_used_channel_spreads_load(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    first, second = two_workers_both_routed(master)
    master.report(first, [], release=True)
    master.report(second, [], release=True)
    assert route_of(route(master)).channel_id == first  # type: ignore[union-attr]


def test_channel_still_processing_its_last_tuple_is_chosen_last(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    a, b = two_workers_both_routed(master)
    master.report(a, [], release=True, processing=True)  # handed over, last tuple still in progress
    master.report(b, [], release=True)  # idle
    assert route_of(route(master)).channel_id == b  # type: ignore[union-attr]  # though a is least recently used
    assert route_of(route(master)).channel_id == a  # type: ignore[union-attr]  # still taken when it is all there is
    master.report(a, [], release=True, processing=True)
    master.report(b, [], release=True, processing=True)
    master.report(a, [], release=False, processing=False)  # a's last tuple ended
    assert route_of(route(master)).channel_id == a  # type: ignore[union-attr]


def test_nonempty_queue_routes_to_queue(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    routed = route(master)  # no channel at all: queue
    assert isinstance(route_of(routed), QueueRoute) and route_of(routed).queue_length == 0
    enqueue(master, routed.tuple_ids[0])
    add_worker(master, "w1")
    later = route(master)
    assert isinstance(route_of(later), QueueRoute) and route_of(later).queue_length == 1


def test_pending_enqueue_routes_to_queue_until_it_arrives(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    ch = add_worker(master, "w1")[0]
    forced = route(master, force_queue=True)
    assert isinstance(route_of(forced), QueueRoute)
    behind = route(master)  # the forced tuple is still on its way
    assert isinstance(route_of(behind), QueueRoute) and route_of(behind).queue_length == 1
    for tuple_id in [*forced.tuple_ids, *behind.tuple_ids]:
        enqueue(master, tuple_id)
    for tuple_id in [*forced.tuple_ids, *behind.tuple_ids]:
        pulled = master.pull(ch, 0)
        assert pulled is not None and pulled.lease.tuple_id == tuple_id
        master.report(ch, [Outcome(tuple_id=tuple_id, ok=True, from_queue=True)], release=True)
    assert isinstance(route_of(route(master)), DirectRoute)


def test_pending_enqueue_expires(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master(reservation_seconds=0.5)
    add_worker(master, "w1")
    route(master, force_queue=True)  # its sender never enqueues it
    assert isinstance(route_of(route(master)), QueueRoute)
    time.sleep(0.55)
    assert isinstance(route_of(route(master)), DirectRoute)


def test_release_with_waiting_queue_answers_pull(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    ch = add_worker(master, "w1")[0]
    direct = route(master)
    assert isinstance(route_of(direct), DirectRoute)
    queued = route(master)
    enqueue(master, queued.tuple_ids[0])
    assert master.report(ch, [Outcome(tuple_id=direct.tuple_ids[0], ok=True, size=10)], release=True)
    assert state(master, ch) == ChannelState.QUEUE
    pulled = master.pull(ch, 0)
    assert pulled is not None and pulled.lease.tuple_id == queued.tuple_ids[0]
    assert not master.report(ch, [Outcome(tuple_id=queued.tuple_ids[0], ok=True, from_queue=True)], release=True)
    assert state(master, ch) == ChannelState.FREE
    assert master.queue.length() == 0 and master.stats.tuples_done == 2
    assert master.registry.channel(ch).tuples_done == 2  # type: ignore[union-attr]


def test_unknown_image_and_bad_requests(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    with pytest.raises(NotFound, match="no/such"):
        route(master, image="no/such")
    add_worker(master, "w1", image="lab/custom")
    assert route(master, image="lab/custom").tuple_ids == [1]  # offered by a worker: accepted
    with pytest.raises(InvalidArgument, match="never issued"):
        master.route(source="t", image=IMAGE, items=[RouteItem(size=1, tuple_id=99)])
    with pytest.raises(InvalidArgument, match="1 to 10000"):
        master.route(source="t", image=IMAGE, items=[])
    with pytest.raises(InvalidArgument, match="max_tuple_bytes"):
        master.route(source="t", image=IMAGE, items=[RouteItem(size=2**40)])
    with pytest.raises(InvalidArgument, match="image must not be empty"):
        master.route(source="t", image="", items=[RouteItem(size=1)])
    kept = master.route(source="t", image=IMAGE, items=[RouteItem(size=1, tuple_id=1), RouteItem(size=1)])
    assert kept.tuple_ids == [1, 2]


def test_reports_with_impossible_figures_are_refused_and_counters_stay_sane(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    ch = add_worker(master, "w1")[0]
    for _ in range(3):  # found by hypothesis: sizes near 2**64 summed past what status can encode
        with pytest.raises(InvalidArgument, match="max_tuple_bytes"):
            master.report(ch, [Outcome(tuple_id=1, ok=True, size=2**64 - 1)], release=False)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(InvalidArgument, match="accepted_unix"):
            master.report(ch, [Outcome(tuple_id=1, ok=True, size=1, accepted_unix=bad)], release=False)
    master.report(ch, [Outcome(tuple_id=1, ok=True, size=10)], release=False)
    status = master.status()
    assert status.tuples_done == 1 and status.bytes_done == 10


def test_latency_ends_when_the_features_were_stored_not_when_the_report_arrives(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    ch = add_worker(master, "w1")[0]
    now = time.time()
    # A direct tuple's outcome may ride on the channel's next report, seconds later.
    master.report(
        ch, [Outcome(tuple_id=1, ok=True, size=1, accepted_unix=now - 3.0, stored_unix=now - 2.5)], release=False
    )
    assert master.stats.latency_sum / master.stats.latency_count == pytest.approx(0.5, abs=0.05)
    # A stored time after the report (another host's clock) counts as the report's time.
    before = time.time()
    master.report(
        ch, [Outcome(tuple_id=2, ok=True, size=1, accepted_unix=before - 0.5, stored_unix=before + 3600)], release=False
    )
    after = time.time()
    # tuple 2's latency is the report's time minus accepted: between 0.5 and 0.5 + (after - before)
    assert 0.5 - 0.01 <= master.stats.latency_sum / master.stats.latency_count <= 0.5 + (after - before) / 2 + 0.01
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(InvalidArgument, match="stored_unix"):
            master.report(ch, [Outcome(tuple_id=3, ok=True, size=1, stored_unix=bad)], release=False)


def test_tickets_are_hmac_of_id_and_image(make_master, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import hashlib
    import hmac

    key_file = tmp_path / "ticket.key"
    key_file.write_text("k" * 32 + "\n")
    master = make_master(ticket_key_file=str(key_file))
    routed = route(master, 2)
    for tuple_id, ticket in zip(routed.tuple_ids, routed.tickets, strict=True):
        expected = hmac.new(b"k" * 32, tuple_id.to_bytes(8, "big") + IMAGE.encode(), hashlib.sha256).digest()[:16]
        assert ticket == expected
    key_file.write_text("short")
    with pytest.raises(ConfigError, match="ticket_key_file"):
        make_master(ticket_key_file=str(key_file))


def test_worker_expiry_requeues_leases_and_warns(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master(heartbeat_interval=0.1, expiry_seconds=1.0)
    ch = add_worker(master, "w1")[0]
    routed = route(master, force_queue=True)
    enqueue(master, routed.tuple_ids[0])
    pulled = master.pull(ch, 0)
    assert pulled is not None
    wait_for(lambda: state(master, ch) == ChannelState.DOWN, timeout=5, what="worker expiry")
    status = master.status()
    assert any("worker w1 expired" in w for w in status.warnings)
    assert any("no channel offers image hio/synthetic; 1 tuples wait" in w for w in status.warnings)
    assert status.channels_down == 1 and status.queues[0].leased == 0
    assert not master.heartbeat("w1", {}).known  # it must register again
    add_worker(master, "w1")
    again = master.pull(ch, 0)
    assert again is not None and again.lease.meta.attempt == 2


def test_heartbeat_down_and_up(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    ch = add_worker(master, "w1")[0]
    assert master.heartbeat("w1", {ch: "engine crashed"}).known
    assert state(master, ch) == ChannelState.DOWN
    assert isinstance(route_of(route(master)), QueueRoute)
    assert master.heartbeat("w1", {}).known
    assert state(master, ch) == ChannelState.FREE
    assert not master.heartbeat("nobody", {}).known


def test_reservation_lapses_without_reports(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master(reservation_seconds=3.0)
    ch = add_worker(master, "w1")[0]
    assert isinstance(route_of(route(master)), DirectRoute)
    time.sleep(1.8)
    master.report(ch, [], release=False)  # a keep-alive report
    time.sleep(1.5)
    assert state(master, ch) == ChannelState.DIRECT
    wait_for(lambda: state(master, ch) == ChannelState.FREE, timeout=6, what="reservation lapse")


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="expiry_seconds must be at most 10"):
        MasterConfig(expiry_seconds=11).validate()
    with pytest.raises(ConfigError, match="fsync"):
        MasterConfig(fsync="sometimes").validate()
    with pytest.raises(ConfigError, match="max_attempts must be positive"):
        MasterConfig(max_attempts=0).validate()
    with pytest.raises(ConfigError, match=r"pull_waiters \(48\) must be below the 48 streams server_threads \(64\)"):
        MasterConfig(pull_waiters=48, server_threads=64).validate()  # a quarter of the threads kept for unary calls
    MasterConfig(pull_waiters=47, server_threads=64).validate()
    MasterConfig().validate()


def test_busy_channels_make_route_requests_wait_first_come_first_served(make_master) -> None:  # type: ignore[no-untyped-def]
    import threading

    master = make_master()
    (channel,) = add_worker(master, "w1")
    assert isinstance(route_of(route(master)), DirectRoute)  # the only channel is now busy
    answers: list[tuple[str, object]] = []

    def ask(name: str) -> None:
        answers.append((name, route_of(route(master, wait_seconds=5.0))))

    def waiting() -> int:
        with master.lock:
            return len(master._route_waiters.get(IMAGE, ()))

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    wait_for(lambda: waiting() == 1, timeout=5, interval=0.01, what="the first route waiting")
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    wait_for(lambda: waiting() == 2, timeout=5, interval=0.01, what="the second route waiting")
    assert answers == [], "both wait while the channel is busy"
    master.report(channel, [], release=True)
    wait_for(lambda: len(answers) == 1, timeout=5, what="the first waiter to get the channel")
    assert answers[0][0] == "first" and isinstance(answers[0][1], DirectRoute)
    master.report(channel, [], release=True)
    wait_for(lambda: len(answers) == 2, timeout=5, what="the second waiter")
    assert answers[1][0] == "second" and isinstance(answers[1][1], DirectRoute)
    first.join()
    second.join()
    started = time.monotonic()
    assert isinstance(route_of(route(master, wait_seconds=0.5)), QueueRoute), "the wait is bounded"
    assert time.monotonic() - started >= 0.45


def test_waiting_never_overtakes_queued_tuples(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    add_worker(master, "w1")
    assert isinstance(route_of(route(master)), DirectRoute)
    queued = route_of(route(master))  # busy: to the queue
    assert isinstance(queued, QueueRoute)
    started = time.monotonic()
    assert isinstance(route_of(route(master, wait_seconds=5.0)), QueueRoute), "tuples ahead in the queue: no waiting"
    assert time.monotonic() - started < 3.0
    with pytest.raises(InvalidArgument, match="wait_seconds"):
        route(master, wait_seconds=31.0)


def test_a_broken_batch_pull_charges_only_the_tuples_it_had_started_to_send(make_master) -> None:  # type: ignore[no-untyped-def]
    """guarantees.md: a tuple that never left the master goes back uncharged."""
    master = make_master()
    [channel] = add_worker(master, "w1")
    ids = list(route(master, 3, force_queue=True).tuple_ids)
    for tuple_id in ids:
        list(master.enqueue(frames(tuple_id, bytes([tuple_id % 251]) * 300_000)))
    pulled = master.pull(channel, 0.0, max_tuples=3, max_bytes=10_000_000)
    assert pulled is not None and [lease.tuple_id for lease in pulled.leases] == ids
    stream = pulled.frames()
    next(stream)  # the first tuple's first chunk is on its way
    assert pulled.started == 1
    pulled.abandon("pull stream cancelled")  # then the stream broke
    attempts = []
    again = master.pull(channel, 0.0, max_tuples=3, max_bytes=10_000_000)
    while again is not None:
        attempts += [(lease.tuple_id, lease.meta.attempt) for lease in again.leases]
        master.report(
            channel,
            [Outcome(tuple_id=lease.tuple_id, ok=True, from_queue=True, size=300_000) for lease in again.leases],
            release=True,
        )
        again = master.pull(channel, 0.0, max_tuples=3, max_bytes=10_000_000)
    assert attempts == [(ids[0], 2), (ids[1], 1), (ids[2], 1)]


def test_a_pull_ahead_yields_to_an_idle_channel_of_the_image(make_master) -> None:  # type: ignore[no-untyped-def]
    """A channel that pulls while it holds a lease pulls ahead (its engine fetches the next tuples
    while it processes): it gets them while every other channel of the image is busy, and nothing
    while one is idle, which would otherwise wait for a tuple held by a busy channel."""
    master = make_master()
    a, b = add_worker(master, "w1", 2)
    queued = route(master, 4, force_queue=True).tuple_ids
    for tuple_id in queued:
        enqueue(master, tuple_id)
    first = master.pull(a, 0)
    assert first is not None and first.lease.tuple_id == queued[0]
    assert state(master, b) == ChannelState.FREE
    assert master.pull(a, 0) is None, "b is idle: a's pull ahead takes nothing"
    assert master.queue.ready_count(IMAGE) == 3
    taken = master.pull(b, 0)  # b is not ahead: it holds nothing
    assert taken is not None and taken.lease.tuple_id == queued[1]
    ahead = master.pull(a, 0)  # both busy now: a pulls ahead
    assert ahead is not None and ahead.lease.tuple_id == queued[2]
    assert master.queue.has_lease(a) and master.queue.ready_count(IMAGE) == 1
    # b releases with tuples waiting: QUEUE, its pull on the way; a's pull ahead waits for it
    assert master.report(b, [Outcome(tuple_id=queued[1], ok=True, from_queue=True)], release=True)
    assert state(master, b) == ChannelState.QUEUE and not master.queue.has_lease(b)
    assert master.pull(a, 0) is None, "b is about to pull: a's pull ahead takes nothing"
    # a FREE channel still processing its last direct tuple is not idle: it does not hold a pull ahead back
    channel_b = master.registry.channel(b)
    assert channel_b is not None
    master.registry.set_free(channel_b)
    master.registry.set_processing(channel_b, True)
    again = master.pull(a, 0)
    assert again is not None and again.lease.tuple_id == queued[3]
