"""Elastic clusters for tests: a master with scaling = elastic and short timings, gateways in
the test process, and the accounting of what was stored."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hio.cluster import LocalCluster
from hio.gateway import Gateway
from hio.proto import master_pb2, master_pb2_grpc
from hio.transport.net import create_channel
from hio.up import read_features
from tests.harness import local_cluster

IMAGE = "hio/synthetic"

# Timings short enough for a test, long enough for a loaded two-core machine.
FAST = [
    "--scaling", "elastic",
    "--predict-interval", "0.5",
    "--packing-interval", "0.5",
    "--cooldown-seconds", "2",
    "--engine-idle-seconds", "4",
    "--heartbeat-interval", "0.5",
    "--expiry-seconds", "4",
]  # fmt: skip


def elastic_cluster(root: Path, master_args: Sequence[str] = (), **options: Any) -> LocalCluster:
    """A repository and an elastic master (no workers: add them, or let the provisioner)."""
    return local_cluster(root, master_args=[*FAST, *master_args], **options)


def gateway(cluster: LocalCluster, name: str = "gw") -> Gateway:
    return Gateway(
        master_address=cluster.master,
        repository_address=cluster.repository,
        data_dir=str(cluster.root / name),
        source=name,
        progress=False,
    )


def scaling(cluster: LocalCluster) -> Any:
    """The master's GetScaling."""
    with create_channel(cluster.master, cluster.settings) as channel:
        return master_pb2_grpc.MasterStub(channel).GetScaling(master_pb2.GetScalingRequest(), timeout=10).scaling


def stored(cluster: LocalCluster) -> Counter[int]:
    """How many feature records the repository holds per tuple id."""
    return Counter(record.tuple_id for record in read_features(cluster.settings))


LOCAL = [
    "--provisioner", "local",
    "--provisioner-options", "runtime=process",
    "--provisioner-options", "worker_args=--grace-seconds 2",
    "--worker-cpus", "1",
    "--worker-grace-seconds", "2",
]  # fmt: skip


def live_workers(cluster: LocalCluster) -> list[str]:
    """Ids of the workers the master sees live (heartbeating)."""
    try:
        status = cluster.status(timeout=5)
    except Exception:  # noqa: BLE001 - a master restarting answers nothing: no workers seen
        return []
    return sorted(w.worker_id for w in status.workers if w.last_heartbeat_age_seconds < 3)


def hio_scale(cluster: LocalCluster, *args: str) -> str:
    """Run `hio scale ARGS` against the cluster's master; its output (AssertionError on failure)."""
    import subprocess
    import sys

    from tests.harness import hio_env

    done = subprocess.run(
        [sys.executable, "-m", "hio.cli", "scale", "--master-address", cluster.master, *args],
        env=hio_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def record_pid(root: Path, worker_id: str) -> int:
    """The pid the local provisioner recorded for a worker."""
    import json

    return int(json.loads((root / "master" / "local-workers" / f"{worker_id}.json").read_text())["pid"])
