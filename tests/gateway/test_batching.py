"""How the dispatcher cuts the ready tuples into batches (one batch = one route, one channel)."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import pytest

from hio.gateway.config import GatewayConfig
from hio.gateway.dispatch import Dispatcher
from hio.gateway.spool import SpoolEntry
from hio.proto.tuple_pb2 import TupleMeta


def open_payload(entry: SpoolEntry) -> BinaryIO:
    return open(entry.data_path, "rb")


def dispatcher(**overrides: object) -> Dispatcher:
    config = GatewayConfig(**{"master_address": "127.0.0.1:1", **overrides})  # type: ignore[arg-type]
    return Dispatcher(
        config,
        persist=lambda entries: None,
        open_payload=open_payload,
        payload_damage=lambda e: "",
        on_complete=lambda *args: None,
    )


def add(d: Dispatcher, count: int, image: str = "hio/synthetic", size: int = 100, start: int = 1) -> None:
    for seq in range(start, start + count):
        d.add(SpoolEntry(seq, TupleMeta(image=image, size=size, name=f"t{seq}"), Path("/nonexistent")))


def sizes(d: Dispatcher) -> list[int]:
    out = []
    while d.waiting():
        out.append(len(d._take_batch()))  # the unit under test; no thread, no network
    return out


def test_few_ready_tuples_spread_over_the_streams() -> None:
    d = dispatcher(streams=4, batch_tuples=64)
    add(d, 4)
    assert sizes(d) == [1, 1, 1, 1]  # four channels can each take one, instead of one taking four


def test_many_ready_tuples_make_large_batches_within_the_bound() -> None:
    d = dispatcher(streams=4, batch_tuples=64)
    add(d, 400)
    first = sizes(d)
    assert first[0] == 64 and sum(first) == 400 and max(first) <= 64
    d = dispatcher(streams=4, batch_tuples=64)
    add(d, 40)
    assert sizes(d)[0] == 10  # a quarter of what waits


def test_a_batch_holds_one_image_and_respects_bytes() -> None:
    d = dispatcher(streams=1, batch_tuples=64, batch_bytes=1000)
    add(d, 3, image="a", size=400)
    add(d, 2, image="b", size=10, start=4)
    assert sizes(d) == [2, 1, 2]  # 800 bytes fit, 1200 would not; then image b alone


def test_a_receipt_naming_another_tuple_settles_nothing() -> None:
    """A receiver that numbers tuples otherwise (one without packing skips packed tuples)
    must not make the gateway forget a tuple it never processed."""
    from hio.gateway.dispatch import _Pending
    from hio.proto.tuple_pb2 import TupleReceipt

    done: list[int] = []
    config = GatewayConfig(master_address="127.0.0.1:1")
    d = Dispatcher(
        config,
        persist=lambda entries: None,
        open_payload=open_payload,
        payload_damage=lambda e: "",
        on_complete=lambda completed: done.extend(entry.meta.tuple_id for entry, _, _ in completed),
    )
    sent = [
        _Pending(n, SpoolEntry(n, TupleMeta(image="hio/synthetic", size=1, tuple_id=100 + n), Path("/x")))
        for n in (1, 2)
    ]
    settled: set[int] = set()
    completed: list = []  # type: ignore[type-arg]
    d._settle(TupleReceipt(index=1, tuple_id=999, state=TupleReceipt.STORED), sent, settled, completed, direct=True)
    d._settle(TupleReceipt(index=0, tuple_id=101, state=TupleReceipt.STORED), sent, settled, completed, direct=True)
    d._complete_many(completed, direct=True)
    assert done == [101] and settled == {0}


@pytest.mark.parametrize(
    "attempt, dead_lettered, outcome", [(1, False, "enqueued"), (3, False, "dead-lettered"), (1, True, "dead-lettered")]
)
def test_a_tuple_an_engine_hands_back_on_its_last_attempt_is_a_dead_letter(
    attempt: int, dead_lettered: bool, outcome: str
) -> None:
    """The engine charges the hand-back an attempt; on the last one the master stores it as a dead
    letter, so the sender must not say the queue tries it again. The master's max_attempts may be
    lower than the gateway's: the receipt says when the master kept a dead letter."""
    from hio.gateway.dispatch import _Pending
    from hio.proto.tuple_pb2 import TupleReceipt

    d = Dispatcher(
        GatewayConfig(master_address="127.0.0.1:1", max_attempts=3),
        persist=lambda entries: None,
        open_payload=open_payload,
        payload_damage=lambda e: "",
        on_complete=lambda completed: None,
    )
    sent = [
        _Pending(1, SpoolEntry(1, TupleMeta(image="hio/synthetic", size=1, tuple_id=7, attempt=attempt), Path("/x")))
    ]
    done: list = []  # type: ignore[type-arg]
    d._settle(
        TupleReceipt(
            index=0, tuple_id=7, state=TupleReceipt.ENQUEUED, message="ValueError: bad", dead_lettered=dead_lettered
        ),
        sent,
        set(),
        done,
        direct=True,
    )
    [(_, got, detail)] = done
    assert (got.value, detail) == (outcome, "processing failed: ValueError: bad")
