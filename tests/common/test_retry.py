"""call_with_retry: retries what may succeed later, and never waits past its deadline."""

from __future__ import annotations

import grpc
import pytest

from hio.transport import retry


class FakeError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self) -> tuple:
        return ()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class LongestWait:
    @staticmethod
    def uniform(low: float, high: float) -> float:
        return high


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The retry module's clock and randomness replaced (not the process's `time` and `random`:
    threads other tests left behind would sleep on the fake clock and skew its count)."""
    fake = Clock()
    monkeypatch.setattr(retry, "time", fake)
    monkeypatch.setattr(retry, "random", LongestWait)  # the longest wait each time
    return fake


def test_the_waits_end_at_the_deadline(clock: Clock) -> None:
    calls = []

    def unavailable() -> None:
        calls.append(clock.now)
        raise FakeError(grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(FakeError):
        retry.call_with_retry(unavailable, deadline=0.5)
    assert sum(clock.sleeps) == pytest.approx(0.5), "the last wait is cut to what is left"
    assert calls[-1] == pytest.approx(100.5) and len(calls) >= 3


def test_success_after_retries_and_no_retry_for_a_final_status(clock: Clock) -> None:
    results = iter([FakeError(grpc.StatusCode.UNAVAILABLE), FakeError(grpc.StatusCode.RESOURCE_EXHAUSTED), "ok"])

    def flaky() -> str:
        value = next(results)
        if isinstance(value, Exception):
            raise value
        return value

    assert retry.call_with_retry(flaky, deadline=10.0) == "ok" and len(clock.sleeps) == 2

    def refused() -> None:
        raise FakeError(grpc.StatusCode.INVALID_ARGUMENT)

    with pytest.raises(FakeError):
        retry.call_with_retry(refused, deadline=10.0)
    assert len(clock.sleeps) == 2, "no wait for a status that will not change"
