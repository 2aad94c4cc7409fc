"""`hio bench`: the search, the pass rules' arithmetic, the report, and a smoke
run of the whole machinery (real roles, real Spark) on a tiny grid."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.grid import (
    BenchConfig,
    StepResult,
    bound_rate,
    find_max,
    parse_cost,
    parse_size,
    percentile,
    read_done,
    slope,
)
from benchmarks.report import check_targets, read_rows, spark_wins, write_report
from benchmarks.systems import HEADER_BYTES, MessageGenerator, parse_header
from hio.config import ConfigError


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


def _write_results(path: Path) -> None:
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
                    "system": system,
                    "size": size,
                    "cost_ms": cost,
                    "max_rate": rate,
                    "bound": bound,
                    "fraction": rate / bound,
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
                }
            )
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(RESULT_FIELDS))
        writer.writeheader()
        writer.writerows(rows)


def test_report_has_tables_plots_targets_and_spark_wins(tmp_path: Path) -> None:
    results = tmp_path / "docs" / "benchmarks" / "results-quick.csv"
    results.parent.mkdir(parents=True)
    _write_results(results)
    doc = write_report(results, tmp_path / "docs")
    text = doc.read_text()
    for png in ("results-quick-best.png", "results-quick-frequency.png"):
        assert (results.parent / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"benchmarks/{png}" in text
    assert "| hio-direct | 0 | 12,000 (0.24%) | 300 (60%) |" in text
    rows = read_rows(results)
    wins = {(r["size"], r["cost_ms"], r["system"]): round(x, 2) for r, x in spark_wins(rows)}
    assert wins == {(100, 0.0, "spark-socket"): 2.5, (10**6, 100.0, "spark-file"): 1.02}
    targets = {t: s for t, s, _ in check_targets(rows)}
    assert targets["100-byte tuples: >= 10,000/s"] == "met"
    assert targets["no cell where Spark beats this system by more than 2x"] == "NOT met"
    assert targets["1 MB, no cost: >= 5x Spark file source"] == "met"
    assert "100 B x 0: spark-socket 30,000/s, 2.50x this system." in text
    assert read_done(results)[("hio-direct", 100, 0.0)]["max_rate"] == "12000"
    assert "| *bound* | 0 | *5,000,000* | *500* |" in text  # one loopback figure: one bound


def test_report_shows_a_bound_range_when_runs_measured_different_loopbacks(tmp_path: Path) -> None:
    results = tmp_path / "docs" / "benchmarks" / "results-full.csv"
    results.parent.mkdir(parents=True)
    _write_results(results)
    rows = list(csv.DictReader(results.read_text().splitlines()))
    for row in rows:
        if row["system"] == "spark-file" and row["cost_ms"] == "0":
            row["bound"] = str(float(row["bound"]) * 2)  # measured in a run with twice the loopback
    with open(results, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = write_report(results, tmp_path / "docs").read_text()
    assert "| *bound* | 0 | *5,000,000 – 10,000,000* | *500 – 1,000* |" in text


@pytest.mark.slow
@pytest.mark.spark
def test_smoke_whole_machinery_on_a_tiny_grid_and_resume(tmp_path: Path) -> None:
    """Every system for real on one cell (1 KB x 100 ms), few steps; then a resume adds nothing."""
    out = tmp_path / "docs"
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
        "--start-fraction",
        "0.1",
        "--min-step-seconds",
        "2",
        "--max-step-seconds",
        "2",
        "--min-step-messages",
        "4",
        "--grace-seconds",
        "2",
        "--drain-seconds",
        "5",
        "--point-seconds",
        "20",
    ]
    # About 1.5 min on an idle 2-core machine (most of it Spark's start); generous for a loaded one.
    run = subprocess.run(args, capture_output=True, text=True, timeout=420, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = read_rows(out / "benchmarks" / "smoke.csv")
    assert sorted(r["system"] for r in rows) == ["hio-direct", "hio-queue", "spark-file", "spark-socket"]
    for row in rows:
        assert row["bound"] == pytest.approx(20.0)  # 2 slots / 100 ms
        assert int(row["steps"]) == 1  # --max-steps bounds the search
    steps = list(csv.DictReader((out / "benchmarks" / "smoke-steps.csv").read_text().splitlines()))
    assert {s["system"] for s in steps} == {r["system"] for r in rows}
    assert any(s["passed"] == "1" for s in steps), steps
    assert "## Targets" in (out / "benchmarks.md").read_text()
    left = [
        p
        for p in (tmp_path / "var" / "bench").rglob("*")
        if p.is_dir() and p.name.startswith("spark-") and "-p" in p.name
    ]
    assert left == []  # Spark's per-point messages and checkpoints are removed
    again = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("points done earlier") == 4
    assert len(read_rows(out / "benchmarks" / "smoke.csv")) == 4


def test_resumed_csv_from_an_older_version_gets_the_new_columns(tmp_path: Path) -> None:
    from benchmarks.grid import append_row

    path = tmp_path / "r.csv"
    path.write_text("system,size\nhio-direct,100\n")
    append_row(path, ("system", "size", "cost_ms"), {"system": "spark-file", "size": 200, "cost_ms": 10})
    rows = list(csv.DictReader(path.read_text().splitlines()))
    assert rows == [
        {"system": "hio-direct", "size": "100", "cost_ms": ""},
        {"system": "spark-file", "size": "200", "cost_ms": "10"},
    ]


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
    assert "disk, written and fsynced:" in run.stdout and "not measured" not in run.stdout
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


def test_report_lists_the_commit_machine_and_day_of_each_run_it_merges(tmp_path: Path) -> None:
    results = tmp_path / "docs" / "benchmarks" / "results-full.csv"
    results.parent.mkdir(parents=True)
    _write_results(results)
    with open(results) as fh:
        rows = list(csv.DictReader(fh))
    for row in rows:
        row["commit"] = "abc1234" if row["system"] == "hio-direct" else "def5678+changes"
        row["machine"] = "Some CPU x86_64, 2 cores, 8 GiB"
    with open(results, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = write_report(results, tmp_path / "docs").read_text()
    assert "| hio-direct | 4 | `abc1234` | Some CPU x86_64, 2 cores, 8 GiB | 2026-01-01 | 500 | not recorded |" in text
    assert "| spark-file | 4 | `def5678+changes` |" in text


def test_the_machine_and_commit_a_run_records() -> None:
    from benchmarks.measure import machine_description, source_commit

    assert f"{os.cpu_count()} cores" in machine_description()
    commit = source_commit()
    assert commit == "" or len(commit.split("+")[0]) >= 7
