"""`hio bench`: the search, the pass rules' arithmetic, the report and the README's
section, and a smoke run of the whole machinery (real roles, real Spark, a real broker)
on a tiny grid."""

from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from benchmarks.grid import (
    BenchConfig,
    StepResult,
    StepRunner,
    bound_rate,
    find_max,
    parse_cost,
    parse_size,
    percentile,
    slope,
)
from benchmarks.report import (
    check_targets,
    machine_spread,
    other_wins,
    published,
    ratios,
    read_rows,
    write_report,
)
from benchmarks.systems import ABOUT, HEADER_BYTES, SYSTEMS, MessageGenerator, System, parse_header
from hio.config import ConfigError
from tests.harness import wait_for
from tests.reaper import REPO


def test_sizes_and_costs_parse_in_the_papers_units() -> None:
    assert [parse_size(s) for s in ("100", "10K", "100KB", "1M", "10M")] == [100, 10**4, 10**5, 10**6, 10**7]
    assert [parse_cost(c) for c in ("0", "10ms", "0.1s", "1s")] == [0.0, 0.01, 0.1, 1.0]
    with pytest.raises(ConfigError, match="costs"):
        parse_cost("fast")
    with pytest.raises(ConfigError, match="sizes"):
        parse_size("big")


def test_config_refuses_unknown_system_and_tiny_size() -> None:
    with pytest.raises(ConfigError, match="unknown system 'flink'"):
        BenchConfig(systems=("flink",)).validate()
    with pytest.raises(ConfigError, match="below 64 bytes"):
        BenchConfig(sizes=("10",)).validate()
    assert BenchConfig(quick=True).grid_sizes() == ("100", "1M")


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["bench-core", "--sizes", "abc"], "sizes: cannot read 'abc' as a size"),
        (["bench-core", "--sizes", "0"], "sizes: '0' is not a size of one byte or more"),
        (["bench-floor", "--disk-probe", "abc"], "disk_probe: cannot read 'abc' as a size"),
        (["bench-floor", "--sizes", "1X"], "sizes: cannot read '1X' as a size"),
        (["bench", "--disk-probe", "abc"], "disk_probe: cannot read 'abc' as a size"),
        (["bench", "--burst-sizes", "10"], "burst_sizes: '10' is below 64 bytes"),
        (["bench", "--spark-conf", "abc"], "spark_conf entry 'abc' is not key=value"),
        (["bench-core", "--seconds=-1"], "seconds must be positive"),
        (["bench-core", "--max-tuples=0"], "max_tuples must be at least 1"),
        (["bench-core", "--engines=-1"], "engines must be between 1 and 1,024"),
        (["bench-core", "--streams=0"], "streams must be between 1 and 256"),
    ],
)
def test_a_benchmark_refuses_a_setting_it_cannot_read_by_its_name(command: list[str], message: str) -> None:
    """A size that is none, a Spark setting without '=', a count or time out of range, is refused
    at start by the setting's name, before anything starts (not a traceback from deep inside
    the run, nor a run that measures nothing)."""
    done = subprocess.run(
        [sys.executable, "-m", "hio.cli", *command], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_bound_is_the_tighter_of_network_and_cpu() -> None:
    assert bound_rate(10**6, 0.0, 500e6, 2) == pytest.approx(500)
    assert bound_rate(100, 1.0, 500e6, 2) == pytest.approx(2)
    assert bound_rate(10**7, 0.1, 500e6, 2) == pytest.approx(20)


def _step(capacity: float, calls: list[float]):
    def run(rate: float) -> StepResult:
        calls.append(rate)
        passed = rate <= capacity
        return StepResult(rate, 10, 1.0, rate, 10 if passed else 5, 0.0, passed, "" if passed else "backlog grew", [])

    return run


def test_find_max_ramps_then_bisects_within_tolerance() -> None:
    calls: list[float] = []
    result = find_max(
        _step(370.0, calls), 10.0, math.inf, tolerance=0.05, min_rate=0.1, max_steps=30, deadline=math.inf
    )
    assert 370 * 0.95 <= result.max_rate <= 370
    assert result.first_fail is not None and result.first_fail.reason == "backlog grew"
    assert calls[:3] == [10.0, 40.0, 160.0]  # x4 ramp while far from any cap


def test_find_max_starting_too_high_halves_then_bisects() -> None:
    calls: list[float] = []
    result = find_max(_step(3.0, calls), 18.0, 20.0, tolerance=0.05, min_rate=0.1, max_steps=30, deadline=math.inf)
    assert 3.0 * 0.95 <= result.max_rate <= 3.0
    assert calls[:4] == [18.0, 9.0, 4.5, 2.25]


def test_find_max_passing_at_the_bound_stops_there() -> None:
    calls: list[float] = []
    result = find_max(_step(100.0, calls), 18.0, 20.0, tolerance=0.05, min_rate=0.1, max_steps=30, deadline=math.inf)
    assert result.max_rate == 20.0 and calls == [18.0, 20.0] and result.first_fail is None


def test_find_max_gives_zero_when_nothing_passes() -> None:
    result = find_max(_step(0.0, []), 1.0, 10.0, tolerance=0.05, min_rate=0.1, max_steps=30, deadline=math.inf)
    assert result.max_rate == 0.0


def test_messages_have_exact_size_and_a_readable_header() -> None:
    binary = MessageGenerator(1000, text=False).message("s12", 7, 1700000000.25)
    text = MessageGenerator(100, text=True).message("s1", 123456, 1700000000.5)
    assert len(binary) == 1000 and len(text) == 100
    assert parse_header(binary) == ("s12", 7, 1700000000.25)
    assert parse_header(text.decode()) == ("s1", 123456, 1700000000.5)
    assert b"\n" not in text and text.isascii()
    with pytest.raises(ValueError):
        MessageGenerator(HEADER_BYTES - 1, text=False)


def test_percentile_and_slope() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert math.isnan(percentile([], 0.5))
    assert slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert slope([(1, 1)]) == 0.0


def _write_results(path: Path, run: str = "20260101T000000") -> None:
    from benchmarks.grid import RESULT_FIELDS

    rows = []
    for system, rates in {
        "hio-direct": (12000, 300, 19, 19.5),
        "spark-file": (40, 30, 18, 19.8),
        "spark-socket": (30000, 5, 2, 1),
    }.items():
        for (size, cost), rate in zip([(100, 0), (10**6, 0), (100, 100), (10**6, 100)], rates, strict=True):
            bound = min(500e6 / size, 2 / (cost / 1000)) if cost else 500e6 / size
            rows.append(
                {
                    "run": run,
                    "attempt": 1,
                    "system": system,
                    "size": size,
                    "cost_ms": cost,
                    "max_rate": rate,
                    "target_rate": rate * 1.02,
                    "bound": bound,
                    "fraction": rate / bound,
                    "cpu_slots": 1.9,
                    "cpu_speed": 30,
                    "loopback_mb_s": 500,
                    "steps": 5,
                    "seconds": 30,
                    "first_fail_rate": rate * 1.1,
                    "first_fail_reason": "backlog grew by 9 messages",
                    "latency_rate": rate / 2 if size == 10**6 else "",
                    "p50_ms": 12 if size == 10**6 else "",
                    "p99_ms": 40 if size == 10**6 else "",
                    "load_avg": 1.5,
                    "finished_at": "2026-01-01T00:00:00",
                    "commit": "abc1234",
                    "machine": "Some CPU x86_64, 2 cores, 8 GiB",
                }
            )
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(RESULT_FIELDS))
        writer.writeheader()
        writer.writerows(rows)


def test_report_has_tables_plots_targets_durability_and_other_systems_wins(tmp_path: Path) -> None:
    results = tmp_path / "docs" / "benchmarks" / "results-quick.csv"
    results.parent.mkdir(parents=True)
    _write_results(results)
    doc = write_report(results, tmp_path / "docs")
    text = doc.read_text()
    for png in ("results-quick-best.png", "results-quick-frequency.png"):
        assert (results.parent / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"benchmarks/{png}" in text
    assert "| hio-direct | 0 | 12,000 of 12,240 (0.24%) | 300 of 306 (60%) |" in text  # achieved of target
    rows = read_rows(results)
    wins = {(r["size"], r["cost_ms"], r["system"]): round(x, 2) for r, x in other_wins(rows)}
    assert wins == {(100, 0.0, "spark-socket"): 2.5, (10**6, 100.0, "spark-file"): 1.02}
    targets = {t: s for t, s, _ in check_targets(rows)}
    assert targets["100-byte tuples: >= 20,000/s"] == "NOT met"  # 12,000/s
    assert targets["10 MB: >= 3x rabbitmq (durable)"] == "not measured"
    assert "| 0 | 0.40x spark-socket | **10.00x spark-file** |" in text  # the ratio to the best other design
    assert targets["no cell where another system beats this system by more than 2x"] == "NOT met"
    assert targets["1 MB, no cost: >= 5x Spark file source"] == "met"
    assert "100 B x 0: spark-socket 30,000/s, 2.50x this system." in text
    assert "| *bound* | 0 | *5,000,000* | *500* |" in text
    assert "run `20260101T000000`, commit `abc1234`, Some CPU x86_64, 2 cores, 8 GiB, 2026-01-01" in text
    for system in ("hio-direct", "spark-file", "spark-socket"):  # what its latency ends at, what survives
        assert f"| {system} | {ABOUT[system].latency_end} | {ABOUT[system].durability} |" in text
    assert "| 1 MB x 0 | 1 | 1.90 / 30.0 / 500 | 1.90 / 30.0 / 500 | 1.90 / 30.0 / 500 | 0%, 0%, 0% | yes |" in text


def _row(system: str, size: int, cost_ms: float, rate: float) -> dict[str, object]:
    """A result row as read_rows gives it, with what the targets read."""
    return {"system": system, "size": size, "cost_ms": cost_ms, "max_rate": rate, "bound": 1e9, "fraction": 0.0}


def test_the_targets_compare_this_system_with_the_best_other_design_the_broker_and_its_secure_row() -> None:
    rows = [
        _row("hio-direct", 10**5, 0.0, 900),
        _row("spark-socket", 10**5, 0.0, 1000),  # behind at 100 KB
        _row("rabbitmq", 10**5, 0.0, 100),
        _row("hio-direct", 10**6, 0.0, 300),
        _row("hio-secure", 10**6, 0.0, 200),  # 67% of plain
        _row("rabbitmq", 10**6, 0.0, 60),
        _row("hio-direct", 10**7, 0.0, 40),
        _row("hio-secure", 10**7, 0.0, 36),
        _row("rabbitmq", 10**7, 0.0, 10),  # 4x
        _row("hio-direct", 10**7, 100.0, 19),
        _row("rabbitmq", 10**7, 100.0, 0.0),  # failed the cell: this system is infinitely ahead
    ]
    targets = {t: (s, d) for t, s, d in check_targets(rows)}
    assert targets["every cell >= 100 KB: ahead of every other system"] == ("NOT met", "100 KB x 0: 0.90x spark-socket")
    assert targets["10 MB: >= 3x rabbitmq (durable)"] == ("met", "0: 4.00x; 100 ms: all x")
    assert targets["secure (TLS + tokens) within 30% of plain at 1 MB and 10 MB"] == (
        "NOT met",
        "1 MB x 0: 67% of plain; 10 MB x 0: 90% of plain",
    )
    found = {cell: (round(r, 2), best["system"]) for cell, (r, best) in ratios(rows).items()}
    assert found == {
        (10**5, 0.0): (0.9, "spark-socket"),
        (10**6, 0.0): (5.0, "rabbitmq"),
        (10**7, 0.0): (4.0, "rabbitmq"),
        (10**7, 100.0): (math.inf, "rabbitmq"),
    }
    assert [(r["system"], round(x, 2)) for r, x in other_wins(rows)] == [("spark-socket", 1.11)]
    ahead = {t: (s, d) for t, s, d in check_targets([r for r in rows if r["size"] != 10**5])}
    assert ahead["every cell >= 100 KB: ahead of every other system"] == ("met", "3 cells, lowest ratio 4.00x")


def test_a_cell_whose_machine_state_differs_is_published_only_from_an_attempt_that_agreed(tmp_path: Path) -> None:
    results = tmp_path / "docs" / "benchmarks" / "results-full.csv"
    results.parent.mkdir(parents=True)
    _write_results(results)
    rows = list(csv.DictReader(results.read_text().splitlines()))
    for row in list(rows):  # 1 MB x 0: attempt 1 with Spark on half the CPU; attempt 2 agreed, with other figures
        if row["size"] == "1000000" and row["cost_ms"] == "0":
            again = {**row, "attempt": "2", "max_rate": str(float(row["max_rate"]) * 2)}
            rows.append(again)
            if row["system"] == "spark-file":
                row["cpu_slots"] = "0.95"
    for row in rows:  # 100 B x 100 ms: never agreed (the loopback halved for one system)
        if row["size"] == "100" and row["cost_ms"] == "100" and row["system"] == "spark-socket":
            row["loopback_mb_s"] = "250"
    for row in rows:  # 1 MB x 100 ms: never agreed (both slots given, one of them run 40% slower)
        if row["size"] == "1000000" and row["cost_ms"] == "100" and row["system"] == "hio-direct":
            row["cpu_speed"] = "18"
    with open(results, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    shown, refused = published(read_rows(results))
    assert {(r["system"], r["max_rate"]) for r in shown if r["size"] == 10**6 and r["cost_ms"] == 0} == {
        ("hio-direct", 600.0),
        ("spark-file", 60.0),
        ("spark-socket", 10.0),
    }
    assert sorted((a[0]["size"], a[0]["cost_ms"]) for a in refused) == [(100, 100.0), (10**6, 100.0)]
    # a run that did not record a figure (an empty column) is left out of that figure only
    assert machine_spread([{"cpu_slots": "2.0", "loopback_mb_s": "500"}, {"cpu_slots": 1.0, "loopback_mb_s": ""}]) == (
        1.0,
        0.0,
        0.0,
    )
    text = write_report(results, tmp_path / "docs").read_text()
    assert "| spark-file | 100 ms | not published |" in text
    assert (
        "| 100 B x 100 ms | 1 | 1.90 / 30.0 / 500 | 1.90 / 30.0 / 500 | 1.90 / 30.0 / 250 | 0%, 0%, 100% "
        "| no: never agreed |"
    ) in text
    assert "| 1 MB x 100 ms | 1 | 1.90 / 18.0 / 500 | 1.90 / 30.0 / 500 | 1.90 / 30.0 / 500 | 0%, 67%, 0% " in text


def test_the_cpu_probe_gives_slots_and_their_speed() -> None:
    from benchmarks.grid import SLOTS, CpuProbe, _steps

    probe = CpuProbe(seconds=0.05)
    try:
        samples = [probe.measure() for _ in range(3)]
    finally:
        probe.close()
    for slots, speed in samples:
        assert 0 < slots <= SLOTS and speed > 0
    speeds = [speed for _, speed in samples]
    assert max(speeds) < 4 * min(speeds)  # the same fixed work: its rate is a property of the machine
    here = probe.steps / _steps(probe.steps) / 1e6  # the same work timed in this process's CPU time
    assert here / 2 < max(speeds) < here * 2, (here, speeds)  # steps per CPU second, not per wall second


PROBE_UNTIL_INTERRUPTED = """
import time
from benchmarks.grid import CpuProbe
probe = CpuProbe(seconds=0.05)
try:
    probe.measure()
    print("measured", flush=True)
    time.sleep(60)  # a system's point runs; the probe's processes wait for the next measurement
finally:
    probe.close()
"""


def test_ctrl_c_during_a_cpu_probe_ends_the_run_and_its_probe_processes() -> None:
    """Ctrl-C reaches the terminal's whole process group, the probe's pool processes too, which
    wait between measurements; the run's clean-up then ends them instead of waiting for ever on
    the lock of its pool's queue (held by the one that was reading it when it died)."""
    run = subprocess.Popen(
        [sys.executable, "-c", PROBE_UNTIL_INTERRUPTED],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives a command
    )
    try:
        assert run.stdout is not None and run.stdout.readline() == "measured\n"
        time.sleep(0.3)  # the probe's processes back to waiting for work
        os.killpg(run.pid, signal.SIGINT)
        _out, err = run.communicate(timeout=20)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert "KeyboardInterrupt" in err, err
    wait_for(lambda: not group_alive(run.pid), timeout=10, what="the probe's processes ended")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("which", ["results", "steps", "burst"])
def test_a_run_refuses_files_of_other_columns_before_any_point(tmp_path: Path, which: str) -> None:
    from benchmarks.grid import BURST_FIELDS, RESULT_FIELDS, STEP_FIELDS, BenchRun

    run = BenchRun(BenchConfig(out_dir=str(tmp_path), results_name="r.csv"))
    path, fields = {
        "results": (run.results, RESULT_FIELDS),
        "steps": (run.steps_path, STEP_FIELDS),
        "burst": (run.burst_path, BURST_FIELDS),
    }[which]
    older = ",".join(fields[:-1]) + "\n"  # a file of another format
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(older)
    with pytest.raises(ConfigError, match=r"other columns .* --fresh"):
        run.run()
    assert path.read_text() == older
    assert run.probe is None  # refused before the machine was probed or any point ran


def test_achieved_rate_counts_finishes_at_the_sink_without_crediting_a_batch_it_waited_for() -> None:
    from benchmarks.grid import achieved_rate

    steady = [100.0 + i / 50 for i in range(100)]  # 50/s, one at a time
    assert achieved_rate(steady, 99.0) == pytest.approx(50.0)
    batches = [100.0 + b for b in range(5) for _ in range(20)]  # 20 a second, in one batch a second
    assert achieved_rate(batches, 99.0) == pytest.approx(20.0)
    assert achieved_rate([101.0] * 10, 99.0) == pytest.approx(5.0)  # one batch: over the time from the first send
    assert achieved_rate([], 99.0) == 0.0


class SourceThatStopsReading:
    """The sending side of a benchmarked system whose source stops reading: after ``good``
    messages every send blocks ``block`` seconds and then fails (or, with ``fails`` off,
    succeeds late), as a socket source does whose reader died."""

    sender_threads = 2

    def __init__(self, good: int, block: float, fails: bool = True) -> None:
        self.good, self.block, self.fails = good, block, fails
        self.sends = 0

    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        self.sends += 1
        if self.sends > self.good:
            time.sleep(self.block)
            if self.fails:
                raise TimeoutError("timed out")


class SystemThatBreaks:
    """A benchmarked system that passes every step up to ``limit`` messages/s and breaks above
    it, as Spark's socket source does when a batch exhausts its driver's heap: the step raises,
    and so does every reset after it (its JVM is gone)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1
        raise RuntimeError("No active or default Spark session found")


class RunnerOfABreakingSystem:
    def __init__(self, system: SystemThatBreaks) -> None:
        self.system = system

    def run(self, rate: float, **options: int) -> StepResult:
        if rate > self.system.limit or self.system.resets:
            raise RuntimeError("An error occurred while calling o1260.collectToPython")
        return StepResult(rate, 40, 4.0, rate, 40, 0.0, True, "", [0.1] * 40, achieved_rate=rate * 0.95)


def test_a_step_that_raises_is_a_failed_step_and_the_point_keeps_what_passed_before(tmp_path: Path) -> None:
    from benchmarks.grid import BenchRun

    run = BenchRun(BenchConfig(out_dir=str(tmp_path), results_name="r.csv"))
    run.run_id = "20260101T000000"
    run.steps_path.parent.mkdir(parents=True)
    runner = RunnerOfABreakingSystem(SystemThatBreaks(limit=95.0))
    point, latency, _steal = run._search(runner, "spark-socket", 10**6, 0.0, 1, 13.0, 5e9)  # type: ignore[arg-type]  # its steps only
    assert point.best is not None and point.best.rate == pytest.approx(52.0), point  # 13, 52, then 208 broke it
    assert latency is not None and not latency.passed and latency.reason.startswith("errors: An error occurred")
    steps = list(csv.DictReader(run.steps_path.read_text().splitlines()))
    raised = [s for s in steps if s["reason"].startswith("errors:")]
    assert raised and all(s["messages"] == "0" and s["finished_fraction"] == "" for s in raised), raised
    assert [s["kind"] for s in steps].count("latency") == 1


def test_sending_stops_at_the_first_failed_send_and_when_the_steps_time_runs_out() -> None:
    failing = SourceThatStopsReading(good=5, block=0.2)
    runner = StepRunner(failing, MessageGenerator(100, text=False), 0.0, BenchConfig())  # type: ignore[arg-type]  # only its sending side
    started = time.monotonic()
    errors = runner._pace("s1", 1000.0, 10_000, started, [], started + 60)
    assert errors and errors[0] == "send: timed out"
    assert failing.sends <= 5 + failing.sender_threads and time.monotonic() - started < 5
    slow = SourceThatStopsReading(good=5, block=0.1, fails=False)
    runner = StepRunner(slow, MessageGenerator(100, text=False), 0.0, BenchConfig())  # type: ignore[arg-type]  # only its sending side
    started = time.monotonic()
    errors = runner._pace("s1", 1000.0, 10_000, started, [], started + 0.5)
    assert errors and "of 10000 sent: the step's time ran out" in errors[0]
    assert slow.sends < 40 and time.monotonic() - started < 5


class SystemWhoseDriverDies:
    """A benchmarked system that stores ``stored`` messages of a burst, then reports an error
    and stores nothing more, as Spark's socket source does when a batch exhausts its driver's
    heap (with ``send_fails``: its source refuses the sends after that)."""

    sender_threads = 2

    def __init__(self, stored: int, send_fails: bool = False) -> None:
        self.stored, self.send_fails = stored, send_fails
        self.sent = 0
        self.error_asks = 0

    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        if self.send_fails and self.sent >= self.stored:
            raise ConnectionResetError("connection reset by peer")
        self.sent += 1

    def finished_count(self) -> int:
        return min(self.sent, self.stored)

    def finished(self, tag: str) -> list[object]:
        return []

    def errors(self) -> list[str]:
        self.error_asks += 1
        return ["Java heap exhausted: spark batch 5"] if self.sent > self.stored else []


def test_a_burst_ends_at_the_systems_first_error_not_at_its_timeout() -> None:
    dying = SystemWhoseDriverDies(stored=30)
    runner = StepRunner(dying, MessageGenerator(100, text=False), 0.0, BenchConfig())  # type: ignore[arg-type]  # its burst side only
    started = time.monotonic()
    burst = runner.burst(100, timeout=900.0)
    assert time.monotonic() - started < 10, "the wait went on after the system's error"
    assert burst.finished == 30 and burst.errors == ["Java heap exhausted: spark batch 5"]
    assert dying.error_asks < 20, "errors are asked for about once a second, not at every look at the count"
    refusing = SystemWhoseDriverDies(stored=30, send_fails=True)
    runner = StepRunner(refusing, MessageGenerator(100, text=False), 0.0, BenchConfig())  # type: ignore[arg-type]  # its burst side only
    started = time.monotonic()
    burst = runner.burst(100, timeout=900.0)
    assert time.monotonic() - started < 5 and burst.finished == 30
    assert burst.errors and burst.errors[0] == "send: connection reset by peer"


class SystemSeenLate:
    """A benchmarked system whose finished count is seen ``lag`` seconds late (as a count
    followed with long polls is), each message finishing 10 ms after it is sent."""

    sender_threads = 2

    def __init__(self, lag: float) -> None:
        self.lag = lag
        self.done: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        with self.lock:
            self.done.append((tag, time.time() + 0.01))

    def finished_count(self) -> int:
        now = time.time()
        with self.lock:
            return sum(1 for _, done in self.done if done + self.lag <= now)

    def finished(self, tag: str) -> list[types.SimpleNamespace]:
        with self.lock:
            return [types.SimpleNamespace(done_unix=t, sent_unix=t - 0.01) for g, t in self.done if g == tag]

    def errors(self) -> list[str]:
        return []


def test_a_bursts_time_ends_at_its_last_finish_not_when_its_count_was_seen() -> None:
    system = SystemSeenLate(lag=1.0)
    runner = StepRunner(system, MessageGenerator(100, text=False), 0.0, BenchConfig())  # type: ignore[arg-type]  # its burst side only
    burst = runner.burst(50, timeout=60.0)
    assert burst.finished == 50
    assert burst.seconds < 0.5, f"{burst.seconds:.2f} s: the burst's time included the count's lag of 1 s"


class SystemWhoseCountIsLateAWhile:
    """A benchmarked system that keeps up (each message finishes 10 ms after it is sent) but
    whose finished count, from 1.0 s to 1.8 s after the first send, is the one of 1.0 s: as a
    count learnt by a call is, while the call is slow to answer."""

    sender_threads = 2

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first = 0.0
        self.done: list[tuple[str, float, float]] = []  # (tag, done monotonic, done unix)

    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        with self.lock:
            self.first = self.first or time.monotonic()
            self.done.append((tag, time.monotonic() + 0.01, time.time() + 0.01))

    def finished_as_of(self) -> tuple[int, float]:
        now = time.monotonic()
        with self.lock:
            late = self.first and self.first + 1.0 <= now < self.first + 1.8
            as_of = self.first + 1.0 if late else now
            return sum(1 for _, done, _unix in self.done if done <= as_of), as_of

    def finished_count(self) -> int:
        return self.finished_as_of()[0]

    def finished(self, tag: str) -> list[types.SimpleNamespace]:
        with self.lock:
            return [types.SimpleNamespace(done_unix=u, sent_unix=u - 0.01) for g, _, u in self.done if g == tag]

    def errors(self) -> list[str]:
        return []


def test_a_late_count_is_paired_with_the_sends_of_its_time_not_taken_for_backlog_growth() -> None:
    config = BenchConfig(min_step_seconds=2.0, max_step_seconds=2.0, grace_seconds=1.0, drain_seconds=0.0)
    runner = StepRunner(SystemWhoseCountIsLateAWhile(), MessageGenerator(100, text=False), 0.0, config)  # type: ignore[arg-type]  # its step side only
    result = runner.run(100.0)
    assert result.passed, result.reason
    assert abs(result.backlog_growth) < 5, result.backlog_growth


def test_a_backlog_rising_and_falling_by_a_micro_batch_is_not_growth() -> None:
    """Spark's backlog at 879/s with batches of about 0.3 s: a slope of 190 messages over the
    step is one batch, not a system falling behind; without a latency seen, it fails."""
    runner = StepRunner(SourceThatStopsReading(0, 0.0), MessageGenerator(100, text=False), 0.0, BenchConfig())  # type: ignore[arg-type]  # only its judging
    assert not runner._judge(879.0, 3518, 4.0, 3518, 190.0, []).passed
    runner.latency_hint = 0.3
    assert runner._judge(879.0, 3518, 4.0, 3518, 190.0, []).passed
    assert runner._judge(879.0, 3518, 4.0, 3518, 400.0, []).reason == "backlog grew by 400 messages"


def test_a_failed_cell_says_why_in_words_the_report_groups_by() -> None:
    from benchmarks.grid import failure_of

    heap = "errors: spark batch 3: An error occurred: java.lang.OutOfMemoryError: Java heap space"
    assert failure_of(heap, 63.6).startswith("Java heap exhausted at 63.6/s: errors: spark batch 3")
    assert failure_of("only 2/10 finished in time (20%)", 5.0).startswith("timeout at 5/s")
    assert failure_of("errors: consumer: connection reset", math.inf).startswith("errors: errors: consumer")


def test_a_csv_of_no_identified_run_is_refused_and_a_fresh_run_starts_a_new_one(tmp_path: Path) -> None:
    from benchmarks.grid import BenchRun

    config = BenchConfig(out_dir=str(tmp_path), results_name="r.csv", data_dir=str(tmp_path / "var"))
    path = config.results_path()
    path.parent.mkdir(parents=True)
    path.write_text("system,size,cost_ms,max_rate\nhio-direct,100,0,5\n")
    with pytest.raises(ConfigError, match=r"no identified run .* --fresh"):
        BenchRun(config).run()
    _write_results(path, run="20260101T000000")
    with open(path, "a") as fh:
        fh.write("20260202T000000" + ",1,hio-queue,100,0" + "," * 20 + "\n")
    with pytest.raises(ConfigError, match="mixes runs 20260101T000000, 20260202T000000"):
        BenchRun(config).run()


def test_the_readme_performance_section_is_the_committed_runs_csv() -> None:
    """Every figure of the README's performance section comes from the committed CSVs of one run."""
    from benchmarks.report import performance_section, read_bursts, readme_section

    root = Path(__file__).resolve().parents[2]
    results = root / "docs" / "benchmarks" / "results-full.csv"
    rows = read_rows(results)
    bursts = read_bursts(results.with_name("results-full-burst.csv"))
    assert len({r["run"] for r in rows} | {b["run"] for b in bursts}) <= 1, "the committed results are one run"
    assert readme_section(root / "README.md") == performance_section(rows, bursts)
    doc = (root / "docs" / "benchmarks.md").read_text()
    for run in {r["run"] for r in rows}:
        assert f"run `{run}`" in doc, "docs/benchmarks.md is generated from the same run"


def test_the_readme_section_is_written_between_its_markers(tmp_path: Path) -> None:
    from benchmarks.report import README_END, README_START, readme_section, write_readme

    results = tmp_path / "docs" / "benchmarks" / "results-full.csv"
    results.parent.mkdir(parents=True)
    _write_results(results)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Performance\n\n{README_START}\nold figures\n{README_END}\n\n## Next\n")
    write_readme(readme, results)
    section = readme_section(readme)
    assert "old figures" not in section and readme.read_text().endswith(f"{README_END}\n\n## Next\n")
    assert "| 1 MB, no processing | 300/s, p50 12 ms | 30/s, p50 12 ms | 5/s, p50 12 ms |" in section
    assert "| cell | hio-direct | spark-file | spark-socket |" in section


@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.spark
def test_a_spark_system_whose_jvm_died_says_so_and_is_reset_onto_a_new_jvm(tmp_path: Path) -> None:
    """The socket source can exhaust the driver's heap and take the JVM down: the system says
    so among its errors instead of raising, its reset starts a new JVM that processes messages
    again, and it stops without raising."""
    from pyspark import SparkContext

    from benchmarks.systems import SparkFileSystem, spark_alive

    system = SparkFileSystem(tmp_path / "spark")
    system.start()
    try:
        system.begin_point(1000, 0.0)
        dead = SparkContext._gateway.proc  # type: ignore[union-attr]  # pyspark keeps its JVM there
        dead.kill()
        dead.wait(30)
        assert not spark_alive()
        assert any(error.startswith("spark: ") for error in system.errors())
        system.reset()
        assert spark_alive() and SparkContext._gateway.proc is not dead  # type: ignore[union-attr]  # as above
        generator = MessageGenerator(1000, text=system.text_payload)
        for seq in range(5):
            system.send("after", seq, generator.message("after", seq, time.time()), 0.0)
        deadline = time.monotonic() + 120
        while len(system.finished("after")) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(system.finished("after")) == 5
    finally:
        system.stop()


@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.spark
def test_smoke_every_system_one_cell_and_bursts_in_one_run_then_resume(tmp_path: Path) -> None:
    """Every system for real on one cell (1 KB x 100 ms), one step each, and a small burst of
    1 MB messages through the library and a watched folder; then a resume adds nothing.
    Nothing it started is left running, nothing it wrote is left in its data folder."""
    import glob

    pytest.importorskip("pika")
    if not glob.glob("/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin/rabbitmq-server"):
        pytest.skip("RabbitMQ is not installed (Debian's rabbitmq-server: apt-get install rabbitmq-server)")
    _need_nats()
    out = tmp_path / "docs"
    readme = tmp_path / "README.md"
    from benchmarks.report import README_END, README_START, readme_section

    readme.write_text(f"{README_START}\n{README_END}\n")
    args = [
        sys.executable,
        "-m",
        "hio.cli",
        "bench",
        "--data-dir",
        str(tmp_path / "var"),
        "--out-dir",
        str(out),
        "--results-name",
        "smoke.csv",
        "--readme",
        str(readme),
        "--sizes",
        "1K",
        "--costs",
        "100ms",
        "--latency-sizes",
        "1K",
        "--latency-messages",
        "4",
        "--max-steps",
        "1",
        "--min-step-seconds",
        "2",
        "--max-step-seconds",
        "2",
        "--min-step-messages",
        "4",
        "--probe-messages",
        "4",
        "--grace-seconds",
        "2",
        "--drain-seconds",
        "5",
        "--point-seconds",
        "20",
        "--loopback-seconds",
        "0.3",
        "--cell-attempts",
        "1",
        "--burst-sizes",
        "1M",
        "--burst-bytes",
        "12M",
        "--burst-seconds",
        "90",
        "--disk-probe",
        "16M",
    ]
    # About 2.5 min on an idle 2-core machine (most of it four Spark starts); generous for a loaded one.
    run = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = read_rows(out / "benchmarks" / "smoke.csv")
    assert sorted(r["system"] for r in rows) == sorted(SYSTEMS)
    assert len({r["run"] for r in rows}) == 1
    for row in rows:
        # one step on a shared machine may fail; the system itself must not
        assert row["failure"] == "" or row["failure"].startswith(
            ("backlog grew", "timeout", "source below", "probe: timeout")
        ), row
        assert row["bound"] == pytest.approx(20.0)  # 2 slots / 100 ms
        assert row["cpu_slots"] > 0 and row["cpu_speed"] > 0 and row["loopback_mb_s"] > 0  # right before its point
        assert int(row["steps"]) == 1  # --max-steps bounds the search
    passed = [r for r in rows if not r["failure"]]
    assert passed, rows
    for row in passed:  # achieved beside the target; latency at least the 100 ms of CPU, then stored
        assert row["max_rate"] > 0 and row["target_rate"] > 0 and row["p50_ms"] >= 100, row
    steps = list(csv.DictReader((out / "benchmarks" / "smoke-steps.csv").read_text().splitlines()))
    assert {s["system"] for s in steps if s["kind"] == "probe"} == set(SYSTEMS)  # each its own probe
    bursts = list(csv.DictReader((out / "benchmarks" / "smoke-burst.csv").read_text().splitlines()))
    assert {(b["system"], b["path"]) for b in bursts} == {(s, p) for s in SYSTEMS for p in ("library", "folder")}
    for burst in bursts:
        assert burst["messages"] == "12" and float(burst["disk_mb_s"]) > 0
        if burst["system"] in ("spark-socket", "rabbitmq", "nats") and burst["path"] == "folder":
            assert burst["failure"] == "no watched-folder source"
        elif burst["system"].startswith("hio") or burst["system"] in ("rabbitmq", "nats"):
            assert burst["failure"] == "" and burst["stored"] == "12", burst
    text = (out / "benchmarks.md").read_text()
    assert "## Targets" in text and "## Bursts: a plate dumped at once" in text
    assert "| rabbitmq |" in readme_section(readme) and "| nats |" in readme_section(readme)
    assert list((tmp_path / "var" / "bench").iterdir()) == []  # everything it wrote is removed
    assert not _processes_under(tmp_path), "the run left processes behind"
    again = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "1 of 1 cells done earlier" in again.stdout
    assert len(read_rows(out / "benchmarks" / "smoke.csv")) == len(SYSTEMS)


def _need_nats() -> None:
    """Skip unless NATS JetStream can run here: nats-py and Debian's nats-server."""
    import shutil

    pytest.importorskip("nats")
    if shutil.which("nats-server") is None and shutil.which("nats-server", path="/usr/sbin:/usr/bin") is None:
        pytest.skip("NATS is not installed (Debian's nats-server: apt-get install nats-server)")


def _wait_finished(system: System, tag: str, count: int, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while len(system.finished(tag)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(system.finished(tag))


@pytest.mark.harness
def test_the_nats_broker_runs_on_loopback_in_its_folder_and_stop_removes_it(tmp_path: Path) -> None:
    _need_nats()
    from benchmarks.jetstream import MAX_PAYLOAD, NatsBroker

    broker = NatsBroker(tmp_path / "broker")
    broker.start()
    try:
        config = (tmp_path / "broker" / "nats-server.conf").read_text()
        assert f'listen: "127.0.0.1:{broker.port}"' in config and f"max_payload: {MAX_PAYLOAD}" in config
        assert MAX_PAYLOAD > 10 * 10**6 + HEADER_BYTES  # a 10 MB message, its header and headers
        assert (tmp_path / "broker" / "store").is_dir()
        assert _processes_under(tmp_path)  # the server, with its configuration in the folder
    finally:
        broker.stop()
    assert not (tmp_path / "broker").exists()
    assert not _processes_under(tmp_path), "the broker left its server behind"
    broker.stop()  # idempotent


def test_the_nats_system_refuses_a_message_size_its_server_would_not_take(tmp_path: Path) -> None:
    pytest.importorskip("nats")
    from benchmarks.jetstream import MAX_MESSAGE, NatsSystem

    assert MAX_MESSAGE > 10 * 10**6  # the grid's largest size
    with pytest.raises(ValueError, match=r"above the \d+ bytes this system's server takes"):
        NatsSystem(tmp_path / "nats").begin_point(MAX_MESSAGE + 1, 0.0)
    assert not (tmp_path / "nats").exists()  # refused before anything started


@pytest.mark.harness
def test_a_nats_server_that_cannot_start_says_why_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_nats()
    import socket

    import benchmarks.jetstream as jetstream

    broker = jetstream.NatsBroker(tmp_path / "broker")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(jetstream, "free_port", lambda: port)  # in use: the real server fails to bind
        with pytest.raises(RuntimeError, match="nats-server exited at start"):
            broker.start(timeout=30)
    assert not (tmp_path / "broker").exists()
    assert not _processes_under(tmp_path)


@pytest.mark.harness
def test_the_nats_system_stores_acknowledged_messages_resets_its_backlog_and_stops_clean(tmp_path: Path) -> None:
    """Real nats-server and consumer processes: 1 KB and 10 MB messages are stored (features
    fsynced, then acked) by the two consumers; a reset drops a backlog (nothing of it finishes
    later) and the next messages finish; stop leaves no process and no broker folder."""
    _need_nats()
    from benchmarks.jetstream import NatsSystem

    system = NatsSystem(tmp_path / "nats")
    try:
        system.start()
        for size, count in ((1000, 40), (10**7, 4)):
            system.begin_point(size, 0.0)
            generator = MessageGenerator(size, text=False)
            tag = f"s{size}"
            for seq in range(count):
                system.send(tag, seq, generator.message(tag, seq, time.time()), 0.0)
            assert _wait_finished(system, tag, count, 60) == count, system.errors()
            assert sorted(f.seq for f in system.finished(tag)) == list(range(count))  # each once
            system.end_point()
        stored = b"".join(p.read_bytes() for p in (tmp_path / "nats").glob("features-*.log"))
        assert stored.count(b"\n") == 44
        system.begin_point(1000, 0.05)  # 50 ms of CPU each: a backlog builds
        generator = MessageGenerator(1000, text=False)
        for seq in range(200):
            system.send("backlog", seq, generator.message("backlog", seq, time.time()), 0.05)
        system.reset()
        left = len(system.finished("backlog"))
        assert left < 200
        for seq in range(5):
            system.send("after", seq, generator.message("after", seq, time.time()), 0.05)
        assert _wait_finished(system, "after", 5, 60) == 5, system.errors()
        time.sleep(1.0)
        assert len(system.finished("backlog")) == left  # purged, not redelivered
        assert system.errors() == []
    finally:
        system.end_point()
        system.stop()
    assert not (tmp_path / "nats" / "broker").exists()
    assert not _processes_under(tmp_path), "the system left processes behind"


def _processes_under(folder: Path) -> list[str]:
    """Command lines of live processes that name ``folder`` (roles, Spark, the broker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(folder).encode() in argv and int(entry.name) != os.getpid():
                found.append(argv.replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_steal_is_read_from_the_machine_and_sets_the_cpu_left_bound() -> None:
    from benchmarks.grid import cpu_ticks, steal_between
    from benchmarks.report import cpu_left_fraction

    before = cpu_ticks()
    sum(range(200_000))
    after = cpu_ticks()
    assert after[1] >= before[1] > 0 and after[0] >= before[0]
    assert math.isnan(steal_between(before, before))
    assert steal_between((10, 100), (35, 200)) == 0.25
    row = {"cost_ms": 100.0, "size": 100, "loopback_mb_s": 1000.0, "max_rate": 15.0, "steal": 0.25}
    assert cpu_left_fraction(row) == 1.0  # 2 x 0.75 / 0.1 s = 15/s left
    assert math.isnan(cpu_left_fraction({**row, "steal": math.nan}))
    assert math.isnan(cpu_left_fraction({**row, "cost_ms": 0.0}))


def test_core_bench_takes_small_tuples_count_from_a_measured_rate_not_the_loopback_bound() -> None:
    """At 100 B the loopback bound would allow millions of tuples in ``seconds``: a calibration
    run's rate sets the count, so the measurement lasts about ``seconds`` (not a fraction of one)."""
    from benchmarks.core import CALIBRATION_TUPLES, CoreBenchConfig, needs_calibration, tuple_count

    config = CoreBenchConfig(seconds=10.0)
    assert (
        needs_calibration(config, tuple_count(config, 100)) and tuple_count(config, 100, measured_rate=5000.0) == 50_000
    )
    assert tuple_count(config, 100, measured_rate=1e9) == config.max_tuples
    assert not needs_calibration(config, tuple_count(config, 10_000_000)) and tuple_count(config, 10_000_000) == 400
    assert tuple_count(config, 1_000_000) > CALIBRATION_TUPLES  # 1 MB: calibrated too (4,000 at the bound)
    paced = CoreBenchConfig(seconds=10.0, rate=40.0)
    assert not needs_calibration(paced, tuple_count(paced, 100)) and tuple_count(paced, 100) == 400


@pytest.mark.harness
def test_core_bench_direct_counts_a_tuple_the_queue_took_once_it_is_done(tmp_path: Path) -> None:
    """More costly tuples at once than one engine takes, and a gateway that queues a batch at once
    when every channel is busy: those batches go through the master's queue and resolve ENQUEUED
    before they are processed. The direct row's time runs until the master counts them done, so
    its rate stays within what the engine can do."""
    args = [sys.executable, "-m", "hio.cli", "bench-core", "--data-dir", str(tmp_path / "var")]
    args += ["--sizes", "1K", "--modes", "direct", "--engines", "1", "--max-tuples", "60", "--cost-ms", "50"]
    env = {**os.environ, "HIO_GATEWAY_ROUTE_WAIT_SECONDS": "0"}
    run = subprocess.run(args, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:2] == ["1K", "direct"]]
    assert len(rows) == 1 and rows[0][2] == "60", run.stdout
    assert "went through the master's queue (no channel free)" in run.stdout
    assert float(rows[0][4]) <= 1 / 0.050 * 1.05, f"one engine burns 50 ms a tuple: {run.stdout}"


@pytest.mark.harness
def test_core_bench_paces_tuples_and_prints_each_roles_cpu_per_tuple(tmp_path: Path) -> None:
    """`hio bench-core` for real: a paced run through both paths, with the CPU line per measurement."""
    args = [
        sys.executable,
        "-m",
        "hio.cli",
        "bench-core",
        "--data-dir",
        str(tmp_path / "var"),
        "--sizes",
        "1K",
        "--rate",
        "40",
        "--seconds",
        "1",
        "--cost-ms",
        "2",
    ]
    run = subprocess.run(args, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tuples paced at 40/s, 2 ms of CPU each" in run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] == ["1K"]]
    assert [(r[1], r[2]) for r in rows] == [("direct", "40"), ("queue", "40")]
    assert all(float(r[3]) >= 39 / 40 for r in rows), "paced: 40 tuples take about a second"
    cpu_lines = [line for line in run.stdout.splitlines() if "ms CPU per tuple" in line]
    assert len(cpu_lines) == 2
    for line in cpu_lines:
        engines = float(line.split("engines ")[1].split(",")[0])
        assert engines >= 2.0, f"each tuple burned 2 ms in an engine: {line}"
    refused = subprocess.run(
        [sys.executable, "-m", "hio.cli", "bench-core", "--rate", "-5"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert refused.returncode != 0 and "rate must be 0 (all at once) or positive" in refused.stderr + refused.stdout


@pytest.mark.harness
def test_floor_bench_streams_both_paths_and_cleans_up_after_itself(tmp_path: Path) -> None:
    """`hio bench-floor` for real: a row per path with tuples moved and the CPU they cost,
    the disk measured, and nothing of its spool left in the data folder; a wrong path is named."""
    args = [
        sys.executable,
        "-m",
        "hio.cli",
        "bench-floor",
        "--data-dir",
        str(tmp_path / "var"),
        "--sizes",
        "100K",
        "--seconds",
        "0.5",
        "--disk-probe",
        "8M",
    ]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "disk, written and fdatasynced:" in run.stdout and "not measured" not in run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] == ["100K"]]
    assert [r[1] for r in rows] == ["memory", "spool"]
    for row in rows:
        tuples, mb_per_s, cpu_ms = int(row[2]), float(row[5]), float(row[7])
        assert tuples > 0 and mb_per_s > 0 and cpu_ms > 0, row
    assert list((tmp_path / "var" / "bench-floor").iterdir()) == []
    refused = subprocess.run(
        [sys.executable, "-m", "hio.cli", "bench-floor", "--paths", "disk"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert refused.returncode != 0 and "paths must be memory or spool, got disk" in refused.stderr + refused.stdout


def test_the_machine_and_commit_a_run_records() -> None:
    from benchmarks.measure import machine_description, source_commit

    assert f"{os.cpu_count()} cores" in machine_description()
    commit = source_commit()
    assert commit == "" or len(commit.split("+")[0]) >= 7
