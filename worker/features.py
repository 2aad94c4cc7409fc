"""Turning what a pipeline returns into a ``FeatureRecord``.

Pipelines return plain Python (numbers, strings, lists, numpy arrays); the
repository stores protobuf. Anything else is refused with a message that
names the feature and its type, so a user sees at once what to fix.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping  # not typing.Mapping: its isinstance goes through typing (per tuple)
from typing import Any

from hio.proto import features_pb2, tuple_pb2

MAX_FEATURES = 4096  # names per record
MAX_NAME_CHARS = 256
MAX_TEXT_CHARS = 64 * 1024
MAX_ARRAY_VALUES = 1_000_000  # 8 MB of doubles


class FeatureError(ValueError):
    """The pipeline's return value cannot be stored; the message says why."""


def _number(value: Any) -> float | None:
    """The value as a float if it is a real number (bools count as 0/1), else None."""
    return float(value) if isinstance(value, numbers.Real) else None  # a bool is one too


def _array(name: str, value: Any) -> list[float]:
    numpy = hasattr(value, "__array__") and hasattr(value, "ndim")  # a numpy array, without importing numpy here
    if numpy and value.ndim != 1:
        raise FeatureError(f"feature {name!r}: array has {value.ndim} dimensions; return a flat (1-D) array")
    if (size := value.size if numpy else len(value)) > MAX_ARRAY_VALUES:
        raise FeatureError(f"feature {name!r}: {size} values is over the limit of {MAX_ARRAY_VALUES}")
    if numpy:
        if value.dtype.kind not in "biuf":
            raise FeatureError(f"feature {name!r}: array of {value.dtype} is not numeric")
        return [float(v) for v in value.tolist()]
    values = []
    for i, item in enumerate(value):
        number = _number(item)
        if number is None:
            raise FeatureError(f"feature {name!r}: item {i} is {type(item).__name__}, not a number")
        values.append(number)
    return values


def feature_value(name: str, value: Any) -> features_pb2.FeatureValue:
    """One feature: numbers (and bools) → number, str → text, flat numeric sequences → array."""
    number = _number(value)
    if number is not None:
        return features_pb2.FeatureValue(number=number)
    if getattr(value, "ndim", None) == 0:  # numpy 0-d array / scalar
        number = _number(value.item())
        if number is not None:
            return features_pb2.FeatureValue(number=number)
    if isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            raise FeatureError(f"feature {name!r}: text of {len(value)} characters is over {MAX_TEXT_CHARS}")
        return features_pb2.FeatureValue(text=value)
    array_like = hasattr(value, "__array__") and hasattr(value, "ndim") and not isinstance(value, bytes)  # np.bytes_
    if isinstance(value, (list, tuple)) or array_like:
        return features_pb2.FeatureValue(array=features_pb2.DoubleArray(values=_array(name, value)))
    raise FeatureError(f"feature {name!r}: {type(value).__name__} is not a number, string or list of numbers")


def _set_feature(slot: features_pb2.FeatureValue, name: str, value: Any) -> float | None:
    """``feature_value`` written in place; the number if it is one. Plain floats, ints
    and short strings skip the general checks (most features are these, and this
    runs for every tuple)."""
    kind = type(value)
    if kind is float or kind is int:
        number = float(value)
        slot.number = number
        return number
    if kind is str and len(value) <= MAX_TEXT_CHARS:
        slot.text = value
        return None
    slot.CopyFrom(feature_value(name, value))
    return slot.number if slot.WhichOneof("kind") == "number" else None


def build_record(
    result: Any,
    meta: tuple_pb2.TupleMeta,
    *,
    kd_features: tuple[str, ...],
    engine: str,
    processed_unix: float,
    processing_seconds: float,
) -> features_pb2.FeatureRecord:
    """The record of one processed tuple; raises FeatureError for an unusable result.

    ``meta`` is copied (it never carries the payload) without its ticket. KD features the
    result does not contain, or that are not numbers, are refused: KD would
    otherwise fail much later, far from the cause.
    """
    if not isinstance(result, Mapping):
        raise FeatureError(f"process() returned {type(result).__name__}; it must return a dict of features")
    if len(result) > MAX_FEATURES:
        raise FeatureError(f"process() returned {len(result)} features, over the limit of {MAX_FEATURES}")
    record = features_pb2.FeatureRecord(
        tuple_id=meta.tuple_id,
        kd_features=list(kd_features),
        processed_unix=processed_unix,
        processing_seconds=processing_seconds,
        engine=engine,
    )
    record.meta.CopyFrom(meta)
    record.meta.ClearField("ticket")  # proof of routing: of no use to readers of the repository
    features = record.features
    numbers: dict[str, float] = {}
    for name, value in result.items():
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise FeatureError(
                f"feature name {name!r} must be a non-empty string of at most {MAX_NAME_CHARS} characters"
            )
        number = _set_feature(features[name], name, value)
        if number is not None:
            numbers[name] = number
    for name in kd_features:
        number = numbers.get(name)
        if number is None:
            raise FeatureError(f"KD feature {name!r} is missing from the result or not a number")
        if not math.isfinite(number):
            raise FeatureError(f"KD feature {name!r} is {number}, not a finite number")
    return record
