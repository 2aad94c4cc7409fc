"""Start real `hio` processes for tests: free ports, health waits, SIGTERM, logs.

    with HioProcess("master", ["--listen", f"127.0.0.1:{port}"], tmp_path) as master:
        master.wait_healthy(f"127.0.0.1:{port}")
    # leaving the block sends SIGTERM, waits, and fails the test on a bad exit

On failure the process's stderr is printed, so a broken test shows why.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from hio.common.net import wait_healthy
from hio.common.settings import ClusterSettings


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def hio_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for child `hio` processes: no stray HIO_* from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIO_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class HioProcess:
    """One `python -m hio.cli <command> ...` child process."""

    def __init__(self, command: str, args: Sequence[str], workdir: Path,
                 env: dict[str, str] | None = None, name: str | None = None) -> None:
        self.command = command
        self.args = list(args)
        self.name = name or command
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        self.env = hio_env(env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "HioProcess":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "hio.cli", self.command, *self.args],
                                     cwd=self.workdir, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_healthy(self, address: str, timeout: float = 30.0,
                     settings: ClusterSettings | None = None) -> None:
        try:
            wait_healthy(address, settings or ClusterSettings(), timeout=timeout)
        except TimeoutError:
            raise AssertionError(f"{self.name} not healthy at {address}:\n{self.output()}") from None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the process (and its children: engines live in its group)."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait up to ``timeout``; SIGKILL and fail if it does not exit."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{self.name} did not exit within {timeout}s of SIGTERM:\n{self.output()}")
        try:  # children left behind (engines) go too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "HioProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        code = self.stop()
        if exc[0] is None and code not in (0, -signal.SIGTERM):
            raise AssertionError(f"{self.name} exited with {code}:\n{self.output()}")


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it returns a truthy value; that value, or AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
