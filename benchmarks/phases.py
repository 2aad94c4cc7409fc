"""`hio experiment phases`: the thesis' load experiment (section 3, Figs. 18-20) on one machine.

Two sources stream real simulation realizations (Brusselator, about 2 MB each)
to the ``hio/simulation`` image, which analyses each one with a red-noise test
of its period (``period_surrogates``: the surrogate count sets a tuple's CPU
cost). Their offered rate steps through the thesis' phases: excess capacity,
matched, overload, excess again. Rates are given in engines' worth: 1.0 is what
one engine processes per second, measured here before the runs.

The same schedule runs once with elasticity off and once on, in one
invocation, one after the other on the same machine:

* ``fixed``: ``max_workers`` workers of ``worker_cpus`` vCPUs, one engine per
  vCPU, from start to end: the peak capacity, provisioned for the whole run.
* ``elastic``: a master with ``scaling = elastic`` and the local provisioner;
  it starts workers (at most ``max_workers``) and places engines on them as the
  load asks, and gives them back when idle.

Every second it records the queue, free channels, workers, engines per image
and each worker's CPU (its process tree, from ``/proc``), and at the end
checks that every tuple sent was stored exactly once. It writes, into
``out``: ``phases.csv`` (one row per second per run), ``phases-summary.csv``
(peak queue, drain time after the overload, worker-seconds, tuples lost and
duplicated, with the date, machine and commit), ``phases-<run>.png`` (thesis
Figs. 18-19: rates, queue, free channels, workers and engines over time) and
``phases-cpu.png`` (the slides' CPU per worker: load packed onto the
lowest-ranked workers).

On one machine every worker shares the same cores, so the runs' throughput
ceiling is this machine's, reached by as many busy engines as it has cores; the
overload phase offers more than that, so that both runs queue and then drain.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import logging
import math
import shlex
import shutil
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from benchmarks.measure import machine_description, source_commit, worker_processes
from hio.config import ConfigError, one_of, positive, setting
from hio.settings import ClusterSettings

log = logging.getLogger("hio.experiment")

IMAGE = "hio/simulation"
RUNS = ("fixed", "elastic")
SAMPLE_SECONDS = 1.0
SUMMARY_FIELDS = (
    "run",
    "peak_backlog",
    "peak_queue",
    "drain_seconds",
    "worker_seconds",
    "window_seconds",
    "mean_workers",
    "peak_workers",
    "peak_engines",
    "submitted",
    "stored",
    "lost",
    "duplicated",
    "dead_letters",
    "engine_rate",
    "surrogates",
    "finished_at",
    "machine",
    "commit",
)
ROW_FIELDS = (
    "run",
    "t",
    "phase",
    "offered_per_s",
    "submitted",
    "stored",
    "stored_per_s",
    "backlog",
    "queue",
    "channels_free",
    "channels_busy",
    "workers_serving",
    "worker_processes",
    "engines_running",
    "engines_wanted",
    "worker_cpu",
)


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    rates: tuple[float, float]  # each source's rate, in engines' worth
    seconds: float


def parse_phase(text: str) -> Phase:
    """``NAME:SOURCE_A:SOURCE_B:SECONDS`` (rates in engines' worth) -> :class:`Phase`."""
    parts = text.split(":")
    if len(parts) != 4 or not parts[0]:
        raise ConfigError(f"phases: {text!r} is not NAME:SOURCE_A:SOURCE_B:SECONDS (e.g. overload:1.2:1.2:60)")
    try:
        a, b, seconds = float(parts[1]), float(parts[2]), float(parts[3])
    except ValueError:
        raise ConfigError(f"phases: {text!r} has a rate or a duration that is not a number") from None
    if not (math.isfinite(a) and math.isfinite(b) and a >= 0 and b >= 0):
        raise ConfigError(f"phases: {text!r}: rates must be zero or more")
    if not 0 < seconds <= 86_400:
        raise ConfigError(f"phases: {text!r}: the duration must be in (0, 86400] seconds")
    return Phase(parts[0], (a, b), seconds)


@dataclasses.dataclass(frozen=True)
class PhasesConfig(ClusterSettings):
    POSITIONAL: ClassVar[tuple[str, str, str]] = ("experiments", "NAME", "the experiment to run: phases")

    experiments: tuple[str, ...] = setting(None, "experiments to run", factory=lambda: ("phases",))
    runs: tuple[str, ...] = setting(
        None, "runs, in this order: fixed (elasticity off) and elastic", factory=lambda: RUNS
    )
    phases: tuple[str, ...] = setting(
        None,
        "the schedule, NAME:SOURCE_A:SOURCE_B:SECONDS each, rates in engines' worth",
        factory=lambda: ("excess:0.4:0:60", "matched:0.8:0:90", "overload:1.2:1.2:60", "excess:0.4:0:150"),
    )
    max_workers: int = setting(4, "peak capacity: the fixed run's workers, the most the elastic master starts")
    worker_cpus: int = setting(1, "vCPUs of each worker (the fixed run gives each vCPU an engine)")
    surrogates: int = setting(300, "red-noise surrogates per realization: each tuple's CPU cost")
    engine_rate: float = setting(0.0, "tuples/s one engine processes; 0 = measure it here first")
    realizations: int = setting(24, "distinct realizations the sources cycle through")
    runtime: str = setting("process", "engine runtime: process or docker")
    elastic_args: str = setting("", "more flags for the elastic run's master, as a shell splits them")
    drain_timeout: float = setting(900.0, "most seconds to wait for every tuple to be stored after the schedule")
    out: str = setting("docs/elasticity", "folder for the CSV files and plots")

    def validate(self) -> None:
        self.validate_cluster()
        for name in self.experiments:
            one_of("experiment", name, ("phases",))
        if not self.runs:
            raise ConfigError("runs: name at least one of fixed, elastic")
        for run in self.runs:
            one_of("runs", run, RUNS)
        one_of("runtime", self.runtime, ("process", "docker"))
        positive("drain_timeout", self.drain_timeout)
        schedule = self.schedule()
        if not schedule:
            raise ConfigError("phases: give at least one phase")
        if not any(a + b > 0 for phase in schedule for a, b in [phase.rates]):
            raise ConfigError("phases: every phase offers nothing")
        if not 1 <= self.max_workers <= 64:
            raise ConfigError(f"max_workers must be between 1 and 64, got {self.max_workers}")
        if not 1 <= self.worker_cpus <= 256:
            raise ConfigError(f"worker_cpus must be between 1 and 256, got {self.worker_cpus}")
        if not 0 <= self.surrogates <= 10_000:
            raise ConfigError(f"surrogates must be between 0 and 10000, got {self.surrogates}")
        if not (math.isfinite(self.engine_rate) and self.engine_rate >= 0):
            raise ConfigError(f"engine_rate must be 0 (measure) or positive, got {self.engine_rate}")
        try:
            shlex.split(self.elastic_args)
        except ValueError as exc:
            raise ConfigError(f"elastic_args cannot be split: {exc}") from None
        if not 1 <= self.realizations <= 1000:
            raise ConfigError(f"realizations must be between 1 and 1000, got {self.realizations}")

    def schedule(self) -> list[Phase]:
        return [parse_phase(text) for text in self.phases]


def measure_engine_rate(files: Sequence[Path], surrogates: int) -> float:
    """Tuples/s one engine analyses: the CPU time of the pipeline's own analysis of a few
    realizations, in this process (an engine's other work per tuple is small beside it)."""
    from hio.worker.pipelines import simulation

    info = _Info({"period_surrogates": str(surrogates)})
    costs = []
    for path in list(files)[:5]:
        data = path.read_bytes()
        start = time.process_time()
        simulation.process(data, info)
        costs.append(time.process_time() - start)
    return 1.0 / max(statistics.median(costs), 1e-3)


@dataclasses.dataclass(frozen=True)
class _Info:
    attributes: dict[str, str]


class Source:
    """One instrument: an in-process gateway offering realizations on the schedule, each
    phase at its rate on a fixed timetable (open loop: a late submission is not skipped)."""

    def __init__(self, gateway: Any, payloads: Sequence[bytes], rates: list[tuple[float, float]], surrogates: int):
        self._gateway = gateway
        self._payloads = payloads
        self._rates = rates  # (tuples/s, seconds) per phase
        self._attributes = {"period_surrogates": str(surrogates)}
        self.futures: list[Any] = []
        self._thread = threading.Thread(target=self._run, name="experiment-source", daemon=True)
        self._stop = threading.Event()
        self.start_at = 0.0
        self.error: BaseException | None = None

    def start(self, at: float) -> None:
        self.start_at = at
        self._thread.start()

    def _run(self) -> None:
        try:
            self._offer()
        except BaseException as exc:  # noqa: BLE001 - handed to join(), which raises it in the run
            self.error = exc

    def _offer(self) -> None:
        begin = self.start_at
        for rate, seconds in self._rates:
            end = begin + seconds
            if rate > 0:
                next_at = begin
                while next_at < end and not self._stop.is_set():
                    delay = next_at - time.monotonic()
                    if delay > 0 and self._stop.wait(delay):
                        return
                    self._submit()
                    next_at += 1.0 / rate
            elif self._stop.wait(max(0.0, end - time.monotonic())):
                return
            begin = end

    def _submit(self) -> None:
        index = len(self.futures)
        self.futures.append(
            self._gateway.submit(
                self._payloads[index % len(self._payloads)],
                image=IMAGE,
                name=f"realization-{index}",
                attributes=self._attributes,
                timeout=None,
            )
        )

    def join(self) -> None:
        """Wait for the schedule's end; raise what stopped the source early, if anything did."""
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"a source stopped offering tuples: {self.error!r}") from self.error

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(10)


@dataclasses.dataclass
class Row:
    run: str
    t: float
    phase: str
    offered_per_s: float
    submitted: int
    stored: int
    stored_per_s: float
    backlog: int  # offered and not stored yet: in a spool, waiting for a route, queued or in an engine
    queue: int  # in the master's backlog queue
    channels_free: int
    channels_busy: int
    workers_serving: int
    worker_processes: int
    engines_running: int
    engines_wanted: int
    worker_cpu: dict[str, float]  # worker id -> cores used over the last sample


class Sampler:
    """A :class:`Row` every :data:`SAMPLE_SECONDS` on a thread of its own."""

    def __init__(self, run: str, cluster: Any, sources: list[Source], schedule: list[Phase], engine_rate: float):
        self.run = run
        self._cluster = cluster
        self._sources = sources
        self._schedule = schedule
        self._engine_rate = engine_rate
        self.rows: list[Row] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="experiment-sampler", daemon=True)
        self._cpu: dict[int, float] = {}  # worker pid -> its tree's CPU seconds at the last sample
        self._cpu_at = 0.0
        self.start_at = 0.0

    def start(self, at: float) -> None:
        self.start_at = at
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(30)

    def phase_at(self, t: float) -> tuple[str, float]:
        """The phase at ``t`` seconds into the schedule and the tuples/s it offers ('drain' after)."""
        begin = 0.0
        for phase in self._schedule:
            if t < begin + phase.seconds:
                return phase.name, sum(phase.rates) * self._engine_rate
            begin += phase.seconds
        return "drain", 0.0

    def _loop(self) -> None:
        next_at = self.start_at
        last_stored, last_t = 0, self.start_at
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += SAMPLE_SECONDS
            try:
                row = self._sample()
            except Exception as exc:  # noqa: BLE001 - a missed sample is logged; the run goes on
                log.warning("sample missed", extra={"error": str(exc)})
                continue
            now = time.monotonic()
            row.stored_per_s = (row.stored - last_stored) / max(now - last_t, 1e-3)
            last_stored, last_t = row.stored, now
            self.rows.append(row)

    def _sample(self) -> Row:
        t = time.monotonic() - self.start_at
        status = self._cluster.status(timeout=5)
        phase, offered = self.phase_at(t)
        cpu = self._worker_cpu()
        submitted = sum(len(s.futures) for s in self._sources)
        stored = stored_records(self._cluster)
        return Row(
            run=self.run,
            t=round(t, 2),
            phase=phase,
            offered_per_s=round(offered, 3),
            submitted=submitted,
            stored=stored,
            stored_per_s=0.0,
            backlog=max(0, submitted - stored),
            queue=sum(q.length for q in status.queues),
            channels_free=int(status.channels_free),
            channels_busy=int(status.channels_busy),
            workers_serving=sum(1 for w in status.workers if w.last_heartbeat_age_seconds < 5),
            worker_processes=len(cpu),
            engines_running=sum(e.running for e in status.engines if e.image == IMAGE),
            engines_wanted=sum(e.wanted for e in status.engines if e.image == IMAGE),
            worker_cpu=cpu,
        )

    def _worker_cpu(self) -> dict[str, float]:
        """Cores each worker's process tree (the worker and its engines) used since the last
        sample; a worker seen for the first time counts 0."""
        from hio.worker.cpu import tree_cpu_seconds

        now = time.monotonic()
        elapsed = max(now - self._cpu_at, 1e-3)
        cores, seen = {}, {}
        for worker_id, pid in worker_processes(self._cluster.root).items():
            seconds = tree_cpu_seconds(pid)
            if seconds is None:
                continue
            seen[pid] = seconds
            before = self._cpu.get(pid)
            cores[worker_id] = 0.0 if before is None else round(max(0.0, (seconds - before) / elapsed), 3)
        self._cpu, self._cpu_at = seen, now
        return cores


def stored_records(cluster: Any) -> int:
    from hio.proto import repository_pb2, repository_pb2_grpc
    from hio.transport.net import create_channel

    with create_channel(cluster.repository, cluster.settings) as channel:
        stub = repository_pb2_grpc.RepositoryStub(channel)
        return int(stub.GetOffsets(repository_pb2.GetOffsetsRequest(), timeout=10).records)


@dataclasses.dataclass(frozen=True)
class RunResult:
    rows: list[Row]
    summary: dict[str, Any]


def _cluster_for(run: str, config: PhasesConfig, root: Path) -> Any:
    from hio.cluster import LocalCluster

    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(ClusterSettings)}
    settings = ClusterSettings(**shared)
    if run == "fixed":
        workers = {f"fixed-{i}": [f"{IMAGE}={config.worker_cpus}"] for i in range(1, config.max_workers + 1)}
        return LocalCluster(
            root,
            settings,
            workers=workers,
            runtime=config.runtime,
            worker_args=["--cpus", str(config.worker_cpus)],
            worker_timeout=180,
        )
    master_args = [
        "--scaling", "elastic",
        "--provisioner", "local",
        "--provisioner-options", f"runtime={config.runtime}",
        "--max-workers", str(config.max_workers),
        "--worker-cpus", str(config.worker_cpus),
        *shlex.split(config.elastic_args),
    ]  # fmt: skip
    return LocalCluster(root, settings, master_args=master_args, runtime=config.runtime)


def _gateway(config: PhasesConfig, cluster: Any, name: str) -> Any:
    from hio.gateway import Gateway

    shared = {f.name: getattr(cluster.settings, f.name) for f in dataclasses.fields(ClusterSettings)}
    return Gateway(**{**shared, "data_dir": str(cluster.root / name)}, source=name, progress=False)


def _wait_ready(run: str, cluster: Any, timeout: float = 120.0) -> None:
    """The elastic run starts from its headroom worker registered (the thesis's phase 1
    starts from one worker); the fixed run's workers are up when the cluster starts."""
    if run != "elastic":
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if len(cluster.status(timeout=5).workers) >= 1:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the elastic master started no worker within {timeout:.0f} s\n{cluster.output()}")


def run_one(run: str, config: PhasesConfig, root: Path, payloads: list[bytes], engine_rate: float) -> RunResult:
    """One run of the schedule; every role it starts is stopped before it returns."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    schedule = config.schedule()
    cluster = _cluster_for(run, config, root)
    cluster.start()
    gateways: list[Any] = []
    sources: list[Source] = []
    sampler: Sampler | None = None
    try:
        _wait_ready(run, cluster)
        gateways = [_gateway(config, cluster, name) for name in ("source-a", "source-b")]
        sources = [
            Source(
                gw,
                payloads[i::2] or payloads,
                [(p.rates[i] * engine_rate, p.seconds) for p in schedule],
                config.surrogates,
            )
            for i, gw in enumerate(gateways)
        ]
        sampler = Sampler(run, cluster, sources, schedule, engine_rate)
        start = time.monotonic() + 0.5
        sampler.start(start)
        for source in sources:
            source.start(start)
        _progress(run, sampler, schedule)
        for source in sources:
            source.join()
        ids = _wait_all(sources, config.drain_timeout)
        _wait_stored(cluster, len(ids), config.drain_timeout)
        sampler.stop()
        dead = int(cluster.status().dead_letters)
        counts = _stored_counts(cluster)
    finally:
        for source in sources:
            source.stop()
        if sampler is not None:
            sampler.stop()
        for gw in gateways:
            gw.close(30.0)
        cluster.stop()
    return RunResult(sampler.rows, summarise(run, sampler.rows, schedule, ids, counts, dead, engine_rate, config))


def _progress(run: str, sampler: Sampler, schedule: list[Phase]) -> None:
    total = sum(p.seconds for p in schedule)
    end = sampler.start_at + total
    last = ""
    while time.monotonic() < end:
        time.sleep(min(5.0, max(0.0, end - time.monotonic())))
        if sampler.rows:
            row = sampler.rows[-1]
            line = (
                f"{run:8s} {row.t:6.0f}/{total:.0f} s {row.phase:9s} queue {row.queue:4d}  "
                f"workers {len(row.worker_cpu)}  engines {row.engines_running}  stored {row.stored}"
            )
            if line != last:
                print(f"hio experiment: {line}", flush=True)
                last = line


def _wait_all(sources: list[Source], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    ids = []
    for source in sources:
        for future in source.futures:
            ids.append(int(future.result(timeout=max(1.0, deadline - time.monotonic()))))
    return ids


def _wait_stored(cluster: Any, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while stored_records(cluster) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not all {count} tuples were stored within {timeout:.0f} s")
        time.sleep(0.5)


def _stored_counts(cluster: Any) -> Counter[int]:
    from hio.up import read_features

    return Counter(record.tuple_id for record in read_features(cluster.settings))


def summarise(
    run: str,
    rows: list[Row],
    schedule: list[Phase],
    ids: list[int],
    counts: Counter[int],
    dead_letters: int,
    engine_rate: float,
    config: PhasesConfig,
) -> dict[str, Any]:
    """The run's figures: the peak backlog (offered, not stored yet) and queue; the drain time,
    from the end of the busiest phase until as many tuples are stored as had been offered by
    then; worker-seconds over the run's window (from the schedule's start until every tuple was
    stored), counted from the worker processes seen each second, as a cloud would bill them."""
    overload_end = _overload_end(schedule)
    offered = next((r.submitted for r in rows if r.t >= overload_end), None)
    drained = next((r.t for r in rows if r.t >= overload_end and offered is not None and r.stored >= offered), None)
    window = rows[-1].t if rows else 0.0
    worker_seconds = sum(r.worker_processes for r in rows) * SAMPLE_SECONDS
    sent = set(ids)
    return {
        "run": run,
        "peak_backlog": max((r.backlog for r in rows), default=0),
        "peak_queue": max((r.queue for r in rows), default=0),
        "drain_seconds": round(drained - overload_end, 1) if drained is not None else "",
        "worker_seconds": round(worker_seconds),
        "window_seconds": round(window),
        "mean_workers": round(worker_seconds / window, 2) if window else 0.0,
        "peak_workers": max((r.worker_processes for r in rows), default=0),
        "peak_engines": max((r.engines_running for r in rows), default=0),
        "submitted": len(ids),
        "stored": len(sent & set(counts)),
        "lost": len(sent - set(counts)),
        "duplicated": sum(1 for n in counts.values() if n > 1),
        "dead_letters": dead_letters,
        "engine_rate": round(engine_rate, 3),
        "surrogates": config.surrogates,
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "commit": source_commit(),
    }


def _overload_end(schedule: list[Phase]) -> float:
    """Seconds into the schedule when its busiest phase ends."""
    ends, begin = [], 0.0
    for phase in schedule:
        begin += phase.seconds
        ends.append((sum(phase.rates), begin))
    return max(ends)[1]


def write_rows(path: Path, results: list[RunResult]) -> None:
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=ROW_FIELDS)
        writer.writeheader()
        for result in results:
            for row in result.rows:
                record = dataclasses.asdict(row)
                record["worker_cpu"] = ";".join(f"{w}={c:.3f}" for w, c in row.worker_cpu.items())
                writer.writerow(record)


def write_summary(path: Path, results: list[RunResult]) -> None:
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        for result in results:
            writer.writerow(result.summary)


def _phase_spans(schedule: list[Phase]) -> Iterator[tuple[str, float, float]]:
    begin = 0.0
    for phase in schedule:
        yield phase.name, begin, begin + phase.seconds
        begin += phase.seconds


def plot_run(path: Path, result: RunResult, schedule: list[Phase]) -> None:
    """Thesis Figs. 18-19 for one run: rates; queue and free channels; workers and engines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    t = [r.t for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    axes[0].plot(t, [r.offered_per_s for r in rows], label="offered (tuples/s)", color="tab:gray")
    axes[0].plot(t, [r.stored_per_s for r in rows], label="stored (tuples/s)", color="tab:green", lw=0.8)
    axes[1].plot(t, [r.backlog for r in rows], label="backlog (offered, not stored)", color="tab:red")
    axes[1].plot(t, [r.queue for r in rows], label="in the master's queue", color="tab:brown", lw=0.8)
    axes[1].plot(t, [r.channels_free for r in rows], label="free channels", color="tab:blue")
    axes[2].step(t, [r.worker_processes for r in rows], where="post", label="workers", color="tab:purple", lw=2.5)
    axes[2].step(t, [r.engines_running for r in rows], where="post", label="engines running", color="tab:orange")
    if result.summary["run"] == "elastic":
        axes[2].step(t, [r.engines_wanted for r in rows], where="post", label="engines wanted", ls=":", color="k")
    top = max([r.worker_processes for r in rows] + [r.engines_running for r in rows] + [r.engines_wanted for r in rows])
    axes[2].set_ylim(0, top + 1)
    for ax in axes:
        for i, (name, begin, end) in enumerate(_phase_spans(schedule)):
            ax.axvspan(begin, end, color="0.93" if i % 2 else "1.0", zorder=0)
            if ax is axes[0]:
                ax.text((begin + end) / 2, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    s = result.summary
    fig.suptitle(
        f"{s['run']}: peak backlog {s['peak_backlog']}, drained {s['drain_seconds']} s after the overload, "
        f"{s['worker_seconds']} worker-seconds, lost {s['lost']}",
        y=0.995,
    )
    axes[2].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cpu(path: Path, results: list[RunResult]) -> None:
    """The slides' CPU per worker over time: one panel per run, workers in the order they
    joined (the master's ranks), colour = cores used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.2 + 1.4 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results, strict=True):
        order: list[str] = []
        for row in result.rows:
            order += [w for w in row.worker_cpu if w not in order]
        grid = np.full((max(1, len(order)), max(1, len(result.rows))), np.nan)
        for j, row in enumerate(result.rows):
            for w, cores in row.worker_cpu.items():
                grid[order.index(w), j] = cores
        end = result.rows[-1].t if result.rows else 1.0
        image = ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            vmin=0,
            vmax=1.0,
            extent=(0, end, len(order) - 0.5, -0.5),
        )
        ax.set_yticks(range(len(order)), [f"{i + 1}" for i in range(len(order))])
        ax.set_ylabel(f"{result.summary['run']}\nworker (rank)")
        fig.colorbar(image, ax=ax, label="cores used", pad=0.01)
    axes[-1, 0].set_xlabel("seconds (blank: no worker)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def comparison(results: list[RunResult]) -> list[str]:
    """The table the run prints (and docs/elasticity.md quotes), with the targets' verdicts."""
    lines = [
        (
            "| run | peak backlog | peak queue | drain after overload (s) | worker-seconds | mean workers "
            "| submitted | stored | lost | duplicated |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.summary
        lines.append(
            f"| {s['run']} | {s['peak_backlog']} | {s['peak_queue']} | {s['drain_seconds']} "
            f"| {s['worker_seconds']} | {s['mean_workers']} "
            f"| {s['submitted']} | {s['stored']} | {s['lost']} | {s['duplicated']} |"
        )
    by_run = {r.summary["run"]: r.summary for r in results}
    if {"fixed", "elastic"} <= set(by_run):
        fixed, elastic = by_run["fixed"], by_run["elastic"]
        saved = 1 - elastic["worker_seconds"] / max(fixed["worker_seconds"], 1)
        lines.append("")
        lines.append(f"elastic uses {saved:.0%} fewer worker-seconds than fixed peak capacity (target: at least 30%)")
        if fixed["drain_seconds"] != "" and elastic["drain_seconds"] != "":
            ratio = elastic["drain_seconds"] / max(fixed["drain_seconds"], SAMPLE_SECONDS)
            lines.append(f"elastic drains in {ratio:.2f}x fixed's time after the overload (target: at most 1.5x)")
    return lines


def run_experiment(config: PhasesConfig) -> int:
    from hio.worker.pipelines.samples import generate_simulation

    data_dir = Path(config.data_dir).resolve() / "experiment"
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"hio experiment: generating {config.realizations} realizations", flush=True)
    files = generate_simulation(data_dir / "samples", config.realizations, seed=11)
    payloads = [path.read_bytes() for path in files]
    engine_rate = config.engine_rate or measure_engine_rate(files, config.surrogates)
    print(
        f"hio experiment: one engine analyses {engine_rate:.2f} realizations/s "
        f"({config.surrogates} surrogates, {statistics.mean(map(len, payloads)) / 1e6:.1f} MB each)",
        flush=True,
    )
    results = []
    for run in config.runs:
        result = run_one(run, config, data_dir / run, payloads, engine_rate)
        results.append(result)
        print(f"hio experiment: {run} done: {result.summary}", flush=True)
        if result.summary["lost"] or result.summary["duplicated"]:
            print(f"hio experiment: {run} LOST or DUPLICATED tuples", file=sys.stderr)
    write_rows(out / "phases.csv", results)
    write_summary(out / "phases-summary.csv", results)
    schedule = config.schedule()
    for result in results:
        plot_run(out / f"phases-{result.summary['run']}.png", result, schedule)
    plot_cpu(out / "phases-cpu.png", results)
    print("\n".join(comparison(results)))
    print(f"hio experiment: results in {out}/phases*.csv and {out}/phases*.png", flush=True)
    return 1 if any(r.summary["lost"] or r.summary["duplicated"] for r in results) else 0
