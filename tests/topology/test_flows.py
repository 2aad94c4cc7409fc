"""docs/deploy.md's table of who connects to whom, against the code (no root needed).

The topology test builds its router's firewall from that table (tests/topology/network.py);
these check that the table says what the roles' settings say, and that the firewall built
from it is the table and nothing more.
"""

from __future__ import annotations

from hio.config import split_address
from hio.master.config import MasterConfig
from hio.repository.config import RepositoryConfig
from hio.settings import ClusterSettings
from tests.topology.network import ENGINE_PORTS, Topology, default_hosts, deploy_flows

ROLES = {"gateway", "master", "worker", "repository", "kd", "operator"}


def port_of(address: str) -> str:
    return str(split_address(address)[1])


def test_the_table_names_known_roles_and_the_ports_their_settings_default_to() -> None:
    flows = deploy_flows()
    master, repository = MasterConfig(), RepositoryConfig()
    ports = {
        "master": {port_of(master.listen), port_of(master.lane_address())},
        "repository": {port_of(repository.listen), port_of(repository.http_listen)},
        "worker": {ENGINE_PORTS},
    }
    assert ports["master"] == {"7000", "7001"} and ports["repository"] == {"7100", "7180"}
    for flow in flows:
        assert {flow.source, flow.target} <= ROLES, flow
        assert flow.port in ports.get(flow.target, set()), f"{flow}: not a port {flow.target} listens on"
        assert flow.purpose, flow
    settings = ClusterSettings()
    assert port_of(settings.master_address) == "7000" and port_of(settings.repository_address) == "7100"


def test_nobody_dials_a_gateway_kd_or_an_operator_and_only_gateways_dial_the_engines() -> None:
    """The edge and the operators only open connections; the master opens none to a worker
    (workers come to it); the engines' ports are the gateways' alone."""
    flows = deploy_flows()
    assert not [f for f in flows if f.target in ("gateway", "kd", "operator")]
    assert {f.target for f in flows if f.source == "master"} == {"repository"}, (
        "the preview: over gRPC and the operator's SSH tunnel"
    )
    assert {f.source for f in flows if f.port == ENGINE_PORTS} == {"gateway"}


def test_the_firewall_is_one_rule_each_way_per_row_and_pair_of_hosts_and_drops_the_rest() -> None:
    flows = deploy_flows()
    topology = Topology(flows, (41000, 41015), default_hosts())
    rules = dict(topology.rules())
    hosts = {role: len(topology.by_role(role)) for role in ROLES}
    assert len(rules) == 2 * sum(hosts[f.source] * hosts[f.target] for f in flows)
    gateway, worker = topology.address("gateway"), topology.address("worker1")
    assert rules["gateway>worker1:engine_ports"] == f"-s {gateway}/32 -d {worker}/32 -p tcp -m tcp --dport 41000:41015"
    assert rules["gateway<worker1:engine_ports"].endswith("--sport 41000:41015 -m conntrack --ctstate ESTABLISHED")
    assert not [name for name in rules if name.startswith("master>worker")], "the master never dials a worker"
    ruleset = topology.ruleset()
    assert ":FORWARD DROP" in ruleset and ":INPUT DROP" in ruleset
