"""Retrying calls that may succeed later: only UNAVAILABLE and RESOURCE_EXHAUSTED, with
full jitter exponential backoff, honouring the server's retry hint."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from hio.transport.errors import retry_after
from hio.transport.net import rpc_status

T = TypeVar("T")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class Backoff:
    """Full-jitter exponential backoff: sleep U(0, min(cap, base * 2**n))."""

    def __init__(self, base: float = 0.05, cap: float = 5.0) -> None:
        self.base, self.cap, self.attempt = base, cap, 0

    def delay(self, hint: float | None = None) -> float:
        bound = min(self.cap, self.base * (2**self.attempt))
        self.attempt += 1
        wait = random.uniform(0, bound)
        return max(wait, hint) if hint else wait

    def sleep(self, hint: float | None = None) -> None:
        time.sleep(self.delay(hint))

    def reset(self) -> None:
        self.attempt = 0


def call_with_retry(fn: Callable[[], T], *, deadline: float = 60.0) -> T:
    """Call ``fn`` until it succeeds, a non-retryable status arrives, or ``deadline`` s pass
    (the last wait ends at the deadline, so callers can count on it)."""
    end = time.monotonic() + deadline
    backoff = Backoff()
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            code, _details = rpc_status(exc)
            left = end - time.monotonic()
            if code not in RETRYABLE or left <= 0:
                raise
            time.sleep(min(backoff.delay(retry_after(exc)), left))  # never sleep past the deadline
