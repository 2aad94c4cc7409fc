"""`hio bench`: maximum sustained frequency against Spark Structured Streaming.

Over a grid of message size x CPU cost per message (the paper's: 100 B .. 10 MB
x 0 .. 1 s), for each system of :mod:`benchmarks.systems` (this system direct
and forced through the queue; Spark with the file and the socket source), find
the highest rate the system sustains: ramp up, then bisect until the bracket
is within ``tolerance``. A step at rate r sends ``N`` messages paced at r
(lasting at least three of the system's latencies) and passes only if

* the source kept the pace (finished sending within 5% of N/r),
* at least 95% of the messages were finished within a grace after the last
  send (``grace_seconds`` or twice the latency seen, plus 2 x the CPU cost),
* the backlog (sent - finished) did not grow once the pipeline was full (the
  last two thirds of the step, later if latency is long; least-squares slope;
  a growth above 5% of N or 2 x slots fails), and
* no errors were reported.

Each system, once started, first runs one short warm-up step that is not
recorded (JIT, Python workers, connections), so its first point is not the
only one that pays for start-up.

Each result is printed beside the bound ``min(loopback bandwidth / size,
slots / cost)`` (bandwidth measured at the start of the run). For the latency
sizes (1 MB and 10 MB), p50/p99 from accepted to stored is measured at half
the maximum. Results go to a CSV as each point finishes, each row with when it
finished, the commit it measured and the machine it ran on; a later run resumes
after the last finished point. At the end the command regenerates
``docs/benchmarks.md`` with tables and plots (:mod:`benchmarks.report`).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from benchmarks.report import cost_label, size_label
from benchmarks.systems import SLOTS, SYSTEMS, MessageGenerator, System, make_system
from hio.config import ConfigError, positive, setting
from hio.settings import ClusterSettings

log = logging.getLogger("hio.bench")

FULL_SIZES = ("100", "10K", "100K", "1M", "10M")
FULL_COSTS = ("0", "10ms", "100ms", "1s")
QUICK_SIZES = ("100", "1M")
QUICK_COSTS = ("0", "100ms")

RESULT_FIELDS = (
    "system",
    "size",
    "cost_ms",
    "max_rate",
    "bound",
    "fraction",
    "loopback_mb_s",
    "steps",
    "seconds",
    "first_fail_rate",
    "first_fail_reason",
    "latency_rate",
    "p50_ms",
    "p99_ms",
    "load_avg",
    "cpu_slots",
    "finished_at",
    "steal",
    "commit",
    "machine",
)
STEP_FIELDS = (
    "system",
    "size",
    "cost_ms",
    "rate",
    "messages",
    "seconds",
    "sent_rate",
    "finished",
    "finished_fraction",
    "backlog_growth",
    "passed",
    "reason",
    "p50_ms",
    "p99_ms",
    "load_avg",
    "steal",
)


@dataclasses.dataclass(frozen=True)
class BenchConfig(ClusterSettings):
    quick: bool = setting(False, "the quick grid (sizes 100 B and 1 MB x costs 0 and 100 ms, short steps)")
    sizes: tuple[str, ...] = setting(
        (), "message sizes (decimal units: 100, 10K, 1M); empty = the grid's", factory=tuple
    )
    costs: tuple[str, ...] = setting((), "CPU cost per message (0, 10ms, 1s); empty = the grid's", factory=tuple)
    systems: tuple[str, ...] = setting(
        None, "systems to measure", factory=lambda: ("hio-direct", "hio-queue", "spark-file", "spark-socket")
    )
    out_dir: str = setting("docs", "where benchmarks.md goes; plots and CSVs under OUT_DIR/benchmarks/")
    results_name: str = setting(
        "", "CSV file name under OUT_DIR/benchmarks/; empty = results-full.csv or results-quick.csv"
    )
    fresh: bool = setting(False, "ignore earlier results in the CSV instead of resuming after them")
    report: bool = setting(True, "regenerate OUT_DIR/benchmarks.md and the plots at the end")
    min_step_seconds: float = setting(0.0, "shortest step (0 = 4 s, quick grid 3 s)")
    max_step_seconds: float = setting(0.0, "longest step (0 = 10 s, quick grid 6 s)")
    min_step_messages: int = setting(20, "messages a step sends at least (unless that exceeds the longest step)")
    grace_seconds: float = setting(
        4.0, "after the last send, time allowed (plus 2x the cost) to finish 95% (covers Spark's micro-batch latency)"
    )
    drain_seconds: float = setting(
        45.0, "after a step, wait this long for the backlog to empty; then the system is reset"
    )
    tolerance: float = setting(0.05, "bisect until (high - low) / high is at most this")
    max_steps: int = setting(12, "steps per grid point at most")
    start_rate: float = setting(100.0, "first rate (/s) of a point without a better guess")
    start_fraction: float = setting(0.9, "first rate as a fraction of the bound, where the bound is finite")
    min_rate: float = setting(0.1, "below this rate (/s) a point is recorded as 0")
    max_rate: float = setting(200_000.0, "never try a rate above this (/s): the generator's own limit")
    latency_sizes: tuple[str, ...] = setting(
        None, "sizes where latency is measured at half the maximum", factory=lambda: ("1M", "10M")
    )
    latency_messages: int = setting(30, "messages of the latency step at least")
    streams: int = setting(4, "gateway delivery streams (this system)")
    batch_tuples: int = setting(256, "gateway batch size in tuples (this system)")
    spark_conf: tuple[str, ...] = setting((), "extra Spark settings KEY=VALUE", factory=tuple)
    point_seconds: float = setting(300.0, "give up bisecting a point after this long (keep the best so far)")

    def validate(self) -> None:
        self.validate_cluster()
        for name in self.systems:
            if name not in SYSTEMS:
                raise ConfigError(f"systems: unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
        for text in self.grid_sizes() + tuple(self.latency_sizes):
            if parse_size(text) < 64:
                raise ConfigError(f"sizes: {text!r} is below 64 bytes (the message header needs 48)")
        for text in self.grid_costs():
            parse_cost(text)
        for name in (
            "min_step_messages",
            "drain_seconds",
            "tolerance",
            "max_steps",
            "start_rate",
            "min_rate",
            "max_rate",
            "latency_messages",
            "streams",
            "batch_tuples",
            "point_seconds",
            "start_fraction",
        ):
            positive(name, getattr(self, name))
        if self.min_step_seconds < 0 or self.max_step_seconds < 0 or self.grace_seconds < 0:
            raise ConfigError("min_step_seconds, max_step_seconds and grace_seconds must not be negative")
        if not 0 < self.tolerance < 1:
            raise ConfigError(f"tolerance must be between 0 and 1, got {self.tolerance}")

    def grid_sizes(self) -> tuple[str, ...]:
        return self.sizes or (QUICK_SIZES if self.quick else FULL_SIZES)

    def grid_costs(self) -> tuple[str, ...]:
        return self.costs or (QUICK_COSTS if self.quick else FULL_COSTS)

    def step_bounds(self) -> tuple[float, float]:
        low = self.min_step_seconds or (3.0 if self.quick else 4.0)
        high = self.max_step_seconds or (6.0 if self.quick else 10.0)
        return low, max(low, high)

    def results_path(self) -> Path:
        name = self.results_name or ("results-quick.csv" if self.quick else "results-full.csv")
        return Path(self.out_dir) / "benchmarks" / name


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_size(text: str) -> int:
    """'100', '10K', '1M', '10MB' -> bytes (decimal units, as the paper's grid)."""
    t = str(text).strip().lower().removesuffix("b")
    try:
        if t and t[-1] in _DECIMAL:
            return int(float(t[:-1]) * _DECIMAL[t[-1]])
        return int(t)
    except ValueError:
        raise ConfigError(f"sizes: cannot read {text!r} as a size (examples: 100, 10K, 1M)") from None


def parse_cost(text: str) -> float:
    """'0', '10ms', '0.1s', '1s' -> seconds of CPU per message."""
    t = str(text).strip().lower()
    try:
        if t.endswith("ms"):
            value = float(t[:-2]) / 1000
        elif t.endswith("s"):
            value = float(t[:-1])
        else:
            value = float(t)
    except ValueError:
        raise ConfigError(f"costs: cannot read {text!r} as a CPU cost (examples: 0, 10ms, 1s)") from None
    if value < 0 or value > 3600:
        raise ConfigError(f"costs: {text!r} must be between 0 and 1 hour")
    return value


def bound_rate(size: int, cost_s: float, bandwidth: float, slots: int) -> float:
    """The ideal system's rate: the tighter of the network and the CPU bound."""
    network = bandwidth / size
    return min(network, slots / cost_s) if cost_s > 0 else network


# -- one step -------------------------------------------------------------------------


@dataclasses.dataclass
class StepResult:
    rate: float
    messages: int
    seconds: float
    sent_rate: float
    finished: int
    backlog_growth: float
    passed: bool
    reason: str
    latencies: list[float]

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y); 0 for fewer than two distinct times."""
    if len(points) < 2:
        return 0.0
    mean_t = statistics.fmean(t for t, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / var


class StepRunner:
    """Runs steps of one grid point on one system, by the pass rules in the module doc."""

    def __init__(
        self, system: System, generator: MessageGenerator, cost_s: float, config: BenchConfig, prefix: str = ""
    ) -> None:
        self.system = system
        self.prefix = prefix  # makes step tags unique across the points of one system run
        self.generator = generator
        self.cost_s = cost_s
        self.config = config
        self.counter = 0
        # Median latency of the latest passing step: a step must
        # last a few latencies, or a pipeline still filling looks like a growing backlog.
        self.latency_hint = 0.0

    def duration(self, rate: float, messages: int) -> tuple[float, int]:
        """Seconds and messages of a step: enough messages, a few latencies long, bounded."""
        low, high = self.config.step_bounds()
        low = max(low, min(3 * self.latency_hint, 3 * high))
        seconds = min(max(messages / rate, low), max(high, low))
        return seconds, max(2, math.ceil(rate * seconds))

    def run(self, rate: float, min_messages: int | None = None) -> StepResult:
        self.counter += 1
        tag = f"{self.prefix}s{self.counter}"
        _seconds, count = self.duration(rate, min_messages or self.config.min_step_messages)
        errors_before = len(self.system.errors())
        base = self.system.finished_count()
        sent = [0]
        samples: list[tuple[float, float]] = []
        t0 = time.monotonic() + 0.05
        stop_sampling = threading.Event()
        sampler = threading.Thread(target=self._sample, args=(t0, base, sent, samples, stop_sampling), daemon=True)
        sampler.start()
        send_errors = self._pace(tag, rate, count, t0, sent)
        send_end = time.monotonic()
        stop_sampling.set()
        sampler.join()
        grace = max(self.config.grace_seconds, 2 * self.latency_hint) + 2 * self.cost_s
        deadline_unix = time.time() + grace
        self._wait_finished(base, count, time.monotonic() + grace)
        finished = self.system.finished(tag)
        in_time = [f for f in finished if f.done_unix <= deadline_unix]
        errors = self.system.errors()[errors_before:] + send_errors
        growth = self._growth(samples, t0, send_end)
        result = self._judge(rate, count, send_end - t0, len(in_time), growth, errors)
        result.latencies = [f.done_unix - f.sent_unix for f in finished]
        if result.passed and result.latencies:  # an overloaded step's latency is queueing, not the system's
            self.latency_hint = result.percentile(0.5)
        self._drain(base, count)
        return result

    def _pace(self, tag: str, rate: float, count: int, t0: float, sent: list[int]) -> list[str]:
        """Send ``count`` messages, message i at t0 + i/rate, from the system's sender threads."""
        lock = threading.Lock()
        next_index = [0]
        errors: list[str] = []

        def worker() -> None:
            while True:
                with lock:
                    i = next_index[0]
                    if i >= count:
                        return
                    next_index[0] += 1
                wait = t0 + i / rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    self.system.send(tag, i, self.generator.message(tag, i, time.time()), self.cost_s)
                except Exception as exc:  # noqa: BLE001 - a failing send is a failed step, not a crash
                    with lock:
                        errors.append(f"send: {exc}")
                with lock:
                    sent[0] += 1

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.system.sender_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return errors[:5]

    def _sample(
        self, t0: float, base: int, sent: list[int], samples: list[tuple[float, float]], stop: threading.Event
    ) -> None:
        while not stop.wait(0.2):
            now = time.monotonic()
            samples.append((now - t0, sent[0] - (self.system.finished_count() - base)))

    def _growth(self, samples: list[tuple[float, float]], t0: float, send_end: float) -> float:
        """Backlog growth once the pipeline is full: least-squares slope over the
        sending period after max(a third of it, 1.5 latencies), times that span."""
        span = send_end - t0
        start = min(max(span / 3, 1.5 * self.latency_hint), span * 2 / 3)
        tail = [(t, y) for t, y in samples if t >= start]
        return slope(tail) * (span - start)

    def _judge(
        self, rate: float, count: int, send_seconds: float, in_time: int, growth: float, errors: list[str]
    ) -> StepResult:
        planned = count / rate
        sent_rate = count / max(send_seconds, 1e-9)
        allowed_growth = max(2 * SLOTS, 0.05 * count)
        reason = ""
        if errors:
            reason = f"errors: {errors[0][:200]}"
        elif send_seconds > planned * 1.05 + 0.05:
            reason = f"source below target rate ({sent_rate:.4g}/s of {rate:.4g}/s)"
        elif in_time < 0.95 * count:
            reason = f"only {in_time}/{count} finished in time ({in_time / count:.0%})"
        elif growth > allowed_growth:
            reason = f"backlog grew by {growth:.0f} messages"
        return StepResult(rate, count, send_seconds, sent_rate, in_time, growth, not reason, reason, [])

    def _wait_finished(self, base: int, count: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.system.finished_count() - base >= count:
                return
            time.sleep(0.05)

    def _drain(self, base: int, count: int) -> None:
        """Let the step's leftovers finish; reset the system if they do not in time."""
        deadline = time.monotonic() + max(self.config.drain_seconds, 0.0)
        self._wait_finished(base, count, deadline)
        if self.system.finished_count() - base < count:
            log.warning("backlog did not drain; resetting", extra={"system": self.system.name})
            self.system.reset()


# -- one point: ramp, then bisect -------------------------------------------------------


@dataclasses.dataclass
class PointResult:
    max_rate: float
    steps: list[StepResult]
    first_fail: StepResult | None


def find_max(
    run_step: Callable[[float], StepResult],
    start: float,
    cap: float,
    *,
    tolerance: float,
    min_rate: float,
    max_steps: int,
    deadline: float,
) -> PointResult:
    """Ramp up from ``start`` (x4 while far below ``cap``, else x2) until a step fails
    or ``cap`` passes; if the very first step fails, halve until one passes; then
    bisect between the highest pass and the lowest fail until within ``tolerance``."""
    steps: list[StepResult] = []
    low, high = 0.0, math.inf
    first_fail: StepResult | None = None

    def step(rate: float) -> bool:
        nonlocal low, high, first_fail
        result = run_step(rate)
        steps.append(result)
        if result.passed:
            low = max(low, rate)
        else:
            high = min(high, rate)
            first_fail = first_fail or result
        return result.passed

    def budget() -> bool:
        return not steps or (len(steps) < max_steps and time.monotonic() < deadline)

    rate = min(start, cap)
    while budget():
        if not step(rate):
            break
        if rate >= cap:
            return PointResult(low, steps, first_fail)
        rate = min(cap, rate * (4 if rate * 16 < cap else 2))
    while low == 0 and budget() and high / 2 >= min_rate:
        step(high / 2)
    while low > 0 and high < math.inf and (high - low) > tolerance * high and budget():
        step((low + high) / 2)
    return PointResult(low, steps, first_fail)


# -- the run --------------------------------------------------------------------------

WARM_UP_RATE = 20.0  # messages/s of the warm-up step (at most)
WARM_UP_BYTES_PER_SECOND = 50e6  # ...and at most this many bytes/s, for large messages
WARM_UP_MESSAGES = 20


def load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def cpu_ticks() -> tuple[int, int]:
    """(stolen, total) CPU time of the whole machine since boot, in clock ticks; (0, 0) where unknown.

    Why: on a virtual machine the hypervisor may run other guests on our
    cores ("steal" in ``/proc/stat``). No process here sees it, yet a
    CPU-bound cell cannot go faster than the CPU that is left.
    """
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return 0, 0
    if fields[0] != "cpu" or len(ticks) < 8:
        return 0, 0
    return ticks[7], sum(ticks)


def steal_between(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The fraction of all CPU time the hypervisor took between two :func:`cpu_ticks`; NaN if unknown."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else math.nan


def _burn(seconds: float) -> float:
    from hio.worker.pipelines.synthetic import burn_cpu

    return burn_cpu(seconds)


class CpuProbe:
    """How many of the two processing slots the machine gives right now.

    Two processes each burn ``seconds`` of CPU with the benchmark's own burn
    function; ``2 * seconds / wall`` is the slots available (2.0 on an idle
    2-core machine, less when others load it). It tells a result hurt by a
    shared machine from one hurt by the system.
    """

    def __init__(self, seconds: float = 0.2) -> None:
        import multiprocessing

        self.seconds = seconds
        self._pool = multiprocessing.get_context("spawn").Pool(SLOTS)
        self._pool.map(_burn, [0.0] * SLOTS)  # pay the start-up once

    def slots(self) -> float:
        start = time.monotonic()
        self._pool.map(_burn, [self.seconds] * SLOTS, chunksize=1)
        return min(float(SLOTS), SLOTS * self.seconds / max(time.monotonic() - start, 1e-9))

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()


def read_done(path: Path) -> dict[tuple[str, int, float], dict[str, str]]:
    """Finished points of an earlier run, by (system, size, cost_ms)."""
    if not path.exists():
        return {}
    with open(path, newline="") as fh:
        return {(row["system"], int(row["size"]), float(row["cost_ms"])): row for row in csv.DictReader(fh)}


def append_row(path: Path, fields: Iterable[str], row: dict[str, object]) -> None:
    """Append one row (header first if the file is new), flushed to disk at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        _upgrade_header(path, list(fields))
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields))
        if new:
            writer.writeheader()
        writer.writerow(row)
        fh.flush()
        os.fsync(fh.fileno())


def _upgrade_header(path: Path, fields: list[str]) -> None:
    """A CSV from an older version with other columns: rewrite it with ``fields`` (atomically)."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames == fields:
            return
        rows = list(reader)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def _fmt(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.6g}"


class BenchRun:
    """One `hio bench` invocation: the grid, the systems, the CSVs."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.results = config.results_path()
        self.steps_path = self.results.with_name(self.results.stem + "-steps.csv")
        self.work = Path(config.data_dir).expanduser().resolve() / "bench"
        self.sizes = [parse_size(s) for s in config.grid_sizes()]
        self.costs = [parse_cost(c) for c in config.grid_costs()]
        self.latency_sizes = {parse_size(s) for s in config.latency_sizes}
        self.bandwidth = 0.0
        self.points = 0
        self.probe: CpuProbe | None = None
        self.commit = ""
        self.machine = ""

    def run(self) -> int:
        from benchmarks.measure import loopback_bandwidth, machine_description, source_commit

        if self.config.fresh:
            for path in (self.results, self.steps_path):
                path.unlink(missing_ok=True)
        done = read_done(self.results)
        pending = {
            name: [(size, cost) for cost in self.costs for size in self.sizes if (name, size, cost * 1000) not in done]
            for name in self.config.systems
        }
        if any(pending.values()):
            self.commit, self.machine = source_commit(), machine_description()
            self.bandwidth = loopback_bandwidth(seconds=2.0)
            print(
                f"hio bench: loopback {self.bandwidth / 1e6:,.0f} MB/s; {os.cpu_count()} cores; "
                f"load {load_avg():.1f}; results {self.results}",
                flush=True,
            )
        self.probe = CpuProbe() if any(pending.values()) else None
        try:
            for name, todo in pending.items():
                if not todo:
                    print(f"hio bench: {name}: all {len(self.sizes) * len(self.costs)} points done earlier")
                    continue
                self._run_system(name, todo, done)
        finally:
            if self.probe is not None:
                self.probe.close()
        if self.config.report:
            from benchmarks.report import write_report

            doc = write_report(self.results, Path(self.config.out_dir), self.config)
            print(f"hio bench: wrote {doc}")
        return 0

    def _run_system(
        self, name: str, todo: list[tuple[int, float]], done: dict[tuple[str, int, float], dict[str, str]]
    ) -> None:
        system = make_system(
            name,
            self.work / f"{name}-{os.getpid()}-{int(time.time())}",
            chunk_bytes=self.config.chunk_bytes,
            streams=self.config.streams,
            batch_tuples=self.config.batch_tuples,
            spark_conf=self.config.spark_conf,
        )
        started = time.monotonic()
        print(f"hio bench: starting {name}", flush=True)
        system.start()
        print(f"hio bench: {name} up in {time.monotonic() - started:.1f}s", flush=True)
        try:
            self._warm_up(system, todo[0][0])
            for size, cost in todo:
                row = self._run_point(system, size, cost, done)
                done[(name, size, cost * 1000)] = {k: str(v) for k, v in row.items()}
        finally:
            system.stop()

    def _warm_up(self, system: System, size: int) -> None:
        """A short step that is not recorded, so the first point does not pay for start-up
        (the JVM's JIT, Python workers, connections) that no later point pays for."""
        rate = min(WARM_UP_RATE, WARM_UP_BYTES_PER_SECOND / size)
        system.begin_point(size, 0.0)
        try:
            result = StepRunner(
                system, MessageGenerator(size, text=system.text_payload), 0.0, self.config, prefix="warm"
            ).run(rate, min_messages=WARM_UP_MESSAGES)
        finally:
            system.end_point()
        print(
            f"hio bench: {system.name} warmed up ({result.finished}/{result.messages} messages at "
            f"{rate:.3g}/s; not recorded)",
            flush=True,
        )

    def _guess(self, name: str, size: int, cost: float, done: dict[tuple[str, int, float], dict[str, str]]) -> float:
        """The best earlier result of this system at the same cost and a smaller size."""
        smaller = [
            float(row["max_rate"])
            for (s, sz, c), row in done.items()
            if s == name and c == cost * 1000 and sz < size and float(row["max_rate"] or 0) > 0
        ]
        return min(smaller) if smaller else 0.0

    def _run_point(
        self, system: System, size: int, cost: float, done: dict[tuple[str, int, float], dict[str, str]]
    ) -> dict[str, object]:
        config = self.config
        bound = bound_rate(size, cost, self.bandwidth, SLOTS)
        cap = min(bound, config.max_rate)
        guess = self._guess(system.name, size, cost, done)
        if cap < config.max_rate:  # a finite bound: start just under it
            start = cap * config.start_fraction if not guess else min(cap * config.start_fraction, guess)
        else:
            start = guess or config.start_rate
        cpu_slots = self.probe.slots() if self.probe is not None else math.nan
        started = time.monotonic()
        system.begin_point(size, cost)
        begun = time.monotonic()  # a Spark query may take long to start on a loaded machine
        try:
            self.points += 1
            runner = StepRunner(
                system, MessageGenerator(size, text=system.text_payload), cost, config, prefix=f"p{self.points}"
            )

            def step(rate: float, **options: int) -> StepResult:
                """One step, logged with the steal during it."""
                before = cpu_ticks()
                result = runner.run(rate, **options)
                self._log_step(system.name, size, cost, result, steal_between(before, cpu_ticks()))
                return result

            point_ticks = cpu_ticks()
            point = find_max(
                step,
                start,
                cap,
                tolerance=config.tolerance,
                min_rate=config.min_rate,
                max_steps=config.max_steps,
                deadline=begun + config.point_seconds,
            )
            steal = steal_between(point_ticks, cpu_ticks())
            latency = None
            if size in self.latency_sizes and point.max_rate > 0:
                latency = step(point.max_rate / 2, min_messages=config.latency_messages)
        finally:
            system.end_point()
        row = {
            "system": system.name,
            "size": size,
            "cost_ms": _fmt(cost * 1000),
            "max_rate": _fmt(point.max_rate),
            "bound": _fmt(bound),
            "fraction": _fmt(point.max_rate / bound),
            "loopback_mb_s": _fmt(self.bandwidth / 1e6),
            "steps": len(point.steps),
            "seconds": _fmt(time.monotonic() - started),
            "first_fail_rate": _fmt(point.first_fail.rate) if point.first_fail else "",
            "first_fail_reason": point.first_fail.reason if point.first_fail else "",
            "latency_rate": _fmt(latency.rate) if latency else "",
            "p50_ms": _fmt(latency.percentile(0.5) * 1000) if latency else "",
            "p99_ms": _fmt(latency.percentile(0.99) * 1000) if latency else "",
            "load_avg": _fmt(load_avg()),
            "cpu_slots": _fmt(cpu_slots),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "steal": _fmt(steal),
            "commit": self.commit,
            "machine": self.machine,
        }
        append_row(self.results, RESULT_FIELDS, row)
        fail_note = f"; first fail: {point.first_fail.reason}" if point.first_fail else ""
        print(
            f"{system.name:>13} {size_label(size):>7} {cost_label(cost * 1000):>7}: "
            f"{point.max_rate:>10.4g}/s  bound {bound:>10.4g}/s  {point.max_rate / bound:>6.1%}  "
            f"(CPU slots {cpu_slots:.2f}; steal {steal:.0%}; {len(point.steps)} steps{fail_note})"
            + (
                f"  p50 {latency.percentile(0.5) * 1000:.0f} ms p99 {latency.percentile(0.99) * 1000:.0f} ms"
                if latency
                else ""
            ),
            flush=True,
        )
        return row

    def _log_step(self, name: str, size: int, cost: float, result: StepResult, steal: float) -> None:
        append_row(
            self.steps_path,
            STEP_FIELDS,
            {
                "system": name,
                "size": size,
                "cost_ms": _fmt(cost * 1000),
                "rate": _fmt(result.rate),
                "messages": result.messages,
                "seconds": _fmt(result.seconds),
                "sent_rate": _fmt(result.sent_rate),
                "finished": result.finished,
                "finished_fraction": _fmt(result.finished / result.messages),
                "backlog_growth": _fmt(result.backlog_growth),
                "passed": int(result.passed),
                "reason": result.reason,
                "p50_ms": _fmt(result.percentile(0.5) * 1000),
                "p99_ms": _fmt(result.percentile(0.99) * 1000),
                "load_avg": _fmt(load_avg()),
                "steal": _fmt(steal),
            },
        )
        log.info(
            "step",
            extra={
                "system": name,
                "size": size,
                "cost_s": cost,
                "rate": result.rate,
                "passed": result.passed,
                "reason": result.reason,
            },
        )


def _interrupt_on_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C, so the systems' child processes are stopped too."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def run_bench(config: BenchConfig) -> int:
    """Entry of `hio bench`: measure the grid (resuming), then write the report."""
    _interrupt_on_sigterm()
    return BenchRun(config).run()
