"""Shared fixtures for the pipeline tests."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest


@dataclass(frozen=True)
class Info:
    """The fields of ``hio.worker.TupleInfo`` that the contract promises a pipeline."""

    tuple_id: int = 1
    source: str = "test"
    image: str = "hio/test"
    name: str = "tuple"
    size: int = 0
    created_unix: float = 0.0
    attributes: Mapping[str, str] = field(default_factory=dict)


@pytest.fixture
def info() -> Info:
    return Info()


def with_attributes(**attributes: str) -> Info:
    """A TupleInfo carrying the given pipeline parameters."""
    return Info(attributes=dict(attributes))
