"""The load predictor: the seeds' rules per image, one change per cooldown in either
direction, idle engines given back, and an image with waiting tuples never left without one."""

from __future__ import annotations

import pytest

from hio.master.config import MasterConfig
from hio.master.demand import DemandPredictor, ImageLoad


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def predictor(**policy: float) -> tuple[DemandPredictor, Clock]:
    clock = Clock()
    return DemandPredictor(MasterConfig(**policy), clock), clock  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("before", "after", "delta", "why"),
    [
        (0, 6, 2, "grows by 6.0/s"),  # rate above 5
        (0, 3, 1, "grows by 3.0/s"),  # rate above 2
        (20, 21, 2, "above 10 and not shrinking fast"),  # queue above 10, rate 1 above -2
        (25, 21, 1, "backlog 21 above 10"),  # queue above 10, shrinking at 4/s
        (5, 5, 0, ""),  # small and steady: nothing
        (3, 1, 0, ""),  # shrinking: nothing
    ],
)
def test_the_seeds_rules_add_engines_by_backlog_and_its_rate(before: int, after: int, delta: int, why: str) -> None:
    p, clock = predictor()
    assert p.step("img", ImageLoad(backlog=before, idle=0, running=3), wanted=3) is None  # the first look only sees
    clock.now += 1
    change = p.step("img", ImageLoad(backlog=after, idle=0, running=3), wanted=3)
    if delta == 0:
        assert change is None
    else:
        assert change is not None and change.delta == delta and why in change.reason


def test_an_image_changes_at_most_once_per_cooldown_up_or_down() -> None:
    p, clock = predictor(cooldown_seconds=10)
    p.step("img", ImageLoad(backlog=0, idle=0, running=2), wanted=2)
    clock.now += 1
    assert p.step("img", ImageLoad(backlog=8, idle=0, running=2), wanted=2).delta == 2  # type: ignore[union-attr]
    for _ in range(9):  # still growing fast, but cooling down
        clock.now += 1
        assert p.step("img", ImageLoad(backlog=30, idle=0, running=4), wanted=4) is None
    clock.now += 1
    assert p.step("img", ImageLoad(backlog=40, idle=0, running=4), wanted=4).delta == 2  # type: ignore[union-attr]
    clock.now += 1
    assert p.step("img", ImageLoad(backlog=0, idle=3, running=6), wanted=6) is None  # idle, but just scaled up
    clock.now += 10
    change = p.step("img", ImageLoad(backlog=0, idle=3, running=6), wanted=6)
    assert change is not None and change.delta == -3 and "idle" in change.reason
    clock.now += 1
    assert p.step("img", ImageLoad(backlog=9, idle=0, running=3), wanted=3) is None  # a burst right after: no flap


def test_idle_engines_are_given_back_only_when_nothing_waits() -> None:
    p, clock = predictor()
    p.step("img", ImageLoad(backlog=2, idle=2, running=4), wanted=4)
    clock.now += 1
    assert p.step("img", ImageLoad(backlog=2, idle=2, running=4), wanted=4) is None  # tuples wait: keep them
    clock.now += 1
    assert p.step("img", ImageLoad(backlog=0, idle=2, running=4), wanted=4).delta == -2  # type: ignore[union-attr]


def test_tuples_waiting_with_no_engine_wanted_get_one_even_while_cooling_down() -> None:
    p, clock = predictor(cooldown_seconds=10)
    p.step("img", ImageLoad(backlog=0, idle=1, running=1), wanted=1)
    clock.now += 1
    assert p.step("img", ImageLoad(backlog=0, idle=1, running=1), wanted=1).delta == -1  # type: ignore[union-attr]
    clock.now += 1
    change = p.step("img", ImageLoad(backlog=1, idle=0, running=0), wanted=0)
    assert change is not None and change.delta == 1 and "no engine" in change.reason


def test_a_steady_backlog_below_the_limit_changes_nothing() -> None:
    p, clock = predictor()
    for n in range(60):
        clock.now += 1
        assert p.step("img", ImageLoad(backlog=4 + n % 3, idle=0, running=2), wanted=2) is None


def test_wanted_engines_that_never_started_are_given_up_once_the_backlog_is_gone() -> None:
    p, clock = predictor(cooldown_seconds=10)
    p.step("img", ImageLoad(backlog=30, idle=0, running=4), wanted=4)
    clock.now += 1
    assert p.step("img", ImageLoad(backlog=40, idle=0, running=4), wanted=4).delta == 2  # type: ignore[union-attr]
    clock.now += 5  # no worker has room for the two: four run
    assert p.step("img", ImageLoad(backlog=0, idle=0, running=4), wanted=6) is None  # cooling down
    clock.now += 5
    change = p.step("img", ImageLoad(backlog=0, idle=0, running=4), wanted=6)
    assert change is not None and change.delta == -2 and "never started" in change.reason
    clock.now += 10
    change = p.step("img", ImageLoad(backlog=0, idle=1, running=4), wanted=4)
    assert change is not None and change.delta == -1 and "idle" in change.reason
