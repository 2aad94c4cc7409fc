"""The elastic loop with the openstack driver, end to end: a real ``hio master`` asks the
HTTP double of Keystone, Nova, Glance and Neutron (tests/openstack_double.py) for
worker servers under a backlog, and gives back the ones that will not serve: a server
that is ACTIVE but whose worker never registers (after ``provision_timeout``), and one
Nova puts in ERROR (at the next poll, with Nova's fault in the log). No worker boots:
the double's servers are records that change status when the test says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("openstack")

from tests.elastic.helpers import IMAGE, elastic_cluster, gateway, scaling
from tests.harness import stop_cleanly, wait_for
from tests.openstack_double import CLOUD, OpenStackDouble

PROVISION_TIMEOUT = 4.0
FAULT = "No valid host was found. There are not enough hosts available."


@pytest.fixture
def cloud() -> Iterator[OpenStackDouble]:
    with OpenStackDouble() as double:
        yield double
        assert double.unknown == [], "openstacksdk asked the double for something it does not serve"


def server_ids(cloud: OpenStackDouble) -> dict[str, str]:
    """Server name -> id, of the servers the double has now."""
    with cloud.lock:
        return {server["name"]: server_id for server_id, server in cloud.servers.items()}


def test_servers_that_do_not_become_workers_are_deleted(cloud: OpenStackDouble, tmp_path: Path) -> None:
    clouds = cloud.clouds_yaml(tmp_path)
    cluster = elastic_cluster(
        tmp_path,
        [
            "--provisioner", "openstack",
            "--provisioner-options", f"cloud={CLOUD}",
            "--provisioner-options", f"clouds_file={clouds}",
            "--provisioner-options", "image=hio-worker-image",
            "--provisioner-options", "cluster=e2e",
            # where servers would reach the master and the repository (no server boots here)
            "--advertise-address", "192.0.2.10:7000",
            "--provisioner-options", "worker_settings=repository_address=192.0.2.11:7100",
            "--max-workers", "2",
            "--provision-timeout", str(PROVISION_TIMEOUT),
            "--log-level", "info",
        ],
    )  # fmt: skip
    cluster.start()
    master_log = cluster.procs["master"].log_path
    try:
        # The headroom worker: a server in BUILD, which the test boots at once.
        first = wait_for(lambda: server_ids(cloud).get("hio-worker-elastic-1"), what="the headroom server")
        cloud.set_status(first, "ACTIVE")

        # A backlog and no engine: one engine wanted, a worker for it, and the headroom.
        with gateway(cluster) as gw:
            for future in [gw.submit(b"x" * 100, image=IMAGE) for _ in range(5)]:
                future.result(timeout=30)  # queued at the master
        second = wait_for(lambda: server_ids(cloud).get("hio-worker-elastic-2"), what="a server for the backlog")
        cloud.fail(second, FAULT)

        # ERROR: deleted at the next poll, with Nova's words in the log.
        wait_for(lambda: second not in cloud.servers, timeout=15, what="the server in ERROR deleted")
        wait_for(lambda: FAULT in master_log.read_text(), timeout=5, what="the fault in the master's log")

        # ACTIVE, and no worker registers: deleted once provision_timeout has passed.
        wait_for(
            lambda: first not in cloud.servers,
            timeout=PROVISION_TIMEOUT + 15,
            what="the ACTIVE server whose worker never registered deleted",
        )
        decisions = {(d.subject, d.action): d.reason for d in scaling(cluster).decisions}
        assert decisions[("elastic-2", "drop worker")].startswith(f"failed: server {second} ERROR: {FAULT}")
        assert decisions[("elastic-1", "drop worker")] == (
            f"not registered for more than {PROVISION_TIMEOUT:g} s (running: server {first} ACTIVE)"
        )
        deleted = sorted(r.path.rsplit("/", 1)[1] for r in cloud.called("DELETE", r"/servers/"))
        assert deleted == sorted([first, second])  # those two, once each
        # The loop goes on: the workers it still wants are asked for again.
        wait_for(lambda: "hio-worker-elastic-3" in server_ids(cloud), timeout=15, what="a replacement asked for")
    finally:
        stop_cleanly(cluster)
