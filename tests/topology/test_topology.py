"""The deployment's networks, for real: hosts as network namespaces behind a router whose
firewall is docs/deploy.md's table of who connects to whom (tests/topology/network.py).

A gateway at the instrument site (edge network), the master and an operator's machine in the
public network, the repository, KD and two workers in the private network, every role a real
``hio`` process on its own host, started by the one cluster builder through ``ip netns exec``,
listening on every address and given the hosts' addresses, as a deployment runs them. Sample
tuples (simulation realizations and microscope images, about 4 MB each) are dropped into the
gateway's watched folder and cross the networks. The tests show:

* the firewall lets through exactly the table's connections;
* every tuple is stored exactly once, and direct payloads go from the gateway to the workers
  and never through the master: from the roles' own counters (the gateway's bytes sent direct
  and to the queue, the master's bytes routed direct and received into its queue, the engines'
  bytes by how they came) and from the router's byte counters;
* a worker cut off for 20 s while tuples stream loses and duplicates none;
* a blocked port is reported naming the address that cannot be reached;
* KD, on its host, reads the features across the router and writes knowledge back.

Run it with ``make topology`` (as root). Skipped, saying why, without root, ``ip netns`` or
iptables. Everything it makes goes again, even when it fails: roles, namespaces (their links
and the router's rules), files; and when the test run is killed, SIGKILL included, the roles
(with their starter) and the namespaces (with the run's reaper, tests/reaper.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hio.cluster import LocalCluster
from hio.proto import features_pb2, ingest_pb2, ingest_pb2_grpc, master_pb2
from hio.settings import ClusterSettings
from hio.tools import fetch_knowledge
from hio.transport.net import create_channel
from hio.up import read_features
from hio.worker.pipelines.samples import SimulationSize, generate_microscopy, generate_simulation
from tests.harness import hio_env, local_cluster, wait_for, wait_names_stored
from tests.reaper import kill_a_run
from tests.topology.network import (
    ENGINE_PORTS,
    Topology,
    default_hosts,
    deploy_flows,
    made_by,
    remove_stale,
    unavailable,
)

pytestmark = pytest.mark.slow

ENGINE_PORT_RANGE = (41000, 41015)
ENGINES = ["hio/microscopy=1", "hio/simulation=1"]
WORKERS = ("worker1", "worker2")
WORKER_HEALTH_PORT = 7290  # the worker controller's gRPC health, on its host (reached through a relay in its netns)
MB = 1e6
PARTITION_SECONDS = 20.0
KD_INTERVAL = 4  # seconds between KD's looks at the repository


@dataclass
class Deployment:
    """The topology, the cluster in it, and the gateway's watched folder."""

    topology: Topology
    cluster: LocalCluster
    incoming: Path
    samples: dict[str, list[Path]]  # phase -> sample files
    dropped: list[str]  # names of every file sent (watched folder, hio send): each is to be stored once

    def drop(self, path: Path, name: str = "") -> None:
        """Put a file into the gateway's watched folder at once (a hard link: it is there whole)."""
        name = name or path.name
        os.link(path, self.incoming / name)
        self.dropped.append(name)

    def gateway_status(self) -> ingest_pb2.GetGatewayStatusResponse:
        """The gateway's counters and warnings (its ingest API, from the gateway's own host)."""
        address = self.topology.relay("gateway", self.topology.address("gateway", 7300))
        with create_channel(address, ClusterSettings()) as channel:
            return ingest_pb2_grpc.IngestStub(channel).GetGatewayStatus(
                ingest_pb2.GetGatewayStatusRequest(), timeout=10
            )

    def records(self) -> list[features_pb2.FeatureRecord]:
        """Every feature record in the repository (read on the repository's own host)."""
        settings = ClusterSettings(repository_address=self.topology.reach(self.cluster.repository))
        return read_features(settings)

    def wait_stored(self, timeout: float = 90.0) -> list[features_pb2.FeatureRecord]:
        """Wait until every dropped file is stored; the records."""
        return wait_names_stored(
            self.records,
            set(self.dropped),
            lambda: f"gateway {self.gateway_status()}\n{self.cluster.output()}",
            timeout=timeout,
        )

    def hio(self, host: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """A one-off ``hio`` command on ``host`` (it dies with this process)."""
        return subprocess.run(
            [*self.topology.prefix(host), sys.executable, "-m", "hio.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=hio_env(),
            cwd=self.cluster.root,
        )


def samples(root: Path) -> dict[str, list[Path]]:
    """About 4 MB each: simulation realizations (cheap to process) and microscope images
    (about a third of a second each), for the steady stream, the partition and the queue."""
    sims = generate_simulation(root / "simulation", 24, size=SimulationSize(timepoints=16000))
    images = generate_microscopy(root / "microscopy", 12, size=1448)
    partition = [path for pair in itertools.zip_longest(sims[10:], images[4:]) for path in pair if path]
    return {"steady": [*sims[:8], *images[:4]], "queue": sims[8:10], "partition": partition}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    why = unavailable()
    if why:
        pytest.skip(f"the deployment topology test {why}")
    stale = remove_stale()
    if stale:
        print(f"removed namespaces of an earlier run that was killed: {', '.join(stale)}")
    root = tmp_path_factory.mktemp("topology")
    topology = Topology(deploy_flows(), ENGINE_PORT_RANGE)
    cluster: LocalCluster | None = None
    failed_before = request.session.testsfailed
    try:
        data = samples(root / "samples")
        topology.build()
        cluster = start_roles(topology, root)
        yield Deployment(topology, cluster, root / "incoming", data, [])
    finally:
        problems: list[str] = []
        if cluster is not None:
            if request.session.testsfailed > failed_before:
                print(f"\nthe roles' logs:\n{cluster.output()}")
            problems = cluster.stop()
        left = topology.remove()
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"namespaces left behind: {left}"
        assert not problems, "\n".join(problems)


def start_roles(topology: Topology, root: Path) -> LocalCluster:
    """Repository, master, both workers and the gateway, each on its host, as a deployment
    starts them (README, "Running each role on its own host"); back once every engine serves."""
    address = topology.address
    (root / "incoming").mkdir()
    cluster = local_cluster(
        root,
        master_address=address("master", 7000),
        repository_address=address("repository", 7100),
        http={"repository": "0.0.0.0:7180"},
        master_args=["--listen", "0.0.0.0:7000", "--advertise-address", address("master", 7000)],
        repository_args=["--listen", "0.0.0.0:7100"],
        prefixes={host: topology.prefix(host) for host in topology.hosts},
        reach=topology.reach,
    )
    try:
        cluster.start()
        cluster.add("kd", ["--interval", str(KD_INTERVAL), "--spark-master", "local[1]"])  # Spark starts slowly
        for worker in WORKERS:
            cluster.add_worker(
                worker,
                ENGINES,
                args=[
                    "--advertise-host",
                    address(worker),
                    "--engine-listen-host",
                    "0.0.0.0",
                    "--engine-ports",
                    "{}-{}".format(*ENGINE_PORT_RANGE),
                ],
                wait=False,
                listen=address(worker, WORKER_HEALTH_PORT),
            )
        cluster.add(
            "gateway",
            [
                "--watch",
                str(root / "incoming"),
                "--ingest-listen",
                address("gateway", 7300),
                "--source",
                "edge",
                "--settle-seconds",
                "0.2",
                "--poll-seconds",
                "0.1",
                "--route-timeout-seconds",
                "3",
            ],
            health=address("gateway", 7300),
        )
        cluster.wait_channels(2 * len(WORKERS), timeout=90)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# -- the firewall -----------------------------------------------------------------------------


def test_the_router_forwards_exactly_the_connections_the_deploy_table_lists(deployment: Deployment) -> None:
    """From every host to every other on every port of the table: a connection the table lists
    gets an answer (open, or refused where nothing listens), any other is dropped."""
    topology = deployment.topology
    allowed = {
        (source.name, target.name, flow.port)
        for flow in topology.flows
        for source in topology.by_role(flow.source)
        for target in topology.by_role(flow.target)
    }
    ports = sorted({flow.port for flow in topology.flows})
    probes = [
        (source, target, port)
        for source in topology.hosts
        for target in topology.hosts
        if source != target
        for port in ports
    ]

    def number(port: str) -> int:
        return ENGINE_PORT_RANGE[0] if port == ENGINE_PORTS else int(port)

    with concurrent.futures.ThreadPoolExecutor(len(probes)) as pool:  # one timeout for all
        answers = list(
            pool.map(
                lambda p: topology.connect(p[0], topology.address(p[1], number(p[2])), timeout=3.0),
                probes,
            )
        )
    wrong = [
        f"{source} -> {target}:{port}: {answer}"
        for (source, target, port), answer in zip(probes, answers, strict=True)
        if (answer == "dropped") == ((source, target, port) in allowed)
    ]
    assert not wrong, "the firewall is not the table:\n" + "\n".join(wrong)
    assert sum(1 for a in answers if a == "open") >= 10, f"the roles listen on their hosts' addresses: {answers}"
    outside = topology.connect("gateway", "192.0.2.1:7000", timeout=2.0)  # TEST-NET-1: no host of ours
    assert outside.startswith("unreachable"), f"the router has no way out of the namespaces: {outside}"
    print(f"\n{len(allowed)} connections allowed and {len(probes) - len(allowed)} dropped, as docs/deploy.md says")


# -- the stream -------------------------------------------------------------------------------


def test_tuples_cross_the_networks_stored_once_and_direct_payloads_never_pass_the_master(
    deployment: Deployment,
) -> None:
    topology, cluster = deployment.topology, deployment.cluster
    before = topology.counters()
    for path in deployment.samples["steady"]:
        deployment.drop(path)
    # Before any tuple is queued: a route that finds tuples of its image queued joins them.
    wait_for(
        lambda: deployment.gateway_status().sent_direct == len(deployment.samples["steady"]),
        timeout=60,
        what=lambda: f"every steady sample sent direct; the gateway's status: {deployment.gateway_status()}",
    )
    queued = deployment.samples["queue"]
    sent = deployment.hio(
        "gateway",
        "send",
        *map(str, queued),
        "--master-address",
        cluster.master,
        "--data-dir",
        str(cluster.root / "send"),
        "--source",
        "edge-send",
        "--force-queue",
    )
    assert sent.returncode == 0, f"hio send --force-queue failed:\n{sent.stdout}\n{sent.stderr}"
    deployment.dropped += [p.name for p in queued]
    records = deployment.wait_stored()
    check_exactly_once(deployment, records)

    direct_bytes = sum(p.stat().st_size for p in deployment.samples["steady"])
    queued_bytes = sum(p.stat().st_size for p in queued)
    gateway = wait_for(
        lambda: (s := deployment.gateway_status()).sent_direct == len(deployment.samples["steady"]) and s,
        timeout=30,
        what=lambda: f"every steady sample sent direct; the gateway's status: {deployment.gateway_status()}",
    )
    master = wait_for(
        lambda: (s := cluster.status()).tuples_done >= len(deployment.dropped) and s,
        timeout=30,
        what="every outcome reported to the master",
    )
    engines_direct = sum(c.bytes_direct for w in master.workers for c in w.channels)
    engines_pulled = sum(c.bytes_pulled for w in master.workers for c in w.channels)
    router = delta(before, topology.counters())
    to_workers = sum(v for k, v in router.items() if k.startswith("gateway>worker"))
    to_master = sum(v for k, v in router.items() if k.startswith("gateway>master"))
    pulled_from_master = sum(v for k, v in router.items() if k.startswith("worker") and "<master:" in k)
    print(
        f"\npayload: {direct_bytes / MB:.1f} MB in {len(deployment.samples['steady'])} tuples by the gateway daemon, "
        f"{queued_bytes / MB:.1f} MB in {len(queued)} by hio send --force-queue\n"
        f"gateway  sent direct {gateway.bytes_sent_direct / MB:.1f} MB ({gateway.sent_direct} tuples), "
        f"to the queue {gateway.bytes_sent_queue / MB:.1f} MB ({gateway.sent_queue})\n"
        f"master   routed direct {master.bytes_routed_direct / MB:.1f} MB, "
        f"received into its queue {master.bytes_enqueued / MB:.1f} MB\n"
        f"engines  stored {engines_direct / MB:.1f} MB that came direct, {engines_pulled / MB:.1f} MB pulled\n"
        f"router   gateway -> workers {to_workers / MB:.2f} MB, gateway -> master {to_master / MB:.2f} MB, "
        f"master -> workers (pulls) {pulled_from_master / MB:.2f} MB"
    )
    # The roles' own counters: direct payloads went to engines, the master received only the queued.
    assert gateway.bytes_sent_direct == direct_bytes and gateway.bytes_sent_queue == 0
    assert master.bytes_routed_direct >= direct_bytes
    assert master.bytes_enqueued == queued_bytes, "the master received the queued tuples' payloads and nothing else"
    assert engines_direct == direct_bytes and engines_pulled == queued_bytes
    # The router's counters, on their own: the direct payload crossed gateway -> workers, and what
    # reached the master beyond the queued tuples' payloads is control traffic (routes), not payload.
    assert direct_bytes <= to_workers <= 1.05 * direct_bytes + 2 * MB
    assert queued_bytes <= to_master <= 1.05 * queued_bytes + 1 * MB
    assert to_master - queued_bytes < 0.02 * direct_bytes
    assert queued_bytes <= pulled_from_master <= 1.05 * queued_bytes + 1 * MB


def check_exactly_once(deployment: Deployment, records: list[features_pb2.FeatureRecord]) -> None:
    """Every file dropped or sent is one record, under one tuple id of its own."""
    names = collections.Counter(r.meta.name for r in records)
    ids = collections.Counter(r.tuple_id for r in records)
    twice = {name: n for name, n in names.items() if n > 1}
    assert not twice, f"stored more than once: {twice}"
    assert all(n == 1 for n in ids.values()), "one record per tuple id"
    assert set(deployment.dropped) <= set(names), f"lost: {set(deployment.dropped) - set(names)}"
    assert len(records) == len(deployment.dropped), f"{len(records)} records for {len(deployment.dropped)} files"


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: value - before.get(name, 0) for name, value in after.items()}


# -- a partition ---------------------------------------------------------------------------


def test_a_worker_cut_off_for_20_seconds_while_tuples_stream_loses_and_duplicates_nothing(
    deployment: Deployment,
) -> None:
    """Worker2's cable is pulled while it holds a tuple, and tuples keep coming, one a second,
    for the 20 s it is away; it is plugged in again and the stream ends. Every tuple is stored
    exactly once, none failed."""
    topology, cluster = deployment.topology, deployment.cluster
    files = list(deployment.samples["partition"])
    held: list[str] = []
    while not held and len(files) > 10:  # until an image (a third of a second or more) is on worker2
        deployment.drop(files.pop(0))
        deadline = time.monotonic() + 1.5
        while not held and time.monotonic() < deadline:
            held = busy_channels(cluster, "worker2", "hio/microscopy")
    assert held, "no image reached worker2's engine"
    topology.cut("worker2")
    cut_at, cut_unix = time.monotonic(), time.time()
    expired = False
    try:
        answer = topology.connect("gateway", topology.address("worker2", ENGINE_PORT_RANGE[0]), timeout=1.0)
        assert answer not in ("open", "refused"), f"worker2 still reachable: {answer}"
        while time.monotonic() - cut_at < PARTITION_SECONDS:
            if len(files) > 2:
                deployment.drop(files.pop(0))
            expired = expired or any("worker worker2 expired" in w for w in cluster.status().warnings)
            time.sleep(max(0.0, min(1.0, PARTITION_SECONDS - (time.monotonic() - cut_at))))
    finally:
        topology.mend("worker2")
    away, mended_unix = time.monotonic() - cut_at, time.time()
    assert expired, "the master expired the worker it no longer heard"
    cluster.wait_channels(len(ENGINES), "worker2", timeout=30)
    for path in files:
        deployment.drop(path)
    records = deployment.wait_stored(timeout=120)
    check_exactly_once(deployment, records)
    gateway, master = deployment.gateway_status(), cluster.status()
    assert gateway.failed == 0 and master.dead_letters == 0
    names = {p.name for p in deployment.samples["partition"]}
    by_worker = collections.Counter(r.engine.split("/")[0] for r in records if r.meta.name in names)
    cut_off = [  # processed on worker2 while it was cut off: stored once it was back
        r.meta.name for r in records if r.engine.startswith("worker2/") and cut_unix <= r.processed_unix < mended_unix
    ]
    print(
        f"\nworker2 cut off for {away:.1f} s holding {', '.join(held)}; it processed {cut_off or 'nothing'} "
        f"meanwhile; {len(names)} tuples streamed before, during and after, stored by "
        f"{dict(sorted(by_worker.items()))}; all {len(records)} tuples so far stored once; gateway retries "
        f"{gateway.retries}, master tuples failed {master.tuples_failed}"
    )


def busy_channels(cluster: LocalCluster, worker: str, image: str) -> list[str]:
    """The channels of ``worker`` for ``image`` that hold a tuple (routed to, pulling, or processing)."""
    busy = (master_pb2.DIRECT, master_pb2.QUEUE)
    return [
        f"{c.channel_id} ({c.image})"
        for w in cluster.status().workers
        if w.worker_id == worker
        for c in w.channels
        if c.image == image and (c.state in busy or c.processing)
    ]


# -- a blocked port --------------------------------------------------------------------------


def test_a_blocked_port_to_the_master_is_reported_naming_its_address(deployment: Deployment) -> None:
    """With the edge's port to the master blocked, ``hio send`` on the gateway's host and the
    gateway daemon's status both name the master's address and say it cannot be reached; the
    tuple that waited meanwhile is stored once the port is open again."""
    topology, cluster = deployment.topology, deployment.cluster
    master = cluster.master
    unblock = topology.block("gateway", "master", 7000)
    try:
        deployment.drop(deployment.samples["steady"][1], "while-blocked.npz")
        sent = deployment.hio(
            "gateway",
            "send",
            str(deployment.samples["steady"][0]),
            "--master-address",
            master,
            "--data-dir",
            str(cluster.root / "send-blocked"),
            "--source",
            "blocked",
            "--connect-seconds",
            "3",
        )
        assert sent.returncode == 2, f"hio send: {sent.returncode}\n{sent.stdout}\n{sent.stderr}"
        assert f"cannot reach the master at {master}" in sent.stderr, sent.stderr
        warning = wait_for(
            lambda: [w for w in deployment.gateway_status().warnings if master in w],
            timeout=30,
            what="the gateway's status to say the master is unreachable",
        )[0]
        assert f"the master at {master} has been unreachable" in warning, warning
        print(f"\n{sent.stderr.strip()}\ngateway status: {warning}")
    finally:
        unblock()
    records = deployment.wait_stored(timeout=60)
    check_exactly_once(deployment, records)
    wait_for(lambda: not deployment.gateway_status().warnings, timeout=30, what="the warning to go")


# -- knowledge discovery ---------------------------------------------------------------------


def test_kd_on_its_host_learns_from_the_stored_tuples_across_the_router(deployment: Deployment) -> None:
    """KD, started with the other roles (Spark takes a while), reads the features from the
    repository across the router and writes knowledge back: at least of the tuples of the
    steady stream, stored a minute before (it learns of later ones at its next intervals)."""
    topology, cluster = deployment.topology, deployment.cluster
    settings = ClusterSettings(repository_address=topology.reach(cluster.repository))
    steady = len(deployment.samples["steady"]) + len(deployment.samples["queue"])

    def learned() -> int:
        knowledge = fetch_knowledge(settings)
        return sum(group.tuple_count for group in knowledge.groups) if knowledge is not None else 0

    wait_for(
        lambda: learned() >= steady,
        timeout=120,
        interval=1.0,
        what=lambda: f"KD to learn from {steady} tuples (it has {learned()}):\n{cluster.procs['kd'].output(3000)}",
    )
    assert learned() <= len(deployment.dropped), "KD counts each stored tuple once"
    cluster.remove("kd", timeout=5)  # one in an interval finishes it first: no need to wait for that here
    router = topology.counters()
    assert router["kd>repository:7100"] > 0 and router["kd<repository:7100"] > 0
    print(
        f"\nKD learned from {learned()} of {len(deployment.dropped)} tuples so far, reading "
        f"{router['kd<repository:7100'] / MB:.2f} MB of features and writing {router['kd>repository:7100'] / MB:.2f} MB"
    )


#: A test run that builds a topology, says its tag, and waits to be killed.
KILLED_RUN = """
import time
from tests.topology.network import Topology, deploy_flows
topology = Topology(deploy_flows(), (41000, 41015))
topology.build()
print(topology.tag, flush=True)
time.sleep(600)
"""


def test_the_namespaces_of_a_run_killed_with_sigkill_go_with_it() -> None:
    """No teardown runs in a process killed with SIGKILL: its reaper deletes its namespaces at
    once, not the next run."""
    why = unavailable()
    if why:
        pytest.skip(f"the deployment topology test {why}")

    def built(tag: str) -> None:
        assert len(made_by(tag)) == 1 + len(default_hosts()), made_by(tag)  # the router and each host

    tag = kill_a_run(KILLED_RUN, before=built)
    wait_for(lambda: not made_by(tag), timeout=60, what=lambda: f"the killed run's namespaces: {made_by(tag)}")
