"""Starting and stopping processing engines: the launcher interface, its
local-process implementation, and the choice of runtime (:func:`select_launcher`).

The controller only talks to :class:`EngineLauncher`; ``ProcessLauncher`` runs
an engine as a child process (``python -m hio.cli engine``), the Docker
launcher (``hio.worker.docker_launcher``) as a container. Both get the engine's
whole configuration in :attr:`EngineSpec.env`.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hio.config import ConfigError
from hio.process.procs import LIFELINE_ENV, child_env, spawn
from hio.settings import BUILTIN_IMAGES
from hio.worker.config import WorkerConfig, engine_counts
from hio.worker.cpu import CpuUsage, tree_usage

log = logging.getLogger("hio.worker")

LOG_TAIL_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What to start: one engine serving one channel on ``port``."""

    channel_id: str
    image: str
    port: int
    env: dict[str, str]
    cpus: float = 1.0
    memory_bytes: int = 0


@dataclasses.dataclass
class EngineHandle:
    """A started engine. ``native`` is the launcher's own object (Popen, container)."""

    spec: EngineSpec
    ident: str
    native: Any = None
    log_path: str = ""
    cpu_source: Any = None  # where the launcher reads the engine's CPU time (found once, then kept)


class EngineLauncher(abc.ABC):
    """Runs engines somewhere. Implementations must be safe to call from one thread."""

    @abc.abstractmethod
    def start(self, spec: EngineSpec) -> EngineHandle:
        """Start an engine; returns at once (the engine reports health itself)."""

    @abc.abstractmethod
    def poll(self, handle: EngineHandle) -> int | None:
        """The engine's exit code, or None while it runs."""

    @abc.abstractmethod
    def stop(self, handle: EngineHandle, timeout: float) -> None:
        """Ask the engine to stop (SIGTERM), kill it after ``timeout`` seconds."""

    @abc.abstractmethod
    def logs(self, handle: EngineHandle, lines: int = 50) -> str:
        """The last ``lines`` lines the engine wrote."""

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Remove our own leftovers (never anything this worker did not start)."""

    def cpu_usage(self, handle: EngineHandle) -> CpuUsage | None:
        """CPU seconds the engine has used since it started (all its processes and threads),
        and seconds it waited for a CPU, for the master's profile of its image
        (:mod:`hio.worker.cpu`); None when they cannot be measured."""
        return None


def tail(path: str | os.PathLike[str], lines: int) -> str:
    """The last ``lines`` lines of a text file (reads at most its last 64 KiB)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - LOG_TAIL_BYTES))
            data = fh.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:]) if lines > 0 else ""


class ProcessLauncher(EngineLauncher):
    """Engines as child processes of this worker, logs under ``data_dir/worker/<id>/engines/``.

    Engines stay in the worker's process group on purpose: whoever kills the
    worker's group (an init system, a test) kills its engines with it.
    """

    def __init__(self, config: WorkerConfig, worker_id: str | None = None) -> None:
        worker = worker_id or config.effective_worker_id()
        self._log_dir = Path(config.data_dir).expanduser() / "worker" / worker / "engines"  # a log per channel
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._running: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, spec: EngineSpec) -> EngineHandle:
        log_path = self._log_dir / f"{spec.channel_id.rsplit('/', 1)[-1]}.log"
        with open(log_path, "ab") as fh:
            fh.write(
                f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting engine {spec.channel_id} "
                f"({spec.image}) on port {spec.port}\n".encode()
            )
            env = {**child_env(spec.env), LIFELINE_ENV: str(os.getpid())}  # a worker killed with -9 takes its engines
            proc = spawn(
                lambda: subprocess.Popen(
                    [sys.executable, "-m", "hio.cli", "engine"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    close_fds=True,
                )
            )
        with self._lock:
            self._running[proc.pid] = proc
        return EngineHandle(spec=spec, ident=str(proc.pid), native=proc, log_path=str(log_path))

    def poll(self, handle: EngineHandle) -> int | None:
        code = handle.native.poll()
        if code is not None:
            with self._lock:
                self._running.pop(handle.native.pid, None)
        return code

    def stop(self, handle: EngineHandle, timeout: float) -> None:
        proc: subprocess.Popen[bytes] = handle.native
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "engine did not stop in time; killing it",
                    extra={"channel": handle.spec.channel_id, "pid": proc.pid, "timeout_s": timeout},
                )
                proc.kill()
                proc.wait(5.0)
        with self._lock:
            self._running.pop(proc.pid, None)

    def logs(self, handle: EngineHandle, lines: int = 50) -> str:
        return tail(handle.log_path, lines)

    def cpu_usage(self, handle: EngineHandle) -> CpuUsage | None:
        return tree_usage(handle.native.pid)

    def cleanup(self) -> None:
        """Kill engines we started that are still running (normally none)."""
        with self._lock:
            procs = list(self._running.values())
            self._running.clear()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5.0)


def select_launcher(config: WorkerConfig, worker_id: str | None = None) -> EngineLauncher:
    """The launcher for ``config.runtime``, chosen once at the worker's start.

    ``process``: local processes. ``docker``: containers, or ConfigError when
    Docker is not usable. ``auto``: containers when the docker launcher
    imports (the docker SDK is installed), the daemon answers and every
    configured image exists locally (an elastic worker, whose images come from
    the master's plan later: the built-in ones); else local processes.
    """
    if config.runtime == "process":
        return ProcessLauncher(config, worker_id)
    try:
        from hio.worker import docker_launcher
    except ImportError as exc:
        if config.runtime == "docker":
            raise ConfigError(
                "runtime is 'docker' but the Docker launcher cannot be imported (pip install 'harmonicio[docker]')"
            ) from None
        log.debug("docker launcher unavailable", extra={"reason": str(exc)})
        return ProcessLauncher(config, worker_id)
    if config.runtime == "docker":
        if not docker_launcher.docker_available():
            raise ConfigError(
                "runtime is 'docker' but no Docker engine answers (is the daemon running "
                "and may this user reach its socket?)"
            )
        return docker_launcher.DockerLauncher(config, worker_id)
    counts = engine_counts(BUILTIN_IMAGES if config.elastic else config.engines, config.effective_cpus())
    try:
        usable = docker_launcher.docker_available() and all(
            docker_launcher.DockerLauncher.has_image(image) for image, _ in counts
        )
    except Exception as exc:  # noqa: BLE001 - "auto" must fall back, whatever docker says
        log.info("docker not usable; running engines as processes", extra={"reason": str(exc)})
        usable = False
    if not usable:
        return ProcessLauncher(config, worker_id)
    log.info("engines run in docker containers")
    return docker_launcher.DockerLauncher(config, worker_id)
