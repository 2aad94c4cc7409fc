"""Payloads kept in memory beside the spool's disk copy, within their bound."""

from __future__ import annotations

from pathlib import Path

from hio.gateway.spool import Spool
from hio.proto.tuple_pb2 import TupleMeta
from tests.harness import spooled_payload


def meta() -> TupleMeta:
    return TupleMeta(source="test", image="hio/synthetic", name="t", attempt=1)


def test_payloads_stay_in_memory_within_the_bound_and_leave_with_the_entry(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", 1 << 20, fsync="never", memory_bytes=250)
    first = spool.put_bytes(b"a" * 200, meta())
    second = spool.put_bytes(b"b" * 100, meta())  # would pass the bound: disk only
    assert first.payload == b"a" * 200 and second.payload is None
    assert spooled_payload(spool, first) == b"a" * 200  # the durable copy is still written
    spool.remove_many([first])
    assert first.payload is None
    third = spool.put_bytes(b"c" * 100, meta())  # room again once the first left
    assert third.payload == b"c" * 100
    spool.close()
    reopened = Spool(tmp_path / "s", 1 << 20, fsync="never", memory_bytes=250)
    assert [e.payload for e in reopened.entries()] == [None, None]  # resumed entries are read from disk
    reopened.close()
