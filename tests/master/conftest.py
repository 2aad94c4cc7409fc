"""Fixtures of the master's tests on the domain object."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hio.master.core import Master
from tests.master.helpers import config


@pytest.fixture
def make_master(tmp_path: Path) -> Iterator[Callable[..., Master]]:
    """Started masters, each with a data folder of its own and the settings given; all
    closed after the test."""
    made: list[Master] = []

    def make(**overrides: object) -> Master:
        master = Master(config(tmp_path / str(len(made)), **overrides)).start()
        made.append(master)
        return master

    yield make
    for master in made:
        master.close()
