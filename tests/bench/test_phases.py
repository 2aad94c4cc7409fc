"""`hio experiment phases`: the schedule, the figures it reports, and a short run of both
clusters for real (real roles, real realizations, the local provisioner)."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.phases import Phase, PhasesConfig, Row, parse_phase, summarise
from hio.config import ConfigError
from tests.harness import hio_env


def test_a_phase_is_name_two_rates_and_a_duration_and_bad_ones_are_named() -> None:
    assert parse_phase("overload:1.2:0.6:45") == Phase("overload", (1.2, 0.6), 45.0)
    for bad, message in [
        ("overload:1.2:45", "NAME:SOURCE_A:SOURCE_B:SECONDS"),
        ("overload:fast:1:45", "not a number"),
        ("overload:-1:1:45", "zero or more"),
        ("overload:1:1:0", "duration"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_phase(bad)
    with pytest.raises(ConfigError, match="every phase offers nothing"):
        PhasesConfig(phases=("quiet:0:0:10",)).validate()
    with pytest.raises(ConfigError, match="runs"):
        PhasesConfig(runs=("autoscaled",)).validate()
    with pytest.raises(ConfigError, match="elastic_args cannot be split"):
        PhasesConfig(elastic_args="--cooldown-seconds '5").validate()


def _row(t: float, submitted: int, stored: int, workers: int) -> Row:
    return Row(
        run="elastic",
        t=t,
        phase="",
        offered_per_s=0.0,
        submitted=submitted,
        stored=stored,
        stored_per_s=0.0,
        backlog=submitted - stored,
        queue=0,
        channels_free=0,
        channels_busy=0,
        workers_serving=workers,
        worker_processes=workers,
        engines_running=1,
        engines_wanted=1,
        worker_cpu={f"w{i}": 0.5 for i in range(workers)},
    )


def test_drain_is_the_time_until_what_was_offered_by_the_overload_s_end_is_stored() -> None:
    schedule = [Phase("excess", (1, 0), 2), Phase("overload", (2, 2), 2), Phase("excess", (1, 0), 4)]
    rows = [
        _row(0, 1, 0, 1),
        _row(1, 2, 2, 1),
        _row(2, 6, 3, 2),
        _row(3, 10, 4, 3),
        _row(4, 11, 6, 3),  # the overload ended at 4 s with 11 offered
        _row(5, 12, 9, 3),
        _row(6, 13, 11, 2),  # 11 stored: drained 2 s after
        _row(7, 14, 14, 1),
    ]
    ids = list(range(1, 15))
    counts = Counter(dict.fromkeys(ids[:-1], 1) | {14: 2})
    summary = summarise("elastic", rows, schedule, ids, counts, 0, 1.0, PhasesConfig())
    assert summary["drain_seconds"] == 2.0
    assert summary["peak_backlog"] == 6
    assert summary["worker_seconds"] == 16  # 1+1+2+3+3+3+2+1 worker processes, one second each
    assert summary["peak_workers"] == 3
    assert (summary["stored"], summary["lost"], summary["duplicated"]) == (14, 0, 1)


@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.alone
def test_a_short_schedule_runs_fixed_and_elastic_loses_nothing_and_elastic_uses_fewer_workers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "hio.cli", "experiment", "phases",
        "--data-dir", str(tmp_path / "var"),
        "--out", str(out),
        "--max-workers", "3",
        "--realizations", "4",
        "--phases", "excess:0.3:0:8",
        "--phases", "overload:1.3:1.3:14",
        "--phases", "excess:0.3:0:22",
        "--elastic-args=--cooldown-seconds 2 --engine-idle-seconds 3 --worker-grace-seconds 3",
    ]  # fmt: skip
    run = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=hio_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    with (out / "phases-summary.csv").open() as f:
        summary = {row["run"]: row for row in csv.DictReader(f)}
    assert set(summary) == {"fixed", "elastic"}
    for row in summary.values():
        assert int(row["submitted"]) > 50
        assert (int(row["stored"]), int(row["lost"]), int(row["duplicated"])) == (int(row["submitted"]), 0, 0)
        assert row["machine"] and row["finished_at"]
    fixed, elastic = summary["fixed"], summary["elastic"]
    assert int(fixed["peak_workers"]) == 3
    assert int(elastic["peak_workers"]) >= 2  # scaled out for the overload ...
    assert int(elastic["worker_seconds"]) < int(fixed["worker_seconds"])  # ... and used fewer workers in all

    with (out / "phases.csv").open() as f:
        rows = list(csv.DictReader(f))
    elastic_rows = [r for r in rows if r["run"] == "elastic"]
    assert {r["phase"] for r in elastic_rows} >= {"excess", "overload"}
    assert max(int(r["engines_running"]) for r in elastic_rows) > int(elastic_rows[0]["engines_running"])
    for name in ("phases-fixed.png", "phases-elastic.png", "phases-cpu.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fewer worker-seconds than fixed peak capacity" in run.stdout
