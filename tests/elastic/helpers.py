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


def engines(cluster: LocalCluster, worker_id: str = "") -> int:
    """Channels the master knows (of ``worker_id``, if given), whatever their state."""
    return sum(len(w.channels) for w in cluster.status().workers if not worker_id or w.worker_id == worker_id)
