"""Real `hio` processes for tests, on top of :mod:`hio.process.procs`.

    with HioProcess("master", ["--listen", f"127.0.0.1:{port}"], tmp_path) as master:
        master.wait_started(f"127.0.0.1:{port}")
    # leaving the block sends SIGTERM, waits, and fails the test on a bad exit

Failures carry the process's log, so a broken test shows why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import grpc
import pytest

from hio.cluster import HTTP_ROLES, LocalCluster
from hio.gateway import Gateway
from hio.process.procs import LIFELINE_ENV, RoleProcess, child_env, children, free_port

__all__ = [
    "FsyncDisk",
    "HioProcess",
    "cluster_engines",
    "die_with_starter",
    "engine_pids",
    "free_port",
    "health_of",
    "hio_env",
    "local_cluster",
    "stop_cleanly",
    "wait_for",
]


#: Each role a test starts serves its HTTP endpoint on a free port unless the test says
#: where (a flag wins over these): on its default port it would clash with another test's.
FREE_HTTP = {f"HIO_{role.upper()}_HTTP_LISTEN": "127.0.0.1:0" for role in HTTP_ROLES}


def die_with_starter(command: Sequence[str]) -> list[str]:
    """``command`` for a child that is no ``hio`` command (a JVM), run so that the kernel
    sends it SIGTERM when the thread that started it ends, as :data:`LIFELINE_ENV` does for
    a role: ``setpriv --pdeathsig`` (util-linux) sets ``PR_SET_PDEATHSIG`` (kept across
    exec), then a shell execs ``command`` only if its parent is still this process (one that
    died before the prctl sent nothing). So a test run killed with -9 leaves none behind.

    Not a ``preexec_fn``: that makes Python fork and run code in the child, and while
    other threads of the test call into gRPC, gRPC skips its fork handlers; its poller
    then aborts about one such child in a hundred before exec (SIGABRT, "epoll_wait
    error: Bad file descriptor"), and Popen returns a process already dead."""
    alive = 'test "$PPID" = "$1" && shift && exec "$@"'
    return ["setpriv", "--pdeathsig", "TERM", "--", "sh", "-c", alive, "die-with-starter", str(os.getpid()), *command]


def hio_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a `hio` command a test runs: no stray HIO_* settings, HTTP endpoints
    on free ports, and it dies with the test process (as the roles a test starts do)."""
    return child_env({LIFELINE_ENV: str(os.getpid()), **FREE_HTTP, **(extra or {})})


class HioProcess(RoleProcess):
    """A RoleProcess whose failures are test failures; its HTTP endpoint on a free port
    unless a flag says where."""

    def __init__(
        self,
        command: str,
        args: Sequence[str],
        workdir: Path,
        env: dict[str, str] | None = None,
        name: str | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        super().__init__(command, args, workdir, env={**FREE_HTTP, **(env or {})}, name=name, prefix=prefix)

    def wait_started(self, address: str, timeout: float = 60.0, settings: Any = None) -> None:
        try:
            super().wait_started(address, timeout, settings)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None

    def stacks(self, settle: float = 1.0) -> str:
        """Every thread's stack (``hio`` roles dump them on SIGUSR1) and the processes under
        this one: what a role that seems stuck is doing."""
        if self.proc is None or self.proc.poll() is not None:
            return f"{self.name} is not running (exit {None if self.proc is None else self.proc.returncode})"
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(settle)
        tree = subprocess.run(
            ["ps", "--ppid", str(self.proc.pid), "-o", "pid,etime,pcpu,args"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return f"processes under {self.name}:\n{tree}\n{self.output()}"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        code = self.stop()
        if exc[0] is None and code not in (0, -signal.SIGTERM):
            raise AssertionError(f"{self.name} exited with {code} after SIGTERM:\n{self.output()}")


def local_cluster(root: Path, **options: Any) -> LocalCluster:
    """A :class:`LocalCluster` (same options) whose roles' failures are test failures."""
    return LocalCluster(root, process=HioProcess, **options)


def stop_cleanly(cluster: LocalCluster) -> None:
    """Stop every role of ``cluster``; one that did not exit cleanly fails the test, with its log."""
    problems = cluster.stop()
    assert not problems, "\n".join(problems)


def engine_pids(worker_pid: int) -> dict[str, int]:
    """The engine processes a worker started, by channel id (Linux /proc)."""
    found = {}
    for pid in children(worker_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone since the listing
            continue
        for item in environ:
            if item.startswith(b"HIO_ENGINE_CHANNEL_ID="):
                found[item.split(b"=", 1)[1].decode()] = pid
    return found


def cluster_engines(cluster: LocalCluster, worker: str = "") -> list[int]:
    """The engine processes of the cluster's running workers (or of worker ``worker``)."""
    return [
        pid
        for name, proc in cluster.procs.items()
        if proc.command == "worker" and proc.alive() and (not worker or name == worker)
        for pid in engine_pids(proc.pid).values()
    ]


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str | Callable[[], str] = "condition",
) -> Any:
    """Poll ``predicate`` until it returns a truthy value; that value, or AssertionError.

    ``what`` may be a function: it is called on failure, so a process's log
    in it is the log at the end of the wait, not at its start.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")


def error_after_stop(stop: Callable[[], None], stream: Any) -> tuple[grpc.RpcError, float]:
    """Stop a role (``stop``: send its process SIGTERM) while ``stream``, a call of it, waits
    for its next answer: the error that answer is, and the seconds from the stop to it."""
    stopped_at = time.monotonic()
    stop()
    with pytest.raises(grpc.RpcError) as stopped:
        next(stream)
    return stopped.value, time.monotonic() - stopped_at


class CuttingProxy:
    """A loopback TCP proxy whose connections can all be cut at once.

    Put it between two roles (give the client ``proxy.address``) and call
    ``cut()`` to sever every open connection mid-stream, as a flaky network
    would. New connections are accepted again right away. ``connect`` opens the
    connection to ``target`` (by default from here; tests/topology opens it from
    inside a network namespace).
    """

    def __init__(self, target: str, connect: Callable[[str], Any] | None = None) -> None:
        import socket
        import threading

        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._address = target
        self._connect = connect
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: list[Any] = []
        self._closed = False
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                if self._connect is not None:
                    upstream = self._connect(self._address)
                else:
                    upstream = socket.create_connection(self._target, timeout=5)
                    upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: Any, dst: Any) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        """Sever every connection open right now (RST, as a dead link)."""
        import socket
        import struct

        with self._lock:
            conns, self._open = self._open, []
        for s in conns:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass
        self.cuts += 1

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()


def health_of(address: str, service: str = "", settings: Any = None) -> str:
    """What the standard health service at ``address`` answers for ``service`` ("" = the server
    as a whole, readiness; "liveness"): 'SERVING', 'NOT_SERVING', or the error's code name."""
    from grpc_health.v1 import health_pb2

    from hio.settings import ClusterSettings
    from hio.transport.net import create_channel

    with create_channel(address, settings or ClusterSettings()) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            reply = check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class FsyncDisk:
    """Stands between a durable store (the gateway's spool, the master's backlog, the
    repository's feature log, KD's Parquet store) and
    ``os.fsync`` (a system call, not one of our roles): names what is synced, and can hold
    or fail the calls, as a slow or failing disk."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.synced: list[str] = []
        self.open = threading.Event()
        self.open.set()
        self.error: OSError | None = None
        self._fsync = os.fsync
        monkeypatch.setattr(os, "fsync", self.fsync)

    def fsync(self, fd: int) -> None:
        self.open.wait()
        if self.error is not None:
            raise self.error
        self.synced.append(os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)"))
        self._fsync(fd)


def spooled_payload(spool: Any, entry: Any) -> bytes:
    """A spooled tuple's whole payload, as delivery streams it."""
    with spool.open_payload(entry) as fh:
        return bytes(fh.read(entry.size))


def cluster_gateway(cluster: LocalCluster, name: str, **overrides: Any) -> Gateway:
    """A gateway in this process sending to ``cluster``: source ``name``, its spool in the
    cluster's folder (``gw-<name>``), no progress bar; ``overrides`` are its settings."""
    return Gateway(
        master_address=cluster.master,
        repository_address=cluster.repository,
        data_dir=str(cluster.root / f"gw-{name}"),
        source=name,
        progress=False,
        **overrides,
    )


def wait_names_stored(
    read: Callable[[], list[Any]], names: set[str], context: Callable[[], str], timeout: float, interval: float = 0.5
) -> list[Any]:
    """Wait until ``read()`` (the repository's feature records) holds a record of every name
    in ``names``; those records. A timeout names the missing ones, then ``context()``."""

    def stored() -> list[Any] | None:
        records = read()
        return records if names <= {r.meta.name for r in records} else None

    def missing() -> str:
        have = {r.meta.name for r in read()}
        return f"{sorted(names - have)} to be stored\n{context()}"

    found: list[Any] = wait_for(stored, timeout=timeout, interval=interval, what=missing)
    return found
