"""The soak test: hours of steady load in minutes' time, to catch slow leaks.

    .venv/bin/python -m benchmarks.soak [--minutes 10] [--load 0.8] [--size 1M] [--cost-ms 5]

Starts real ``hio`` processes (repository, master, a worker with synthetic
engines) and an in-process :class:`hio.gateway.Gateway`, measures the
pipeline's capacity with a short closed-loop ramp, then offers ``load`` x
that rate for ``minutes``. Every ``sample_seconds`` it reads each role
process's resident memory (``/proc/<pid>/status`` VmRSS), open files
(``/proc/<pid>/fd``) and threads (``Threads``), and at the end prints the
table and a verdict per role: *flat* when, after ``warmup_seconds``, the
mean of the last third is within ``rss_tolerance`` (RSS) and within 10 %
plus ``count_slack`` (open files, threads) of the mean of the first third.
It also checks that every tuple offered was stored exactly once. Exit code 0
when everything is flat and nothing was lost, 1 otherwise.

This is a script, not a CI test: it runs for the full duration on purpose.
Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.measure import Usage, proc_usage, role_pids, total
from hio import config as cfg
from hio.config import ConfigError, positive, setting
from hio.process.procs import children
from hio.settings import ClusterSettings

log = logging.getLogger("hio.soak")

IMAGE = "hio/synthetic"
ROLES = ("repository", "master", "worker", "engines", "gateway")


@dataclasses.dataclass(frozen=True)
class SoakConfig(ClusterSettings):
    minutes: float = setting(10.0, "duration of the steady phase, in minutes")
    load: float = setting(0.8, "fraction of the measured capacity to offer during the steady phase")
    size: str = setting("1M", "tuple size (binary units: 64K, 1M, ...)")
    cost_ms: float = setting(5.0, "CPU time each tuple costs in the synthetic pipeline (milliseconds)")
    engines: int = setting(2, "synthetic engines on the worker")
    streams: int = setting(4, "gateway delivery streams")
    ramp_seconds: float = setting(30.0, "seconds of closed-loop load to measure the capacity")
    ramp_outstanding: int = setting(16, "tuples in flight during the capacity ramp")
    sample_seconds: float = setting(10.0, "seconds between samples of the role processes")
    warmup_seconds: float = setting(60.0, "samples in the first seconds of the steady phase are not judged")
    rss_tolerance: float = setting(0.10, "RSS: the last third's mean may exceed the first third's by this fraction")
    count_slack: int = setting(2, "open files and threads: allowed growth beyond 10 percent of the first third's mean")
    drain_seconds: float = setting(120.0, "after the steady phase: how long the backlog may take to drain")
    keep: bool = setting(False, "keep the soak's data folder (logs, stores) afterwards")

    def validate(self) -> None:
        self.validate_cluster()
        for name in (
            "minutes",
            "load",
            "engines",
            "streams",
            "ramp_seconds",
            "ramp_outstanding",
            "sample_seconds",
            "drain_seconds",
        ):
            positive(name, getattr(self, name))
        if self.load > 1.5:
            raise ConfigError(f"load must be at most 1.5 (a fraction of capacity), got {self.load}")
        if self.cost_ms < 0 or self.warmup_seconds < 0 or self.rss_tolerance < 0 or self.count_slack < 0:
            raise ConfigError("cost_ms, warmup_seconds, rss_tolerance and count_slack must not be negative")
        if self.warmup_seconds >= self.minutes * 60:
            raise ConfigError(
                f"warmup_seconds ({self.warmup_seconds}) must be shorter than the run ({self.minutes} minutes)"
            )
        if self.tuple_bytes() > self.max_tuple_bytes:
            raise ConfigError(f"size {self.size} is over max_tuple_bytes ({self.max_tuple_bytes})")

    def tuple_bytes(self) -> int:
        return cfg.size_setting("size", self.size)


class SoakCluster:
    """Repository, master and worker as ``hio`` processes; an in-process gateway."""

    def __init__(self, config: SoakConfig, root: Path) -> None:
        from hio.cluster import LocalCluster

        self.config = config
        self.root = root
        self._cluster = LocalCluster(root, config, workers={"": [f"{IMAGE}={config.engines}"]}, worker_timeout=120)
        self.master, self.repository = self._cluster.master, self._cluster.repository
        self.gateway: Any = None
        self.pids: dict[str, int] = {}

    def start(self) -> None:
        from hio.gateway import Gateway

        self._cluster.start()
        self.pids = role_pids(self._cluster)
        self.gateway = Gateway(
            master_address=self.master,
            repository_address=self.repository,
            data_dir=str(self.root / "gateway"),
            source="soak",
            chunk_bytes=self.config.chunk_bytes,
            streams=self.config.streams,
            progress=False,
            token=self.config.token,
            token_file=self.config.token_file,
        )

    def usage(self) -> dict[str, Usage]:
        """Per role: what its processes use now (engines: the worker's children)."""
        out = {role: total([proc_usage(pid)]) for role, pid in self.pids.items()}
        out["engines"] = total([proc_usage(pid) for pid in children(self.pids["worker"])])
        out["gateway"] = total([proc_usage(os.getpid())])
        return out

    def status(self) -> Any:
        return self._cluster.status()

    def stored_records(self) -> int:
        from hio.proto import repository_pb2, repository_pb2_grpc
        from hio.transport.net import create_channel

        with create_channel(self.repository, self._cluster.settings) as channel:
            stub = repository_pb2_grpc.RepositoryStub(channel)
            return stub.GetOffsets(repository_pb2.GetOffsetsRequest(), timeout=10).records

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.close(30.0)
        self._cluster.stop()


# ---- load -------------------------------------------------------------------------------


class Load:
    """Submits synthetic tuples through the gateway and counts what became of them."""

    def __init__(self, cluster: SoakCluster, config: SoakConfig) -> None:
        size = config.tuple_bytes()
        self._payloads = [os.urandom(size) for _ in range(4)]
        self._gateway = cluster.gateway
        self._attributes = {"cost_ms": f"{config.cost_ms:g}"}
        self._lock = threading.Lock()
        self._outstanding: collections.deque[Any] = collections.deque()
        self.submitted = 0
        self.failed = 0
        self.late_seconds = 0.0

    def submit_one(self) -> None:
        future = self._gateway.submit(
            self._payloads[self.submitted % len(self._payloads)],
            image=IMAGE,
            name=f"soak-{self.submitted}",
            attributes=self._attributes,
            timeout=None,
        )
        with self._lock:
            self.submitted += 1
            self._outstanding.append(future)

    def outstanding(self) -> int:
        """Tuples neither STORED nor ENQUEUED yet; forgets the finished ones."""
        with self._lock:
            while self._outstanding and self._outstanding[0].done():
                if self._outstanding.popleft().exception() is not None:
                    self.failed += 1
            return len(self._outstanding)

    def closed_loop(self, seconds: float, in_flight: int) -> None:
        """Keep ``in_flight`` tuples outstanding for ``seconds``: as fast as the pipeline goes."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.outstanding() < in_flight:
                self.submit_one()
            else:
                time.sleep(0.002)

    def open_loop(self, rate: float, seconds: float, stop: threading.Event) -> None:
        """Offer ``rate`` tuples/s for ``seconds``, on a fixed schedule (lateness is recorded)."""
        interval = 1.0 / rate
        start = next_at = time.monotonic()
        while next_at < start + seconds and not stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            else:
                self.late_seconds = max(self.late_seconds, -delay)
            self.submit_one()
            self.outstanding()
            next_at += interval


def measure_capacity(cluster: SoakCluster, load: Load, config: SoakConfig) -> float:
    """Tuples/s processed (the master's tuples_done) under closed-loop load, after a short warm-up."""
    warm = config.ramp_seconds / 4
    load.closed_loop(warm, config.ramp_outstanding)
    first = cluster.status()
    t0 = time.monotonic()
    load.closed_loop(config.ramp_seconds - warm, config.ramp_outstanding)
    last = cluster.status()
    elapsed = time.monotonic() - t0
    return (last.tuples_done - first.tuples_done) / elapsed


def wait_processed(cluster: SoakCluster, load: Load, timeout: float) -> bool:
    """Until the master counts every submitted tuple done (or failed); False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = cluster.status()
        if load.outstanding() == 0 and status.tuples_done + status.tuples_failed >= load.submitted:
            return True
        time.sleep(0.5)
    return False


# ---- sampling and the verdict --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sample:
    seconds: float  # since the steady phase began
    usage: dict[str, Usage]
    done_per_s: float
    queue_length: int
    outstanding: int


class Sampler:
    """Takes a :class:`Sample` every ``interval`` seconds on its own thread."""

    def __init__(self, cluster: SoakCluster, load: Load, interval: float, on_sample: Callable[[Sample], None]) -> None:
        self._cluster = cluster
        self._load = load
        self._interval = interval
        self._on_sample = on_sample
        self._stop = threading.Event()
        self.samples: list[Sample] = []
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> Sampler:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._interval + 15)

    def _run(self) -> None:
        last_done, last_t = self._cluster.status().tuples_done, time.monotonic()
        while not self._stop.wait(self._interval):
            try:
                status = self._cluster.status()
            except Exception as exc:  # noqa: BLE001 - a missed sample is reported, not fatal
                log.warning("status unavailable", extra={"error": str(exc)})
                continue
            now = time.monotonic()
            sample = Sample(
                seconds=now - self._start,
                usage=self._cluster.usage(),
                done_per_s=(status.tuples_done - last_done) / (now - last_t),
                queue_length=sum(q.length for q in status.queues),
                outstanding=self._load.outstanding(),
            )
            last_done, last_t = status.tuples_done, now
            self.samples.append(sample)
            self._on_sample(sample)


@dataclasses.dataclass(frozen=True)
class Verdict:
    role: str
    first: Usage
    last: Usage
    flat: bool
    why: str


def _mean_usage(samples: list[Sample], role: str) -> Usage:
    usages = [s.usage[role] for s in samples]
    return Usage(
        rss_kib=round(statistics.fmean(u.rss_kib for u in usages)),
        fds=round(statistics.fmean(u.fds for u in usages)),
        threads=round(statistics.fmean(u.threads for u in usages)),
        processes=max(u.processes for u in usages),
    )


def judge(samples: list[Sample], config: SoakConfig) -> list[Verdict]:
    """Per role: compare the last third's means with the first third's, after the warm-up."""
    judged = [s for s in samples if s.seconds >= config.warmup_seconds]
    if len(judged) < 3:
        raise ConfigError(f"only {len(judged)} samples after the warm-up; run longer or sample more often")
    third = len(judged) // 3
    verdicts = []
    for role in ROLES:
        first, last = _mean_usage(judged[:third], role), _mean_usage(judged[-third:], role)
        problems = []
        if last.rss_kib > first.rss_kib * (1 + config.rss_tolerance):
            problems.append(f"RSS +{100 * (last.rss_kib / max(first.rss_kib, 1) - 1):.0f}%")
        for name in ("fds", "threads"):
            a, b = getattr(first, name), getattr(last, name)
            if b > a * 1.10 + config.count_slack:
                problems.append(f"{name} {a} -> {b}")
        verdicts.append(Verdict(role, first, last, not problems, ", ".join(problems) or "flat"))
    return verdicts


def format_sample(sample: Sample) -> str:
    cells = " ".join(
        f"{s.usage[r].rss_kib / 1024:>7.1f} {s.usage[r].fds:>4} {s.usage[r].threads:>4}"
        for s in (sample,)
        for r in ROLES
    )
    return f"{sample.seconds:>6.0f} {cells} {sample.done_per_s:>7.1f} {sample.queue_length:>6} {sample.outstanding:>6}"


def header() -> str:
    roles = " ".join(f"{r[:16]:>17}" for r in ROLES)
    units = " ".join(f"{'RSS MiB':>7} {'fds':>4} {'thr':>4}" for _ in ROLES)
    return f"{'':>6} {roles}\n{'t [s]':>6} {units} {'done/s':>7} {'queue':>6} {'flight':>6}"


def report(verdicts: list[Verdict]) -> str:
    lines = [f"{'role':<11} {'RSS MiB first→last':>20} {'fds':>10} {'threads':>10}  verdict"]
    for v in verdicts:
        lines.append(
            f"{v.role:<11} {v.first.rss_kib / 1024:>9.1f}→{v.last.rss_kib / 1024:<9.1f} "
            f"{v.first.fds:>4}→{v.last.fds:<5} {v.first.threads:>4}→{v.last.threads:<5}  {v.why}"
        )
    return "\n".join(lines)


# ---- the run ------------------------------------------------------------------------------


def run_soak(config: SoakConfig) -> int:
    """Measure capacity, hold ``load`` x capacity for ``minutes``, judge; 0 when flat and nothing lost."""
    root = Path(config.data_dir).expanduser().resolve() / f"soak-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    cluster = SoakCluster(config, root)
    try:
        from benchmarks.measure import loopback_bandwidth

        print(
            f"soak: loopback bandwidth (one TCP stream) {loopback_bandwidth() / 1e6:,.0f} MB/s, "
            f"{os.cpu_count()} cores; starting repository, master, worker ({config.engines} x {IMAGE}) "
            f"in {root}",
            flush=True,
        )
        cluster.start()
        load = Load(cluster, config)
        capacity = measure_capacity(cluster, load, config)
        if not wait_processed(cluster, load, config.drain_seconds) or capacity <= 0:
            print(f"soak: the capacity ramp did not finish ({capacity:.1f} tuples/s measured)", flush=True)
            return 1
        rate = config.load * capacity
        print(
            f"soak: capacity {capacity:.1f} tuples/s ({capacity * config.tuple_bytes() / 1e6:.1f} MB/s) of "
            f"{config.size} tuples at {config.cost_ms:g} ms CPU; offering {rate:.1f} tuples/s "
            f"({config.load:.0%}) for {config.minutes:g} min",
            flush=True,
        )
        return _steady(cluster, load, config, rate)
    finally:
        cluster.stop()
        if not config.keep:
            shutil.rmtree(root, ignore_errors=True)


def _steady(cluster: SoakCluster, load: Load, config: SoakConfig, rate: float) -> int:
    before_records = cluster.stored_records()
    before_submitted = load.submitted
    print(header(), flush=True)
    sampler = Sampler(cluster, load, config.sample_seconds, lambda s: print(format_sample(s), flush=True)).start()
    stop = threading.Event()
    try:
        load.open_loop(rate, config.minutes * 60, stop)
    except KeyboardInterrupt:
        stop.set()
    finally:
        sampler.stop()
    drained = wait_processed(cluster, load, config.drain_seconds)
    offered = load.submitted - before_submitted
    stored = cluster.stored_records() - before_records
    verdicts = judge(sampler.samples, config)
    print(report(verdicts))
    exact = drained and stored == offered and load.failed == 0
    print(
        f"soak: {offered} tuples offered in the steady phase, {stored} feature records stored, "
        f"{load.failed} failed; backlog drained: {'yes' if drained else 'NO'}; "
        f"worst submit lateness {load.late_seconds:.2f} s"
    )
    flat = all(v.flat for v in verdicts)
    print(f"soak: {'FLAT' if flat else 'NOT FLAT'}; {'every tuple stored once' if exact else 'TUPLES MISSING'}")
    return 0 if flat and exact else 1


def main(argv: list[str] | None = None) -> int:
    from hio.process.log import setup_logging

    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    cfg.add_arguments(parser, SoakConfig, "soak")
    args = parser.parse_args(argv)
    try:
        config = cfg.build(SoakConfig, "soak", args)
    except ConfigError as exc:
        print(f"benchmarks.soak: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_json)
    return run_soak(config)


if __name__ == "__main__":
    sys.exit(main())
