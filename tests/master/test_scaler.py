"""The elastic scaler on the master's domain object (no network): wanted engines follow the
backlog, pinned counts win, and every decision is kept with its reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hio.master.core import Master, RouteItem
from hio.master.scaler import Scaler
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
