"""The ``local`` driver: workers as ``hio worker --elastic`` processes on the master's machine,
for tests, the demo and trying elasticity out. As docs/elasticity.md ("Restarts") says, they
outlive the master and end with the process its cluster ends with (``--owner-pid``); a record
beside each one's log (``<worker_id>.json``) lets a restarted master adopt it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hio.config import ConfigError, one_of
from hio.master.provisioners import ProvisionedWorker, WorkerRequest, WorkerState, check_options
from hio.process.procs import child_env, lifeline_owner, start_ticks
from hio.settings import settings_flags
from hio.storage.files import atomic_write
from hio.worker.config import RUNTIMES

if TYPE_CHECKING:
    from hio.master.config import MasterConfig

log = logging.getLogger("hio.master.provisioners")

FOLDER = "local-workers"
OPTIONS = ("runtime", "worker_args")
STOP_SECONDS = 20.0  # a worker given back gets this long to stop its engines before it is killed
_NOT_PASSED = ("master_address", "repository_address", "data_dir", "token", "token_file")


def create_provisioner(config: MasterConfig, state_dir: Path, options: dict[str, str]) -> LocalProvisioner:
    check_options("local", options, OPTIONS)
    runtime = options.get("runtime", "process")
    one_of("provisioner_options: runtime", runtime, RUNTIMES)
    try:
        args = shlex.split(options.get("worker_args", ""))
    except ValueError as exc:
        raise ConfigError(f"provisioner_options: worker_args cannot be split: {exc}") from None
    return LocalProvisioner(config, state_dir / FOLDER, runtime=runtime, worker_args=args)


@dataclasses.dataclass(frozen=True)
class _Record:
    worker_id: str
    pid: int
    started: int  # the process's start time in clock ticks since boot
    created_unix: float

    def alive(self) -> bool:
        """The recorded process still runs, and is that worker (pids are reused)."""
        if start_ticks(self.pid) != self.started:
            return False
        try:
            argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"worker" in argv and self.worker_id.encode() in argv


class LocalProvisioner:
    """Starts and stops ``hio worker`` processes on this machine (see the module's words)."""

    def __init__(self, config: MasterConfig, folder: Path, *, runtime: str, worker_args: list[str]) -> None:
        self._config = config
        self._folder = folder
        self._folder.mkdir(parents=True, exist_ok=True)
        self._runtime = runtime
        self._args = worker_args
        self._lock = threading.Lock()
        self._children: dict[str, subprocess.Popen[bytes]] = {}  # started by this master: reaped by it

    def create(self, request: WorkerRequest) -> ProvisionedWorker:
        with self._lock:
            record = self._read(request.worker_id)
            if record is not None and record.alive():
                return ProvisionedWorker(request.worker_id, WorkerState.RUNNING, f"pid {record.pid}")
            proc = self._spawn(request)
            started = start_ticks(proc.pid)
            self._children[request.worker_id] = proc
            self._write(_Record(request.worker_id, proc.pid, started or 0, time.time()))
        log.info("local worker started", extra={"worker": request.worker_id, "pid": proc.pid})
        return ProvisionedWorker(request.worker_id, WorkerState.BUILDING, f"pid {proc.pid}")

    def _spawn(self, request: WorkerRequest) -> subprocess.Popen[bytes]:
        config = self._config
        argv = [sys.executable, "-m", "hio.cli", "worker", "--worker-id", request.worker_id, "--elastic"]
        argv += ["--master-address", request.master_address, "--repository-address", config.repository_address]
        argv += ["--data-dir", config.data_dir, "--cpus", str(config.new_worker_cpus()), "--runtime", self._runtime]
        # workers side by side on one machine: each on a free port (in its log)
        argv += ["--http-listen", "127.0.0.1:0", *settings_flags(config, omit=_NOT_PASSED)]
        if owner := lifeline_owner():
            argv += ["--owner-pid", str(owner)]
        argv += self._args
        env = child_env({"HIO_TOKEN": request.token} if request.token else {})
        with open(self._folder / f"{request.worker_id}.log", "ab") as out:
            return subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not in the master's group: a signal to the master is not for it
                close_fds=True,
            )

    def state(self, worker_id: str) -> ProvisionedWorker:
        with self._lock:
            record = self._read(worker_id)
            child = self._children.get(worker_id)
        if record is None:
            return ProvisionedWorker(worker_id, WorkerState.GONE)
        if child is not None and child.poll() is not None:
            return ProvisionedWorker(worker_id, WorkerState.FAILED, f"exited with code {child.returncode}")
        if record.alive():
            return ProvisionedWorker(worker_id, WorkerState.RUNNING, f"pid {record.pid}")
        return ProvisionedWorker(worker_id, WorkerState.FAILED, f"process {record.pid} is gone")

    def delete(self, worker_id: str) -> None:
        """SIGTERM the worker (it stops its engines gracefully), SIGKILL its group after
        :data:`STOP_SECONDS`, on a thread of its own; the record goes once it is gone."""
        with self._lock:
            record = self._read(worker_id)
            child = self._children.pop(worker_id, None)
        if record is None:
            return
        threading.Thread(target=self._stop, args=(record, child), name=f"stop-{worker_id}", daemon=True).start()

    def _stop(self, record: _Record, child: subprocess.Popen[bytes] | None) -> None:
        stop_process(record.pid, record.started, STOP_SECONDS, child)
        with self._lock:
            (self._folder / f"{record.worker_id}.json").unlink(missing_ok=True)
        log.info("local worker stopped", extra={"worker": record.worker_id, "pid": record.pid})

    def adopt(self) -> list[ProvisionedWorker]:
        found = []
        with self._lock:
            for path in sorted(self._folder.glob("*.json")):
                record = self._read(path.stem)
                if record is not None and record.alive():
                    found.append(ProvisionedWorker(record.worker_id, WorkerState.RUNNING, f"pid {record.pid}"))
                else:
                    path.unlink(missing_ok=True)
        return found

    def worker_cpus(self) -> int:
        """Each worker is started with ``--cpus`` this many (``worker_cpus``, else this machine's)."""
        return self._config.new_worker_cpus()

    def close(self) -> None:
        """Nothing is held open: the workers are processes of their own, for a restarted
        master to adopt."""

    def _read(self, worker_id: str) -> _Record | None:
        return read_record(self._folder / f"{worker_id}.json")

    def _write(self, record: _Record) -> None:
        atomic_write(self._folder / f"{record.worker_id}.json", json.dumps(dataclasses.asdict(record)).encode())


def read_record(path: Path) -> _Record | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return _Record(str(data["worker_id"]), int(data["pid"]), int(data["started"]), float(data["created_unix"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stop_process(pid: int, started: int, timeout: float, child: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM ``pid`` (if it is still the process that started at ``started``), wait up to
    ``timeout``, then SIGKILL its process group (the worker and its engines)."""
    if start_ticks(pid) != started:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.poll() is not None:
            break
        if child is None and start_ticks(pid) != started:
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # leftovers in its group: engines of a worker that did not stop
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(10)


def stop_recorded_workers(master_dir: Path, timeout: float = STOP_SECONDS) -> list[str]:
    """Stop every local worker recorded under a master's folder (its cluster is being
    stopped, the master first); the ids of those that were running."""
    folder = master_dir / FOLDER
    records = [r for r in (read_record(p) for p in sorted(folder.glob("*.json"))) if r is not None]
    running = [r for r in records if r.alive()]
    threads = [threading.Thread(target=stop_process, args=(r.pid, r.started, timeout), daemon=True) for r in running]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 15)
    for record in records:
        (folder / f"{record.worker_id}.json").unlink(missing_ok=True)
    return [r.worker_id for r in running]
