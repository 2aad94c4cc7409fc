"""``hio bench-scale``: how the cost grows with the cluster and the store.

Three curves, each written as a CSV (one row per point, with the date, machine, commit and
load average) and a plot under ``out``, and all three as ``out/scale.md``:

* ``master``: the master's routing capacity with 10 to 5,000 channels. A real ``hio master``
  process; a load generator that speaks the worker and gateway protocols over real gRPC, in
  processes of its own: fake workers register the channels (``channels_per_worker`` each, as
  many engines as a worker has vCPUs) and heartbeat as the real worker does (every interval,
  every channel listed with its CPU time); gateway threads route one batch at a time as the
  real gateway does (``RouteTuples`` with its route wait), and the channel's "engine" reports
  the batch stored and releases the channel at once (``ReportTuples``), so no engine runs.
  Never more routes are in flight than there are channels, so every route finds one (a route
  to the queue is counted, not enqueued; none is expected). Routes/s over a window after a
  warm-up, the master's CPU per route from ``/proc``, and the route call's latency. Right
  before each point, the gRPC floor: the CPU the roles' server (grpcio's synchronous server as
  ``create_server`` builds it) spends per unary call and per message of a kept stream when its
  handlers do nothing (:func:`grpc_floor`), the part of a route's cost that no change to the
  master's own code can remove.
* ``repository``: restart time (process start to SERVING: the index rebuilt from the segments)
  and index memory (RSS after start less an empty repository's) with stores of ``records``
  small records, filled with real ``PutFeatures`` batches. Each store is kept under
  ``data_dir/bench-scale/`` and reused by later runs (filling 10 M takes minutes); restarts are
  measured with the segments in the page cache (warm) and evicted from it (cold).
* ``kd``: one KD interval over ``kd_new`` new records with the store empty and with each of
  ``kd_stored`` records already stored and accumulated by KD (``hio bench-kd``'s measurement).

Targets (printed with each curve): at least 20,000 routes/s at 1,000 channels; a restart under
30 s and an index under 1 GiB at 10 M records; the KD interval over 10 M stored within 2x of the
empty store's.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import dataclasses
import datetime
import json
import multiprocessing
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.measure import machine_description, proc_cpu_seconds, proc_usage, source_commit
from hio.config import ConfigError, positive, setting
from hio.settings import ClusterSettings

CURVES = ("master", "repository", "kd")
IMAGE = "hio/synthetic"
TUPLE_BYTES = 1_000_000  # the size each routed tuple claims (routing does not look at payloads)
FILL_BATCH = 5000  # records per PutFeatures while filling a store
FILL_FEATURES = 4  # numeric features per record: a small record
ROUTE_TARGET = 20_000.0  # routes/s at TARGET_CHANNELS
TARGET_CHANNELS = 1000
RESTART_TARGET = 30.0  # seconds, at TARGET_RECORDS
INDEX_TARGET_MIB = 1024.0  # at TARGET_RECORDS
TARGET_RECORDS = 10_000_000
KD_RATIO_TARGET = 2.0
_DECIMAL = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_count(text: str, name: str) -> int:
    """'10', '10k', '1M', '10M' -> a count (decimal units)."""
    t = str(text).strip().lower()
    try:
        value = int(float(t[:-1]) * _DECIMAL[t[-1]]) if t and t[-1] in _DECIMAL else int(t)
    except ValueError:
        raise ConfigError(f"{name}: cannot read {text!r} as a count (examples: 100, 10k, 1M)") from None
    if value < 0:
        raise ConfigError(f"{name}: {text!r} is negative")
    return value


def count_label(n: int) -> str:
    """10_000_000 -> '10M', 1000 -> '1k', 10 -> '10'."""
    for suffix, unit in (("M", 1_000_000), ("k", 1_000)):
        if n >= unit and n % (unit // 10) == 0:
            return f"{n / unit:g}{suffix}"
    return str(n)


@dataclasses.dataclass(frozen=True)
class ScaleBenchConfig(ClusterSettings):
    curves: tuple[str, ...] = setting(None, "curves to measure: master, repository, kd", factory=lambda: CURVES)
    out: str = setting("docs/benchmarks", "folder for the CSV files, plots and scale.md")
    channels: tuple[str, ...] = setting(
        None, "master: channel counts to measure", factory=lambda: ("10", "100", "1000", "5000")
    )
    channels_per_worker: int = setting(16, "master: channels each fake worker registers (its engines)")
    seconds: float = setting(10.0, "master: measured window per channel count")
    warmup_seconds: float = setting(3.0, "master: load before the window, not counted")
    gateways: int = setting(2, "master: load generator processes routing as gateways")
    gateway_threads: int = setting(8, "master: routes in flight per gateway process (never more than the channels)")
    tuples_per_route: int = setting(1, "master: tuples in each routed batch (the real gateway's batch_tuples bound)")
    route_wait_seconds: float = setting(5.0, "master: how long a route may wait for a busy channel (the gateway's)")
    records: tuple[str, ...] = setting(None, "repository: store sizes to measure", factory=lambda: ("1M", "10M"))
    restarts: int = setting(3, "repository: restarts measured per store size and cache state")
    fill_processes: int = setting(2, "repository: processes putting records while a store is filled")
    kd_stored: tuple[str, ...] = setting(
        None, "kd: records already stored, besides the empty store", factory=lambda: ("1M", "10M")
    )
    kd_new: int = setting(1000, "kd: new records in each timed interval")
    kd_catch_up: int = setting(200_000, "kd: KD's micro-batch bound while it catches up on the stored records")
    spark_master: str = setting("local[2]", "kd: Spark master URL")
    measure: bool = setting(True, "off: measure nothing, only write scale.md again from the CSVs in out")
    profile: bool = setting(
        False,
        "master: sample the master's thread holding the interpreter with py-spy during each window "
        "(pip install py-spy; needs ptrace) and print where its time goes; the samples (collapsed "
        "stacks) stay under data_dir/bench-scale/profiles",
    )

    def validate(self) -> None:
        self.validate_cluster()
        unknown = sorted(set(self.curves) - set(CURVES))
        if unknown or not self.curves:
            raise ConfigError(f"curves must be some of {', '.join(CURVES)}, got {', '.join(self.curves) or 'none'}")
        for name in (
            "channels_per_worker",
            "seconds",
            "gateways",
            "gateway_threads",
            "tuples_per_route",
            "restarts",
            "fill_processes",
            "kd_new",
            "kd_catch_up",
        ):
            positive(name, getattr(self, name))
        if self.channels_per_worker > 1024:
            raise ConfigError(
                f"channels_per_worker must be at most 1024 (the master's bound), got {self.channels_per_worker}"
            )
        if not 0 <= self.route_wait_seconds <= 30:
            raise ConfigError(f"route_wait_seconds must be between 0 and 30, got {self.route_wait_seconds}")
        if not self.warmup_seconds >= 0:  # NaN too
            raise ConfigError(f"warmup_seconds must be 0 or more, got {self.warmup_seconds}")
        if any(n < 1 for n in self.channel_counts()):
            raise ConfigError("channels: every count must be at least 1")
        if any(n < 1 for n in self.record_counts()):
            raise ConfigError("records: every size must be at least 1")
        if any(n < self.kd_new for n in self.kd_sizes()):
            raise ConfigError(f"kd_stored: every size must be at least kd_new ({self.kd_new})")
        if self.profile and "master" in self.curves and not py_spy():
            raise ConfigError("profile: py-spy is not installed here (pip install py-spy), nor on PATH")

    def channel_counts(self) -> list[int]:
        return sorted({parse_count(c, "channels") for c in self.channels})

    def record_counts(self) -> list[int]:
        return sorted({parse_count(r, "records") for r in self.records})

    def kd_sizes(self) -> list[int]:
        return sorted({parse_count(s, "kd_stored") for s in self.kd_stored})


def _provenance() -> dict[str, Any]:
    """What every row records: when, the load, the machine and the commit."""
    return {
        "load_avg": round(os.getloadavg()[0], 2),
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "commit": source_commit(),
    }


# ---------------------------------------------------------------------------------------------
# The gRPC floor: what one call costs the roles' server before any handler code runs

FLOOR_CALLS = 2000  # calls (and stream messages) per client thread
FLOOR_THREADS = 4  # client threads calling at once, as several gateways and workers do


def _floor_handlers() -> Any:
    import grpc

    def unary(request: bytes, context: Any) -> bytes:
        return request

    def stream(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        yield from requests

    return grpc.method_handlers_generic_handler(
        "floor.Floor",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )


def floor_server_process(settings: ClusterSettings, port: Any, stop: Any) -> None:
    """The roles' gRPC server (:func:`~hio.transport.net.create_server`: the master's pool of
    threads, options and interceptors) serving only handlers that do nothing."""
    from hio.transport.net import create_server

    server, port.value, _ = create_server(
        settings, "127.0.0.1:0", register=[lambda s: s.add_generic_rpc_handlers((_floor_handlers(),))]
    )
    server.start()
    stop.wait()
    server.stop(0)


def grpc_floor(settings: ClusterSettings, calls: int = FLOOR_CALLS, threads: int = FLOOR_THREADS) -> dict[str, float]:
    """The server's CPU (µs) per unary call and per message of a kept bidirectional stream, with
    handlers that do nothing, measured in a process of its own right before a master point: the
    part of the master's CPU per route that is its gRPC server's, whatever the master's code does,
    on this machine in its state at that point (which moves by up to 2x between days here)."""
    import grpc

    from hio.transport.net import create_channel

    context = multiprocessing.get_context("spawn")
    port, stop = context.Value("i", 0), context.Event()
    server = context.Process(target=floor_server_process, args=(settings, port, stop), daemon=True)
    server.start()
    pid = server.pid or 0
    try:
        deadline = time.monotonic() + 60
        while port.value == 0:
            if not server.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gRPC floor's server did not start")
            time.sleep(0.05)
        with create_channel(f"127.0.0.1:{port.value}", settings) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            unary: Any = channel.unary_unary("/floor.Floor/Unary")
            stream: Any = channel.stream_stream("/floor.Floor/Stream")
            message = bytes(64)

            def unary_calls(n: int) -> None:
                for _ in range(n):
                    unary(message, timeout=30)

            def stream_messages(n: int) -> None:
                requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
                answers = stream(iter(requests.get, None), timeout=300)
                for _ in range(n):
                    requests.put(message)
                    next(answers)
                requests.put(None)

            def server_us_per_call(work: Callable[[int], None]) -> float:
                work(calls // 10)  # warm: channel, pool threads, code paths
                before = proc_cpu_seconds(pid)
                clients = [threading.Thread(target=work, args=(calls,)) for _ in range(threads)]
                for client in clients:
                    client.start()
                for client in clients:
                    client.join()
                return round((proc_cpu_seconds(pid) - before) * 1e6 / (calls * threads), 1)

            unary_us = server_us_per_call(unary_calls)
            return {"grpc_unary_us": unary_us, "grpc_stream_us": server_us_per_call(stream_messages)}
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.kill()
            server.join(10)


# ---------------------------------------------------------------------------------------------
# The master's routing capacity


@dataclasses.dataclass(frozen=True)
class _Window:
    """The measured window, by the wall clock every generator process shares."""

    start: float
    end: float
    stop: float  # routes in flight at ``end`` finish; then the processes stop


def _fake_channels(worker: int, per_worker: int, first_port: int) -> list[Any]:
    """A fake worker's channels as the real worker announces them: FREE, engine and lane addresses."""
    from hio.proto import master_pb2

    return [
        master_pb2.ChannelInfo(
            channel_id=f"bench-w{worker:05d}/{n}",
            image=IMAGE,
            address=f"127.0.0.1:{first_port + 2 * n}",
            lane_address=f"127.0.0.1:{first_port + 2 * n + 1}",
            state=master_pb2.FREE,
        )
        for n in range(per_worker)
    ]


def workers_process(
    address: str, settings: ClusterSettings, channels: int, per_worker: int, stop: Any, registered: Any, expired: Any
) -> None:
    """Register ``channels`` channels in workers of ``per_worker``, then heartbeat each worker at
    the interval the master gives, every channel listed with its CPU time (as the real worker's
    complete heartbeat), until ``stop``. As the real worker, a worker the master no longer
    knows (it expired: a heartbeat came late on a loaded machine) registers again, and a
    heartbeat that fails is tried again at the next interval; ``expired`` counts both."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from hio.proto import master_pb2, master_pb2_grpc
    from hio.transport.net import create_channel

    sizes = [min(per_worker, channels - start) for start in range(0, channels, per_worker)]
    with create_channel(address, settings) as channel, ThreadPoolExecutor(4) as pool:
        stub = master_pb2_grpc.MasterStub(channel)

        def register(worker: int) -> float:
            reply = stub.RegisterWorker(
                master_pb2.RegisterWorkerRequest(
                    worker_id=f"bench-w{worker:05d}",
                    host="bench",
                    cpus=sizes[worker],
                    channels=_fake_channels(worker, sizes[worker], 20000),
                ),
                timeout=30,
            )
            return float(reply.heartbeat_interval_seconds or 1.0)

        interval = min(pool.map(register, range(len(sizes))))
        registered.set()
        started = time.monotonic()

        def heartbeat(worker: int) -> None:
            infos = _fake_channels(worker, sizes[worker], 20000)
            for info in infos:  # the engines' CPU so far, for the master's profile
                info.cpu_seconds = (time.monotonic() - started) * 0.01
            request = master_pb2.HeartbeatRequest(worker_id=f"bench-w{worker:05d}", channels=infos, complete=True)
            try:
                if not stub.Heartbeat(request, timeout=interval * 5).known:
                    register(worker)
                    with expired.get_lock():
                        expired.value += 1
            except grpc.RpcError:
                with expired.get_lock():
                    expired.value += 1

        while not stop.is_set():
            began = time.monotonic()
            list(pool.map(heartbeat, range(len(sizes))))  # every worker once per interval
            stop.wait(max(0.0, interval - (time.monotonic() - began)))


def gateway_process(
    address: str, settings: ClusterSettings, threads: int, batch: int, wait: float, window: _Window, results: Any
) -> None:
    """Route batches on ``threads`` threads (one kept channel, as the real gateway); each channel
    route is answered at once by the channel's report (stored, released). Puts this process's
    counts and latencies on ``results``."""
    from hio.proto import master_pb2, master_pb2_grpc
    from hio.transport.net import create_channel

    counts = {"routes": 0, "queued": 0, "errors": 0}
    latencies: list[float] = []
    lock = threading.Lock()
    source = f"bench-scale-{os.getpid()}"

    with create_channel(address, settings) as channel:
        stub = master_pb2_grpc.MasterStub(channel)

        def loop() -> None:
            import grpc

            while time.time() < window.stop:
                began = time.time()
                try:
                    reply = stub.RouteTuples(
                        master_pb2.RouteTuplesRequest(
                            source=source,
                            image=IMAGE,
                            items=[master_pb2.RouteItem(size=TUPLE_BYTES)] * batch,
                            wait_seconds=wait,
                        ),
                        timeout=wait + 15,
                    )
                    routed = time.time()
                    if reply.HasField("channel"):
                        now = time.time()
                        stub.ReportTuples(
                            master_pb2.ReportTuplesRequest(
                                channel_id=reply.channel.channel_id,
                                outcomes=[
                                    master_pb2.TupleOutcome(
                                        tuple_id=tuple_id,
                                        ok=True,
                                        size=TUPLE_BYTES,
                                        processing_seconds=0.0,
                                        accepted_unix=began,
                                        stored_unix=now,
                                    )
                                    for tuple_id in reply.tuple_ids
                                ],
                                release=True,
                            ),
                            timeout=15,
                        )
                    outcome = "routes" if reply.HasField("channel") else "queued"
                except grpc.RpcError:
                    outcome, routed = "errors", time.time()
                if window.start <= began and time.time() <= window.end:
                    with lock:
                        counts[outcome] += 1
                        latencies.append(routed - began)

        workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    results.put({**counts, "latencies": latencies, "cpu": proc_cpu_seconds(os.getpid())})


def py_spy() -> str:
    """The py-spy executable: on PATH, else beside this interpreter; '' when neither has it."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else "")


def _profile(pid: int, seconds: float, path: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` for ``seconds`` into ``path`` (collapsed stacks: one line per
    stack, its frames from the root, and its sample count)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [py_spy(), "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", "200", "--gil"]
    return subprocess.Popen(
        [*command, "--format", "raw", "--nonblocking", "-o", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def profile_summary(path: Path, top: int = 25) -> list[str]:
    """The functions the samples of ``path`` spent most time in (inclusive, their callees
    counted) and below them the leaves (where time is spent itself), as shares of all samples."""
    inclusive: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        n = int(count)
        total += n
        for frame in set(frames):
            inclusive[frame] += n
        if frames:
            leaves[frames[-1]] += n
    if not total:
        return [f"{path}: no samples"]
    lines = [f"{total} samples; inclusive:"]
    lines += [f"  {n / total:6.1%}  {frame}" for frame, n in inclusive.most_common(top)]
    lines += ["leaves:"]
    lines += [f"  {n / total:6.1%}  {frame}" for frame, n in leaves.most_common(top)]
    return lines


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_master(config: ScaleBenchConfig, root: Path, channels: int, profile: Path | None = None) -> dict[str, Any]:
    """One point of the master curve: a fresh master, ``channels`` channels, routes/s and CPU;
    with ``profile``, the master's samples over the window go there."""
    from hio.cluster import LocalCluster
    from hio.transport.net import wait_healthy

    shutil.rmtree(root, ignore_errors=True)
    floor = grpc_floor(config)
    context = multiprocessing.get_context("spawn")
    cluster = LocalCluster(root, config)
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        proc = cluster.add("master", ["--listen", cluster.master], health=cluster.master)
        settings = cluster.settings
        stop, registered, expired = context.Event(), context.Event(), context.Value("i", 0)
        workers = context.Process(
            target=workers_process,
            args=(cluster.master, settings, channels, config.channels_per_worker, stop, registered, expired),
            daemon=True,
        )
        workers.start()
        stack.callback(workers.join, 30)
        stack.callback(stop.set)
        if not registered.wait(120):
            raise RuntimeError(f"the fake workers did not register {channels} channels within 120 s")
        wait_healthy(cluster.master, settings, timeout=60, alive=proc.alive)  # ready: channels serve
        in_flight = min(channels, config.gateways * config.gateway_threads)
        processes = min(config.gateways, in_flight)
        start = time.time() + 2.0 + config.warmup_seconds  # the processes start within 2 s
        window = _Window(start, start + config.seconds, start + config.seconds + 1.0)
        results = context.Queue()
        gateways = [
            context.Process(
                target=gateway_process,
                args=(
                    cluster.master,
                    settings,
                    in_flight // processes + (1 if p < in_flight % processes else 0),
                    config.tuples_per_route,
                    config.route_wait_seconds,
                    window,
                    results,
                ),
                daemon=True,
            )
            for p in range(processes)
        ]
        for gateway in gateways:
            gateway.start()
        time.sleep(max(0.0, window.start - time.time()))
        cpu_before, load_before = proc_cpu_seconds(proc.pid), os.getloadavg()[0]
        profiler = _profile(proc.pid, config.seconds, profile) if profile is not None else None
        time.sleep(max(0.0, window.end - time.time()))
        cpu = proc_cpu_seconds(proc.pid) - cpu_before
        if profiler is not None:
            profiler.wait(60)
        rss_kib = (proc_usage(proc.pid) or _NO_USAGE).rss_kib
        parts = [results.get(timeout=120) for _ in gateways]
        for gateway in gateways:
            gateway.join(30)
    routes = sum(p["routes"] for p in parts)
    latencies = [x for p in parts for x in p["latencies"]]
    return {
        "channels": channels,
        "workers": -(-channels // config.channels_per_worker),
        "in_flight": in_flight,
        "tuples_per_route": config.tuples_per_route,
        "seconds": config.seconds,
        "routes": routes,
        "routes_per_s": round(routes / config.seconds, 1),
        "queued": sum(p["queued"] for p in parts),
        "errors": sum(p["errors"] for p in parts),
        "heartbeats_missed": expired.value,
        "master_cpu_ms_per_route": round(cpu * 1000 / max(routes, 1), 4),
        "master_cores": round(cpu / config.seconds, 3),
        "routes_per_master_cpu_s": round(routes / cpu, 1) if cpu > 0 else "",
        **floor,
        "route_p50_ms": round(_percentile(latencies, 0.5) * 1000, 3),
        "route_p99_ms": round(_percentile(latencies, 0.99) * 1000, 3),
        "generator_cpu_s": round(sum(p["cpu"] for p in parts), 2),
        "master_rss_mib": round(rss_kib / 1024, 1),
        "load_avg_before": round(load_before, 2),
        **_provenance(),
    }


@dataclasses.dataclass(frozen=True)
class _Usage:
    rss_kib: int = 0


_NO_USAGE = _Usage()


def run_master_curve(config: ScaleBenchConfig, root: Path) -> list[dict[str, Any]]:
    rows = []
    for channels in config.channel_counts():
        profile = root / "profiles" / f"master-{channels}.txt" if config.profile else None
        row = measure_master(config, root / "master" / str(channels), channels, profile)
        rows.append(row)
        if profile is not None:
            for line in profile_summary(profile):
                print(f"  {line}", flush=True)
        print(
            f"master  {channels:>6} channels: {row['routes_per_s']:>9,.1f} routes/s, "
            f"{row['master_cpu_ms_per_route']:.3f} ms master CPU per route "
            f"({row['routes_per_master_cpu_s'] or 0:,.0f} routes per CPU second; gRPC floor "
            f"{row['grpc_unary_us']:,.0f} µs a unary call, {row['grpc_stream_us']:,.0f} µs a stream message), "
            f"p50 {row['route_p50_ms']:.2f} ms, "
            f"p99 {row['route_p99_ms']:.2f} ms, queued {row['queued']}, errors {row['errors']}, "
            f"heartbeats missed {row['heartbeats_missed']}, "
            f"load {row['load_avg']}",
            flush=True,
        )
    shutil.rmtree(root / "master", ignore_errors=True)  # a master's state is of no use to a later run
    return rows


# ---------------------------------------------------------------------------------------------
# The repository: restart time and index memory


def fill_process(address: str, settings: ClusterSettings, chunks: list[int], done: Any) -> None:
    """Put the records of ``chunks`` (chunk k: tuple ids k*FILL_BATCH+1 ..), one PutFeatures each."""
    from benchmarks.kd import feature_uploads
    from hio.proto import repository_pb2, repository_pb2_grpc
    from hio.transport.net import create_channel

    with create_channel(address, settings) as channel:
        stub = repository_pb2_grpc.RepositoryStub(channel)
        for chunk in chunks:
            uploads = feature_uploads(chunk * FILL_BATCH + 1, FILL_BATCH, FILL_FEATURES, 1, seed=chunk)
            stub.PutFeatures(repository_pb2.PutFeaturesRequest(records=uploads), timeout=300)
            with done.get_lock():
                done.value += FILL_BATCH


def _stored(address: str, settings: ClusterSettings) -> int:
    from hio.proto import repository_pb2, repository_pb2_grpc
    from hio.transport.net import create_channel

    with create_channel(address, settings) as channel:
        stub = repository_pb2_grpc.RepositoryStub(channel)
        return int(stub.GetOffsets(repository_pb2.GetOffsetsRequest(), timeout=30).latest)


def fill_store(config: ScaleBenchConfig, root: Path, records: int) -> float:
    """The store under ``root`` holding ``records`` records (rounded up to whole batches): kept
    from an earlier run, finished where one stopped, or filled; the seconds its filling took."""
    from hio.cluster import LocalCluster

    marker = root / "filled.json"
    if marker.exists():
        return float(json.loads(marker.read_text())["fill_seconds"])
    chunks = -(-records // FILL_BATCH)
    cluster = LocalCluster(root, config)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        # Filling needs no fsync per batch; the restarts measured afterwards use the defaults.
        cluster.add("repository", ["--listen", cluster.repository, "--fsync", "never"], health=cluster.repository)
        stored = _stored(cluster.repository, cluster.settings)
        # Each process puts its chunks in order, so everything below (stored - a chunk per
        # process) is there; putting a stored chunk again is idempotent.
        first = max(0, stored // FILL_BATCH - config.fill_processes)
        todo = list(range(first, chunks))
        print(f"repository: filling {count_label(records)} records ({stored:,} there already)", flush=True)
        context = multiprocessing.get_context("spawn")
        done = context.Value("q", first * FILL_BATCH)
        fillers = [
            context.Process(
                target=fill_process,
                args=(cluster.repository, cluster.settings, todo[p :: config.fill_processes], done),
                daemon=True,
            )
            for p in range(config.fill_processes)
        ]
        for filler in fillers:
            filler.start()
        last_print = time.monotonic()
        while any(f.is_alive() for f in fillers):
            time.sleep(0.5)
            if time.monotonic() - last_print >= 30:
                last_print = time.monotonic()
                print(f"repository: {done.value:,} of {chunks * FILL_BATCH:,} records put", flush=True)
        if any(f.exitcode != 0 for f in fillers):
            raise RuntimeError(f"filling the store failed; the repository's log: {cluster.output()}")
        stored = _stored(cluster.repository, cluster.settings)
    if stored < chunks * FILL_BATCH:
        raise RuntimeError(f"the store holds {stored} records after filling, not {chunks * FILL_BATCH}")
    seconds = time.monotonic() - started
    marker.write_text(json.dumps({"records": stored, "fill_seconds": round(seconds, 1)}))
    return seconds


def evict_from_cache(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (theirs only: other processes' pages stay),
    so the next start reads them from the disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def start_repository(root: Path, config: ScaleBenchConfig) -> tuple[float, int]:
    """Start ``hio repository`` on the store under ``root``: (seconds from process start to
    SERVING, its RSS in KiB once serving)."""
    from hio.cluster import LocalCluster
    from hio.transport.net import ROLE_SERVICES, wait_healthy

    cluster = LocalCluster(root, config)
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        started = time.monotonic()
        proc = cluster.add("repository", ["--listen", cluster.repository])
        wait_healthy(
            cluster.repository, cluster.settings, timeout=900, alive=proc.alive, service=ROLE_SERVICES["repository"]
        )
        seconds = time.monotonic() - started
        time.sleep(0.5)  # threads the server starts once serving
        usage = proc_usage(proc.pid)
    return seconds, usage.rss_kib if usage is not None else 0


def run_repository_curve(config: ScaleBenchConfig, root: Path) -> list[dict[str, Any]]:
    empty = root / "repository-empty"
    shutil.rmtree(empty, ignore_errors=True)
    empty_rss = statistics.median(start_repository(empty, config)[1] for _ in range(config.restarts))
    shutil.rmtree(empty, ignore_errors=True)
    print(f"repository: an empty one uses {empty_rss / 1024:.1f} MiB", flush=True)
    rows = []
    for records in config.record_counts():
        store = root / f"repository-{records}"
        fill_seconds = fill_store(config, store, records)
        stored = int(json.loads((store / "filled.json").read_text())["records"])
        features = store / "repository" / "features"
        disk = sum(p.stat().st_size for p in features.glob("*.seg"))
        for cache in ("warm", "cold"):
            starts = []
            for _ in range(config.restarts):
                if cache == "cold":
                    evict_from_cache(features)
                starts.append(start_repository(store, config))
            seconds = [s for s, _ in starts]
            rss = statistics.median(r for _, r in starts)
            index_kib = max(0.0, rss - empty_rss)
            row = {
                "records": stored,
                "cache": cache,
                "restart_s": round(statistics.median(seconds), 2),
                "restart_min_s": round(min(seconds), 2),
                "restart_max_s": round(max(seconds), 2),
                "restarts": len(starts),
                "rss_mib": round(rss / 1024, 1),
                "empty_rss_mib": round(empty_rss / 1024, 1),
                "index_mib": round(index_kib / 1024, 1),
                "index_bytes_per_record": round(index_kib * 1024 / max(stored, 1), 1),
                "disk_mib": round(disk / 2**20, 1),
                "fill_seconds": round(fill_seconds, 1),
                **_provenance(),
            }
            rows.append(row)
            print(
                f"repository {count_label(stored):>5} records, {cache}: restart {row['restart_s']:.2f} s "
                f"({row['restart_min_s']:.2f}-{row['restart_max_s']:.2f}), index {row['index_mib']:,.0f} MiB "
                f"({row['index_bytes_per_record']:.0f} B per record), {row['disk_mib']:,.0f} MiB on disk, "
                f"filled in {row['fill_seconds']:,.0f} s, load {row['load_avg']}",
                flush=True,
            )
    return rows


# ---------------------------------------------------------------------------------------------
# KD: one interval over new records, against what is stored


def run_kd_curve(config: ScaleBenchConfig, root: Path) -> list[dict[str, Any]]:
    from benchmarks.kd import KDBenchConfig, measure_intervals

    sizes = config.kd_sizes()
    kd = KDBenchConfig(
        stored=max(sizes, default=config.kd_new),
        new=config.kd_new,
        max_records_per_interval=config.kd_catch_up,
        spark_master=config.spark_master,
    )
    work = Path(tempfile.mkdtemp(prefix="kd-", dir=root))
    try:
        results = measure_intervals(kd, work, sizes).cases
    finally:
        shutil.rmtree(work, ignore_errors=True)
    empty = results[0][2].last_seconds
    rows = []
    for _case, stored, job in results:
        row = {
            "stored": stored,
            "new": job.store.total - stored,
            "interval_s": round(job.last_seconds, 3),
            "ratio_to_empty": round(job.last_seconds / max(empty, 1e-9), 2),
            "breakdown": ";".join(f"{k}={v:.3f}" for k, v in job.last_timings.items()),
            "spark_master": config.spark_master,
            **_provenance(),
        }
        rows.append(row)
        print(
            f"kd {count_label(stored):>5} stored: interval {row['interval_s']:.2f} s over {row['new']} new "
            f"({row['ratio_to_empty']:.2f}x the empty store's), {row['breakdown']}, load {row['load_avg']}",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------------------------------------
# Results: CSV (merged by point), plots, the document

KEYS: dict[str, Callable[[dict[str, str]], tuple[str, ...]]] = {
    "master": lambda row: (row["channels"],),
    "repository": lambda row: (row["records"], row["cache"]),
    "kd": lambda row: (row["stored"],),
}


def csv_path(out: Path, curve: str) -> Path:
    return out / f"scale-{curve}.csv"


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def merge_rows(path: Path, curve: str, rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Write ``rows`` into the curve's CSV: a point measured again replaces its old row, the
    other points stay (a curve is measured in parts: 10 M records can wait for a quiet
    machine). The rows, sorted by point."""
    key = KEYS[curve]
    fresh = [{k: str(v) for k, v in row.items()} for row in rows]
    kept = {key(row): row for row in read_csv(path)}
    kept.update({key(row): row for row in fresh})
    merged = sorted(kept.values(), key=lambda row: tuple(_sort_value(v) for v in key(row)))
    fields = list(dict.fromkeys(f for row in (*fresh, *merged) for f in row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(merged)
    return merged


def _sort_value(text: str) -> tuple[int, float, str]:
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def plot_master(rows: list[dict[str, str]], path: Path) -> None:
    """Routes/s and the master's CPU per route against channels, the target marked."""
    plt = _pyplot()
    channels = [_number(r["channels"]) for r in rows]
    fig, (rate, cpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    rate.plot(channels, [_number(r["routes_per_s"]) for r in rows], "o-", label="routes/s measured")
    rate.plot(
        channels,
        [_number(r["routes_per_master_cpu_s"]) for r in rows],
        "s--",
        label="routes per second of master CPU (one core's worth)",
    )
    rate.axhline(ROUTE_TARGET, color="tab:red", ls=":", label=f"target at {TARGET_CHANNELS:,} channels")
    rate.set_xscale("log")
    rate.set_yscale("log")
    rate.set_xlabel("channels")
    rate.set_ylabel("routes/s")
    rate.legend(fontsize=8)
    cpu.plot(channels, [_number(r["master_cpu_ms_per_route"]) for r in rows], "o-", color="tab:purple")
    cpu.set_xscale("log")
    cpu.set_ylim(bottom=0)
    cpu.set_xlabel("channels")
    cpu.set_ylabel("master CPU ms per route (route + report)")
    for ax in (rate, cpu):
        ax.grid(alpha=0.3, which="both")
    fig.suptitle("The master's routing capacity")
    _save(fig, path)


def plot_repository(rows: list[dict[str, str]], path: Path) -> None:
    """Restart time (warm, cold) and index memory against records, the targets marked."""
    plt = _pyplot()
    fig, (restart, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    for cache, style in (("warm", "o-"), ("cold", "s--")):
        points = [r for r in rows if r["cache"] == cache]
        restart.plot(
            [_number(r["records"]) for r in points], [_number(r["restart_s"]) for r in points], style, label=cache
        )
    warm = [r for r in rows if r["cache"] == "warm"] or rows
    memory.plot([_number(r["records"]) for r in warm], [_number(r["index_mib"]) for r in warm], "o-")
    restart.axhline(RESTART_TARGET, color="tab:red", ls=":", label=f"target at {count_label(TARGET_RECORDS)}")
    memory.axhline(INDEX_TARGET_MIB, color="tab:red", ls=":", label=f"target at {count_label(TARGET_RECORDS)}")
    restart.set_ylabel("seconds from process start to SERVING")
    memory.set_ylabel("index MiB (RSS less an empty repository's)")
    for ax in (restart, memory):
        ax.set_xscale("log")
        ax.set_xlabel("records stored")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("The repository: restart and index memory")
    _save(fig, path)


def plot_kd(rows: list[dict[str, str]], path: Path) -> None:
    """The interval's time against records stored (0 drawn at the left edge), 2x empty marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    stored = [max(_number(r["stored"]), 1.0) for r in rows]
    ax.plot(stored, [_number(r["interval_s"]) for r in rows], "o-")
    empty = next((_number(r["interval_s"]) for r in rows if r["stored"] == "0"), None)
    if empty is not None:
        ax.axhline(KD_RATIO_TARGET * empty, color="tab:red", ls=":", label="target: 2x the empty store's")
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("records stored before the interval (empty at 1)")
    ax.set_ylabel("interval seconds")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, which="both")
    fig.suptitle("KD: one interval over new records")
    _save(fig, path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


PLOTS: dict[str, Callable[[list[dict[str, str]], Path], None]] = {
    "master": plot_master,
    "repository": plot_repository,
    "kd": plot_kd,
}


def verdicts(out: Path) -> list[str]:
    """Each target, met or not, from the CSVs there are."""
    lines = []
    master = {r["channels"]: r for r in read_csv(csv_path(out, "master"))}
    row = master.get(str(TARGET_CHANNELS))
    if row is not None:
        rate, per_cpu = _number(row["routes_per_s"]), _number(row["routes_per_master_cpu_s"])
        met = "met" if rate >= ROUTE_TARGET else "NOT met"
        lines.append(
            f"master: {rate:,.0f} routes/s at {TARGET_CHANNELS:,} channels ({per_cpu:,.0f} per second of master "
            f"CPU); target {ROUTE_TARGET:,.0f}: {met}"
        )
    else:
        lines.append(f"master: {TARGET_CHANNELS:,} channels not measured yet")
    repository = [r for r in read_csv(csv_path(out, "repository")) if _number(r["records"]) >= TARGET_RECORDS]
    if not repository:
        lines.append(f"repository: {count_label(TARGET_RECORDS)} records not measured yet")
    for row in repository:
        seconds, index = _number(row["restart_s"]), _number(row["index_mib"])
        restart_met = "met" if seconds < RESTART_TARGET else "NOT met"
        index_met = "met" if index < INDEX_TARGET_MIB else "NOT met"
        lines.append(
            f"repository: {count_label(int(row['records']))} records, {row['cache']} cache: restart {seconds:.1f} s "
            f"(target < {RESTART_TARGET:g} s: {restart_met}), index {index:,.0f} MiB "
            f"(target < {INDEX_TARGET_MIB:,.0f} MiB: {index_met})"
        )
    kd = [r for r in read_csv(csv_path(out, "kd")) if _number(r["stored"]) >= TARGET_RECORDS]
    if not kd:
        lines.append(f"kd: {count_label(TARGET_RECORDS)} stored not measured yet")
    for row in kd:
        ratio = _number(row["ratio_to_empty"])
        lines.append(
            f"kd: interval over {count_label(int(row['stored']))} stored is {ratio:.2f}x the empty store's "
            f"(target <= {KD_RATIO_TARGET:g}x: {'met' if ratio <= KD_RATIO_TARGET else 'NOT met'})"
        )
    return lines


TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "master": (
        ("channels", "channels"),
        ("workers", "workers"),
        ("in_flight", "in flight"),
        ("routes_per_s", "routes/s"),
        ("master_cpu_ms_per_route", "master CPU ms/route"),
        ("routes_per_master_cpu_s", "routes per master CPU s"),
        ("grpc_unary_us", "gRPC floor µs/unary call"),
        ("grpc_stream_us", "gRPC floor µs/stream message"),
        ("master_cores", "master cores"),
        ("route_p50_ms", "route p50 ms"),
        ("route_p99_ms", "route p99 ms"),
        ("queued", "queued"),
        ("errors", "errors"),
        ("heartbeats_missed", "heartbeats missed"),
        ("load_avg", "load"),
        ("commit", "commit"),
        ("finished_at", "finished"),
    ),
    "repository": (
        ("records", "records"),
        ("cache", "cache"),
        ("restart_s", "restart s (median)"),
        ("restart_min_s", "min"),
        ("restart_max_s", "max"),
        ("index_mib", "index MiB"),
        ("index_bytes_per_record", "B/record"),
        ("rss_mib", "RSS MiB"),
        ("disk_mib", "disk MiB"),
        ("fill_seconds", "fill s"),
        ("load_avg", "load"),
        ("commit", "commit"),
        ("finished_at", "finished"),
    ),
    "kd": (
        ("stored", "stored"),
        ("new", "new"),
        ("interval_s", "interval s"),
        ("ratio_to_empty", "x empty"),
        ("breakdown", "breakdown (s)"),
        ("load_avg", "load"),
        ("commit", "commit"),
        ("finished_at", "finished"),
    ),
}

TITLES = {
    "master": "The master's routing capacity",
    "repository": "The repository: restart time and index memory",
    "kd": "KD: one interval over new records",
}


def _cell(field: str, value: str) -> str:
    if field in ("commit",) and value:
        return f"`{value}`"
    if field == "finished_at":
        return value[:16].replace("T", " ")
    if field == "breakdown":
        return value.replace(";", ", ").replace("=", " ")
    number = _number(value)
    if number != number or field in ("load_avg",):  # NaN: text
        return value
    return f"{number:,.0f}" if number >= 100 or number == int(number) else f"{number:.3g}"


def write_document(out: Path) -> Path:
    """``out/scale.md``: per curve its plot and table, the targets, and ``scale-analysis.md``
    (written by hand: where the time goes) when there is one."""
    lines = [
        "# How cost grows with scale",
        "",
        (
            "*Generated by `hio bench-scale` (`make bench-scale`) from the CSV files beside it; do not edit by "
            "hand (the analysis at the end is `scale-analysis.md`). Each row records its date, the 1-minute load "
            "average, the machine and the commit; `benchmarks/scale.py` says how each curve is measured.*"
        ),
        "",
    ]
    machines = sorted({r["machine"] for curve in CURVES for r in read_csv(csv_path(out, curve)) if r.get("machine")})
    if machines:
        lines += [f"Measured on: {'; '.join(machines)}.", ""]
    targets = verdicts(out)
    if targets:
        lines += ["## Targets", "", *[f"* {t}" for t in targets], ""]
    for curve in CURVES:
        rows = read_csv(csv_path(out, curve))
        if not rows:
            continue
        columns = [(f, title) for f, title in TABLES[curve] if f in rows[0]]
        lines += [
            f"## {TITLES[curve]}",
            "",
            f"![{TITLES[curve]}](scale-{curve}.png)",
            "",
            "| " + " | ".join(title for _, title in columns) + " |",
            "|" + "---|" * len(columns),
            *["| " + " | ".join(_cell(f, row.get(f, "")) for f, _ in columns) + " |" for row in rows],
            "",
            f"Every column: [`scale-{curve}.csv`](scale-{curve}.csv).",
            "",
        ]
    analysis = out / "scale-analysis.md"
    if analysis.exists():
        lines += ["## Analysis", "", analysis.read_text().strip(), ""]
    doc = out / "scale.md"
    doc.write_text("\n".join(lines))
    return doc


RUNS: dict[str, Callable[[ScaleBenchConfig, Path], list[dict[str, Any]]]] = {
    "master": run_master_curve,
    "repository": run_repository_curve,
    "kd": run_kd_curve,
}


def run_scale_bench(config: ScaleBenchConfig) -> int:
    """Measure the curves asked for, merge them into their CSVs, plot, write the document."""
    root = Path(config.data_dir).expanduser().resolve() / "bench-scale"
    out = Path(config.out)
    root.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"hio bench-scale: {', '.join(config.curves)}; {machine_description()}; load {os.getloadavg()[0]:.1f}; "
        f"stores under {root}; results in {out}",
        flush=True,
    )
    for curve in CURVES:
        if curve not in config.curves or not config.measure:
            continue
        rows = merge_rows(csv_path(out, curve), curve, RUNS[curve](config, root))
        PLOTS[curve](rows, out / f"scale-{curve}.png")
    doc = write_document(out)
    for line in verdicts(out):
        print(line, flush=True)
    print(f"hio bench-scale: {doc}", flush=True)
    return 0
