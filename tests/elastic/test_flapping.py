"""No flapping: under a steady load an image's engines settle, and no scale-down is followed by
a scale-up of the same image within the cooldown. Also what an operator sees of it (hio scale,
hio status --json)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.elastic.helpers import IMAGE, elastic_cluster, gateway, hio_scale, scaling, stored
from tests.harness import hio_env, stop_cleanly, wait_for

pytestmark = pytest.mark.slow

COOLDOWN = 3.0


def test_a_steady_load_never_scales_an_image_down_then_up_within_the_cooldown(tmp_path: Path) -> None:
    cluster = elastic_cluster(tmp_path, ["--cooldown-seconds", str(COOLDOWN)])
    cluster.start()
    try:
        cluster.add_worker("w1", engines=(), args=["--elastic", "--cpus", "4"], wait=False)
        hio_scale(cluster, "--pin", f"{IMAGE}=4")  # more engines than the load needs
        wait_for(lambda: _running(cluster) == 4, timeout=90, what="four engines serving", interval=0.2)
        out = hio_scale(cluster, "--unpin", IMAGE)  # the predictor goes on from four
        assert "unpinned at 4" in out
        began = time.time()
        sent: list[int] = []
        with gateway(cluster) as gw:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # steady: 4 tuples a second, 50 ms of CPU each
                sent.append(gw.send(b"x" * 500, image=IMAGE, attributes={"cost_ms": "50"}, timeout=60))
                time.sleep(0.25)
        wait_for(lambda: len(stored(cluster)) >= len(sent), timeout=60, what="every tuple stored")
        changes = [
            d for d in scaling(cluster).decisions if d.subject == IMAGE and d.unix >= began and d.action[0] in "+-"
        ]
        downs = [d for d in changes if d.action.startswith("-")]
        assert downs, "the surplus engines were given back while the load ran"
        for before, after in itertools.pairwise(changes):
            if before.action.startswith("-") and after.action.startswith("+"):
                assert after.unix - before.unix >= COOLDOWN, f"flapped: {before} then {after}"
        assert 1 <= _running(cluster) < 4

        # What an operator sees.
        out = hio_scale(cluster)
        assert "scaling elastic, provisioner none" in out and "w1" in out and "idle for" in out
        status = subprocess.run(
            [sys.executable, "-m", "hio.cli", "status", "--json", "--master-address", cluster.master],
            env=hio_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        (engines,) = [e for e in json.loads(status.stdout)["engines"] if e["image"] == IMAGE]
        assert engines["wanted"] >= 1 and engines["running"] >= 1 and engines["cpuShare"] > 0
    finally:
        stop_cleanly(cluster)


def _running(cluster) -> int:  # type: ignore[no-untyped-def]
    return sum(e.running for e in cluster.status().engines if e.image == IMAGE)
