"""Workers follow the master's plan: an elastic worker starts the engines its part of the plan
names as a backlog builds, and stops them, drained, once they stay idle; every tuple is stored
once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.elastic.helpers import IMAGE, elastic_cluster, engines, gateway, stored
from tests.harness import stop_cleanly, wait_for

pytestmark = pytest.mark.slow


def test_an_elastic_worker_starts_engines_for_a_backlog_and_stops_them_drained(tmp_path: Path) -> None:
    cluster = elastic_cluster(tmp_path)
    cluster.start()
    try:
        cluster.add_worker("w1", engines=(), args=["--elastic", "--cpus", "2"], wait=False)
        with gateway(cluster) as gw:
            futures = [gw.submit(b"x" * 1000, image=IMAGE, attributes={"cost_ms": "150"}) for _ in range(40)]
            wait_for(lambda: engines(cluster, "w1") >= 2, timeout=60, what="engines started for the backlog")
            ids = [future.result(timeout=120) for future in futures]
        wait_for(lambda: len(stored(cluster)) == len(ids), timeout=60, what="every tuple stored")
        counts = stored(cluster)
        assert set(counts) == set(ids) and set(counts.values()) == {1}
        wait_for(lambda: engines(cluster, "w1") == 0, timeout=60, what="idle engines retired and stopped")
        wait_for(lambda: not cluster.engine_pids("w1"), timeout=30, what="the engine processes gone")
        (image,) = [e for e in cluster.status().engines if e.image == IMAGE]
        assert (image.running, image.wanted) == (0, 0)
    finally:
        stop_cleanly(cluster)
