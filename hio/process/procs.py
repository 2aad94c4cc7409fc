"""Child `hio` processes: start, wait healthy, stop with SIGTERM, show logs; and
the lifeline that makes them die with the process that started them.

Every child a :class:`RoleProcess` starts gets ``HIO_DIE_WITH_PARENT=<our
pid>``; ``hio.cli`` then asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``) and checks that the parent is still the one named,
closing the race with a parent that died first. So a test run that is killed,
or a `hio up` killed with -9, takes its roles along (a worker starts its
process engines the same way, so they go with it). The kernel sends that signal when the
*thread* that started the child ends, so children are started from a thread
that lives as long as the process (the main thread, else :func:`spawn`'s own).

The local-cluster builder on top of this is :mod:`hio.cluster`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from hio.settings import ClusterSettings

LIFELINE_ENV = "HIO_DIE_WITH_PARENT"  # the pid of the process whose death ends this one
_PR_SET_PDEATHSIG = 1
T = TypeVar("T")


_OWNER: list[int] = []  # the pid this process dies with (die_with_parent), once known


def die_with_parent() -> None:
    """In a child started with :data:`LIFELINE_ENV`: get SIGTERM when the parent dies.

    Called first thing by ``hio.cli``. If the parent is already gone (it died
    before the request took effect), exit now. The variable is removed, so
    processes this one starts do not inherit it (:func:`lifeline_owner` still
    names the parent)."""
    expected = os.environ.pop(LIFELINE_ENV, "")
    if not expected or not sys.platform.startswith("linux"):
        return
    _OWNER[:] = [int(expected)]
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not glibc/musl: the parent's own cleanup still applies
        return
    if os.getppid() != int(expected):
        raise SystemExit(f"hio: the process that started this one (pid {expected}) is gone")


def lifeline_owner() -> int:
    """The pid whose death ends this process (the test run or `hio up` that started this
    role); 0 when none. Processes this one starts to outlive it (a master's local workers,
    which a restarted master adopts) watch that pid instead, so they still end with it."""
    return _OWNER[0] if _OWNER else 0


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``): with the pid,
    it names one process for good, since pids are reused. None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def watch_process(pid: int, on_gone: Callable[[], None], interval: float = 1.0) -> None:
    """Call ``on_gone`` (once, from a daemon thread) when process ``pid``, as it is now, has
    ended; a new process given the same pid does not count as it."""
    started = start_ticks(pid)

    def run() -> None:
        while started is not None and start_ticks(pid) == started:
            threading.Event().wait(interval)
        on_gone()

    threading.Thread(target=run, name=f"watch-{pid}", daemon=True).start()


_spawn_jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
_spawner_lock = threading.Lock()
_spawner: list[threading.Thread] = []


def _spawn_forever() -> None:
    while True:
        job, future = _spawn_jobs.get()
        try:
            future.set_result(job())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)


def spawn(start: Callable[[], T]) -> T:
    """Run ``start`` (which starts a child process) on a thread that lives as long as this
    process (see the module's doc): the main thread if we are on it, else a daemon thread
    kept for this. (Not a thread pool's: interpreter shutdown joins those as soon as the main
    thread returns, which would end their children while other threads still use them.)"""
    if threading.current_thread() is threading.main_thread():
        return start()
    with _spawner_lock:
        if not _spawner:
            _spawner.append(threading.Thread(target=_spawn_forever, name="hio-spawner", daemon=True))
            _spawner[0].start()
    future: Future[T] = Future()
    _spawn_jobs.put((start, future))
    return future.result()


def read_proc(path: str) -> bytes:
    """A /proc file's bytes, read with plain system calls: a worker reads dozens of them a
    heartbeat, and a Path and a text file per read cost several times the read itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = []
        while chunk := os.read(fd, 65536):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux: /proc/<pid>/task/*/children); [] once it is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return []
    for task in tasks:
        try:
            found += [int(c) for c in read_proc(f"/proc/{pid}/task/{task}/children").split()]
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended since the listing
            continue
    return sorted(set(found))


_GIVEN_PORTS: set[int] = set()  # ports free_port returned: the roles given them may not have bound yet
PORT_FLOOR = 10_000  # free_port's lowest port: below it, well-known and registered services
# The share of free_port's ports this process draws from, (index, count): processes that place
# roles on one machine side by side (a test run's parallel workers) each take their own share, so
# that none gives a port another gave whose role has not bound it yet.
PORT_SHARE = (0, 1)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default when unknown)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, with the port after it, and neither given before.

    The kernel may hand out a port again once its probe socket is closed: two roles
    told the same port would have the second fail to bind while a health probe of
    its address is answered by the first. A server's payload lane listens on its
    port + 1 by default (``lane_address``), so that port is kept from other roles
    too. The port is taken below the kernel's ephemeral range, from which outgoing
    connections take their local ports: a role started again on its port (after a
    crash, a kill) would otherwise fail to bind whenever some connection had taken
    that port meanwhile. Where the range below the ephemeral one leaves each share more
    than 1,000 ports, the port and its port + 1 lie in this process's :data:`PORT_SHARE`;
    else the kernel chooses.
    """
    index, count = PORT_SHARE
    span = (ephemeral_low() - PORT_FLOOR) // count
    first = PORT_FLOOR + index * span
    for _ in range(200):
        if span > 1000:
            port = random.randrange(first, first + span - 1)
        else:  # no room below the ephemeral range: the kernel's choice
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
        pair = (port, port + 1)
        if port < 65535 and not any(p in _GIVEN_PORTS for p in pair) and all(bindable(host, p) for p in pair):
            _GIVEN_PORTS.update(pair)
            return port
    raise RuntimeError(f"no fresh free port on {host}")


def bindable(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` (IPv4 or IPv6; empty = every interface) right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host or "0.0.0.0", port))
        except OSError:  # in use (or waiting out a closed connection's TIME_WAIT)
            return False
    return True


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child role: the caller's, minus stray HIO_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIO_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


_RUNNING: set[RoleProcess] = set()  # started and not stopped: stop_all's work
_RUNNING_LOCK = threading.Lock()


def stop_all(timeout: float = 10.0) -> list[str]:
    """Stop every RoleProcess this process started and did not stop (runs at exit too).
    Returns the names of those that were still running: their starters should have stopped them."""
    with _RUNNING_LOCK:
        left = list(_RUNNING)
    running = [proc.name for proc in left if proc.alive()]
    for proc in left:
        proc.stop(timeout)
    return running


atexit.register(stop_all)


class RoleProcess:
    """One `python -m hio.cli <command> ...` child, its output in a log file.

    The child leads its own process group, so ``kill`` also takes the engines
    a worker started, and it dies with this process (see the module's doc).
    ``prefix`` is a command that runs the rest in another context and then
    becomes it (``exec``, not a child of its own: the lifeline needs this
    process as the role's parent), e.g. ``ip netns exec NS`` for a role in a
    network namespace.
    """

    def __init__(
        self,
        command: str,
        args: Sequence[str],
        workdir: Path,
        env: dict[str, str] | None = None,
        name: str | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.command = command
        self.args = list(args)
        self.name = name or command
        self.prefix = list(prefix)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        self.env = child_env(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> RoleProcess:
        if self._log is None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it until stop() closes it
        env = {**self.env, LIFELINE_ENV: str(os.getpid())}
        self.proc = spawn(
            lambda: subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "hio.cli", self.command, *self.args],
                cwd=self.workdir,
                env=env,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    def wait_started(self, address: str, timeout: float = 60.0, settings: ClusterSettings | None = None) -> None:
        """Wait until this role has started at ``address`` (dialled from this process): its
        health's liveness SERVING and its service known there (not whatever else answers at
        ``address``); it need not be ready (a master without workers is not). If the process
        dies or time runs out, raise with its log."""
        from hio.settings import ClusterSettings
        from hio.transport.net import ROLE_SERVICES, wait_healthy

        try:
            wait_healthy(
                address,
                settings or ClusterSettings(),
                timeout=timeout,
                alive=self.alive,
                service=ROLE_SERVICES.get(self.command, ""),
                ready=False,
            )
        except TimeoutError as exc:
            raise RuntimeError(
                f"{self.name} did not start at {address} ({exc}); its log {self.log_path}:\n{self.output(4000)}"
            ) from None

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
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (stuck in the kernel)
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
        with _RUNNING_LOCK:
            _RUNNING.discard(self)
        return code
