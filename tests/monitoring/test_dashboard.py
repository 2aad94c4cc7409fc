"""The Grafana dashboard (ansible/roles/monitoring/files/hio-dashboard.json): it parses as
an importable dashboard whose data source is a variable, its panels lie on Grafana's grid
without overlapping, Prometheus' parser reads every expression, and the expressions use
only metrics the roles export, covering what an operator watches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.monitoring.promql import DASHBOARD, check_expressions, documented_metrics, names_used, problems

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's own variables, as Prometheus would see them once Grafana replaced them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$image": ".*"}


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def expressions() -> list[str]:
    return [target["expr"] for panel in panels() for target in panel["targets"]]


def substituted(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def test_the_dashboard_is_importable_with_its_data_source_a_variable() -> None:
    data = dashboard()
    assert data["uid"] == "hio-cluster" and data["title"] == "HarmonicIO"
    assert "id" not in data and "__inputs" not in data, "an import or a provisioned file sets these itself"
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["image"]["datasource"] == DATASOURCE
    for panel in panels():
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]
        assert panel["description"], panel["title"]


def test_panels_lie_on_the_grid_without_overlapping() -> None:
    everything = dashboard()["panels"]
    assert len({p["id"] for p in everything}) == len(everything)
    taken: set[tuple[int, int]] = set()
    for panel in everything:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_prometheus_reads_every_expression(tmp_path: Path) -> None:
    output = check_expressions([substituted(e) for e in expressions()], tmp_path)
    assert f"SUCCESS: {len(expressions())} rules found" in output


def test_the_expressions_use_only_metrics_the_roles_export() -> None:
    metrics = documented_metrics()
    found = [f"{expr}: {p}" for expr in expressions() for p in problems(expr, metrics)]
    found += [
        p for v in dashboard()["templating"]["list"] if "definition" in v for p in problems(v["definition"], metrics)
    ]
    assert not found, "\n".join(found)


def test_the_dashboard_shows_what_an_operator_watches() -> None:
    used = {name for expr in expressions() for name in names_used(expr)}
    watched = {
        "hio_master_tuples_done_total",  # throughput
        "hio_master_tuple_latency_seconds_bucket",  # latency to stored
        "hio_master_queue_tuples",  # queue length per image
        "hio_master_queue_bytes",
        "hio_master_channels",  # channels by state
        "hio_master_workers",
        "hio_master_engines_wanted",  # the elastic plan
        "hio_master_engines_running",
        "hio_master_workers_wanted",
        "hio_gateway_spooled_bytes",  # the spool
        "hio_gateway_delivery_attempts_total",
        "hio_repository_records",
        "hio_repository_fsync_seconds_bucket",
        "hio_repository_consumer_lag_records",
        "hio_kd_interval_seconds_sum",
        "hio_kd_lag_records",
        "hio_master_queue_sync_failed",  # what refuses tuples after a failed fsync
        "hio_gateway_spool_sync_failed",
        "hio_repository_sync_failed",
    }
    assert watched <= used, f"not on the dashboard: {watched - used}"
