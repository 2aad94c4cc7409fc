"""The local-cluster builder: one machine's roles as `hio` child processes.

Used by `hio up`, the benchmarks, the soak and every test that starts roles::

    with LocalCluster(root, workers={"w1": ["hio/synthetic=2"]}) as cluster:
        # a repository and a master on free ports, and w1 with its engines FREE
        cluster.add_worker("w2", ["hio/simulation=1"])  # another, also waited for
        cluster.add("kd", ["--interval", "3"])          # any other role
        ... cluster.master, cluster.repository, cluster.settings (for clients) ...
    # leaving: SIGTERM to every role in reverse order, SIGKILL after stop_timeout

Every role runs ``python -m hio.cli <role>`` with ``--data-dir root`` (each
role keeps its state in a folder of its own under it), the cluster's addresses,
and every shared setting that differs from its default (the token goes in the
environment, not on the command line). Arguments given for one role come after
those, so they override them (``--master-address PROXY``). Logs are
``root/logs/<name>.log``; a role that fails to come up raises with its log.
Every role dies with this process, even one killed with -9 (:mod:`hio.process.procs`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from hio.process.procs import RoleProcess, free_port
from hio.settings import ClusterSettings, settings_flags

#: Exit codes of a role that stopped as asked (None: killed after the timeout; -SIGKILL: killed
#: by its user on purpose, as the fault tests do).
CLEAN_EXITS = (0, None, -signal.SIGTERM, -signal.SIGKILL)
_OWN = ("master_address", "repository_address", "data_dir", "token")
HTTP_ROLES = ("master", "repository", "worker", "gateway", "kd")  # the commands with an http_listen


class LocalCluster:
    """A repository, a master and ``workers`` (:meth:`start`); more roles added to them.

    ``settings``: what every role shares (tokens, TLS, chunk size, log level); its
    addresses and data folder are not used. ``master_address`` / ``repository_address``:
    where those listen, by default free loopback ports. ``http``: role name -> where its
    HTTP endpoint listens ('' = none); a role not named gets a free loopback port (all are
    in :attr:`http` once started). ``master_args`` / ``repository_args``: their own flags.
    ``workers``: worker id ('' = the worker's default) -> its ``--engines`` entries, started
    with ``runtime`` and ``worker_args``; :meth:`start` returns once their engines are FREE.
    ``env``: variables for every role. ``process``: the class of each role's process
    (tests use one whose failures are test failures). Roles may run on hosts of their own
    that share this machine's files, such as network namespaces (``tests/topology``):
    ``prefixes``: role name -> the command that role is started through (``ip netns exec
    NS``, :class:`RoleProcess`'s ``prefix``); ``reach``: the address this process dials to
    reach a role's address for its own look at it (health, status; by default that address).
    """

    def __init__(
        self,
        root: Path,
        settings: ClusterSettings | None = None,
        *,
        master_address: str = "",
        repository_address: str = "",
        http: Mapping[str, str] | None = None,
        master_args: Sequence[str] = (),
        repository_args: Sequence[str] = (),
        workers: Mapping[str, Sequence[str]] | None = None,
        runtime: str = "process",
        worker_args: Sequence[str] = (),
        worker_timeout: float = 90.0,
        env: dict[str, str] | None = None,
        logs: Path | None = None,
        process: type[RoleProcess] = RoleProcess,
        stop_timeout: float = 20.0,
        prefixes: Mapping[str, Sequence[str]] | None = None,
        reach: Callable[[str], str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.logs = Path(logs) if logs else self.root / "logs"
        self.master = master_address or f"127.0.0.1:{free_port()}"
        self.repository = repository_address or f"127.0.0.1:{free_port()}"
        self._http_wanted = dict(http or {})
        self.http: dict[str, str] = {}  # role name -> where its HTTP endpoint listens ('' = none)
        self.settings = dataclasses.replace(
            ClusterSettings(
                **{f.name: getattr(settings or ClusterSettings(), f.name) for f in dataclasses.fields(ClusterSettings)}
            ),
            master_address=self.master,
            repository_address=self.repository,
            data_dir=str(self.root),
        )
        self.master_args = list(master_args)
        self.repository_args = list(repository_args)
        self.workers = dict(workers or {})
        self.runtime = runtime
        self.worker_args = list(worker_args)
        self.worker_timeout = worker_timeout
        self.env = dict(env or {})
        if self.settings.token:
            self.env.setdefault("HIO_TOKEN", self.settings.token)
        self.process = process
        self.stop_timeout = stop_timeout
        self.prefixes = {name: list(prefix) for name, prefix in (prefixes or {}).items()}
        self.reach = reach or (lambda address: address)
        self.procs: dict[str, RoleProcess] = {}
        self.health: dict[str, str] = {}  # name -> address to wait for SERVING at (re)start
        self.problems: list[str] = []  # what stop() found: roles that did not exit cleanly

    def start(self) -> Self:
        """Start the repository and the master, then the workers; return once the servers serve
        and the workers' engines are FREE. Everything started is stopped again if this fails
        (or is interrupted)."""
        try:
            if "repository" not in self.procs:
                self.add("repository", ["--listen", self.repository, *self.repository_args], health=self.repository)
            if "master" not in self.procs:
                self.add("master", ["--listen", self.master, *self.master_args], health=self.master)
            started = [
                (self.add_worker(worker_id, engines, args=self.worker_args, wait=False), worker_id, engines)
                for worker_id, engines in self.workers.items()
                if (worker_id or "worker") not in self.procs
            ]
            self._wait_engines(started, self.worker_timeout)  # started together, so their waits overlap
        except BaseException:
            self.stop()
            raise
        return self

    def add(
        self,
        command: str,
        args: Iterable[str] = (),
        *,
        name: str | None = None,
        env: dict[str, str] | None = None,
        health: str | None = None,
    ) -> RoleProcess:
        """Start one more role (``hio <command>``); with ``health``, wait until it serves there."""
        name = name or command
        if name in self.procs and self.procs[name].alive():
            raise RuntimeError(f"{name} is already running in this cluster")
        http: list[str] = []
        if command in HTTP_ROLES:
            self.http[name] = self._http_wanted.get(name, f"127.0.0.1:{free_port()}")
            http = ["--http-listen", self.http[name]]
        proc = self.process(
            command,
            [*self.common_args(), *http, *args],
            self.logs,
            env={**self.env, **(env or {})},
            name=name,
            prefix=self.prefixes.get(name, ()),
        )
        self.procs[name] = proc
        if health:
            self.health[name] = health
        self._start(name)
        return proc

    def add_worker(
        self,
        worker_id: str = "",
        engines: Sequence[str] = ("hio/synthetic=2",),
        *,
        runtime: str | None = None,
        args: Iterable[str] = (),
        env: dict[str, str] | None = None,
        name: str | None = None,
        wait: bool = True,
        timeout: float | None = None,
        listen: str = "",
    ) -> RoleProcess:
        """Start a worker (``worker_id`` '' = the worker's own default) with ``engines``
        (IMAGE or IMAGE=COUNT each); with ``wait``, return once its engines are FREE.
        ``runtime`` and ``timeout`` default to the cluster's. Its health listens on
        ``listen``, by default a free loopback port (``health[name]``)."""
        listen = listen or f"127.0.0.1:{free_port()}"
        flags = ["--runtime", runtime or self.runtime, "--listen", listen]
        flags += ["--worker-id", worker_id] if worker_id else []
        for entry in engines:
            flags += ["--engines", entry]
        proc = self.add("worker", [*flags, *args], name=name or worker_id or "worker", env=env, health=listen)
        if wait:
            self._wait_engines([(proc, worker_id, engines)], timeout or self.worker_timeout)
        return proc

    def _wait_engines(self, started: Iterable[tuple[RoleProcess, str, Sequence[str]]], timeout: float) -> None:
        """Wait until the engines of each worker started are FREE, all within ``timeout`` (1 s each at least)."""
        from hio.worker.config import engine_counts

        deadline = time.monotonic() + timeout
        for proc, worker_id, engines in started:
            left = max(1.0, deadline - time.monotonic())
            # the engines as a worker without --cpus counts them
            count = sum(n for _, n in engine_counts(tuple(engines), os.cpu_count() or 1))
            default_id = f"{socket.gethostname()}-{proc.pid}"  # the id of a worker started without one
            self.wait_channels(count, worker_id or default_id, left)

    def restart(self, name: str) -> RoleProcess:
        """Start ``name`` again (after it stopped or was killed), as it was first started."""
        self._start(name)
        return self.procs[name]

    def _start(self, name: str) -> None:
        proc = self.procs[name]
        proc.start()
        if name in self.health:
            proc.wait_started(self.reach(self.health[name]), settings=self.settings)

    def common_args(self) -> list[str]:
        return [
            "--master-address",
            self.master,
            "--repository-address",
            self.repository,
            "--data-dir",
            str(self.root),
            *settings_flags(self.settings, omit=_OWN),
        ]

    def status(self, timeout: float = 10.0) -> Any:
        from hio.proto import master_pb2, master_pb2_grpc
        from hio.transport.net import create_channel

        with create_channel(self.reach(self.master), self.settings) as channel:
            return master_pb2_grpc.MasterStub(channel).GetStatus(master_pb2.GetStatusRequest(), timeout=timeout)

    def free_channels(self, worker_id: str = "") -> int:
        """FREE channels at the master (of ``worker_id``, if given); 0 if it does not answer."""
        import grpc

        from hio.proto import master_pb2

        try:
            status = self.status(timeout=5)
        except grpc.RpcError:
            return 0
        if not worker_id:
            return int(status.channels_free)
        return sum(
            1 for w in status.workers if w.worker_id == worker_id for c in w.channels if c.state == master_pb2.FREE
        )

    def wait_channels(self, count: int, worker_id: str = "", timeout: float = 90.0) -> None:
        """Wait until ``count`` channels (of ``worker_id``, if given) are FREE at the master;
        else raise with the log of every worker."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.free_channels(worker_id) >= count:
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"{count} engines{f' of {worker_id}' if worker_id else ''} did not come up within {timeout:.0f} s\n"
            f"{self.output(command='worker')}"
        )

    def output(self, limit: int = 3000, command: str = "") -> str:
        """The end of every role's log (of each ``command`` role, if given), the workers the
        master's local provisioner started counted as workers: what to show when something
        went wrong."""
        logs = [
            f"--- {name} ({proc.log_path}) ---\n{proc.output(limit)}"
            for name, proc in self.procs.items()
            if not command or proc.command == command
        ]
        if command in ("", "worker"):
            for path in sorted((self.root / "master" / "local-workers").glob("*.log")):
                logs.append(f"--- {path.stem} ({path}) ---\n{path.read_text(errors='replace')[-limit:]}")
        return "\n".join(logs)

    def remove(self, name: str, timeout: float | None = None) -> int | None:
        """Stop one role and forget it; its exit code (None if it had to be killed)."""
        self.health.pop(name, None)
        self.http.pop(name, None)
        return self.procs.pop(name).stop(self.stop_timeout if timeout is None else timeout)

    def stop(self) -> list[str]:
        """SIGTERM each role, last started first, and wait (SIGKILL after ``stop_timeout``).
        Every role is stopped whatever happens to the others. Returns (and keeps in
        ``problems``) a line with the log's end for each that did not exit cleanly."""
        problems = []
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            try:
                code = proc.stop(self.stop_timeout)
            except Exception as exc:  # noqa: BLE001 - the others must still be stopped
                problems.append(f"{name} could not be stopped: {exc!r}")
                continue
            if code not in CLEAN_EXITS:
                problems.append(f"{name} exited with {code}; its log {proc.log_path}:\n{proc.output(3000)}")
        # workers the master's local provisioner started outlive the master (a restarted master
        # adopts them), not the cluster: stopped once the master is
        from hio.master.provisioners.local import stop_recorded_workers

        stop_recorded_workers(self.root / "master", self.stop_timeout)
        self.procs.clear()
        self.health.clear()
        self.http.clear()
        self.problems += problems
        return problems

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
