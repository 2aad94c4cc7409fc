"""Real `hio` processes for tests, on top of :mod:`hio.common.procs`.

    with HioProcess("master", ["--listen", f"127.0.0.1:{port}"], tmp_path) as master:
        master.wait_healthy(f"127.0.0.1:{port}")
    # leaving the block sends SIGTERM, waits, and fails the test on a bad exit

Failures carry the process's log, so a broken test shows why.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Callable

from hio.common.procs import RoleProcess, child_env, free_port

__all__ = ["HioProcess", "free_port", "hio_env", "wait_for"]

hio_env = child_env


class HioProcess(RoleProcess):
    """A RoleProcess whose failures are test failures."""

    def wait_healthy(self, address: str, timeout: float = 60.0, settings: Any = None) -> None:
        try:
            super().wait_healthy(address, timeout, settings)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None

    def __enter__(self) -> "HioProcess":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        code = self.stop()
        if exc[0] is None and code not in (0, -signal.SIGTERM):
            raise AssertionError(f"{self.name} exited with {code} after SIGTERM:\n{self.output()}")


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value; that value, or AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
