"""A pipeline for the worker's tests; its behaviour is chosen per tuple by the
``mode`` attribute: ok (default), fail, cancel (a BaseException, as asyncio's
CancelledError), huge (features over the repository's 64 MiB), sleep (``seconds``),
exit, badtype."""

from __future__ import annotations

import asyncio
import os
import time

KD_FEATURES = ["size"]
SETUP_CALLS = 0


def setup() -> None:
    global SETUP_CALLS
    SETUP_CALLS += 1


def process(data: bytes, info) -> dict:  # type: ignore[no-untyped-def]
    mode = info.attributes.get("mode", "ok")
    if mode == "fail":
        raise ValueError(f"cannot analyse {info.name}")
    if mode == "cancel":
        raise asyncio.CancelledError(f"task cancelled while analysing {info.name}")
    if mode == "huge":  # compresses to almost nothing; 72 MB before compression
        return {"size": len(data), **{f"t{i}": "a" * 60_000 for i in range(1200)}}
    if mode == "sleep":
        time.sleep(float(info.attributes.get("seconds", "1")))
    if mode == "exit":
        os._exit(9)
    if mode == "badtype":
        return {"size": len(data), "blob": object()}
    return {
        "size": len(data),
        "first": data[0] if data else -1,
        "name": info.name,
        "histogram": [float(data.count(b)) for b in (b"a", b"b")],
        "setup_calls": SETUP_CALLS,
    }
