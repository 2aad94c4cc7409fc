"""Profiling end to end: a worker reports each engine's CPU time with its heartbeat, the
engines report each tuple's processing time, and the master's status shows both per image."""

from __future__ import annotations

from pathlib import Path

import pytest

from hio.gateway import Gateway
from tests.harness import local_cluster, stop_cleanly, wait_for

pytestmark = pytest.mark.slow


def test_status_shows_the_cpu_share_and_processing_time_of_a_busy_image(tmp_path: Path) -> None:
    cluster = local_cluster(tmp_path, workers={"w1": ["hio/synthetic=1"]}, master_args=["--profile-seconds", "10"])
    cluster.start()
    try:
        with Gateway(
            master_address=cluster.master,
            repository_address=cluster.repository,
            data_dir=str(tmp_path / "gw"),
            progress=False,
        ) as gw:

            def busy_and_measured() -> object:
                futures = [
                    gw.submit(b"x" * 1000, image="hio/synthetic", attributes={"cost_ms": "100"}) for _ in range(10)
                ]
                for future in futures:
                    future.result(timeout=60)
                (engines,) = [e for e in cluster.status().engines if e.image == "hio/synthetic"]
                return engines if engines.cpu_share >= 0.3 else None

            engines = wait_for(busy_and_measured, timeout=90, interval=0, what="a CPU share of at least 0.3 cores")
        assert engines.running == 1 and engines.wanted == 1
        assert engines.seconds_per_tuple >= 0.09  # each tuple burnt 100 ms of CPU in process()
        assert engines.tuples_per_second > 0
    finally:
        stop_cleanly(cluster)
