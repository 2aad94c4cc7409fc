"""Online first-fit packing of engines onto workers, and the headroom of workers kept."""

from __future__ import annotations

import pytest

from hio.master.packer import Bin, Packer, headroom

A, B = "img/a", "img/b"


def bins(*ids: str, capacity: float = 1.8) -> list[Bin]:
    return [Bin(worker_id=w, capacity=capacity) for w in ids]


def test_first_fit_fills_the_lowest_ranked_worker_first() -> None:
    plan = Packer().pack({}, {A: 5}, {A: 0.5}, bins("w1", "w2", "w3"), 1.8)
    assert plan.engines == {"w1": {A: 3}, "w2": {A: 2}, "w3": {}}
    assert plan.used() == ["w1", "w2"] and plan.unplaced == {} and plan.new_bins == 0
    assert plan.load == {"w1": 1.5, "w2": 1.0, "w3": 0.0}


def test_engines_no_longer_wanted_come_off_the_highest_ranked_workers() -> None:
    current = {"w1": {A: 3}, "w2": {A: 2, B: 1}}
    plan = Packer().pack(current, {A: 3, B: 1}, {A: 0.5, B: 0.5}, bins("w1", "w2"), 1.8)
    assert plan.engines == {"w1": {A: 3}, "w2": {B: 1}}


def test_a_plan_changes_as_little_as_it_can() -> None:
    current = {"w1": {A: 1}, "w2": {B: 3}}
    plan = Packer().pack(current, {A: 2, B: 3}, {A: 0.5, B: 0.5}, bins("w1", "w2"), 1.8)
    assert plan.engines == {"w1": {A: 2}, "w2": {B: 3}}  # B's engines stay where they run


def test_what_fits_nowhere_says_how_many_new_workers_would_hold_it() -> None:
    plan = Packer().pack({}, {A: 6, B: 1}, {A: 0.9, B: 0.3}, bins("w1"), 1.8)
    assert plan.engines == {"w1": {A: 2}}
    assert plan.unplaced == {A: 4, B: 1}
    assert plan.new_bins == 3  # two A each on two workers, B beside neither: 0.9 + 0.9 = 1.8 full


def test_an_engine_larger_than_a_worker_runs_alone_on_an_empty_one() -> None:
    plan = Packer().pack({}, {A: 2}, {A: 3.0}, bins("w1", "w2"), 1.8)
    assert plan.engines == {"w1": {A: 1}, "w2": {A: 1}}


def test_the_highest_ranked_worker_is_emptied_when_lower_ones_can_take_its_engines() -> None:
    current = {"w1": {A: 2}, "w2": {A: 1}, "w3": {B: 1}}
    plan = Packer().pack(current, {A: 3, B: 1}, {A: 0.4, B: 0.4}, bins("w1", "w2", "w3"), 1.8)
    assert plan.engines["w3"] == {}  # B moved down: w3 can be given back
    assert plan.count(A) == 3 and plan.count(B) == 1
    assert plan.engines["w2"] == {A: 1}  # one worker per packing: w2 stays as it was


def test_a_worker_with_engines_of_its_own_counts_and_never_changes() -> None:
    fixed = Bin(worker_id="w0", capacity=1.8, fixed={A: 2})
    plan = Packer().pack({}, {A: 3}, {A: 0.5}, [fixed, *bins("w1")], 1.8)
    assert plan.engines == {"w0": {A: 2}, "w1": {A: 1}}
    plan = Packer().pack(plan.engines, {A: 0}, {A: 0.5}, [fixed, *bins("w1")], 1.8)
    assert plan.engines == {"w0": {A: 2}, "w1": {}}


def test_engines_whose_share_grew_are_not_evicted() -> None:
    current = {"w1": {A: 4}}
    plan = Packer().pack(current, {A: 5}, {A: 0.9}, bins("w1", "w2"), 1.8)
    assert plan.engines == {"w1": {A: 4}, "w2": {A: 1}}


@pytest.mark.parametrize(("workers", "extra"), [(0, 1), (1, 1), (9, 1), (10, 2), (50, 2), (99, 3), (100, 4), (1000, 6)])
def test_headroom_is_one_below_ten_workers_then_grows_with_the_log(workers: int, extra: int) -> None:
    assert headroom(workers) == extra
