"""Child `hio` processes: start, wait healthy, stop with SIGTERM, show logs.

Used by `hio up` (every role on one machine) and by the end-to-end tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO, Sequence

from hio.common.net import ROLE_SERVICES, wait_healthy
from hio.common.settings import ClusterSettings


_GIVEN_PORTS: set[int] = set()   # ports free_port returned: the roles given them may not have bound yet


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, and not one this process was given before.

    The kernel may hand out a port again once its probe socket is closed: two roles
    told the same port would have the second fail to bind while a health probe of
    its address is answered by the first.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port
    raise RuntimeError(f"no fresh free port on {host}")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child role: the caller's, minus stray HIO_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIO_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class RoleProcess:
    """One `python -m hio.cli <command> ...` child, its output in a log file.

    The child leads its own process group, so ``kill`` also takes the engines
    a worker started.
    """

    def __init__(self, command: str, args: Sequence[str], workdir: Path,
                 env: dict[str, str] | None = None, name: str | None = None) -> None:
        self.command = command
        self.args = list(args)
        self.name = name or command
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        self.env = child_env(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> "RoleProcess":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "hio.cli", self.command, *self.args],
                                     cwd=self.workdir, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        return self

    def wait_healthy(self, address: str, timeout: float = 60.0,
                     settings: ClusterSettings | None = None) -> None:
        """Wait for SERVING of this role's service (not of whatever else answers at
        ``address``); if the process dies or time runs out, raise with its log."""
        try:
            wait_healthy(address, settings or ClusterSettings(), timeout=timeout,
                         alive=self.alive, service=ROLE_SERVICES.get(self.command, ""))
        except TimeoutError as exc:
            raise RuntimeError(f"{self.name} did not become healthy at {address} ({exc}); "
                               f"its log {self.log_path}:\n{self.output(4000)}") from None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self, limit: int = 20000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the process group (the role and any engines it started)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM and wait; SIGKILL after ``timeout``. Returns the exit code (None if killed)."""
        if self.proc is None:
            return 0
        code: int | None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
        else:
            code = self.proc.returncode
        self.kill()  # leftovers in the group (engines) go too
        if self._log:
            self._log.close()
            self._log = None
        return code
