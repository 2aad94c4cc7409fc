"""Pipeline parameters read from a tuple's string attributes, bounded and checked.

Senders may tune a pipeline per tuple (``min_object_area=40``). Every value is
parsed here with an explicit range, so a typo or a hostile value fails the
tuple with a ``ValueError`` naming the attribute instead of running a
pipeline with nonsense (or unbounded) settings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def attributes_of(info: Any) -> Mapping[str, str]:
    """The attribute mapping of a ``TupleInfo``-like object (empty when there is none)."""
    attributes = getattr(info, "attributes", None)
    return attributes if attributes is not None else {}


def attr_float(attributes: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    """A finite float attribute in ``[low, high]``; ``default`` when absent."""
    if not (raw := attributes.get(name)):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"attribute {name}={raw!r} is not a number") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"attribute {name}={raw!r} is outside [{low:g}, {high:g}]")
    return value


def attr_int(attributes: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    """An integer attribute in ``[low, high]``; ``default`` when absent."""
    if not (raw := attributes.get(name)):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"attribute {name}={raw!r} is not an integer") from None
    if not low <= value <= high:
        raise ValueError(f"attribute {name}={raw!r} is outside [{low}, {high}]")
    return value


def attr_choice(attributes: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices``; ``default`` when absent."""
    if not (raw := attributes.get(name)):
        return default
    if raw not in choices:
        raise ValueError(f"attribute {name}={raw!r} must be one of {', '.join(choices)}")
    return raw
