"""Decoding feature records: what KD clusters on, and what it refuses (without raising)."""

from __future__ import annotations

import pytest

from hio.kd.records import decode, to_signed, to_unsigned
from tests.kd.helpers import blob, record

LIMIT = 1 << 20


def test_all_scalar_numbers_sorted_when_pipeline_chose_none() -> None:
    rec = record(7, {"b": 2.0, "a": 1.0}, text={"name": "x"})
    row = decode(3, 7, blob(rec), LIMIT)
    assert row.error is None
    assert (row.names, row.values, row.image, row.offset) == (("a", "b"), (1.0, 2.0), "hio/synthetic", 3)


def test_kd_features_in_pipeline_order() -> None:
    row = decode(1, 7, blob(record(7, {"a": 1.0, "b": 2.0, "c": 3.0}, kd=("c", "a"))), LIMIT)
    assert row.names == ("c", "a") and row.values == (3.0, 1.0)


@pytest.mark.parametrize(
    ("rec", "why"),
    [
        (record(7, {"a": 1.0}, kd=("a", "missing")), "kd feature 'missing' is missing"),
        (record(7, {"a": 1.0}, kd=("t",), text={"t": "x"}), "kd feature 't' is not a number"),
        (record(7, {}, text={"t": "x"}), "no numeric features"),
        (record(7, {"a": float("nan")}), "not finite"),
        (record(7, {"a": float("inf")}, kd=("a",)), "not finite"),
        (record(8, {"a": 1.0}), "record says tuple 8, stored as 7"),
    ],
)
def test_unusable_records_become_error_rows(rec, why: str) -> None:  # type: ignore[no-untyped-def]
    row = decode(1, 7, blob(rec), LIMIT)
    assert row.error is not None and why in row.error
    assert row.names == () and row.tuple_id == 7


def test_damaged_bytes_and_bombs_are_refused() -> None:
    assert "not zstd" in (decode(1, 7, b"not zstd at all", LIMIT).error or "")
    big = record(7, {f"f{i}": float(i) for i in range(2000)})
    assert "exceeds" in (decode(1, 7, blob(big), 1024).error or "")


def test_ids_above_2_63_round_trip_through_signed_storage() -> None:
    for value in (1, 2**63 - 1, 2**63, 2**64 - 1):
        assert to_unsigned(to_signed(value)) == value
        assert -(2**63) <= to_signed(value) < 2**63
