"""The metrics the alert rules and the dashboard use are exported by real roles: a cluster
of `hio` processes (master, repository, a worker, a gateway daemon) scraped over HTTP, its
families read as Prometheus reads them."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import free_port, local_cluster, stop_cleanly
from tests.monitoring.promql import DASHBOARD, alert_rules, documented_metrics, names_used

pytestmark = pytest.mark.slow

#: Shown only by a role this cluster does not run: KD (Spark; tests/e2e/test_metrics.py,
#: marked spark) and an elastic master's plan (tests/master/test_metrics.py).
ELSEWHERE = ("hio_kd_", "hio_master_workers_wanted", "hio_master_workers_present")


def exported(address: str) -> set[str]:
    """The names of every sample a role's /metrics may carry, empty families included."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    names = set()
    for family in families:
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        else:
            names.add(family.name)
    return names


def used() -> set[str]:
    exprs = [str(rule["expr"]) for rule in alert_rules()]
    exprs += [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    return {name for expr in exprs for name in names_used(expr)}


def test_every_metric_the_rules_and_the_dashboard_use_is_exported_by_a_running_cluster(tmp_path: Path) -> None:
    cluster = local_cluster(tmp_path, workers={"w1": ["hio/synthetic=1"]})
    try:
        cluster.start()
        ingest = f"127.0.0.1:{free_port()}"
        cluster.add("gateway", ["--ingest-listen", ingest, "--source", "lab"], health=ingest)
        assert set(cluster.http) == {"master", "repository", "w1", "gateway"}
        shown = {"up"}.union(*(exported(address) for address in cluster.http.values()))
    finally:
        stop_cleanly(cluster)
    elsewhere = {name for name in documented_metrics() if name.startswith(ELSEWHERE)}
    assert not used() - shown - elsewhere, "used but exported by no role"
    assert not set(documented_metrics()) - shown - elsewhere, "documented but exported by no role"
    assert used() & elsewhere <= set(documented_metrics())
