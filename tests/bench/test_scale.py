"""`hio bench-scale`: counts, merged results, the document's verdicts, and short runs of each
curve for real (a real master and repository as processes; KD on a local Spark)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scale import (
    ScaleBenchConfig,
    count_label,
    csv_path,
    merge_rows,
    parse_count,
    verdicts,
    write_document,
)
from hio.config import ConfigError
from tests.harness import hio_env

PNG = b"\x89PNG\r\n\x1a\n"


def test_counts_read_in_decimal_units_and_label_back() -> None:
    assert [parse_count(t, "records") for t in ("10", "10k", "1M", "10M", "2.5k")] == [10, 10**4, 10**6, 10**7, 2500]
    assert [count_label(n) for n in (10, 1000, 10_000, 1_000_000, 10_000_000, 1234)] == [
        "10",
        "1k",
        "10k",
        "1M",
        "10M",
        "1234",
    ]
    with pytest.raises(ConfigError, match="records: cannot read 'lots'"):
        parse_count("lots", "records")


def test_config_refuses_unknown_curves_and_impossible_sizes() -> None:
    with pytest.raises(ConfigError, match="curves must be some of master, repository, kd"):
        ScaleBenchConfig(curves=("spark",)).validate()
    with pytest.raises(ConfigError, match="channels_per_worker must be at most 1024"):
        ScaleBenchConfig(channels_per_worker=2000).validate()
    with pytest.raises(ConfigError, match="kd_stored: every size must be at least kd_new"):
        ScaleBenchConfig(kd_stored=("500",), kd_new=1000).validate()
    assert ScaleBenchConfig(channels=("5000", "10", "1k")).channel_counts() == [10, 1000, 5000]


def test_profiling_the_master_without_py_spy_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ConfigError, match=r"profile: py-spy is not installed here \(pip install py-spy\)"):
        ScaleBenchConfig(curves=("master",), profile=True).validate()
    ScaleBenchConfig(curves=("repository",), profile=True).validate()  # only the master's curve profiles
    spy = tmp_path / "py-spy"
    spy.write_text("#!/bin/sh\n")
    spy.chmod(0o755)
    ScaleBenchConfig(curves=("master",), profile=True).validate()


def test_a_point_measured_again_replaces_its_row_and_the_others_stay(tmp_path: Path) -> None:
    path = csv_path(tmp_path, "repository")
    merge_rows(path, "repository", [_repository_row(10_000_000, "warm", 40.0), _repository_row(1_000_000, "warm", 4.0)])
    rows = merge_rows(path, "repository", [_repository_row(10_000_000, "warm", 20.0)])
    assert [(r["records"], r["restart_s"]) for r in rows] == [("1000000", "4.0"), ("10000000", "20.0")]
    assert rows == list(csv.DictReader(path.read_text().splitlines()))


def test_the_document_shows_each_curve_and_says_plainly_which_targets_are_met(tmp_path: Path) -> None:
    merge_rows(
        csv_path(tmp_path, "master"),
        "master",
        [_master_row(100, 2500.0), _master_row(1000, 2100.0)],
    )
    merge_rows(csv_path(tmp_path, "repository"), "repository", [_repository_row(10_000_000, "cold", 25.0)])
    merge_rows(
        csv_path(tmp_path, "kd"),
        "kd",
        [_kd_row(0, 5.0, 1.0), _kd_row(10_000_000, 6.0, 1.2)],
    )
    (tmp_path / "scale-analysis.md").write_text("Where the time goes: gRPC.\n")
    lines = verdicts(tmp_path)
    assert lines[0].startswith("master: 2,100 routes/s at 1,000 channels") and lines[0].endswith("NOT met")
    assert "restart 25.0 s (target < 30 s: met), index 1,500 MiB (target < 1,024 MiB: NOT met)" in lines[1]
    assert lines[2] == "kd: interval over 10M stored is 1.20x the empty store's (target <= 2x: met)"
    text = write_document(tmp_path).read_text()
    for curve in ("master", "repository", "kd"):
        assert "![" in text and f"(scale-{curve}.png)" in text and f"(scale-{curve}.csv)" in text
    assert "| 1,000 | 63 |" in text  # channels, workers
    assert "## Analysis\n\nWhere the time goes: gRPC." in text


def _run(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "hio.cli", "bench-scale",
        "--data-dir", str(tmp_path / "var"),
        "--out", str(tmp_path / "out"),
        *args,
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=hio_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def _rows(tmp_path: Path, curve: str) -> list[dict[str, str]]:
    rows = list(csv.DictReader((tmp_path / "out" / f"scale-{curve}.csv").read_text().splitlines()))
    for row in rows:
        assert row["machine"] and row["finished_at"] and row["load_avg"] and "commit" in row
    assert (tmp_path / "out" / f"scale-{curve}.png").read_bytes()[:8] == PNG
    return rows


@pytest.mark.harness
def test_a_real_master_routes_for_fake_workers_and_gateways_and_its_cpu_per_route_is_measured(
    tmp_path: Path,
) -> None:
    _run(tmp_path, "--curves", "master", "--channels", "10,100", "--seconds", "2", "--warmup-seconds", "0.5")
    rows = _rows(tmp_path, "master")
    assert [int(r["channels"]) for r in rows] == [10, 100]
    assert [int(r["workers"]) for r in rows] == [1, 7]  # 16 channels per worker
    for row in rows:
        assert int(row["routes"]) > 20, row  # even on a loaded machine, a route is milliseconds
        assert (int(row["queued"]), int(row["errors"])) == (0, 0), row  # every route found a channel
        assert 0.01 < float(row["master_cpu_ms_per_route"]) < 50, row
        assert float(row["route_p50_ms"]) <= float(row["route_p99_ms"])
        # the gRPC floor: a do-nothing call costs the server CPU, and less than the master's route
        unary, stream = float(row["grpc_unary_us"]), float(row["grpc_stream_us"])
        assert stream > 0
        assert 0 < unary < float(row["master_cpu_ms_per_route"]) * 1000, row
    assert "## The master's routing capacity" in (tmp_path / "out" / "scale.md").read_text()
    assert list((tmp_path / "var" / "bench-scale").iterdir()) == []  # the masters' folders are removed


@pytest.mark.harness
def test_a_repository_store_is_filled_once_and_restarts_are_timed_warm_and_cold(tmp_path: Path) -> None:
    first = _run(tmp_path, "--curves", "repository", "--records", "10k", "--restarts", "1")
    assert "filling 10k records" in first.stdout
    rows = _rows(tmp_path, "repository")
    assert [(r["records"], r["cache"]) for r in rows] == [("10000", "cold"), ("10000", "warm")]
    for row in rows:
        assert 0 < float(row["restart_s"]) < 60, row
        assert float(row["index_mib"]) >= 0 and float(row["disk_mib"]) > 0.5, row  # 10k records of ~100 B
    again = _run(tmp_path, "--curves", "repository", "--records", "10k", "--restarts", "1")
    assert "filling" not in again.stdout  # the store is kept under the data dir and reused
    assert [r["fill_seconds"] for r in _rows(tmp_path, "repository")] == [r["fill_seconds"] for r in rows]


@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.spark
def test_kd_intervals_are_timed_over_an_empty_and_a_stored_store(tmp_path: Path) -> None:
    _run(tmp_path, "--curves", "kd", "--kd-stored", "2k", "--kd-new", "200", timeout=600)
    rows = _rows(tmp_path, "kd")
    assert [int(r["stored"]) for r in rows] == [0, 2000]
    assert [int(r["new"]) for r in rows] == [200, 200]
    assert all(float(r["interval_s"]) > 0 for r in rows)
    assert float(rows[0]["ratio_to_empty"]) == 1.0


def _provenance() -> dict[str, object]:
    return {"load_avg": 1.0, "finished_at": "2026-01-01T00:00:00+00:00", "machine": "test machine", "commit": "abc1234"}


def _master_row(channels: int, rate: float) -> dict[str, object]:
    return {
        "channels": channels,
        "workers": -(-channels // 16),
        "in_flight": 16,
        "routes_per_s": rate,
        "master_cpu_ms_per_route": 0.4,
        "routes_per_master_cpu_s": 2500,
        "master_cores": 0.9,
        "route_p50_ms": 3.0,
        "route_p99_ms": 9.0,
        "queued": 0,
        "errors": 0,
        **_provenance(),
    }


def _repository_row(records: int, cache: str, restart: float) -> dict[str, object]:
    return {
        "records": records,
        "cache": cache,
        "restart_s": restart,
        "restart_min_s": restart,
        "restart_max_s": restart,
        "index_mib": 1500.0,
        "index_bytes_per_record": 157,
        "disk_mib": 1000.0,
        "fill_seconds": 600,
        **_provenance(),
    }


def _kd_row(stored: int, seconds: float, ratio: float) -> dict[str, object]:
    return {
        "stored": stored,
        "new": 1000,
        "interval_s": seconds,
        "ratio_to_empty": ratio,
        "breakdown": "",
        **_provenance(),
    }
