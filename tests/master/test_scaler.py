"""The elastic scaler on the master's domain object (no network): wanted engines follow the
backlog, pinned counts win, and every decision is kept with its reason."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from hio.master.core import Master
from hio.master.registry import ChannelState
from hio.master.scaler import Scaler
from hio.proto.master_pb2 import DOWN, ChannelInfo, ImageCount, RouteItem
from hio.transport.errors import FailedPrecondition, InvalidArgument
from tests.master.helpers import config, frames

IMAGE = "hio/synthetic"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def elastic(tmp_path: Path) -> Iterator[tuple[Master, Clock]]:
    master = Master(config(tmp_path, scaling="elastic", cooldown_seconds=5))
    clock = Clock()
    master.scaler = Scaler(master, clock=clock)
    try:
        yield master, clock
    finally:
        master.close()


def enqueue(master: Master, n: int) -> None:
    routed = master.route(source="t", image=IMAGE, items=[RouteItem(size=10)] * n)
    for tuple_id in routed.tuple_ids:
        list(master.enqueue(frames(tuple_id, b"x" * 10)))


def test_a_backlog_with_no_engine_wants_one_then_more_as_it_grows(elastic: tuple[Master, Clock]) -> None:
    master, clock = elastic
    assert master.scaler is not None
    elastic_worker(master, "w1", cpus=4)  # room for the engines wanted
    enqueue(master, 1)
    master.scaler.tick()
    assert master.scaler.wanted_count(IMAGE) == 1
    clock.now += 1
    enqueue(master, 8)  # 8 more in a second
    master.scaler.tick()
    assert master.scaler.wanted_count(IMAGE) == 1  # cooling down after the first
    clock.now += 5
    enqueue(master, 8)
    master.scaler.tick()
    assert master.scaler.wanted_count(IMAGE) == 3  # 17 queued, above 10 and not shrinking
    (engines,) = [e for e in master.status().engines if e.image == IMAGE]
    assert (engines.wanted, engines.running, engines.pinned) == (3, 0, False)
    reasons = [d.reason for d in master.scaler.decisions]
    assert "tuples wait and no engine is wanted" in reasons[0] and "above 10" in reasons[1]


def test_no_more_engines_are_wanted_than_can_ever_have_room(elastic: tuple[Master, Clock]) -> None:
    master, clock = elastic
    assert master.scaler is not None
    elastic_worker(master, "w1", cpus=1)  # 0.9 cores: 7 engines of the default share, and no provisioner
    enqueue(master, 100)
    for _ in range(10):
        master.scaler.tick()
        clock.now += 6
    wanted = master.scaler.wanted_count(IMAGE)
    assert wanted <= 7 + 2  # the step that found no room, then no more
    for _ in range(10):
        master.scaler.tick()
        clock.now += 6
    assert master.scaler.wanted_count(IMAGE) == wanted


def test_a_pinned_count_wins_over_the_predictor(elastic: tuple[Master, Clock]) -> None:
    master, clock = elastic
    assert master.scaler is not None
    master.scaler.pinned[IMAGE] = 5
    enqueue(master, 30)
    master.scaler.tick()
    clock.now += 10
    master.scaler.tick()
    assert master.scaler.wanted_count(IMAGE) == 5
    (engines,) = [e for e in master.status().engines if e.image == IMAGE]
    assert engines.wanted == 5 and engines.pinned


def test_fixed_sizing_has_no_scaler(tmp_path: Path) -> None:
    master = Master(config(tmp_path))
    try:
        assert master.scaler is None
    finally:
        master.close()


def counts(items: Iterable[ImageCount]) -> dict[str, int]:
    return {c.image: c.count for c in items}


def elastic_worker(master: Master, worker_id: str, n: int = 0, cpus: int = 2) -> list[str]:
    specs = [ChannelInfo(channel_id=f"{worker_id}/{i}", image=IMAGE, address=f"127.0.0.1:{6000 + i}") for i in range(n)]
    master.register_worker(worker_id, "host", cpus, specs, elastic=True)
    return [s.channel_id for s in specs]


def test_routing_concentrates_on_the_lowest_ranked_worker(elastic: tuple[Master, Clock]) -> None:
    master, _clock = elastic
    elastic_worker(master, "w1", 2)
    elastic_worker(master, "w2", 2)

    def routed() -> str:
        reply = master.route(source="t", image=IMAGE, items=[RouteItem(size=10)])
        assert reply.WhichOneof("route") == "channel"
        return reply.channel.channel_id

    assert [routed(), routed(), routed()] == ["w1/0", "w1/1", "w2/0"]
    master.report("w1/0", [], release=True)
    master.report("w2/0", [], release=True)
    assert routed() == "w1/0"  # not the least recently used: the lowest ranked


def test_the_plan_places_wanted_engines_and_heartbeats_carry_it(elastic: tuple[Master, Clock]) -> None:
    master, _clock = elastic
    assert master.scaler is not None
    elastic_worker(master, "w1", cpus=1)  # 0.9 cores for engines: 7 of the default 0.125
    elastic_worker(master, "w2", cpus=1)
    master.scaler.pinned[IMAGE] = 9
    master.scaler.replan()
    assert counts(master.heartbeat("w1", {}).plan.engines) == {IMAGE: 7}
    assert counts(master.heartbeat("w2", {}).plan.engines) == {IMAGE: 2}


def test_a_retired_channel_takes_no_work_and_stops_only_once_drained(elastic: tuple[Master, Clock]) -> None:
    master, _clock = elastic
    assert master.scaler is not None
    a, b = elastic_worker(master, "w1", 2)
    master.scaler.pinned[IMAGE] = 2
    master.scaler.tick()
    reply = master.route(source="t", image=IMAGE, items=[RouteItem(size=10)])
    assert reply.WhichOneof("route") == "channel" and reply.channel.channel_id == a  # a is busy with a direct stream
    master.scaler.pinned[IMAGE] = 0
    master.scaler.replan()
    assert master.registry.channel(a).retiring and master.registry.channel(b).retiring  # type: ignore[union-attr]
    assert master.heartbeat("w1", {}).stop_channels == [b]  # a still holds its stream
    routed = master.route(source="t", image=IMAGE, items=[RouteItem(size=10)])
    assert routed.WhichOneof("route") == "queue"  # nothing routable: the queue
    list(master.enqueue(frames(routed.tuple_ids[0], b"x" * 10)))
    assert master.pull(b, 0) is None  # a retiring channel leases nothing
    assert master.report(a, [], release=True) is False  # released, and told not to pull
    assert master.heartbeat("w1", {}).stop_channels == [a, b]
    # the worker stopped both engines: its complete list no longer has them
    master.heartbeat("w1", {}, channels=[])
    assert master.registry.worker("w1").channels == {}  # type: ignore[union-attr]


def test_channels_a_worker_starts_join_with_a_complete_heartbeat(elastic: tuple[Master, Clock]) -> None:
    master, _clock = elastic
    elastic_worker(master, "w1")
    spec = ChannelInfo(channel_id="w1/0", image=IMAGE, address="127.0.0.1:6000", state=DOWN, detail="starting")
    master.heartbeat("w1", {"w1/0": "starting"}, channels=[spec])
    assert master.registry.channel("w1/0").state == ChannelState.DOWN  # type: ignore[union-attr]
    master.heartbeat("w1", {}, channels=[ChannelInfo(channel_id="w1/0", image=IMAGE, address="127.0.0.1:6000")])
    assert master.registry.channel("w1/0").state == ChannelState.FREE  # type: ignore[union-attr]


def test_operator_controls_pin_unpin_and_bounds_with_their_decisions(elastic: tuple[Master, Clock]) -> None:
    master, _clock = elastic
    elastic_worker(master, "w1", cpus=2)
    report = master.set_scaling(pin={IMAGE: 3}, min_workers=1, max_workers=4)
    (image,) = [i for i in report.images if i.image == IMAGE]
    assert (image.wanted, image.pinned) == (3, True)
    assert (report.min_workers, report.max_workers, report.bounds_set) == (1, 4, True)
    assert counts(report.workers[0].planned) == {IMAGE: 3}
    report = master.set_scaling(unpin=[IMAGE], reset_bounds=True)
    (image,) = [i for i in report.images if i.image == IMAGE]
    assert (image.wanted, image.pinned) == (3, False)  # the predictor goes on from the pinned count
    assert (report.min_workers, report.max_workers, report.bounds_set) == (0, 8, False)
    actions = [(d.subject, d.action) for d in report.decisions]
    assert (IMAGE, "pinned to 3") in actions and (IMAGE, "unpinned at 3") in actions
    assert ("workers", "min 1, max 4") in actions and ("workers", "min 0, max 8") in actions


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"min_workers": 5, "max_workers": 2}, "min_workers (5) must not exceed max_workers (2)"),
        ({"max_workers": 0}, "max_workers must be at least 1"),
        ({"pin": {IMAGE: 5000}}, "count must be between 0 and 1024"),
        ({"pin": {"": 1}}, "invalid image name"),
    ],
)
def test_bad_operator_changes_are_refused_whole(
    elastic: tuple[Master, Clock], change: dict[str, object], named: str
) -> None:
    master, _clock = elastic
    before = master.scaling()
    with pytest.raises(InvalidArgument, match=re.escape(named)):
        master.set_scaling(**change)  # type: ignore[arg-type]
    after = master.scaling()
    assert (after.min_workers, after.max_workers, after.images) == (
        before.min_workers,
        before.max_workers,
        before.images,
    )


def test_fixed_sizing_shows_its_engines_and_refuses_changes(tmp_path: Path) -> None:
    master = Master(config(tmp_path))
    try:
        master.register_worker("w1", "host", 2, [ChannelInfo(channel_id="w1/0", image=IMAGE, address="127.0.0.1:6000")])
        report = master.scaling()
        assert report.mode == "fixed" and counts(report.workers[0].running) == {IMAGE: 1}
        with pytest.raises(FailedPrecondition, match="scaling is fixed"):
            master.set_scaling(pin={IMAGE: 2})
    finally:
        master.close()
