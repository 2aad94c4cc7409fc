"""The master's profile of each image: CPU share per engine and processing rate, over a
moving window; the default share until measured."""

from __future__ import annotations

import pytest

from hio.master.profile import Profile


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_image_not_measured_has_the_default_share() -> None:
    profile = Profile(window=20, default_share=0.125, clock=Clock())
    assert profile.share("hio/new") == 0.125
    assert profile.image("hio/new").cpu_share is None


def test_share_is_cpu_seconds_of_all_engines_over_their_watched_seconds() -> None:
    clock = Clock()
    profile = Profile(window=20, default_share=0.125, clock=clock)
    for second in range(5):
        profile.cpu("w/0", "img", 1.0 * second)  # busy: a whole core
        profile.cpu("w/1", "img", 0.0)  # idle
        clock.now += 1
    assert profile.share("img") == pytest.approx(0.5)


def test_a_reading_lower_than_the_last_is_a_new_engine_not_a_negative_share() -> None:
    clock = Clock()
    profile = Profile(window=20, default_share=0.125, clock=clock)
    profile.cpu("w/0", "img", 50.0)
    clock.now += 1
    profile.cpu("w/0", "img", 0.2)  # the engine restarted
    assert profile.image("img").cpu_share is None
    clock.now += 1
    profile.cpu("w/0", "img", 1.0)
    assert profile.share("img") == pytest.approx(0.8)


def test_old_samples_leave_the_window_and_the_last_share_is_kept() -> None:
    clock = Clock()
    profile = Profile(window=10, default_share=0.125, clock=clock)
    profile.cpu("w/0", "img", 0.0)
    clock.now += 2
    profile.cpu("w/0", "img", 2.0)
    assert profile.share("img") == pytest.approx(1.0)
    clock.now += 30
    assert profile.image("img").cpu_share is None  # nothing measured within the window
    assert profile.share("img") == pytest.approx(1.0)  # the last measured share, not the default
    assert profile.known_shares() == {"img": pytest.approx(1.0)}


def test_processing_seconds_give_seconds_per_tuple_and_tuples_per_second() -> None:
    clock = Clock()
    profile = Profile(window=10, default_share=0.125, clock=clock)
    clock.now += 10
    for _ in range(20):
        profile.outcome("img", 0.25)
    got = profile.image("img")
    assert got.seconds_per_tuple == pytest.approx(0.25)
    assert got.tuples_per_second == pytest.approx(2.0)
