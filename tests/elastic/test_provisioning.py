"""Workers come and go with the load through the local provisioner, a restarted master adopts
the workers it asked for (registered or still starting), and no worker outlives its cluster."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from benchmarks.measure import worker_processes
from hio.process.procs import children
from tests.elastic.helpers import (
    IMAGE,
    LOCAL,
    elastic_cluster,
    gateway,
    hio_scale,
    live_workers,
    scaling,
    stored,
)
from tests.harness import stop_cleanly, wait_for

pytestmark = pytest.mark.slow


def test_workers_are_added_for_a_backlog_and_given_back_when_idle(tmp_path: Path) -> None:
    cluster = elastic_cluster(tmp_path, [*LOCAL, "--max-workers", "3"])
    cluster.start()
    try:
        wait_for(lambda: len(live_workers(cluster)) == 1, timeout=60, what="the headroom worker", interval=0.3)
        with gateway(cluster) as gw:
            futures = [gw.submit(b"x" * 1000, image=IMAGE, attributes={"cost_ms": "200"}) for _ in range(60)]
            wait_for(
                lambda: len(live_workers(cluster)) >= 2,
                timeout=90,
                what="a second worker for the backlog",
                interval=0.3,
            )
            ids = [future.result(timeout=180) for future in futures]
        wait_for(lambda: len(stored(cluster)) == len(ids), timeout=60, what="every tuple stored")
        assert set(stored(cluster).values()) == {1}
        wait_for(lambda: len(live_workers(cluster)) == 1, timeout=90, what="idle workers given back", interval=0.3)
        wait_for(lambda: len(worker_processes(tmp_path)) == 1, timeout=60, what="their processes gone")
        (headroom,) = worker_processes(tmp_path).values()
        wait_for(lambda: not children(headroom), timeout=60, what="the idle engines stopped")
    finally:
        stop_cleanly(cluster)
    assert worker_processes(tmp_path) == {}  # the cluster stopped its provisioned workers


def test_a_restarted_master_adopts_the_workers_it_asked_for_registered_or_not(tmp_path: Path) -> None:
    cluster = elastic_cluster(tmp_path, [*LOCAL, "--min-workers", "2"])
    cluster.start()
    records = tmp_path / "master" / "local-workers"
    try:
        # Killed as soon as it has asked for two workers: they may not have registered yet.
        wait_for(lambda: len(list(records.glob("*.json"))) == 2, timeout=60, what="two workers asked for")
        cluster.procs["master"].kill()
        asked = sorted(json.loads(p.read_text())["worker_id"] for p in records.glob("*.json"))
        pids = worker_processes(tmp_path)
        assert len(pids) == 2
        cluster.restart("master")
        wait_for(lambda: live_workers(cluster) == asked, timeout=60, what="the same two workers serving")
        state = json.loads((tmp_path / "master" / "scaling.json").read_text())
        assert sorted(state["provisioned"]) == asked
        assert worker_processes(tmp_path) == pids  # adopted: none started again, none leaked

        # The same plan after a restart: the engines it placed keep running, none is moved.
        hio_scale(cluster, "--pin", f"{IMAGE}=3")
        wait_for(lambda: len(channels(cluster)) == 3, timeout=90, what="three engines serving")
        before, plan = channels(cluster), scaling(cluster)
        cluster.procs["master"].kill()
        cluster.restart("master")
        wait_for(lambda: len(channels(cluster)) == 3, timeout=60, what="the engines registered again")
        after = scaling(cluster)
        assert channels(cluster) == before
        assert [(w.worker_id, list(w.planned)) for w in after.workers] == [
            (w.worker_id, list(w.planned)) for w in plan.workers
        ]
        (image,) = [i for i in after.images if i.image == IMAGE]
        assert image.pinned and image.wanted == 3

        # A worker that dies while the master is down is forgotten and replaced.
        cluster.procs["master"].kill()
        os.kill(pids[asked[0]], signal.SIGKILL)
        cluster.restart("master")
        wait_for(lambda: len(live_workers(cluster)) == 2, timeout=60, what="two workers again")
        assert asked[0] not in live_workers(cluster)
        wait_for(lambda: len(worker_processes(tmp_path)) == 2, timeout=30, what="no leftover process")
    finally:
        stop_cleanly(cluster)
    assert worker_processes(tmp_path) == {}


def channels(cluster) -> list[str]:  # type: ignore[no-untyped-def]
    """Ids of the channels serving (FREE at the master)."""
    from hio.proto import master_pb2

    try:
        status = cluster.status(timeout=5)
    except Exception:  # noqa: BLE001 - a master restarting: nothing serves yet
        return []
    return sorted(c.channel_id for w in status.workers for c in w.channels if c.state == master_pb2.FREE)
