"""The worker controller (`hio worker`): starts engines, keeps them running,
and keeps the master informed.

Two loops run side by side. The supervisor (main thread, every 0.2 s) polls
engines through the :class:`EngineLauncher`, marks an engine up once its
health check answers SERVING, and restarts crashed ones with exponential
backoff. The master session (a thread) registers the worker (retrying while
the master is unavailable), heartbeats every interval the master asked for
with every channel's state and its engine's CPU use, and registers again when
the master no longer knows the worker.

An elastic worker (``elastic``) has no engines of its own: it runs what the
master's plan gives it. Each heartbeat answer says how many engines of each
image; the supervisor starts engines until it runs that many, and stops an
engine only when the master names its channel as drained (it holds no tuple),
with the engine's own graceful stop.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import operator
import random
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hio.config import ConfigError, as_text, local_host
from hio.metrics import Tally
from hio.process.log import NOTICE
from hio.process.procs import watch_process
from hio.proto import master_pb2, master_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.http import serve_http
from hio.transport.net import ROLE_SERVICES, connect_hint, create_channel, create_server, stop_on_signals
from hio.transport.retry import Backoff
from hio.worker.api import PIPELINE_EXIT_CODE, pipeline_for_image
from hio.worker.config import EngineSettings, WorkerConfig, engine_counts
from hio.worker.cpu import CpuUsage
from hio.worker.launcher import EngineHandle, EngineLauncher, EngineSpec, ProcessLauncher, select_launcher
from hio.worker.metrics import WorkerMetrics

log = logging.getLogger("hio.worker")

SUPERVISE_INTERVAL = 0.2  # seconds between engine polls while an engine starts, restarts or stops
SETTLED_INTERVAL = 1.0  # ... while every engine serves and the plan wants no change (an exit is seen within it)
RESTART_BACKOFF_MIN = 0.5  # first restart delay; doubles up to restart_backoff_max
HEALTHY_RESET = 60.0  # seconds of healthy running that reset the backoff
NEW_PORT_AFTER = 3  # failed starts in a row before an engine gets a new port
HEALTH_TIMEOUT = 0.5
MASTER_CALL_TIMEOUT = 5.0


def free_port(host: str, port_range: tuple[int, int] | None = None, exclude: frozenset[int] = frozenset()) -> int:
    """A TCP port free on ``host`` right now (the engine binds it moments later), not in ``exclude``.

    With ``port_range`` the port comes from that range (tried in random order),
    so firewalls between gateways and workers can stay narrow.
    """
    if port_range is None:
        candidates = [0] * 100  # the kernel's choice, drawn again while it falls in ``exclude``
    else:
        candidates = [port for port in range(port_range[0], port_range[1] + 1) if port not in exclude]
        random.shuffle(candidates)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in candidates:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, candidate))
            except OSError:
                continue
            port = int(sock.getsockname()[1])
            if port not in exclude:
                return port
    where = "" if port_range is None else f" in {port_range[0]}-{port_range[1]}"
    raise RuntimeError(f"no free port for an engine{where} on {host}")


def _engine_health(stub: health_pb2_grpc.HealthStub, channel_id: str) -> health_pb2.HealthCheckResponse:
    """The engine's health, asked by its service's name: another process's server that took
    the port answers NOT_FOUND. So does an engine whose image does not name its service
    (it answers for the server as a whole); it is then asked that way, with a warning."""
    check = stub.Check  # type: ignore[attr-defined]  # types-grpcio-health-checking's HealthStub lists no methods
    try:
        return check(health_pb2.HealthCheckRequest(service=ROLE_SERVICES["engine"]), timeout=HEALTH_TIMEOUT)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
    reply = check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT)
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        log.warning(
            "engine answers health only as a whole: an image built by an older hio (rebuild it: "
            "hio images build), or another server holds its port",
            extra={"channel": channel_id},
        )
    return reply


def engine_env(
    config: WorkerConfig, *, channel_id: str, image: str, pipeline: str, port: int, lane_port: int = 0
) -> dict[str, str]:
    """The complete environment of one engine: its settings and the cluster's.

    Complete on purpose: the same variables configure a local process and a
    container with host networking, which inherits nothing else from us.
    """
    cluster = {f.name for f in dataclasses.fields(ClusterSettings)}
    passed = cluster - {"data_dir", "token", "token_file"}  # its own scratch folder; the token as read
    env = {f"HIO_{name.upper()}": as_text(getattr(config, name)) for name in passed if getattr(config, name) != ""}
    env.update(
        (f"HIO_ENGINE_{f.name.upper()}", as_text(getattr(config, f.name)))
        for f in dataclasses.fields(EngineSettings)
        if f.name not in cluster
    )
    env.update(
        HIO_ENGINE_CHANNEL_ID=channel_id,
        HIO_ENGINE_IMAGE=image,
        HIO_ENGINE_LISTEN=f"{config.engine_listen_host}:{port}",
    )
    env.update((f"HIO_ENGINE_{name.upper()}", value) for name, value in config.engine_overrides().items())
    if lane_port:
        env["HIO_ENGINE_LANE_LISTEN"] = f"{config.engine_listen_host}:{lane_port}"
    if pipeline:  # empty: the engine falls back to $HIO_PIPELINE of its image, then the built-in
        env["HIO_ENGINE_PIPELINE"] = pipeline
    if token := config.presented_token():
        env["HIO_TOKEN"] = token
    return env


@dataclasses.dataclass
class EngineSlot:
    """One channel: its engine, and the restart policy's memory of it."""

    channel_id: str
    image: str
    pipeline: str
    port: int
    lane_port: int = 0  # the engine's payload lane; 0 = none
    handle: EngineHandle | None = None
    up: bool = False
    detail: str = "starting"
    restarts: int = 0
    failed_starts: int = 0  # exits in a row before becoming healthy
    backoff: float = RESTART_BACKOFF_MIN
    next_start: float = 0.0  # monotonic time the engine may (re)start
    up_since: float = 0.0
    unavailable: str = ""  # why this engine cannot start at all (no pipeline for its image): never started
    stopping: bool = False  # drained for the master's plan: being stopped, then dropped

    def on_exit(self, code: int, now: float, backoff_max: float, last_line: str = "", reason: str = "") -> str:
        """Record a crash; schedule the restart; the operator-facing detail, which starts with
        ``reason`` when given.

        An engine that cannot load its pipeline says why on its last line: that is the
        reason shown, and it does not count towards moving the engine to a new port."""
        pipeline = code == PIPELINE_EXIT_CODE
        self.failed_starts = 0 if self.up or pipeline else self.failed_starts + 1
        self.handle, self.up = None, False
        self.restarts += 1
        delay = self.backoff
        self.next_start = now + delay
        self.backoff = min(self.backoff * 2, backoff_max)
        if not reason:
            reason = last_line.removeprefix("hio engine: ") if pipeline and last_line else f"exited with code {code}"
        self.detail = f"{reason}; restart {self.restarts} in {delay:.1f}s"
        return self.detail

    def on_healthy(self, now: float) -> None:
        self.up, self.up_since, self.failed_starts, self.detail = True, now, 0, ""

    def settle(self, now: float) -> None:
        """Forget past crashes after a long healthy run."""
        if self.up and now - self.up_since >= HEALTHY_RESET:
            self.backoff = RESTART_BACKOFF_MIN


class MasterSession:
    """Registration and heartbeats, on a thread of their own (never blocks supervision)."""

    def __init__(
        self,
        config: WorkerConfig,
        worker_id: str,
        channels: Callable[[bool], list[master_pb2.ChannelInfo]],
        on_answer: Callable[[master_pb2.HeartbeatResponse], None],
    ) -> None:
        self._config = config
        self._worker_id = worker_id
        self._channels = channels
        self._on_answer = on_answer
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._registered = False
        self.problem = "not registered with the master yet"  # '' while the master answers
        self._interval = 1.0
        self._channel = create_channel(config.master_address, config)
        self._stub = master_pb2_grpc.MasterStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="master-session", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        self._thread.join(MASTER_CALL_TIMEOUT + 1.0)
        self._channel.close()

    def poke(self) -> None:
        """A channel changed state: heartbeat now rather than at the next interval."""
        self._poke.set()

    def reregister(self) -> None:
        """Register again (channel addresses changed, or the master forgot this worker)."""
        self._registered = False
        self._poke.set()

    def _run(self) -> None:
        backoff = Backoff(base=0.2, cap=5.0)
        failures = 0
        while not self._stop.is_set():
            try:
                if not self._registered:
                    self._register()
                    backoff.reset()
                else:
                    self._heartbeat()
                wait = self._interval
                failures = 0
                if self._registered:  # else the master forgot this worker; it registers again
                    self.problem = ""
            except grpc.RpcError as exc:
                wait = backoff.delay()
                failures += 1
                code, reason = getattr(exc.code(), "name", "?"), exc.details()
                self.problem = f"the master does not answer ({code}: {reason})"
                extra = {"worker": self._worker_id, "code": code, "reason": reason, "retry_in_s": round(wait, 2)}
                if hint := connect_hint(reason or "", speaks_tls=self._config.speaks_tls):
                    extra["hint"] = hint  # a TLS mistake, not a master that is down
                # the first failure of a streak is a warning; the rest would only repeat it
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "master unreachable" if not self._registered else "heartbeat failed",
                    extra={**extra, "failures": failures},
                )
            self._poke.wait(wait)
            self._poke.clear()

    def _register(self) -> None:
        request = master_pb2.RegisterWorkerRequest(
            worker_id=self._worker_id,
            host=socket.gethostname(),
            cpus=self._config.effective_cpus(),
            channels=self._channels(True),
            elastic=self._config.elastic,
        )
        reply = self._stub.RegisterWorker(request, timeout=MASTER_CALL_TIMEOUT)
        self._interval = reply.heartbeat_interval_seconds if reply.heartbeat_interval_seconds > 0 else 1.0
        self._registered = True
        log.log(
            NOTICE,
            "registered with the master",
            extra={"worker": self._worker_id, "channels": len(request.channels), "heartbeat_s": self._interval},
        )

    def _heartbeat(self) -> None:
        request = master_pb2.HeartbeatRequest(worker_id=self._worker_id, channels=self._channels(False), complete=True)
        reply = self._stub.Heartbeat(request, timeout=MASTER_CALL_TIMEOUT)
        if not reply.known:
            self.problem = "the master does not know this worker; registering again"
            log.warning(self.problem, extra={"worker": self._worker_id})
            self.reregister()
            return
        self._on_answer(reply)


class Controller:
    """Supervises this worker's engines; see the module docstring."""

    def __init__(self, config: WorkerConfig, worker_id: str, launcher: EngineLauncher) -> None:
        self._config = config
        self._worker_id = worker_id
        self._launcher = launcher
        self._lock = threading.Lock()
        counts = [] if config.elastic else engine_counts(self._config.engines, self._config.effective_cpus())
        self._lanes = self._lanes_fit(sum(count for _, count in counts))
        self._indexes = itertools.count()  # of the channels this worker names "<worker_id>/<index>"
        self._slots = self._plan(counts)
        self._wanted: dict[str, int] | None = None  # the master's plan for this worker (elastic)
        self._to_stop: set[str] = set()  # channels the master drained for its plan
        self._stoppers: list[threading.Thread] = []
        self._restarts_gone: collections.Counter[str] = collections.Counter()  # image -> restarts of dropped slots
        self.cpu: Tally[tuple[str, str], float] = Tally(float, operator.add)  # image -> its engines' CPU seconds
        self.cpu_shares: dict[str, float] = {}  # image -> cores its engines used between the last two heartbeats
        self._cpu_last: dict[tuple[str, str], tuple[float, float]] = {}  # engine -> (CPU seconds, when read)
        self._session = MasterSession(config, worker_id, self.channel_infos, self._on_answer)

    def _plan(self, counts: list[tuple[str, int]]) -> list[EngineSlot]:
        """One slot per engine, pipelines resolved now so a bad image fails at start."""
        slots: list[EngineSlot] = []
        for image, count in counts:
            for _ in range(count):
                slots.append(self._new_slot(image, slots, strict=True))
        return slots

    def _new_slot(self, image: str, slots: list[EngineSlot], *, strict: bool) -> EngineSlot:
        """A channel for ``image``, its pipeline resolved and its ports none of ``slots`` has. One
        that cannot run (no pipeline, no free port) raises if ``strict``, else stays DOWN with
        the reason."""
        slot = EngineSlot(channel_id=f"{self._worker_id}/{next(self._indexes)}", image=image, pipeline="", port=0)
        try:
            local = isinstance(self._launcher, ProcessLauncher)
            slot.pipeline = pipeline_for_image(image, self._config.pipelines, builtin=local)
            slot.port, slot.lane_port = self._ports(slots)
        except (ConfigError, RuntimeError) as exc:
            if strict:
                raise
            slot.unavailable = slot.detail = f"cannot run: {exc}"
        return slot

    def _on_answer(self, reply: master_pb2.HeartbeatResponse) -> None:
        """A heartbeat answer (the master session's thread): the plan and the channels to stop,
        carried out by the supervisor."""
        if not self._config.elastic:
            return
        with self._lock:
            if reply.HasField("plan"):
                self._wanted = {item.image: item.count for item in reply.plan.engines}
            self._to_stop.update(reply.stop_channels)

    def _follow_plan(self) -> None:
        """Start engines the plan wants and this worker lacks; stop the drained ones named."""
        with self._lock:
            wanted = dict(self._wanted) if self._wanted is not None else None
            to_stop, self._to_stop = self._to_stop, set()
            slots = list(self._slots)
        for slot in slots:
            if slot.channel_id in to_stop and not slot.stopping:
                self._stop_drained(slot)
        for image, count in sorted((wanted or {}).items()):
            running = sum(1 for slot in slots if slot.image == image and not slot.stopping)
            for _ in range(count - running):
                self._add_slot(image)

    def _add_slot(self, image: str) -> None:
        """A new channel for ``image`` (:meth:`_new_slot`), its engine started by the next supervision pass."""
        with self._lock:
            slots = list(self._slots)
        slot = self._new_slot(image, slots, strict=False)
        with self._lock:
            self._slots.append(slot)
        log.info("engine added for the master's plan", extra={"channel": slot.channel_id, "image": image})
        self._session.poke()

    def _stop_drained(self, slot: EngineSlot) -> None:
        """Stop a drained engine gracefully (on a thread of its own: it may take the engine's
        grace), then drop its slot."""
        with self._lock:
            slot.stopping, slot.up, slot.detail = True, False, "stopping: drained for the master's plan"
            handle = slot.handle

        def stop() -> None:
            if handle is not None:
                try:
                    self._launcher.stop(handle, self._config.grace_seconds + 2.0)
                except Exception as exc:  # noqa: BLE001 - docker's errors are requests' and its own
                    log.warning(
                        "stopping a drained engine failed", extra={"channel": slot.channel_id, "error": str(exc)}
                    )
            with self._lock:
                self._slots = [other for other in self._slots if other is not slot]
                self._restarts_gone[slot.image] += slot.restarts
            log.info("engine stopped for the master's plan", extra={"channel": slot.channel_id})
            self._session.poke()

        thread = threading.Thread(target=stop, name=f"stop-{slot.channel_id}", daemon=True)
        self._stoppers.append(thread)
        thread.start()

    def _ports(self, slots: list[EngineSlot], *also: int) -> tuple[int, int]:
        """Free ports for an engine and its payload lane (0 = none: lanes off, or an engine_ports
        range without two ports per engine), none that ``slots`` were given (they bind later) or ``also``."""
        taken = frozenset({p for slot in slots for p in (slot.port, slot.lane_port)} | set(also))
        host, span = self._config.engine_listen_host, self._config.engine_port_range()
        port = free_port(host, span, exclude=taken)
        return port, free_port(host, span, exclude=taken | {port}) if self._lanes else 0

    def _lanes_fit(self, engines: int) -> bool:
        """Lanes on unless turned off, or engine_ports cannot give each engine two ports."""
        if not self._config.lanes:
            return False
        span = self._config.engine_port_range()
        if span is not None and span[1] - span[0] + 1 < 2 * engines:
            log.warning(
                "engine_ports has fewer than two ports per engine; engines serve no payload lane",
                extra={"engine_ports": self._config.engine_ports, "engines": engines},
            )
            return False
        return True

    @property
    def slots(self) -> list[EngineSlot]:
        return list(self._slots)

    def not_ready(self) -> str:
        """Why this worker cannot do its job just now, '' when it can (its health's
        readiness): the master does not answer it, or it runs engines and none serves."""
        if self._session.problem:
            return self._session.problem
        with self._lock:
            running = [slot for slot in self._slots if not slot.stopping]
        if running and not any(slot.up for slot in running):
            return f"none of its {len(running)} engines serves ({running[0].detail or 'starting'})"
        return ""

    def channel_infos(self, registering: bool) -> list[master_pb2.ChannelInfo]:
        """Every channel, FREE (serving) or DOWN with the reason; in heartbeats (not
        ``registering``) with the CPU its engine has used and waited for, for the master's
        profile."""
        host = self._config.advertise_host
        with self._lock:
            slots = [(slot, slot.handle) for slot in self._slots]
        cpu = {} if registering else self._cpu_usage(slots)
        with self._lock:
            return [
                master_pb2.ChannelInfo(
                    channel_id=slot.channel_id,
                    image=slot.image,
                    address=f"{host}:{slot.port}",
                    lane_address=f"{host}:{slot.lane_port}" if slot.lane_port else "",
                    state=master_pb2.FREE if slot.up else master_pb2.DOWN,
                    detail=slot.detail,
                    # None (not measured) leaves the field unset
                    cpu_seconds=getattr(cpu.get(slot.channel_id), "cpu_seconds", None),
                    cpu_wait_seconds=getattr(cpu.get(slot.channel_id), "wait_seconds", None),
                )
                for slot, _handle in slots
            ]

    def _cpu_usage(self, slots: list[tuple[EngineSlot, EngineHandle | None]]) -> dict[str, CpuUsage]:
        """CPU use of each running engine (read outside the lock: a container's may take a call
        to the Docker daemon)."""
        cpu = {}
        for slot, handle in slots:
            if handle is None:
                continue
            try:
                usage = self._launcher.cpu_usage(handle)
            except Exception as exc:  # noqa: BLE001 - a measurement must never stop the heartbeat
                log.debug("cannot measure an engine's CPU", extra={"channel": slot.channel_id, "error": str(exc)})
                continue
            if usage is not None:
                cpu[slot.channel_id] = usage
        self._tally_cpu(slots, cpu)
        return cpu

    def _tally_cpu(self, slots: list[tuple[EngineSlot, EngineHandle | None]], cpu: dict[str, CpuUsage]) -> None:
        """Each image's CPU seconds (a counter, across engine restarts) and the cores its
        engines used since the last reading, for the worker's metrics."""
        now = time.monotonic()
        live = {(slot.channel_id, handle.ident): slot.image for slot, handle in slots if handle is not None}
        seconds = {engine: cpu[engine[0]].cpu_seconds for engine in live if engine[0] in cpu}
        self.cpu.update(live, seconds)
        shares: dict[str, float] = {}
        for engine, used in seconds.items():
            before, when = self._cpu_last.get(engine, (used, now))
            if now > when:
                shares[live[engine]] = shares.get(live[engine], 0.0) + max(0.0, used - before) / (now - when)
        self._cpu_last = {engine: (used, now) for engine, used in seconds.items()}
        self.cpu_shares = shares

    def engine_slots(self) -> tuple[list[EngineSlot], dict[str, int]]:
        """A copy of every slot as it is now (for the metrics: the supervisor changes the slots
        meanwhile), and the restarts of engines no longer kept."""
        with self._lock:
            return [dataclasses.replace(slot) for slot in self._slots], dict(self._restarts_gone)

    def engine_address(self, slot: EngineSlot) -> str:
        """Where this worker reaches the slot's engine."""
        return f"{local_host(self._config.engine_listen_host)}:{slot.port}"

    def run(self, stop: threading.Event) -> int:
        """Supervise until ``stop`` is set; then stop every engine. Exit code 0."""
        self._session.start()
        try:
            while not stop.is_set():
                self.tick(time.monotonic())
                stop.wait(SETTLED_INTERVAL if self._settled() else SUPERVISE_INTERVAL)
        finally:
            self._session.stop()
            self.stop_engines(self._config.grace_seconds)
        return 0

    def _settled(self) -> bool:
        """Every engine that can run serves and the master's plan asks for nothing: the
        supervisor may look less often (an idle worker's polls are CPU spent for nothing)."""
        with self._lock:
            if self._to_stop or any(slot.stopping or not (slot.up or slot.unavailable) for slot in self._slots):
                return False
            running = collections.Counter(slot.image for slot in self._slots)
            return not any(running[image] < count for image, count in (self._wanted or {}).items())

    def tick(self, now: float) -> None:
        """One supervision pass over every slot. A slot the runtime cannot answer for just
        now (the Docker daemon restarting, an API timeout) is looked at again next pass; the
        engines keep running meanwhile; the worker does not stop them."""
        if self._config.elastic:
            self._follow_plan()
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            try:
                self._supervise(slot, now)
            except Exception as exc:  # noqa: BLE001 - docker's errors are requests' and its own
                log.warning(
                    "cannot supervise an engine just now; trying again",
                    extra={"channel": slot.channel_id, "error": f"{type(exc).__name__}: {exc}"},
                )

    def _supervise(self, slot: EngineSlot, now: float) -> None:
        if slot.stopping or slot.unavailable:
            return
        if slot.handle is None:
            if now >= slot.next_start:
                self._start(slot)
            return
        code = self._launcher.poll(slot.handle)
        if code is not None:
            self._on_exit(slot, slot.handle, code, now)
        elif not slot.up:
            self._check_health(slot, now)
        else:
            slot.settle(now)

    def _start(self, slot: EngineSlot) -> None:
        if slot.failed_starts >= NEW_PORT_AFTER:
            others = [other for other in self._slots if other is not slot]
            try:  # not the ports that kept failing either
                port, lane_port = self._ports(others, slot.port, slot.lane_port)
            except RuntimeError:  # a range with no other free port: keep trying the ones it has
                port, lane_port = slot.port, slot.lane_port
            with self._lock:
                slot.port, slot.lane_port, slot.failed_starts = port, lane_port, 0
            log.warning(
                "engine keeps failing to start; moving it to a new port",
                extra={"channel": slot.channel_id, "port": slot.port},
            )
            self._session.reregister()
        spec = EngineSpec(
            channel_id=slot.channel_id,
            image=slot.image,
            port=slot.port,
            env=engine_env(
                self._config,
                channel_id=slot.channel_id,
                image=slot.image,
                pipeline=slot.pipeline,
                port=slot.port,
                lane_port=slot.lane_port,
            ),
            cpus=self._config.engine_cpus,
            memory_bytes=self._config.engine_memory_bytes,
        )
        try:
            handle = self._launcher.start(spec)
        except Exception as exc:  # noqa: BLE001 - a launcher failure is one more crash to back off from
            log.error("cannot start engine", extra={"channel": slot.channel_id, "reason": str(exc)})
            with self._lock:
                slot.on_exit(
                    -1, time.monotonic(), self._config.restart_backoff_max, reason=f"cannot start: {str(exc)[:200]}"
                )
            self._session.poke()
            return
        with self._lock:
            slot.handle = handle
            if slot.restarts:
                slot.detail = f"restarting (restart {slot.restarts})"
        log.info(
            "engine started",
            extra={"channel": slot.channel_id, "image": slot.image, "port": slot.port, "id": handle.ident},
        )

    def _on_exit(self, slot: EngineSlot, handle: EngineHandle, code: int, now: float) -> None:
        lines = self._launcher.logs(handle, 3).strip().splitlines()
        with self._lock:
            detail = slot.on_exit(code, now, self._config.restart_backoff_max, lines[-1].strip() if lines else "")
        log.warning(
            "engine exited", extra={"channel": slot.channel_id, "detail": detail, "log_tail": " | ".join(lines)[-1000:]}
        )
        self._session.poke()

    def _check_health(self, slot: EngineSlot, now: float) -> None:
        address = self.engine_address(slot)
        try:
            with create_channel(address, self._config) as channel:
                reply = _engine_health(health_pb2_grpc.HealthStub(channel), slot.channel_id)
        except grpc.RpcError:
            return
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            with self._lock:
                slot.on_healthy(now)
            log.info("engine serving", extra={"channel": slot.channel_id, "address": address})
            self._session.poke()

    def stop_engines(self, grace: float) -> None:
        """SIGTERM every engine at once; kill those still running after ``grace`` + 2 s."""
        with self._lock:
            running = [slot.handle for slot in self._slots if slot.handle is not None and not slot.stopping]
        if running:
            with futures.ThreadPoolExecutor(max_workers=len(running)) as pool:
                list(pool.map(lambda h: self._launcher.stop(h, grace + 2.0), running))
        for thread in self._stoppers:  # drained engines being stopped
            thread.join(grace + 5.0)
        for slot in self._slots:
            slot.handle, slot.up = None, False
        self._launcher.cleanup()


def run_worker(config: WorkerConfig) -> int:
    """`hio worker`: supervise engines until SIGTERM/SIGINT; exit 0 once they are stopped."""
    worker_id = config.effective_worker_id()
    launcher = select_launcher(config, worker_id)
    controller = Controller(config, worker_id, launcher)
    stop = threading.Event()
    stop_on_signals(stop)
    if config.owner_pid:

        def owner_gone() -> None:
            log.warning("the process this worker ends with is gone; stopping", extra={"owner_pid": config.owner_pid})
            stop.set()

        watch_process(config.owner_pid, owner_gone)
    server, port, health = create_server(config, config.listen, max_workers=4)
    server.start()
    health.start(controller.not_ready)
    metrics = WorkerMetrics(controller, config) if config.metrics else None
    http = None
    try:
        http = serve_http(config, config.http_listen, metrics.registry if metrics else None, name="worker")
        log.log(
            NOTICE,
            "worker starting",
            extra={
                "worker": worker_id,
                "engines": len(controller.slots),
                "launcher": type(launcher).__name__,
                "listen": f"{config.listen.rpartition(':')[0]}:{port}",
                "http": http.address if http else "off",
            },
        )
        code = controller.run(stop)
    finally:
        if http is not None:
            http.close()
        if metrics is not None:
            metrics.close()
        health.stop()
        server.stop(0)
    log.info("worker stopped", extra={"worker": worker_id})
    return code
