"""provision.yml for real against the OpenStack double (tests/openstack_double.py): the
openstack.cloud modules and openstacksdk make every request they make against a cloud,
over HTTP on loopback. One walk through a cluster's life, as an operator runs it: create,
run again (nothing changes), grow (only the new workers are created), shrink (the
workers beyond the count are drained, then deleted; one whose worker fails to stop, and
a gateway, are kept), tear down (the project holds nothing of the cluster). Every
address the double hands out is a loopback one, so the drain's SSH to a server that
"does not answer" is refused on this machine."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openstack")

import yaml

from tests.ansible.helpers import ANSIBLE_DIR, openstack_modules_env, recap, require_collections, run_playbook
from tests.openstack_double import CLOUD, EXTERNAL_CIDR, OpenStackDouble

pytestmark = pytest.mark.slow

PRIVATE_CIDR = "127.0.100.0/24"
ANY = "0.0.0.0/0"
# (protocol, port_range_min, port_range_max, remote_ip_prefix) of each group's ingress
# rules, as roles/openstack/defaults/main.yml lists them for the private CIDR above
INGRESS = {
    "hio-internal": {
        ("tcp", 22, 22, PRIVATE_CIDR),
        ("tcp", 7000, 7001, PRIVATE_CIDR),
        ("tcp", 7100, 7100, PRIVATE_CIDR),
        ("tcp", 7180, 7180, PRIVATE_CIDR),
        ("tcp", 7300, 7300, PRIVATE_CIDR),
        *(("tcp", port, port, PRIVATE_CIDR) for port in (7080, 7280, 7380, 7480)),  # HTTP endpoints: /metrics
        ("tcp", 7077, 7079, PRIVATE_CIDR),  # the spark group's cluster and KD's driver
        ("tcp", 7090, 7099, PRIVATE_CIDR),  # Spark's block managers
        ("icmp", None, None, PRIVATE_CIDR),
    },
    "hio-master": {("tcp", 7000, 7001, ANY), ("tcp", 22, 22, ANY)},
    "hio-workers": {("tcp", 32768, 60999, PRIVATE_CIDR)},
}
GROUPS_OF_SERVER = {
    "hio-master": ["hio-internal", "hio-master"],
    "hio-repository": ["hio-internal"],
    "hio-worker-1": ["hio-internal", "hio-workers"],
    "hio-worker-2": ["hio-internal", "hio-workers"],
    "hio-worker-3": ["hio-internal", "hio-workers"],
    "hio-worker-4": ["hio-internal", "hio-workers"],
    "hio-gateway-1": ["hio-internal"],
}
# Servers of the same project that are not this cluster's: an elastic master's worker,
# and one named as ours but made by hand (no hio_groups metadata). Never touched.
OTHERS = {"hio-worker-elastic-1": {"hio_cluster": "physics", "hio_worker_id": "elastic-1"}, "hio-worker-9": {}}
# Shrinking from 4 workers to 1, the servers beyond the count: the ones that answer
# (a local connection whose systemctl is the test's), with the exit status of their
# `systemctl stop` (hio-worker-4's worker fails to stop), and hio-worker-3, which does
# not answer (SSH to its loopback address is refused).
ANSWERING = {"hio-worker-2": 0, "hio-worker-4": 1}


@pytest.fixture
def cloud() -> Iterator[OpenStackDouble]:
    with OpenStackDouble(empty=True, boot_seconds=0) as double:
        yield double
        assert double.unknown == [], "openstack.cloud asked the double for something it does not serve"


def answering_server(folder: Path, systemctl_exit: int) -> dict[str, Any]:
    """Host variables of a server that answers: a local connection whose modules find the
    test's ``systemctl`` first, which records what it is asked in ``folder/systemctl.log``,
    stops nothing and exits with ``systemctl_exit``."""
    folder.mkdir(parents=True)
    scripts = {
        "systemctl": f'#!/bin/sh\necho "$@" >> {folder / "systemctl.log"}\nexit {systemctl_exit}\n',
        "python": f'#!/bin/sh\nPATH={folder}:/usr/bin:/bin exec {sys.executable} "$@"\n',
    }
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return {"ansible_connection": "local", "ansible_python_interpreter": str(folder / "python"), "hio_become": False}


class Operator:
    """Runs provision.yml against the double with a test's settings, and keeps the runs."""

    def __init__(self, cloud: OpenStackDouble, tmp: Path) -> None:
        self.cloud, self.tmp = cloud, tmp
        self.inventory_file = tmp / "inventory.yml"
        public_key = tmp / "id_ed25519.pub"
        public_key.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHRlc3Qga2V5IG9mIHRoZSBkb3VibGU operator@test\n")
        here = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        hosts: dict[str, Any] = {"localhost": here}
        hosts |= {name: answering_server(tmp / "servers" / name, status) for name, status in ANSWERING.items()}
        self.hosts = tmp / "hosts.yml"
        self.hosts.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
        self.settings = tmp / "settings.yml"
        self.settings.write_text(
            yaml.safe_dump(
                {
                    "hio_os_cloud": CLOUD,
                    "hio_os_image": "hio-worker-image",
                    "hio_os_private_cidr": PRIVATE_CIDR,
                    "hio_os_public_key_file": str(public_key),
                    "hio_os_inventory_file": str(self.inventory_file),
                    "hio_os_wait_for_ssh": False,
                    "hio_os_workers": 2,
                    "hio_os_gateways": 1,
                    "hio_os_timeout": 120,
                }
            )
        )
        self.env = openstack_modules_env(tmp) | {
            "OS_CLIENT_CONFIG_FILE": str(cloud.clouds_yaml(tmp)),
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp / "ssh-control"),
        }
        self.seconds: dict[str, float] = {}

    def provision(self, step: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """One run of provision.yml (``extra``: ``-e`` items; ``check``: fail the test if the
        run fails); its duration is kept under ``step``."""
        args = ["-e", f"@{self.settings}"] + [item for value in extra for item in ("-e", value)]
        started = time.monotonic()
        proc = run_playbook(ANSIBLE_DIR / "provision.yml", self.hosts, self.tmp, *args, env=self.env, check=check)
        self.seconds[step] = round(time.monotonic() - started, 1)
        (self.tmp / f"{step}.out").write_text(proc.stdout)  # kept with the test's tmp_path
        return proc

    def systemctl_calls(self, name: str) -> str:
        log = self.tmp / "servers" / name / "systemctl.log"
        return log.read_text() if log.exists() else ""

    def inventory(self) -> dict[str, Any]:
        """The generated inventory: group -> host names, and each host's variables."""
        data = yaml.safe_load(self.inventory_file.read_text())["all"]
        groups = {name: sorted(group["hosts"] or {}) for name, group in data["children"].items()}
        return {"groups": groups, "hosts": data["hosts"]}


def changes_during(cloud: OpenStackDouble, since: int) -> list[str]:
    """The requests that change the cloud (not a login) made since request number ``since``."""
    with cloud.lock:
        made = cloud.requests[since:]
    return [f"{r.method} {r.path}" for r in made if r.method != "GET" and not r.path.startswith("/identity/")]


def fixed_address(cloud: OpenStackDouble, name: str) -> str:
    server = cloud.server_named(name)
    [port] = [p for p in cloud.ports if p["device_id"] == server["id"]]
    [fixed] = port["fixed_ips"]
    return str(fixed["ip_address"])


def check_the_cluster(
    cloud: OpenStackDouble, operator: Operator, workers: int, gateways: int = 1, kept: tuple[str, ...] = ()
) -> None:
    """Everything provision.yml makes is in the cloud, and the inventory names the servers
    counted (``kept``: servers of the cluster beyond the counts that it keeps)."""
    worker_names = [f"hio-worker-{i}" for i in range(1, workers + 1)]
    gateway_names = [f"hio-gateway-{i}" for i in range(1, gateways + 1)]
    names = ["hio-master", "hio-repository", *worker_names, *gateway_names]
    holdings = cloud.holdings()
    assert holdings["servers"] == sorted([*names, *kept, *OTHERS])
    assert holdings["networks"] == ["hio-net"] and holdings["subnets"] == ["hio-net-subnet"]
    assert holdings["routers"] == ["hio-net-router"] and holdings["keypairs"] == ["hio"]

    [subnet] = [s for s in cloud.subnets if s["name"] == "hio-net-subnet"]
    assert (subnet["cidr"], subnet["dns_nameservers"]) == (PRIVATE_CIDR, ["1.1.1.1", "8.8.8.8"])
    [router] = cloud.routers
    [public] = [n for n in cloud.networks if n["router:external"]]
    assert router["external_gateway_info"]["network_id"] == public["id"]
    [interface] = [p for p in cloud.ports if p["device_id"] == router["id"]]
    assert interface["fixed_ips"] == [{"subnet_id": subnet["id"], "ip_address": subnet["gateway_ip"]}]

    for group in cloud.security_groups:
        rules = [r for r in cloud.security_group_rules if r["security_group_id"] == group["id"]]
        ingress = {
            (r["protocol"], r["port_range_min"], r["port_range_max"], r["remote_ip_prefix"])
            for r in rules
            if r["direction"] == "ingress"
        }
        assert ingress == INGRESS[group["name"]], group["name"]
        assert sorted(r["ethertype"] for r in rules if r["direction"] == "egress") == ["IPv4", "IPv6"]

    for name in [*names, *kept]:
        server = cloud.server_named(name)
        assert server["status"] == "ACTIVE" and server["key_name"] == "hio"
        assert sorted(g["name"] for g in server["security_groups"]) == GROUPS_OF_SERVER[name]
        assert ipaddress.ip_address(fixed_address(cloud, name)) in ipaddress.ip_network(PRIVATE_CIDR)

    # one floating IP, the master's: the SSH jump host
    [floating] = cloud.floating_ips
    assert floating["fixed_ip_address"] == fixed_address(cloud, "hio-master")
    assert ipaddress.ip_address(floating["floating_ip_address"]) in ipaddress.ip_network(EXTERNAL_CIDR)

    inventory = operator.inventory()
    assert inventory["groups"] == {
        "master": ["hio-master"],
        "repository": ["hio-repository"],
        "workers": worker_names,
        "gateways": gateway_names,
        "kd": ["hio-repository"],
    }
    assert sorted(inventory["hosts"]) == sorted(names)
    jump = floating["floating_ip_address"]
    assert inventory["hosts"]["hio-master"]["ansible_host"] == jump
    for name in names:
        host = inventory["hosts"][name]
        assert host["hio_private_ip"] == fixed_address(cloud, name)
        if name != "hio-master":
            assert host["ansible_host"] == host["hio_private_ip"]
            assert host["ansible_ssh_common_args"] == f"-o ProxyJump=ubuntu@{jump}"


def test_provision_creates_refreshes_grows_shrinks_and_tears_down_a_cluster(
    cloud: OpenStackDouble, tmp_path: Path
) -> None:
    require_collections()
    operator = Operator(cloud, tmp_path)
    for name, metadata in OTHERS.items():
        cloud.add_server(name, metadata)

    # create: 2 workers, 1 gateway
    operator.provision("create")
    check_the_cluster(cloud, operator, workers=2)

    # again: nothing changes, nothing is asked of the cloud but to look
    since = len(cloud.requests)
    again = operator.provision("again")
    assert recap(again.stdout, "localhost")["changed"] == 0
    assert changes_during(cloud, since) == []

    # grow to 4 workers: the two missing servers asked for, nothing deleted
    since = len(cloud.requests)
    operator.provision("grow", "hio_os_workers=4")
    assert [c for c in changes_during(cloud, since) if "/servers" in c] == ["POST /compute/v2.1/servers"] * 2
    asked = cloud.called("POST", r"/compute/v2\.1/servers$")[-2:]
    assert sorted(r.body["server"]["name"] for r in asked) == ["hio-worker-3", "hio-worker-4"]
    check_the_cluster(cloud, operator, workers=4)

    # shrink to 1 worker and no gateway: each worker beyond the count is drained, then
    # deleted, unless its worker fails to stop (hio-worker-4: kept); the gateway is kept
    # (its spool may hold undelivered tuples); the run fails, naming what it kept
    drained = {cloud.server_named(f"hio-worker-{i}")["id"] for i in (2, 3)}
    since = len(cloud.requests)
    shrink = operator.provision("shrink", "hio_os_workers=1", "hio_os_gateways=0", check=False)
    out = shrink.stdout
    assert shrink.returncode == 2, out[-3000:]
    deleted = {c.rsplit("/", 1)[1] for c in changes_during(cloud, since) if c.startswith("DELETE /compute")}
    assert deleted == drained
    assert operator.systemctl_calls("hio-worker-2") == operator.systemctl_calls("hio-worker-4") == "stop hio-worker\n"
    assert re.search(r"fatal: \[hio-worker-3\]: UNREACHABLE!.*\n.*ignoring", out), out[-3000:]
    assert "fatal: [hio-worker-4]: FAILED!" in out
    assert "Kept, beyond hio_os_gateways: hio-gateway-1." in out
    assert out.index("TASK [Stop the worker, which drains first]") < out.index("TASK [openstack : Delete the servers")
    assert recap(out, "hio-worker-2")["changed"] == 1 and recap(out, "hio-worker-4")["failed"] == 1
    check_the_cluster(cloud, operator, workers=1, gateways=0, kept=("hio-worker-4", "hio-gateway-1"))

    # tear down, with hio-worker-4 and the gateway beyond the counts: they are found all the
    # same (name and metadata), and nothing of the cluster is left, not even a port; the key
    # pair is the operator's
    operator.provision("teardown", "hio_os_state=absent", "hio_os_gateways=0")
    assert cloud.holdings() == {
        "servers": sorted(OTHERS),
        "networks": [],
        "subnets": [],
        "routers": [],
        "ports": [],
        "security_groups": [],
        "floating_ips": [],
        "keypairs": ["hio"],
    }
    assert not operator.inventory_file.exists()
    print(f"\nprovision.yml run seconds: {operator.seconds}")
