"""Synthetic pipeline (image ``hio/synthetic``): a benchmark load with a known cost.

The tuple's attributes say what to do, so a benchmark can dial CPU cost and
output size per tuple without changing code:

* ``cost_ms`` (default 0, at most :data:`MAX_COST_MS`): burn that much CPU time
  of this thread in a busy loop (measured with ``time.thread_time()``, never a
  sleep, so the cost is real work that competes for cores like a real pipeline).
* ``features`` (default 4, at most :data:`MAX_FEATURES`): how many numeric
  features ``f0 .. f{n-1}`` to output. They are derived from the payload, so
  they are deterministic and differ between payloads.

Always output, so results are verifiable end to end: ``size_bytes`` (payload
length) and ``crc32_head`` (CRC-32 of the first :data:`HEAD_BYTES` bytes, as a
number). The same :func:`burn_cpu` is what the benchmark runs inside Spark, so
both systems pay exactly the same cost per tuple.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

from hio.worker.pipelines.params import attr_float, attr_int, attributes_of

KD_FEATURES = ["f0", "f1", "f2", "f3"]

DEFAULT_FEATURES = 4
MAX_FEATURES = 4096
MAX_COST_MS = 3_600_000.0  # one hour: a typo must not wedge an engine forever
HEAD_BYTES = 4096
_MASK64 = (1 << 64) - 1


def burn_cpu(seconds: float) -> float:
    """Busy-loop until this thread has used ``seconds`` of CPU; return the CPU seconds used.

    Measured with ``time.thread_time()``: time spent descheduled (other
    threads, other processes) does not count, so the work done is the same
    however loaded the machine is.
    """
    start = time.thread_time()
    if seconds <= 0:
        return 0.0
    deadline = start + seconds
    while True:
        spin(2000)  # ~0.1 ms between clock reads
        now = time.thread_time()
        if now >= deadline:
            return now - start


def spin(steps: int) -> None:
    """``steps`` steps of fixed integer work: what :func:`burn_cpu` burns, and what the
    benchmark's CPU probe times to tell how fast a CPU slot runs."""
    state = 0x9E3779B9
    for _ in range(steps):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF


def _mix(value: int) -> int:
    """SplitMix64 finaliser: a cheap, well-spread 64-bit hash."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def process(data: bytes, info: Any) -> dict[str, float | str | list[float]]:
    """Pipeline entry point: burn ``cost_ms`` of CPU, output ``features`` numbers."""
    attrs = attributes_of(info)
    cost_ms = attr_float(attrs, "cost_ms", 0.0, 0.0, MAX_COST_MS)
    count = attr_int(attrs, "features", DEFAULT_FEATURES, 0, MAX_FEATURES)
    burn_cpu(cost_ms / 1000.0)
    head = zlib.crc32(bytes(data[:HEAD_BYTES])) & 0xFFFFFFFF
    base = _mix(((head << 32) ^ len(data)) & _MASK64)
    return {
        "size_bytes": float(len(data)),
        "crc32_head": float(head),
        **{f"f{i}": _mix((base + i) & _MASK64) / 2.0**64 for i in range(count)},  # in [0, 1)
    }
