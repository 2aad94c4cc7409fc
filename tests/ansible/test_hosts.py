"""site.yml for real, over SSH, onto hosts that boot systemd (tests/ansible/hosts.py): the
master, the repository, KD and the gateway on one host, a worker on another, each role a systemd
service from its unit, with tokens and mutual TLS, everything installed from the wheelhouse (the
hosts reach no package index). Tuples dropped into the gateway's watched folder are processed on
the worker host and stored once; a second run changes nothing; a second worker host added to the
inventory and deployed with the documented command registers and takes tuples beside the first.

Two hosts, then three, not one per role: each host costs every task of every run a module call
on two shared cores. The roles on the first host reach each other at its private address, as they
would across hosts, and what the test proves crosses hosts: the gateway streams to the engines on
the worker hosts, which store into the repository on the first."""

from __future__ import annotations

import collections
import dataclasses
import io
import re
import shlex
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from hio.proto import features_pb2, master_pb2, master_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.net import create_channel
from hio.up import read_features
from hio.worker.pipelines.samples import SimulationSize, generate_microscopy, generate_simulation
from tests.ansible.helpers import (
    ANSIBLE_DIR,
    REPO,
    build_wheel,
    recap,
    require_collections,
    run_playbook,
    write_inventory,
)
from tests.ansible.hosts import (
    Hosts,
    HostsUnavailable,
    docker_client,
    ensure_image,
    made_by,
    remove_stale,
    require_tools,
)
from tests.harness import wait_for, wait_names_stored
from tests.reaper import kill_a_run

pytestmark = [pytest.mark.slow, pytest.mark.docker]

SITE = ANSIBLE_DIR / "site.yml"
WHEELHOUSE = REPO / "wheelhouse"
# Inventory group -> hosts: the roles that are one each share the first host.
CORE = "hio-core"
GROUPS = {
    "master": [CORE],
    "repository": [CORE],
    "kd": [CORE],
    "workers": ["hio-worker-1"],
    "gateways": [CORE],
}
NEW_WORKER = "hio-worker-2"
ENGINES = ["hio/microscopy=1", "hio/simulation=1"]
INCOMING = "/var/lib/hio/incoming"  # the gateway's watched folder (hio_gateway_watch's default)
SCALE_OUT = re.compile(r"ansible-playbook -i ansible/inventory\.yml ansible/site\.yml --limit '([^']+)'")


@dataclass
class Run:
    """One ansible-playbook run: what it was, how long it took, each host's recap."""

    what: str
    seconds: float
    recaps: dict[str, dict[str, int]]

    def line(self) -> str:
        changed = ", ".join(f"{host} {counts['changed']}" for host, counts in self.recaps.items())
        return f"{self.what}: {self.seconds:.0f} s, changed: {changed}"


@dataclass
class Cluster:
    """The hosts, the inventory site.yml deploys them from, and what was sent."""

    hosts: Hosts
    tmp: Path
    groups: dict[str, list[str]]
    common_vars: dict[str, object]
    runs: list[Run] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    last_output: str = ""  # the last run's output, for failure messages

    @property
    def inventory(self) -> Path:
        return self.tmp / "inventory.yml"

    def write_inventory(self) -> None:
        names = sorted({host for hosts in self.groups.values() for host in hosts})
        host_vars = {
            name: {"ansible_host": self.hosts.addresses[name], "hio_private_ip": self.hosts.addresses[name]}
            for name in names
        }
        write_inventory(self.inventory, self.groups, host_vars, dict(self.common_vars))

    def deploy(self, what: str, *args: str) -> Run:
        """``ansible-playbook -i <inventory> ansible/site.yml ARGS``, as an operator runs it."""
        self.write_inventory()
        start = time.monotonic()
        proc = run_playbook(
            SITE,
            self.inventory,
            self.tmp,
            *args,
            timeout=1200,
            env={"ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.hosts.dir / "cp")},
        )
        seconds = time.monotonic() - start
        played = [host for host in self.hosts.addresses if f"\n{host} " in proc.stdout.split("PLAY RECAP", 1)[1]]
        run = Run(what, seconds, {host: recap(proc.stdout, host) for host in played})
        for host, counts in run.recaps.items():
            assert counts["failed"] == 0 and counts["unreachable"] == 0, f"{host}: {counts}\n{proc.stdout[-6000:]}"
        self.runs.append(run)
        print(f"\n{run.line()}", flush=True)
        self.last_output = proc.stdout
        return run

    def credentials(self) -> Path:
        return Path(str(self.common_vars["hio_credentials_dir"]))

    def client_settings(self, address: str, token: bool = True) -> ClusterSettings:
        """How this machine reaches a role as an operator: the admin token, the cluster's CA,
        and (mutual TLS) a certificate the CA signed: the master host's."""
        tls = self.credentials() / "tls"
        return ClusterSettings(
            master_address=address,
            repository_address=address,
            token_file=str(self.credentials() / "tokens" / "admin") if token else "",
            tls_ca=str(tls / "ca.crt"),
            tls_cert=str(tls / f"{CORE}.crt"),
            tls_key=str(tls / f"{CORE}.key"),
        )

    def status(self) -> master_pb2.GetStatusResponse:
        """``sudo hio status --json`` on the master host (its [status] section presents the admin token)."""
        out = self.hosts.ssh(CORE, "sudo hio status --json", timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr + self.hosts.journal(CORE, "hio-master")
        return json_format.Parse(out.stdout, master_pb2.GetStatusResponse())

    def serving_workers(self) -> set[str]:
        """Workers the master lists with every engine up (FREE or busy)."""
        return {
            worker.worker_id
            for worker in self.status().workers
            if len(worker.channels) == len(ENGINES)
            and all(channel.state == master_pb2.FREE for channel in worker.channels)
        }

    def records(self) -> list[features_pb2.FeatureRecord]:
        address = f"{self.hosts.addresses[CORE]}:7100"
        return read_features(self.client_settings(address))

    def drop(self, files: list[Path]) -> None:
        """Put files into the gateway host's watched folder over SSH, each there whole at once
        (written into a hidden folder beside it, which the watch skips, then renamed)."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for path in files:
                tar.add(path, arcname=path.name)
        upload = f"{INCOMING}/.upload"
        script = f"mkdir -p {upload} && tar -x -C {upload} && mv {upload}/* {INCOMING}/"
        out = self.hosts.ssh(CORE, f"sudo -u hio sh -c {shlex.quote(script)}", stdin=buffer.getvalue())
        assert out.returncode == 0, out.stdout + out.stderr
        self.dropped += [path.name for path in files]

    def wait_stored(self, timeout: float = 120.0) -> list[features_pb2.FeatureRecord]:
        """Every file dropped so far is stored once, under a tuple id of its own; the records."""
        records = wait_names_stored(
            self.records,
            set(self.dropped),
            lambda: (
                self.hosts.journal(CORE, "hio-gateway")
                + "".join(self.hosts.journal(w, "hio-worker", 20) for w in self.groups["workers"])
            ),
            timeout=timeout,
            interval=1.0,
        )
        names = collections.Counter(r.meta.name for r in records)
        assert not {name: n for name, n in names.items() if n > 1}, f"stored more than once: {names}"
        assert len({r.tuple_id for r in records}) == len(records) == len(self.dropped)
        return records


def worker_of(record: features_pb2.FeatureRecord) -> str:
    """The worker whose engine stored ``record`` (channel ids are ``<worker id>/<n>``)."""
    return record.engine.rpartition("/")[0]


def samples(root: Path, tag: str, simulations: int, images: int) -> list[Path]:
    """Small real tuples: Brusselator realizations and microscope images, named apart by ``tag``."""
    files = generate_simulation(root / tag / "sim", simulations, size=SimulationSize(timepoints=2000))
    files += generate_microscopy(root / tag / "img", images, size=256)
    renamed = []
    for path in files:
        target = path.with_name(f"{tag}-{path.name}")
        path.rename(target)
        renamed.append(target)
    return renamed


def documented_limit() -> str:
    """The scale-out command's --limit, the same in site.yml's header and docs/deploy.md."""
    in_site = SCALE_OUT.findall(SITE.read_text())
    in_docs = SCALE_OUT.findall((REPO / "docs" / "deploy.md").read_text())
    assert in_site and in_docs, "the scale-out command is in site.yml's header and docs/deploy.md"
    assert set(in_site) == set(in_docs) and len(set(in_site)) == 1, (in_site, in_docs)
    return in_site[0]


@pytest.fixture(scope="module")
def host_image() -> tuple[Any, str]:
    """A Docker client and the host image, what killed runs left removed; or the tests skip."""
    try:
        require_tools()
        client = docker_client()
        remove_stale(client)
        return client, ensure_image(client)
    except HostsUnavailable as exc:
        pytest.skip(f"no hosts for site.yml here: {exc}")


@pytest.fixture(scope="module")
def cluster(host_image: tuple[Any, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The hosts booted and site.yml run once over all of them."""
    require_collections()
    if not any(WHEELHOUSE.glob("grpcio-*.whl")) or not any(WHEELHOUSE.glob("kd/pyspark-*.whl")):
        pytest.skip(f"{WHEELHOUSE} lacks the hosts' wheels (grpcio, kd/pyspark): run `make images`")
    client, image = host_image
    tmp = tmp_path_factory.mktemp("site")
    hosts = Hosts(client, image)
    try:
        names = sorted({host for group in GROUPS.values() for host in group})
        try:
            for name in names:
                hosts.add(name)
        except HostsUnavailable as exc:
            pytest.skip(f"no hosts for site.yml here: {exc}")
        wheel = build_wheel(tmp / "wheel")
        common_vars: dict[str, object] = {
            **hosts.inventory_vars(),
            "hio_manage_packages": False,  # the image has them, as an offline site's prepared image
            "hio_wheel": str(wheel),
            "hio_wheelhouse": str(WHEELHOUSE),
            "hio_credentials_dir": str(tmp / "credentials"),
            "hio_tls": True,
            "hio_tls_client_auth": True,
            "hio_worker_runtime": "process",  # no Docker engine inside the hosts (docs/deploy.md)
            "hio_worker_engines": ENGINES,
            "hio_log_level": "info",
        }
        deployed = Cluster(hosts, tmp, {g: list(h) for g, h in GROUPS.items()}, common_vars)
        deployed.deploy("first run")
        yield deployed
        print("\n" + "\n".join(run.line() for run in deployed.runs))
    finally:
        hosts.close()


# A run of the hosts that is killed once its host serves: it prints its run's name, then waits.
KILLED_RUN = """
import sys, time
from tests.ansible.hosts import Hosts, docker_client
hosts = Hosts(docker_client(), sys.argv[1])
hosts.add("hio-killed")
print(hosts.run, flush=True)
time.sleep(600)
"""


def test_the_hosts_of_a_run_killed_with_sigkill_go_with_it(host_image: tuple[Any, str]) -> None:
    """No teardown runs in a process killed with SIGKILL: its reaper removes its running host,
    the network and the keys at once, not the next run."""
    client, image = host_image

    def serving(name: str) -> None:
        containers, _, _ = made_by(client, name)
        assert [c.status for c in containers] == ["running"]

    name = kill_a_run(KILLED_RUN, image, before=serving)

    def left() -> list[str]:
        containers, networks, folders = made_by(client, name)
        return [*(c.name for c in containers), *(n.name for n in networks), *map(str, folders)]

    wait_for(lambda: not left(), timeout=60, what=lambda: f"what the killed run left: {left()}")


def test_site_yml_runs_every_role_as_a_systemd_service_on_hosts_reached_over_ssh(cluster: Cluster) -> None:
    first = cluster.runs[0]
    assert set(first.recaps) == set(cluster.hosts.addresses)
    assert all(counts["changed"] > 0 for counts in first.recaps.values()), first.line()
    roles = {"master": "master", "repository": "repository", "kd": "kd", "workers": "worker", "gateways": "gateway"}
    for group, hosts in cluster.groups.items():
        for host in hosts:
            unit = f"hio-{roles[group]}"
            properties = "-p ActiveState -p UnitFileState -p User -p MainPID"
            shown = cluster.hosts.ssh(host, f"sudo systemctl show {unit} {properties}")
            state = dict(line.split("=", 1) for line in shown.stdout.split())
            assert (state["ActiveState"], state["UnitFileState"], state["User"]) == ("active", "enabled", "hio"), (
                host + cluster.hosts.journal(host, unit)
            )
            pid = state["MainPID"]
            # The unit's sandbox is in force: the service has a mount namespace of its own (read
            # as hio: the hosts' root lacks CAP_SYS_PTRACE, which reading another user's needs).
            namespaces = cluster.hosts.ssh(
                host, f"sudo readlink /proc/1/ns/mnt && sudo -u hio readlink /proc/{pid}/ns/mnt"
            ).stdout.split()
            assert len(set(namespaces)) == 2, f"{unit} on {host} shares the host's mounts: {namespaces}"
    wait_for(
        lambda: cluster.serving_workers() == set(cluster.groups["workers"]),
        timeout=90,
        interval=1.0,
        what=lambda: f"the worker to register and serve:\n{cluster.status()}",
    )


def test_the_cluster_refuses_callers_without_a_token_or_a_certificate(cluster: Cluster) -> None:
    address = f"{cluster.hosts.addresses[CORE]}:7000"
    with create_channel(address, cluster.client_settings(address)) as channel:
        status = master_pb2_grpc.MasterStub(channel).GetStatus(master_pb2.GetStatusRequest(), timeout=30)
    assert {w.worker_id for w in status.workers} >= set(cluster.groups["workers"])
    admin = cluster.client_settings(address)
    for settings, refused in (
        (cluster.client_settings(address, token=False), "UNAUTHENTICATED"),
        (dataclasses.replace(admin, tls_cert="", tls_key=""), "UNAVAILABLE"),  # TLS without a client certificate
        (ClusterSettings(token_file=admin.token_file), "UNAVAILABLE"),  # no TLS
    ):
        with create_channel(address, settings) as channel, pytest.raises(Exception, match=refused):
            master_pb2_grpc.MasterStub(channel).GetStatus(master_pb2.GetStatusRequest(), timeout=30)


def test_tuples_from_the_gateway_host_are_processed_on_the_worker_hosts_and_stored_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.drop(samples(tmp_path, "first", simulations=6, images=4))
    records = cluster.wait_stored()
    by_worker = collections.Counter(worker_of(r) for r in records)
    assert set(by_worker) == set(cluster.groups["workers"]), by_worker
    assert {r.meta.source for r in records} == {CORE}
    print(f"\n{len(records)} tuples stored once, by {dict(sorted(by_worker.items()))}")


def test_a_second_run_of_site_yml_changes_nothing(cluster: Cluster) -> None:
    second = cluster.deploy("second run")
    assert set(second.recaps) == set(cluster.hosts.addresses)
    changed = {host: counts["changed"] for host, counts in second.recaps.items() if counts["changed"]}
    assert not changed, f"changed on a second run: {changed}\n{cluster.last_output[-8000:]}"


def test_a_worker_added_to_the_inventory_joins_with_the_documented_command_and_takes_tuples(
    cluster: Cluster, tmp_path: Path
) -> None:
    limit = documented_limit()
    cluster.hosts.add(NEW_WORKER)
    cluster.groups["workers"].append(NEW_WORKER)
    grown = cluster.deploy("scale-out run", "--limit", limit)
    limited = {host for group in limit.split(",") for host in cluster.groups[group]}
    assert set(grown.recaps) == limited, f"--limit '{limit}' ran on {sorted(grown.recaps)}"
    assert grown.recaps[NEW_WORKER]["changed"] > 0
    wait_for(
        lambda: cluster.serving_workers() == set(cluster.groups["workers"]),
        timeout=120,
        interval=1.0,
        what=lambda: (
            f"{NEW_WORKER} to register beside the first:\n{cluster.status()}"
            + cluster.hosts.journal(NEW_WORKER, "hio-worker")
        ),
    )
    before = {r.meta.name for r in cluster.records()}
    cluster.drop(samples(tmp_path, "grown", simulations=6, images=2))
    records = cluster.wait_stored()
    by_worker = collections.Counter(worker_of(r) for r in records if r.meta.name not in before)
    assert set(by_worker) == set(cluster.groups["workers"]), f"not every worker took tuples: {by_worker}"
    print(f"\nafter the scale-out {sum(by_worker.values())} tuples stored once, by {dict(sorted(by_worker.items()))}")
