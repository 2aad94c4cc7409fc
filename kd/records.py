"""Feature records as KD sees them: decoded, checked, reduced to the numbers it
clusters on. A record that cannot be used is never an exception: it becomes a
row with ``error`` set, so it is skipped, counted and reported.

Rows travel as Arrow columns (``ROW_SCHEMA``) from Spark's Python workers to
the driver and into the accumulated Parquet store. Tuple ids are unsigned
64-bit on the wire; Arrow/Spark/Parquet store them as signed 64-bit, two's
complement (``to_signed``/``to_unsigned``), so no id is ever rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import zstandard

from hio.proto import features_pb2

SPARK_SCHEMA = (
    "offset long, tuple_id long, image string, processed_unix double, "
    "names array<string>, `values` array<double>, error string"
)
MAX_ERROR_CHARS = 200


def to_signed(value: int) -> int:
    """An unsigned 64-bit id as the signed 64-bit integer with the same bits."""
    return value - (1 << 64) if value >= (1 << 63) else value


def to_unsigned(value: int) -> int:
    """Inverse of :func:`to_signed`."""
    return value + (1 << 64) if value < 0 else value


@dataclass(frozen=True)
class Row:
    """One repository record, decoded (``error`` empty) or refused (``error`` says why)."""

    offset: int
    tuple_id: int
    image: str = ""
    processed_unix: float = 0.0
    names: tuple[str, ...] = ()
    values: tuple[float, ...] = ()
    error: str | None = None

    def as_tuple(self) -> tuple[Any, ...]:
        """In ``SPARK_SCHEMA``'s order, ids signed, as Spark's Python data source expects."""
        return (
            self.offset,
            to_signed(self.tuple_id),
            self.image,
            self.processed_unix,
            list(self.names),
            list(self.values),
            self.error,
        )


class MalformedRecord(ValueError):
    """Why a stored feature record cannot be used by KD."""


def _decompress(blob: bytes, max_bytes: int) -> bytes:
    try:
        with zstandard.ZstdDecompressor().stream_reader(blob) as reader:
            data = reader.read(max_bytes + 1)
    except zstandard.ZstdError as exc:
        raise MalformedRecord(f"not zstd data: {exc}") from None
    if len(data) > max_bytes:
        raise MalformedRecord(f"decompressed record exceeds {max_bytes} bytes")
    return data


def _parse(data: bytes) -> features_pb2.FeatureRecord:
    record = features_pb2.FeatureRecord()
    try:
        record.ParseFromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError or RuntimeWarning-ish errors
        raise MalformedRecord(f"not a FeatureRecord: {exc}") from None
    return record


def kd_vector(record: features_pb2.FeatureRecord) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The (names, values) KD clusters on: ``kd_features`` in the pipeline's
    order, or every scalar number sorted by name when the pipeline chose none."""
    if record.kd_features:
        names = tuple(record.kd_features)
        if len(set(names)) != len(names):
            raise MalformedRecord("kd_features names a feature twice")
        for name in names:
            value = record.features.get(name)
            if value is None:
                raise MalformedRecord(f"kd feature '{name}' is missing")
            if value.WhichOneof("kind") != "number":
                raise MalformedRecord(f"kd feature '{name}' is not a number")
    else:
        names = tuple(sorted(n for n, v in record.features.items() if v.WhichOneof("kind") == "number"))
        if not names:
            raise MalformedRecord("record has no numeric features")
    values = tuple(float(record.features[n].number) for n in names)
    for name, number in zip(names, values, strict=True):
        if not math.isfinite(number):
            raise MalformedRecord(f"feature '{name}' is not finite ({number})")
    return names, values


def decode(offset: int, tuple_id: int, blob: bytes, max_bytes: int) -> Row:
    """Decode one stored record; never raises for bad content."""
    try:
        record = _parse(_decompress(blob, max_bytes))
        if record.tuple_id != tuple_id:
            raise MalformedRecord(f"record says tuple {record.tuple_id}, stored as {tuple_id}")
        names, values = kd_vector(record)
    except MalformedRecord as exc:
        return Row(offset=offset, tuple_id=tuple_id, error=str(exc)[:MAX_ERROR_CHARS])
    return Row(
        offset=offset,
        tuple_id=tuple_id,
        image=record.meta.image,
        processed_unix=record.processed_unix,
        names=names,
        values=values,
    )
