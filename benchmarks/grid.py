"""`hio bench`: maximum sustained frequency against Spark Structured Streaming and durable brokers.

Over a grid of message size x CPU cost per message (the paper's: 100 B .. 10 MB
x 0 .. 1 s), for each system of :mod:`benchmarks.systems` (this system direct,
forced through the queue and with TLS and tokens on every hop; Spark with the
file and the socket source; RabbitMQ; NATS JetStream), find the highest rate the system
sustains. One run measures every system's row of a cell, interleaved per cell
(all systems at cell A, then all at cell B, ...), so the rows of a cell share
the machine's state; each system is started for its point and stopped after it.

A system's point:

1. **Machine state.** Right before the system starts: the CPU slots the
   machine gives and how fast they run (:class:`CpuProbe`), and the loopback
   bandwidth (one TCP stream). Measured while no system runs, so that a system's own idle work
   (Spark's streaming query polls its source without pause) is not taken
   for the machine's state, which is what the cell's systems must share.
2. **Probe.** A few messages sent at once (the first step of a freshly started
   system also warms it: JIT, Python workers, connections); the rate they
   finished at is where the search starts (at most ``start_fraction`` of the
   bound), so every system starts from its own measure in every cell, never
   from another cell's result. A probe that fails (a burst the system cannot
   take at once) does not end the point: the system is reset and the search
   starts at ``PROBE_FAILED_START_RATE``.
3. **Search.** Ramp up, then bisect until the bracket is within ``tolerance``.
   A step at rate r sends ``N`` messages paced at r (lasting at least three of
   the system's latencies) and passes only if

   * the source kept the pace (finished sending within 5% of N/r),
   * at least 95% of the messages were finished within a grace after the last
     send (``grace_seconds`` or twice the latency seen, plus 2 x the CPU cost),
   * the backlog (sent - finished) did not grow once the pipeline was full (the
     last two thirds of the step, later if latency is long; least-squares slope;
     a growth above the largest of 5% of N, 2 x slots and the messages sent in
     one latency fails: a micro-batch system's backlog rises and falls by about
     a batch, rate x its latency, which a slope over a few batches reads as
     growth), and
   * no errors were reported.

   The point's rate is the **achieved** rate of its highest passing step
   (finished messages per second at the sink, :func:`achieved_rate`), recorded
   beside that step's target.
4. **Latency.** For the latency sizes (1 MB and 10 MB), p50/p99 from accepted
   (sent) to finished at half the achieved maximum. Finished means the
   features are durably stored (:data:`benchmarks.systems.ABOUT`).

After every system's point of a cell, the cell's machine state is compared: a
cell whose CPU slots, CPU speed or loopback differ by more than ``agreement`` between its
systems is run again, up to ``cell_attempts`` times; the report publishes only
a cell that agreed and says which never did.

Then the **burst** rows, the way an instrument dumps a plate: ``burst_bytes``
of 1 MB and of 10 MB messages submitted at once, through the library and
through a watched folder (where the system has one), timed until all are
stored, beside the disk's write bandwidth measured with ``fdatasync`` first. A
burst fails at the system's first error (a failed send, a driver out of heap):
its row says why and how many were stored by then.

Results go to one CSV per run (``run`` column: the run's id) as each point
finishes, each row with when it finished, the commit it measured and the
machine; a later invocation resumes the same run after its last finished
point; ``--fresh`` starts a new run and a new CSV. At the end the command
regenerates ``docs/benchmarks.md`` (:mod:`benchmarks.report`) and the
README's performance section from that CSV alone. Everything the run started
(roles, Spark, the broker) is stopped and what it wrote is removed, also when
it fails.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import logging
import math
import os
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from benchmarks.report import cost_label, size_label
from benchmarks.systems import SLOTS, SYSTEMS, MessageGenerator, System, make_system
from hio.config import ConfigError, positive, setting
from hio.kd.config import check_spark_conf
from hio.settings import ClusterSettings

log = logging.getLogger("hio.bench")

MACHINE_SAMPLES = 5  # samples of the CPU slots and speed and of the loopback before a point; the best counts
MACHINE_TRIES = 3  # measurements before a point at most, while it disagrees with the cell's
MACHINE_PAUSE_SECONDS = 10.0  # between those measurements
PACE_SLACK_SECONDS = 10.0  # a step's sending stops at twice its planned time plus this
ERROR_POLL_SECONDS = 1.0  # how often a burst's wait asks the system for errors
PROBE_FAILED_START_RATE = 1.0  # messages/s where the search starts when a point's probe failed
FULL_SIZES = ("100", "10K", "100K", "1M", "10M")
FULL_COSTS = ("0", "10ms", "100ms", "1s")
QUICK_SIZES = ("100", "1M")
QUICK_COSTS = ("0", "100ms")

RESULT_FIELDS = (
    "run",
    "attempt",
    "system",
    "size",
    "cost_ms",
    "max_rate",
    "target_rate",
    "bound",
    "fraction",
    "cpu_slots",
    "cpu_speed",
    "loopback_mb_s",
    "probe_rate",
    "steps",
    "seconds",
    "failure",
    "first_fail_rate",
    "first_fail_reason",
    "latency_rate",
    "p50_ms",
    "p99_ms",
    "load_avg",
    "steal",
    "finished_at",
    "commit",
    "machine",
)
STEP_FIELDS = (
    "run",
    "attempt",
    "system",
    "size",
    "cost_ms",
    "kind",
    "rate",
    "achieved_rate",
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
BURST_FIELDS = (
    "run",
    "system",
    "size",
    "path",
    "messages",
    "stored",
    "seconds",
    "mb_s",
    "disk_mb_s",
    "cpu_slots",
    "cpu_speed",
    "loopback_mb_s",
    "failure",
    "finished_at",
    "commit",
    "machine",
)
BURST_PATHS = ("library", "folder")


@dataclasses.dataclass(frozen=True)
class BenchConfig(ClusterSettings):
    quick: bool = setting(False, "the quick grid (sizes 100 B and 1 MB x costs 0 and 100 ms, short steps)")
    sizes: tuple[str, ...] = setting(
        (), "message sizes (decimal units: 100, 10K, 1M); empty = the grid's", factory=tuple
    )
    costs: tuple[str, ...] = setting((), "CPU cost per message (0, 10ms, 1s); empty = the grid's", factory=tuple)
    systems: tuple[str, ...] = setting(None, "systems to measure", factory=lambda: SYSTEMS)
    out_dir: str = setting("docs", "where benchmarks.md goes; plots and CSVs under OUT_DIR/benchmarks/")
    results_name: str = setting(
        "", "CSV file name under OUT_DIR/benchmarks/; empty = results-full.csv or results-quick.csv"
    )
    readme: str = setting(
        "", "README whose performance section is regenerated from the results (`make bench`: README.md)"
    )
    fresh: bool = setting(False, "start a new run (a new CSV) instead of resuming the run in the CSV")
    report: bool = setting(True, "regenerate OUT_DIR/benchmarks.md, the plots and the README's section at the end")
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
    probe_messages: int = setting(20, "messages of a point's probe at most (sent at once; the search starts there)")
    probe_bytes: str = setting("50M", "bytes of a point's probe at most (a cheap probe: five 10 MB messages)")
    start_fraction: float = setting(0.9, "first rate at most this fraction of the bound, where the bound is finite")
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
    agreement: float = setting(
        0.15,
        "a cell is published only if its systems' CPU slots, CPU speed and loopback differ by at most this fraction",
    )
    cell_attempts: int = setting(3, "runs of a cell at most, until its machine state agrees")
    loopback_seconds: float = setting(2.0, "time of each loopback measurement (its samples in all)")
    burst_sizes: tuple[str, ...] = setting(
        None, "message sizes of the burst rows (empty: no burst rows)", factory=lambda: ("1M", "10M")
    )
    burst_bytes: str = setting("2G", "bytes of each burst (per size and path), submitted at once")
    burst_paths: tuple[str, ...] = setting(None, "how a burst is submitted", factory=lambda: BURST_PATHS)
    burst_seconds: float = setting(900.0, "a burst not stored within this long fails (timeout)")
    disk_probe: str = setting("1G", "bytes written and fdatasynced to measure the disk before the bursts")

    def validate(self) -> None:
        self.validate_cluster()
        for name in self.systems:
            if name not in SYSTEMS:
                raise ConfigError(f"systems: unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
        for name, texts in (
            ("sizes", self.grid_sizes()),
            ("latency_sizes", self.latency_sizes),
            ("burst_sizes", self.burst_sizes),
        ):
            for text in texts:
                if parse_size(text, name) < 64:
                    raise ConfigError(f"{name}: {text!r} is below 64 bytes (the message header needs 48)")
        for text in self.grid_costs():
            parse_cost(text)
        check_spark_conf(self.spark_conf)
        for path in self.burst_paths:
            if path not in BURST_PATHS:
                raise ConfigError(f"burst_paths: unknown path {path!r}; choose from {', '.join(BURST_PATHS)}")
        for name in (
            "min_step_messages",
            "drain_seconds",
            "tolerance",
            "max_steps",
            "probe_messages",
            "min_rate",
            "max_rate",
            "latency_messages",
            "streams",
            "batch_tuples",
            "point_seconds",
            "start_fraction",
            "cell_attempts",
            "loopback_seconds",
            "burst_seconds",
            "agreement",
        ):
            positive(name, getattr(self, name))
        for name in ("probe_bytes", "burst_bytes", "disk_probe"):
            if parse_size(getattr(self, name), name) <= 0:
                raise ConfigError(f"{name} must be a positive size (examples: 200M, 2G), got {getattr(self, name)!r}")
        if not all(v >= 0 for v in (self.min_step_seconds, self.max_step_seconds, self.grace_seconds)):  # NaN too
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


def parse_size(text: str, name: str = "sizes") -> int:
    """'100', '10K', '1M', '10MB' -> bytes (decimal units, as the paper's grid); ConfigError
    naming the setting ``name`` when ``text`` is no size."""
    t = str(text).strip().lower().removesuffix("b")
    try:
        if t and t[-1] in _DECIMAL:
            return int(float(t[:-1]) * _DECIMAL[t[-1]])
        return int(t)
    except ValueError:
        raise ConfigError(f"{name}: cannot read {text!r} as a size (examples: 100, 10K, 1M)") from None


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
    rate: float  # the target
    messages: int
    seconds: float
    sent_rate: float
    finished: int
    backlog_growth: float
    passed: bool
    reason: str
    latencies: list[float]
    achieved_rate: float = 0.0  # finished messages per second at the sink (:func:`achieved_rate`)

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)

    @property
    def finished_fraction(self) -> float | None:
        """Of the messages sent, the fraction finished; None for a step that sent none."""
        return self.finished / self.messages if self.messages else None

    @classmethod
    def raised(cls, rate: float, exc: BaseException) -> StepResult:
        """A step that raised before it could be judged: failed, nothing sent, the error its reason."""
        return cls(rate, 0, 0.0, 0.0, 0, 0.0, False, f"errors: {in_one_line(exc)}", [])


def in_one_line(exc: BaseException, limit: int = 300) -> str:
    """An error's text on one line, at most ``limit`` characters (a CSV cell, a log field)."""
    return " ".join(str(exc).split())[:limit]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def achieved_rate(done: list[float], first_sent: float) -> float:
    """Finished messages per second over the measured window: those finished after the first
    finish, over the time from the first finish to the last. Counting from the first finish,
    not the first send, leaves one latency out of the window; leaving out the messages of the
    first finish (a micro-batch finishes many at once) keeps a batching system from being
    credited with the batch it had to wait for. With a single finish time: all over the time
    from the first send."""
    if not done:
        return 0.0
    first, last = min(done), max(done)
    if last - first <= 1e-6:
        return len(done) / max(last - first_sent, 1e-6)
    return sum(1 for t in done if t > first) / (last - first)


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


@dataclasses.dataclass
class Burst:
    """``count`` messages sent at once: how many finished, when sending ended, when the last did."""

    count: int
    finished: int
    send_seconds: float
    seconds: float  # from the first send until all finished (or until the timeout)
    errors: list[str]
    done_unix: list[float]
    started_unix: float = 0.0

    @property
    def achieved_rate(self) -> float:
        """Its messages finished per second (:func:`achieved_rate`, from the first send)."""
        return achieved_rate(self.done_unix, self.started_unix)


def burst_time(system: System, tag: str, count: int, started_unix: float, waited: float) -> tuple[float, list[float]]:
    """A burst's seconds from its first send until its last message finished, by that
    message's own finish time (the count a wait looks at can be seen a look later), and the
    finish times; ``waited`` (the wait's own end) when not all finished."""
    done = [f.done_unix for f in system.finished(tag)]
    return (max(done) - started_unix if len(done) >= count else waited), done


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
        sent_times: list[float] = []
        samples: list[tuple[float, float]] = []
        t0 = time.monotonic() + 0.05
        stop_sampling = threading.Event()
        sampler = threading.Thread(
            target=self._sample, args=(t0, base, sent_times, samples, stop_sampling), daemon=True
        )
        sampler.start()
        send_errors = self._pace(tag, rate, count, t0, sent_times, t0 + 2 * count / rate + PACE_SLACK_SECONDS)
        send_end = time.monotonic()
        stop_sampling.set()
        sampler.join()
        grace = max(self.config.grace_seconds, 2 * self.latency_hint) + 2 * self.cost_s
        deadline_unix = time.time() + grace
        self.wait_finished(base, count, time.monotonic() + grace)
        finished = self.system.finished(tag)
        in_time = [f for f in finished if f.done_unix <= deadline_unix]
        errors = self.system.errors()[errors_before:] + send_errors
        growth = self._growth(samples, t0, send_end)
        result = self._judge(rate, count, send_end - t0, len(in_time), growth, errors)
        result.latencies = [f.done_unix - f.sent_unix for f in finished]
        first_sent = min((f.sent_unix for f in in_time), default=0.0)
        # finishes bunched at the end of the window (a lagging sink catching up) must not
        # count for more than the source sent
        result.achieved_rate = min(achieved_rate([f.done_unix for f in in_time], first_sent), result.sent_rate)
        if result.passed and result.latencies:  # an overloaded step's latency is queueing, not the system's
            self.latency_hint = result.percentile(0.5)
        self._drain(base, count)
        return result

    def burst_timeout(self, count: int) -> float:
        """How long ``count`` messages sent at once may take to finish on a healthy system."""
        return self.config.grace_seconds * 4 + 2 * count * self.cost_s + 30

    def burst(self, count: int, timeout: float) -> Burst:
        """Send ``count`` messages at once (as fast as the source takes them); wait until all
        are finished or ``timeout`` passes."""
        self.counter += 1
        tag = f"{self.prefix}b{self.counter}"
        errors_before = len(self.system.errors())
        base = self.system.finished_count()
        started, started_unix = time.monotonic(), time.time()
        send_errors = self._pace(tag, math.inf, count, started, [], started + timeout)
        sent = time.monotonic() - started
        # a failed send fails the burst: what was sent is counted, nothing more is waited for
        deadline = time.monotonic() if send_errors else started + timeout
        finished = self.wait_finished(base, count, deadline, errors_from=errors_before)
        seconds = time.monotonic() - started
        errors = self.system.errors()[errors_before:] + send_errors
        seconds, done = burst_time(self.system, tag, count, started_unix, seconds)
        return Burst(count, finished, sent, seconds, errors[:5], done, started_unix)

    def _pace(
        self,
        tag: str,
        rate: float,
        count: int,
        t0: float,
        sent_times: list[float],
        deadline: float,
    ) -> list[str]:
        """Send ``count`` messages, message i at t0 + i/rate, from the system's sender threads;
        ``sent_times`` gets when each send returned, in order (its length: how many were sent).

        Sending stops at the first failed send and at ``deadline``: a source that stopped
        reading (a send that times out after minutes) fails its step once, instead of once
        per message left, which for a big step is hours."""
        lock = threading.Lock()
        next_index = [0]
        errors: list[str] = []

        def worker() -> None:
            while True:
                with lock:
                    i = next_index[0]
                    if i >= count or errors:
                        return
                    if time.monotonic() > deadline:
                        errors.append(f"send: stopped with {i} of {count} sent: the step's time ran out")
                        return
                    next_index[0] += 1
                wait = t0 + i / rate - time.monotonic()  # rate inf: no wait
                if wait > 0:
                    time.sleep(wait)
                try:
                    self.system.send(tag, i, self.generator.message(tag, i, time.time()), self.cost_s)
                except Exception as exc:  # noqa: BLE001 - a failing send is a failed step, not a crash
                    with lock:
                        errors.append(f"send: {exc}")
                with lock:
                    sent_times.append(time.monotonic())

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.system.sender_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return errors[:5]

    def _sample(
        self, t0: float, base: int, sent_times: list[float], samples: list[tuple[float, float]], stop: threading.Event
    ) -> None:
        """The backlog every 0.2 s: what had been sent when the finished count was true, less
        that count (a count learnt by a call is as old as its answer)."""
        while not stop.wait(0.2):
            finished, as_of = self.system.finished_as_of()
            samples.append((as_of - t0, bisect.bisect_right(sent_times, as_of) - (finished - base)))

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
        allowed_growth = max(2 * SLOTS, 0.05 * count, rate * self.latency_hint)
        reason = ""
        if errors:
            reason = f"errors: {errors[0][:200]}"
        elif send_seconds > planned * 1.05 + 0.05:
            reason = f"source below target rate ({sent_rate:.4g}/s of {rate:.4g}/s)"
        elif in_time < 0.95 * count:
            reason = f"only {in_time}/{count} finished in time ({in_time / count:.0%})"
        elif growth > allowed_growth:
            reason = f"backlog grew by {growth:.0f} messages"
        return StepResult(rate, count, send_seconds, sent_rate, in_time, growth, not reason, reason, [], 0.0)

    def wait_finished(self, base: int, count: int, deadline: float, errors_from: int | None = None) -> int:
        """Wait until ``count`` more messages are finished, or until ``deadline``; how many are.

        With ``errors_from`` (the system's error count before the wait), the wait also ends
        at the system's next error, looked for every :data:`ERROR_POLL_SECONDS` (asking
        costs some systems a call): a burst fails at its first error anyway, and a system
        whose driver died would otherwise be waited for until ``deadline``."""
        next_look = time.monotonic() + ERROR_POLL_SECONDS
        while True:
            finished = self.system.finished_count() - base
            now = time.monotonic()
            if finished >= count or now >= deadline:
                return finished
            if errors_from is not None and now >= next_look:
                if len(self.system.errors()) > errors_from:
                    return finished
                next_look = now + ERROR_POLL_SECONDS
            time.sleep(0.05)

    def _drain(self, base: int, count: int) -> None:
        """Let the step's leftovers finish; reset the system if they do not in time."""
        deadline = time.monotonic() + max(self.config.drain_seconds, 0.0)
        self.wait_finished(base, count, deadline)
        if self.system.finished_count() - base < count:
            log.warning("backlog did not drain; resetting", extra={"system": self.system.name})
            self.system.reset()
            self.burst(WARM_UP_MESSAGES, self.burst_timeout(WARM_UP_MESSAGES))


# -- one point: ramp, then bisect -------------------------------------------------------


@dataclasses.dataclass
class PointResult:
    max_rate: float  # the target rate of the highest passing step (0: none passed)
    steps: list[StepResult]
    first_fail: StepResult | None
    best: StepResult | None = None  # the highest passing step


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
    best: StepResult | None = None

    def step(rate: float) -> bool:
        nonlocal low, high, first_fail, best
        result = run_step(rate)
        steps.append(result)
        if result.passed:
            if rate >= low:
                low, best = rate, result
        else:
            high = min(high, rate)
            first_fail = first_fail or result
        return result.passed

    def budget() -> bool:
        return not steps or (len(steps) < max_steps and time.monotonic() < deadline)

    def done() -> PointResult:
        return PointResult(low, steps, first_fail, best)

    rate = min(start, cap)
    while budget():
        if not step(rate):
            break
        if rate >= cap:
            return done()
        rate = min(cap, rate * (4 if rate * 16 < cap else 2))
    while low == 0 and budget() and high / 2 >= min_rate:
        step(high / 2)
    while low > 0 and high < math.inf and (high - low) > tolerance * high and budget():
        step((low + high) / 2)
    return done()


def failure_of(reason: str, rate: float) -> str:
    """Why a system failed a cell, in a word the report can group by, with the rate and the detail."""
    lowered = reason.lower()
    if "outofmemoryerror" in lowered or "java heap" in lowered:
        kind = "Java heap exhausted"
    elif "finished in time" in lowered or "timeout" in lowered or "timed out" in lowered:
        kind = "timeout"
    elif "error" in lowered or "exception" in lowered:
        kind = "errors"
    elif "backlog grew" in lowered:
        kind = "backlog grew"
    elif "source below" in lowered:
        kind = "source below target rate"
    else:
        kind = "failed"
    at = f" at {rate:.4g}/s" if rate > 0 and math.isfinite(rate) else ""
    return f"{kind}{at}: {' '.join(reason.split())[:240]}"


# -- the run --------------------------------------------------------------------------

WARM_UP_MESSAGES = 4  # sent at once to a fresh or reset system before it is measured (not recorded)


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


def _ignore_interrupts() -> None:
    """A probe process's start: Ctrl-C (SIGINT to the terminal's process group) is for the run.
    A pool worker it killed while waiting for work holds the pool's queue lock for ever, and
    the run's clean-up then waits on that lock in ``Pool.terminate``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _steps(count: int) -> float:
    """The CPU seconds ``count`` steps of ``burn_cpu``'s work took."""
    from hio.worker.pipelines.synthetic import spin

    start = time.thread_time()
    spin(count)
    return time.thread_time() - start


class MachineState(NamedTuple):
    """What a point's machine gives, measured right before it; a cell's systems must share it."""

    slots: float  # CPU slots: CPU seconds the probe's processes got per wall second (2.0: both cores)
    speed: float  # how fast a slot runs: millions of probe steps per CPU second
    loopback: float  # one TCP stream's bytes/s

    def fields(self) -> dict[str, str]:
        """The result row's columns."""
        return {
            "cpu_slots": _fmt(self.slots),
            "cpu_speed": _fmt(self.speed),
            "loopback_mb_s": _fmt(self.loopback / 1e6),
        }

    def __str__(self) -> str:
        return f"CPU slots {self.slots:.2f} at {self.speed:.1f} M steps/s; loopback {self.loopback / 1e6:,.0f} MB/s"


class CpuProbe:
    """How many of the two processing slots the machine gives right now, and how fast they run.

    Two processes each do the same fixed work (about ``seconds`` of CPU on an
    idle machine). The CPU seconds they got per wall second are the slots
    available (2.0 on an idle 2-core machine, less when others load it); the
    steps per CPU second are the slots' speed, which falls where a host runs a
    virtual machine's cores slower under sustained load without taking them
    away, which the slots alone do not see. Both tell a result hurt by a shared
    machine from one hurt by the system.
    """

    CALIBRATION_STEPS = 1_000_000

    def __init__(self, seconds: float = 0.2) -> None:
        import multiprocessing

        self._pool = multiprocessing.get_context("spawn").Pool(SLOTS, initializer=_ignore_interrupts)
        took = max(self._pool.map(_steps, [self.CALIBRATION_STEPS] * SLOTS))  # pays the start-up too
        self.steps = max(1, round(self.CALIBRATION_STEPS * seconds / max(took, 1e-9)))

    def measure(self) -> tuple[float, float]:
        """(slots, speed) of one sample."""
        start = time.monotonic()
        cpu = sum(self._pool.map(_steps, [self.steps] * SLOTS, chunksize=1))
        wall = max(time.monotonic() - start, 1e-9)
        return min(float(SLOTS), cpu / wall), SLOTS * self.steps / max(cpu, 1e-9) / 1e6

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()


def read_csv(path: Path) -> list[dict[str, str]]:
    """Every row of a results file, as written (no row: an empty list)."""
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def check_columns(path: Path, fields: Sequence[str]) -> None:
    """Refuse a results file of other columns than ``fields`` (rows appended to it would be
    read under the wrong names); an absent or empty file is fine."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, newline="") as fh:
        header = next(csv.reader(fh), [])
    if header != list(fields):
        raise ConfigError(f"{path} has other columns than this benchmark writes; start a new run with --fresh")


def append_row(path: Path, fields: Iterable[str], row: Mapping[str, object]) -> None:
    """Append one row (header first if the file is new), flushed to disk at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields))
        if new:
            writer.writeheader()
        writer.writerow(row)
        fh.flush()
        os.fsync(fh.fileno())


def _fmt(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.6g}"


def _cost_key(cost_s: float) -> str:
    return _fmt(cost_s * 1000)


def cell_rows(rows: list[dict[str, str]], size: int, cost: float, attempt: int) -> list[dict[str, str]]:
    """The rows (as read from the CSV) of one attempt at the cell (size, cost)."""
    return [
        r for r in rows if r["size"] == str(size) and r["cost_ms"] == _cost_key(cost) and int(r["attempt"]) == attempt
    ]


class BenchRun:
    """One run of `hio bench`: the cells, interleaved systems, the bursts, the CSVs."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.results = config.results_path()
        self.steps_path = self.results.with_name(self.results.stem + "-steps.csv")
        self.burst_path = self.results.with_name(self.results.stem + "-burst.csv")
        self.work = Path(config.data_dir).expanduser().resolve() / "bench" / f"run-{os.getpid()}"
        self.sizes = [parse_size(s) for s in config.grid_sizes()]
        self.costs = [parse_cost(c) for c in config.grid_costs()]
        self.latency_sizes = {parse_size(s) for s in config.latency_sizes}
        self.run_id = ""
        self.points = 0
        self.probe: CpuProbe | None = None
        self.commit = ""
        self.machine = ""

    # -- the run as a whole
    def run(self) -> int:
        if self.config.fresh:
            for path in (self.results, self.steps_path, self.burst_path):
                path.unlink(missing_ok=True)
        rows = read_csv(self.results)
        bursts = read_csv(self.burst_path)
        self.run_id = self._run_id(rows + bursts)
        for path, fields in (
            (self.results, RESULT_FIELDS),
            (self.steps_path, STEP_FIELDS),
            (self.burst_path, BURST_FIELDS),
        ):
            check_columns(path, fields)  # before any point runs: a point's minutes are not lost to it
        cells = [(size, cost) for cost in self.costs for size in self.sizes]
        pending = [cell for cell in cells if not self._cell_done(cell, rows)]
        burst_sizes = [parse_size(s) for s in self.config.burst_sizes]
        burst_todo = [
            (size, name)
            for size in burst_sizes
            for name in self.config.systems
            if not all(
                (name, str(size), path) in {(b["system"], b["size"], b["path"]) for b in bursts}
                for path in self.config.burst_paths
            )
        ]
        print(
            f"hio bench: run {self.run_id}; {len(cells) - len(pending)} of {len(cells)} cells done earlier; "
            f"systems {', '.join(self.config.systems)}; results {self.results}",
            flush=True,
        )
        try:
            if pending or burst_todo:
                from benchmarks.measure import machine_description, source_commit

                self.commit, self.machine = source_commit(), machine_description()
                self.probe = CpuProbe()
                print(f"hio bench: {os.cpu_count()} cores; load {load_avg():.1f}; {self.machine}", flush=True)
            for cell in pending:
                self._run_cell(*cell, rows)
            if burst_todo:
                self._run_bursts(burst_todo, bursts)
        finally:
            if self.probe is not None:
                self.probe.close()
            shutil.rmtree(self.work, ignore_errors=True)
        if self.config.report:
            from benchmarks.report import write_readme, write_report

            doc = write_report(self.results, Path(self.config.out_dir), self.config)
            print(f"hio bench: wrote {doc}")
            if self.config.readme:
                write_readme(Path(self.config.readme), self.results)
                print(f"hio bench: wrote the performance section of {self.config.readme}")
        return 0

    def _run_id(self, rows: list[dict[str, str]]) -> str:
        """The run the CSVs hold (resumed), or a new one; a CSV of no identified run is refused."""
        ids = {row.get("run") or "" for row in rows}
        if "" in ids:
            raise ConfigError(
                f"{self.results} holds results of no identified run (an older format); start a new run with --fresh"
            )
        if len(ids) > 1:
            raise ConfigError(f"{self.results} mixes runs {', '.join(sorted(ids))}; start a new run with --fresh")
        return ids.pop() if ids else time.strftime("%Y%m%dT%H%M%S")

    def _attempts(self, size: int, cost: float, rows: list[dict[str, str]]) -> dict[int, set[str]]:
        """The cell's attempts so far: attempt -> the systems measured in it."""
        attempts: dict[int, set[str]] = {}
        for row in rows:
            if row["size"] == str(size) and row["cost_ms"] == _cost_key(cost):
                attempts.setdefault(int(row["attempt"]), set()).add(row["system"])
        return attempts

    def _cell_done(self, cell: tuple[int, float], rows: list[dict[str, str]]) -> bool:
        """Done: an attempt with every system agreed, or every attempt is used."""
        from benchmarks.report import machine_spread

        size, cost = cell
        wanted = set(self.config.systems)
        complete = [n for n, systems in self._attempts(size, cost, rows).items() if wanted <= systems]
        for n in complete:
            if max(machine_spread(cell_rows(rows, size, cost, n))) <= self.config.agreement:
                return True
        return len(complete) >= self.config.cell_attempts

    # -- one cell, every system
    def _run_cell(self, size: int, cost: float, rows: list[dict[str, str]]) -> None:
        from benchmarks.report import machine_spread, spread_text

        label = f"{size_label(size)} x {cost_label(cost * 1000)}"
        attempts = self._attempts(size, cost, rows)
        # each cell starts with the next system, so that no system always follows the same one
        # (what a system leaves behind, page cache and disk discards, weighs on the next)
        first = (self.sizes.index(size) * len(self.costs) + self.costs.index(cost)) % len(self.config.systems)
        wanted = [*self.config.systems[first:], *self.config.systems[:first]]
        attempt = max(attempts, default=1)
        if attempt in attempts and set(wanted) <= attempts[attempt]:
            attempt += 1
        while True:
            done = attempts.get(attempt, set())
            for name in wanted:
                if name not in done:
                    rows.append(self._point(name, size, cost, attempt, cell_rows(rows, size, cost, attempt)))
            spread = machine_spread(cell_rows(rows, size, cost, attempt))
            apart = spread_text(spread)
            if max(spread) <= self.config.agreement:
                print(f"hio bench: {label}: machine state agreed ({apart})")
                return
            if attempt >= self.config.cell_attempts:
                print(
                    f"hio bench: {label}: machine state never agreed in {attempt} attempts ({apart}); "
                    "the report leaves the cell out",
                    flush=True,
                )
                return
            print(
                f"hio bench: {label}: machine state differed ({apart}, more than {self.config.agreement:.0%}); "
                "measuring the cell again",
                flush=True,
            )
            attempt += 1

    def _start(self, name: str, size: int, cost: float, where: str) -> System:
        system = make_system(
            name,
            self.work / where,
            chunk_bytes=self.config.chunk_bytes,
            streams=self.config.streams,
            batch_tuples=self.config.batch_tuples,
            spark_conf=self.config.spark_conf,
        )
        try:
            system.start()
            system.begin_point(size, cost)
        except BaseException:
            self._stop(system, where)
            raise
        return system

    def _stop(self, system: System, where: str) -> None:
        """End the point and stop the system, whatever fails; remove what it wrote."""
        try:
            system.end_point()
        except Exception as exc:  # noqa: BLE001 - stopping goes on; the point's result is already taken
            log.warning("ending the point failed", extra={"system": system.name, "error": str(exc)})
        try:
            system.stop()
        except Exception as exc:  # noqa: BLE001 - the run goes on to the next point (its JVM died, ...)
            log.warning("stopping the system failed", extra={"system": system.name, "error": in_one_line(exc)})
        finally:
            shutil.rmtree(self.work / where, ignore_errors=True)

    def _machine(self) -> MachineState:
        """The machine state right now: the best of ``MACHINE_SAMPLES`` short samples of
        each figure. One sample is at the mercy of a blip (on an idle machine single samples
        spread 30% in loopback and 0.8 to 1.95 in slots); a machine loaded for the point's
        minutes lowers every sample, which is what the cell's agreement is there to catch."""
        from benchmarks.measure import loopback_bandwidth

        each = self.config.loopback_seconds / MACHINE_SAMPLES
        assert self.probe is not None, "run() starts the probe before any point"
        cpu = [self.probe.measure() for _ in range(MACHINE_SAMPLES)]
        loopback = max(loopback_bandwidth(seconds=each) for _ in range(MACHINE_SAMPLES))
        return MachineState(max(s for s, _ in cpu), max(v for _, v in cpu), loopback)

    # -- one system's point
    def _settled_machine(self, earlier: list[dict[str, str]]) -> MachineState:
        """The machine state before a point, measured again (after a pause) up to
        ``MACHINE_TRIES`` times while it is further than ``agreement`` from what the cell's
        earlier systems had: a passing disturbance (the previous system's processes still
        exiting, a burst of the host's work) is waited out instead of costing the whole cell
        another run; a lasting one still shows."""
        from benchmarks.report import machine_spread

        machine = self._machine()
        for _ in range(MACHINE_TRIES - 1):
            spread = max(machine_spread([*earlier, machine.fields()]))
            if spread <= self.config.agreement:
                break
            print(
                f"hio bench: machine state ({machine}) is {spread:.0%} from the cell's; "
                f"measuring again in {MACHINE_PAUSE_SECONDS:.0f} s",
                flush=True,
            )
            time.sleep(MACHINE_PAUSE_SECONDS)
            machine = self._machine()
        return machine

    def _point(self, name: str, size: int, cost: float, attempt: int, earlier: list[dict[str, str]]) -> dict[str, str]:
        config = self.config
        self.points += 1
        where = f"{name}-p{self.points}"
        started = time.monotonic()
        failure, probe_rate, steal = "", math.nan, math.nan
        point: PointResult | None = None
        latency: StepResult | None = None
        print(f"hio bench: {name}: {size_label(size)} x {cost_label(cost * 1000)} (attempt {attempt})", flush=True)
        machine = self._settled_machine(earlier)
        try:
            system = self._start(name, size, cost, where)
        except Exception as exc:  # noqa: BLE001 - a system that cannot start is that cell's result, not the run's end
            failure = f"could not start: {in_one_line(exc)}"
        else:
            try:
                runner = StepRunner(
                    system, MessageGenerator(size, text=system.text_payload), cost, config, prefix=f"p{self.points}"
                )
                probe = self._probe(runner, name, size, cost, attempt)
                probe_failure, estimate = "", probe.achieved_rate
                if probe.finished < probe.count or probe.errors:
                    # A burst a system cannot take (Spark's socket source holds a batch of 10 MB
                    # lines in its driver's heap) says nothing of the rates it can sustain: the
                    # search starts low instead, on the system reset.
                    reason = (
                        probe.errors[0] if probe.errors else f"only {probe.finished}/{probe.count} finished in time"
                    )
                    probe_failure = "probe: " + failure_of(reason, math.inf)
                    print(
                        f"hio bench: {name}: {probe_failure[:160]}; reset, the search starts at "
                        f"{PROBE_FAILED_START_RATE:g}/s",
                        flush=True,
                    )
                    runner.system.reset()
                    estimate = PROBE_FAILED_START_RATE
                else:
                    probe_rate = estimate
                point, latency, steal = self._search(runner, name, size, cost, attempt, estimate, machine.loopback)
                if point.best is None:
                    ff = point.first_fail
                    found = failure_of(ff.reason, ff.rate) if ff else "no step ran within the point's time"
                    failure = f"{found}; {probe_failure}" if probe_failure else found
            except Exception as exc:  # noqa: BLE001 - a system that breaks is that cell's result; the run goes on
                failure = f"errors: {in_one_line(exc)}"
            finally:
                self._stop(system, where)
        return self._record(name, size, cost, attempt, started, failure, probe_rate, machine, steal, point, latency)

    def _probe(self, runner: StepRunner, name: str, size: int, cost: float, attempt: int) -> Burst:
        """A few messages at once: warms the fresh system and gives the search its start."""
        count = max(2, min(self.config.probe_messages, parse_size(self.config.probe_bytes) // size))
        if cost > 0:
            count = max(2, min(count, math.ceil(4 * SLOTS / cost)))
        burst = runner.burst(count, runner.burst_timeout(count))
        self._log_burst_step(name, size, cost, attempt, burst)
        return burst

    def _search(
        self, runner: StepRunner, name: str, size: int, cost: float, attempt: int, estimate: float, loopback: float
    ) -> tuple[PointResult, StepResult | None, float]:
        config = self.config
        bound = bound_rate(size, cost, loopback, SLOTS)
        cap = min(bound, config.max_rate)
        start = max(config.min_rate, min(cap * config.start_fraction, estimate))
        begun = time.monotonic()

        def step(rate: float, **options: int) -> StepResult:
            """One step, logged with the steal during it. A step that raises is a failed step
            (the system is reset for the next), so the point keeps what passed before it."""
            before = cpu_ticks()
            try:
                result = runner.run(rate, **options)
            except Exception as exc:  # noqa: BLE001 - one step's breakage is that step's failure
                result = StepResult.raised(rate, exc)
                try:
                    runner.system.reset()
                except Exception as again:  # noqa: BLE001 - the next steps fail fast and say so
                    log.warning("resetting the system failed", extra={"system": name, "error": in_one_line(again)})
            self._log_step(
                name,
                size,
                cost,
                attempt,
                "latency" if options else "search",
                result,
                steal_between(before, cpu_ticks()),
            )
            return result

        ticks = cpu_ticks()
        point = find_max(
            step,
            start,
            cap,
            tolerance=config.tolerance,
            min_rate=config.min_rate,
            max_steps=config.max_steps,
            deadline=begun + config.point_seconds,
        )
        steal = steal_between(ticks, cpu_ticks())
        latency = None
        if size in self.latency_sizes and point.best is not None:
            latency = step(point.best.achieved_rate / 2, min_messages=config.latency_messages)
        return point, latency, steal

    def _record(
        self,
        name: str,
        size: int,
        cost: float,
        attempt: int,
        started: float,
        failure: str,
        probe_rate: float,
        machine: MachineState,
        steal: float,
        point: PointResult | None,
        latency: StepResult | None,
    ) -> dict[str, str]:
        best = point.best if point is not None else None
        first_fail = point.first_fail if point is not None else None
        bound = bound_rate(size, cost, machine.loopback, SLOTS) if not math.isnan(machine.loopback) else math.nan
        achieved = best.achieved_rate if best is not None else 0.0
        row = {
            "run": self.run_id,
            "attempt": str(attempt),
            "system": name,
            "size": str(size),
            "cost_ms": _cost_key(cost),
            "max_rate": _fmt(achieved),
            "target_rate": _fmt(best.rate) if best is not None else "",
            "bound": _fmt(bound),
            "fraction": _fmt(achieved / bound) if bound and not math.isnan(bound) else "",
            **machine.fields(),
            "probe_rate": _fmt(probe_rate),
            "steps": str(len(point.steps) if point is not None else 0),
            "seconds": _fmt(time.monotonic() - started),
            "failure": failure,
            "first_fail_rate": _fmt(first_fail.rate) if first_fail else "",
            "first_fail_reason": first_fail.reason if first_fail else "",
            "latency_rate": _fmt(latency.rate) if latency else "",
            "p50_ms": _fmt(latency.percentile(0.5) * 1000) if latency else "",
            "p99_ms": _fmt(latency.percentile(0.99) * 1000) if latency else "",
            "load_avg": _fmt(load_avg()),
            "steal": _fmt(steal),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "commit": self.commit,
            "machine": self.machine,
        }
        append_row(self.results, RESULT_FIELDS, row)
        target = f" (target {best.rate:.4g}/s)" if best is not None else ""
        print(
            f"{name:>13} {size_label(size):>7} {cost_label(cost * 1000):>7}: {achieved:>10.4g}/s{target}  "
            f"bound {bound:.4g}/s; {machine}; steal {steal:.0%}"
            + (f"; FAILED: {failure}" if failure else "")
            + (
                f"  p50 {latency.percentile(0.5) * 1000:.0f} ms p99 {latency.percentile(0.99) * 1000:.0f} ms"
                if latency
                else ""
            ),
            flush=True,
        )
        return row

    # -- the bursts
    def _run_bursts(self, todo: list[tuple[int, str]], done: list[dict[str, str]]) -> None:
        from benchmarks.floor import disk_write_bandwidth

        self.work.mkdir(parents=True, exist_ok=True)
        disk = disk_write_bandwidth(self.work, parse_size(self.config.disk_probe))
        print(f"hio bench: disk, written and fdatasynced: {disk / 1e6:,.0f} MB/s", flush=True)
        for size, name in todo:
            paths = [
                p
                for p in self.config.burst_paths
                if (name, str(size), p) not in {(b["system"], b["size"], b["path"]) for b in done}
            ]
            self._burst(name, size, paths, disk)

    def _burst(self, name: str, size: int, paths: list[str], disk: float) -> None:
        count = math.ceil(parse_size(self.config.burst_bytes) / size)
        self.points += 1
        where = f"{name}-burst{self.points}"
        results: dict[str, tuple[Burst | None, str]] = {}
        machine = self._machine()
        try:
            system = self._start(name, size, 0.0, where)
        except Exception as exc:  # noqa: BLE001 - a system that cannot start is its rows' result
            results = {path: (None, f"could not start: {in_one_line(exc)}") for path in paths}
        else:
            try:
                runner = StepRunner(
                    system, MessageGenerator(size, text=system.text_payload), 0.0, self.config, prefix=f"b{self.points}"
                )
                runner.burst(WARM_UP_MESSAGES, self.config.burst_seconds)  # a fresh system warms first, unrecorded
                for path in paths:
                    burst, failure = results[path] = self._one_burst(system, runner, path, count)
                    if burst is not None and burst.finished < count:
                        system.reset()  # what is left of a burst that failed must not count for the next
            except Exception as exc:  # noqa: BLE001 - a system that breaks is its rows' result; the run goes on
                for path in paths:
                    results.setdefault(path, (None, f"errors: {in_one_line(exc)}"))
            finally:
                self._stop(system, where)
        for path in paths:
            burst, failure = results[path]
            stored = burst.finished if burst is not None else 0
            seconds = burst.seconds if burst is not None else math.nan
            row = {
                "run": self.run_id,
                "system": name,
                "size": str(size),
                "path": path,
                "messages": str(count),
                "stored": str(min(stored, count)),
                "seconds": _fmt(seconds) if not failure else "",
                "mb_s": _fmt(count * size / seconds / 1e6) if not failure else "",
                "disk_mb_s": _fmt(disk / 1e6),
                **machine.fields(),
                "failure": failure,
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "commit": self.commit,
                "machine": self.machine,
            }
            append_row(self.burst_path, BURST_FIELDS, row)
            print(
                f"{name:>13} burst {count} x {size_label(size)} via {path}: "
                + (f"FAILED: {failure}" if failure else f"{seconds:.1f} s, {count * size / seconds / 1e6:,.0f} MB/s")
                + f" (disk {disk / 1e6:,.0f} MB/s)",
                flush=True,
            )

    def _one_burst(self, system: System, runner: StepRunner, path: str, count: int) -> tuple[Burst | None, str]:
        """(the burst, why it failed or '')."""
        timeout = self.config.burst_seconds
        if path == "library":
            burst = runner.burst(count, timeout)
        else:
            folder = system.watch_folder()
            if folder is None:
                return None, "no watched-folder source"
            burst = self._dump(system, runner, folder, count, timeout)
        if burst.errors:
            return burst, failure_of(burst.errors[0], math.inf)
        if burst.finished < count:
            return burst, f"timeout: {burst.finished} of {count} stored after {timeout:g} s"
        return burst, ""

    def _dump(self, system: System, runner: StepRunner, folder: Path, count: int, timeout: float) -> Burst:
        """``count`` files written into ``folder`` at once (each hidden while written, then renamed
        into place, as an instrument's software does), timed until all are stored."""
        runner.counter += 1
        tag = f"{runner.prefix}f{runner.counter}"
        errors_before = len(system.errors())
        base = system.finished_count()
        started, started_unix = time.monotonic(), time.time()
        for seq in range(count):
            name = f"{tag}-{seq:07d}.bin"
            partial = folder / f".{name}.part"
            with open(partial, "wb") as fh:
                fh.write(runner.generator.message(tag, seq, time.time()))
            os.rename(partial, folder / name)
        sent = time.monotonic() - started
        finished = runner.wait_finished(base, count, started + timeout, errors_from=errors_before)
        seconds, _done = burst_time(system, tag, count, started_unix, time.monotonic() - started)
        return Burst(count, finished, sent, seconds, system.errors()[errors_before:][:5], [])

    # -- the steps CSV
    def _log_step(
        self, name: str, size: int, cost: float, attempt: int, kind: str, result: StepResult, steal: float
    ) -> None:
        append_row(
            self.steps_path,
            STEP_FIELDS,
            {
                "run": self.run_id,
                "attempt": attempt,
                "system": name,
                "size": size,
                "cost_ms": _cost_key(cost),
                "kind": kind,
                "rate": _fmt(result.rate),
                "achieved_rate": _fmt(result.achieved_rate),
                "messages": result.messages,
                "seconds": _fmt(result.seconds),
                "sent_rate": _fmt(result.sent_rate),
                "finished": result.finished,
                "finished_fraction": _fmt(result.finished_fraction),
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

    def _log_burst_step(self, name: str, size: int, cost: float, attempt: int, burst: Burst) -> None:
        """The probe in the steps CSV: sent at once (no target rate)."""
        result = StepResult(
            math.inf,
            burst.count,
            burst.send_seconds,
            burst.count / max(burst.send_seconds, 1e-9),
            burst.finished,
            0.0,
            burst.finished >= burst.count and not burst.errors,
            burst.errors[0] if burst.errors else "",
            [],
            burst.achieved_rate,
        )
        self._log_step(name, size, cost, attempt, "probe", result, math.nan)


def _interrupt_on_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C, so the systems' child processes are stopped too."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def run_bench(config: BenchConfig) -> int:
    """Entry of `hio bench`: measure the run's cells and bursts (resuming), then write the report."""
    _interrupt_on_sigterm()
    return BenchRun(config).run()
