"""The common role's configuration, units, tokens and certificates, rendered
by Ansible for a four-host cluster on this machine, and checked with the
project's own code: every role config builds from its host's hio.toml, the
tokens files accept exactly the right clients, and the TLS certificates
carry a real gRPC health check. A fifth host runs the monitoring role: its
Prometheus configuration scrapes every role of every host, promtool accepts it,
and every role's endpoint serves /metrics to the token and client certificate it
presents."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import ssl
import stat
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from hio import config as cfg
from hio.metrics import role_registry
from hio.settings import ClusterSettings
from hio.transport.http import HttpEndpoint, role_routes
from hio.transport.net import TokenTable, create_server, wait_healthy
from tests.ansible.helpers import REPO, local_vars, read_unit, require_collections, run_playbook, write_inventory

ROLE_CONFIGS = {
    "master": "hio.master.config:MasterConfig",
    "repository": "hio.repository.config:RepositoryConfig",
    "worker": "hio.worker.config:WorkerConfig",
    "gateway": "hio.gateway.config:GatewayConfig",
    "kd": "hio.kd.config:KDConfig",
}
# hio-m runs master, repository and kd (KD beside the repository, as provisioned);
# the workers' hosts are a Spark standalone cluster too, hio-w1 its master.
GROUPS = {
    "master": ["hio-m"],
    "repository": ["hio-m"],
    "kd": ["hio-m"],
    "workers": ["hio-w1", "hio-w2"],
    "gateways": ["hio-g1"],
    "monitoring": ["hio-p"],  # Prometheus on a host of its own
    "spark": ["hio-w1", "hio-w2"],
}
SPARK_UNITS = {"hio-w1": ["hio-spark-master", "hio-spark-worker"], "hio-w2": ["hio-spark-worker"]}
HOST_ROLES = {
    "hio-m": ["master", "repository", "kd"],
    "hio-w1": ["worker"],
    "hio-w2": ["worker"],
    "hio-g1": ["gateway"],
}
# One Ansible run over four hosts, TLS included: well over 20 s on two cores.
pytestmark = pytest.mark.slow

PRIVATE_IP = {"hio-m": "10.9.0.10", "hio-w1": "10.9.0.21", "hio-w2": "10.9.0.22", "hio-g1": "10.9.0.31"}

RENDER_PLAYBOOK = """
- name: Render what the common role writes, without installing anything
  hosts: all:!monitoring
  gather_facts: false
  tasks:
    - ansible.builtin.include_role: {name: common, tasks_from: system, public: true}
    - ansible.builtin.include_role: {name: common, tasks_from: tokens}
    - ansible.builtin.include_role: {name: common, tasks_from: tls}
    - ansible.builtin.include_role: {name: common, tasks_from: config}
    - ansible.builtin.include_role: {name: spark, tasks_from: units}
      when: "'spark' in group_names"

- name: Render what the monitoring role writes
  hosts: monitoring
  gather_facts: false
  roles:
    - role: monitoring
"""
PROMETHEUS = "hio-p"


@dataclasses.dataclass
class Rendered:
    root: Path

    def host(self, name: str) -> Path:
        return self.root / name

    def toml(self, host: str) -> dict[str, Any]:
        with open(self.host(host) / "etc/hio/hio.toml", "rb") as fh:
            return tomllib.load(fh)

    def token(self, name: str) -> str:
        return (self.root / "credentials" / "tokens" / name).read_text().strip()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    require_collections()
    root = tmp_path_factory.mktemp("render")
    playbook = root / "render.yml"
    playbook.write_text(RENDER_PLAYBOOK)
    identity = local_vars(root)
    per_host = str(root) + "/{{ inventory_hostname }}"
    common = {
        **identity,
        "hio_tls": True,
        "hio_tls_client_auth": True,
        "hio_gateway_watch": str(root) + "/{{ inventory_hostname }}/incoming",
        "hio_monitoring_config_dir": per_host + "/etc/prometheus",
        "hio_monitoring_defaults_file": per_host + "/etc/default/prometheus",
        "hio_monitoring_owner": identity["hio_config_owner"],
        "hio_monitoring_service_group": identity["hio_group"],
        "hio_monitoring_service": False,
        "hio_monitoring_validate": shutil.which("promtool") is not None,  # promtool checks what it writes
        "hio_monitoring_grafana": True,
        "hio_monitoring_grafana_provisioning_dir": per_host + "/etc/grafana/provisioning",
        "hio_monitoring_grafana_dashboards_dir": per_host + "/var/lib/grafana/dashboards/hio",
        "hio_monitoring_grafana_group": identity["hio_group"],
    }
    hosts: dict[str, dict[str, Any]] = {h: {"hio_private_ip": ip} for h, ip in PRIVATE_IP.items()}
    hosts["hio-w2"]["hio_worker_extra"] = {"http_listen": "0.0.0.0:7281"}  # Prometheus follows it
    inventory = write_inventory(root / "inventory.yml", GROUPS, hosts, common)
    for host in HOST_ROLES:  # GatewayConfig checks that the watched folder exists
        (root / host / "incoming").mkdir(parents=True)
    run_playbook(playbook, inventory, root)
    return Rendered(root)


def _config_class(role: str) -> type:
    module, _, name = ROLE_CONFIGS[role].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"{ROLE_CONFIGS[role]} is not available yet: {exc}")


@pytest.mark.parametrize("host,role", [(h, r) for h, roles in HOST_ROLES.items() for r in roles])
def test_role_config_builds_from_the_rendered_file(rendered: Rendered, host: str, role: str) -> None:
    data = rendered.toml(host)
    assert set(data) >= {"cluster", role}
    config = cfg.build(_config_class(role), role, file_data=data)
    assert config.master_address == f"{PRIVATE_IP['hio-m']}:7000"
    assert config.repository_address == f"{PRIVATE_IP['hio-m']}:7100"
    assert config.tls_cert.endswith("/tls/host.crt") and config.tls_client_auth is True
    assert config.log_json is True and config.chunk_bytes == 1024 * 1024


def test_sections_only_for_the_roles_a_host_runs(rendered: Rendered) -> None:
    assert set(rendered.toml("hio-w1")) == {"cluster", "worker"}
    assert set(rendered.toml("hio-g1")) == {"cluster", "gateway"}
    # Operators' tools on the master present the admin token.
    master = rendered.toml("hio-m")
    assert set(master) == {"cluster", "master", "repository", "kd", "status", "dead_letters", "knowledge"}
    assert master["status"]["token_file"].endswith("/tokens/admin.token")


def test_worker_advertises_its_private_address(rendered: Rendered) -> None:
    worker = cfg.build(_config_class("worker"), "worker", file_data=rendered.toml("hio-w2"))
    assert worker.advertise_host == PRIVATE_IP["hio-w2"]
    assert worker.worker_id == "hio-w2"
    assert worker.engine_listen_host == "0.0.0.0"


@pytest.mark.parametrize("host", list(HOST_ROLES))
def test_one_systemd_unit_per_role(rendered: Rendered, host: str) -> None:
    units = sorted(p.name for p in (rendered.host(host) / "etc/systemd/system").iterdir())
    spark = [f"{name}.service" for name in SPARK_UNITS.get(host, [])]
    assert units == sorted([f"hio-{r}.service" for r in HOST_ROLES[host]] + spark)
    for role in HOST_ROLES[host]:
        unit = read_unit(rendered.host(host) / f"etc/systemd/system/hio-{role}.service")
        assert unit["ExecStart"] == [f"{rendered.host(host)}/opt/hio/bin/hio {role}"]
        assert f"HIO_CONFIG={rendered.host(host)}/etc/hio/hio.toml" in unit["Environment"]
        assert unit["KillSignal"] == ["SIGTERM"] and unit["Restart"] == ["on-failure"]
        assert unit["TimeoutStopSec"] == ["60"] and unit["LimitNOFILE"] == ["65536"]
        assert unit["User"] == [os.environ.get("USER") or unit["User"][0]]
        assert ("SupplementaryGroups" in unit) == (role == "worker")
        assert unit["WantedBy"] == ["multi-user.target"]


def test_each_host_gets_only_its_own_token(rendered: Rendered) -> None:
    def tokens(host: str) -> set[str]:
        return {p.name for p in (rendered.host(host) / "etc/hio/tokens").iterdir()}

    assert tokens("hio-w1") == {"worker.token", "worker.tokens"}
    assert tokens("hio-g1") == {"gateway.token", "gateway.tokens"}
    assert tokens("hio-m") == {
        *("kd.token", "viewer.token", "admin.token"),
        *("master.tokens", "repository.tokens", "kd.tokens"),
    }
    secrets = rendered.host(PROMETHEUS) / "etc/prometheus/hio"
    assert {p.name for p in secrets.iterdir()} == {"viewer.token", "ca.crt", "client.crt", "client.key"}
    assert (secrets / "viewer.token").read_text().strip() == rendered.token(f"monitoring-{PROMETHEUS}")
    assert stat.S_IMODE((secrets / "client.key").stat().st_mode) == 0o640
    assert (rendered.host("hio-w1") / "etc/hio/tokens/worker.token").read_text().strip() == rendered.token(
        "worker-hio-w1"
    )
    assert rendered.token("worker-hio-w1") != rendered.token("worker-hio-w2")
    for path in (rendered.host("hio-w1") / "etc/hio/tokens").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path


def _table(rendered: Rendered, host: str, role: str) -> TokenTable:
    table = TokenTable.from_settings(
        ClusterSettings(tokens_file=str(rendered.host(host) / f"etc/hio/tokens/{role}.tokens"))
    )
    assert table is not None
    return table


def test_servers_accept_exactly_their_clients(rendered: Rendered) -> None:
    master = _table(rendered, "hio-m", "master")
    repository = _table(rendered, "hio-m", "repository")
    engines = _table(rendered, "hio-w1", "worker")
    gateway, kd, admin = rendered.token("gateway-hio-g1"), rendered.token("kd-hio-m"), rendered.token("admin")
    assert master.lookup(rendered.token("worker-hio-w2")) == ("worker", "worker-hio-w2")
    assert master.lookup(gateway) == ("gateway", "gateway-hio-g1")
    assert master.lookup(admin) == ("admin", "admin")
    assert repository.lookup(kd) == ("kd", "kd-hio-m")
    assert engines.lookup(gateway) == ("gateway", "gateway-hio-g1")
    assert engines.lookup(kd) is None
    assert master.lookup("not-a-token") is None
    # the gateway's ingest API takes its own token (instrument software presents it), not another's
    ingest = _table(rendered, "hio-g1", "gateway")
    assert ingest.lookup(gateway) == ("gateway", "gateway-hio-g1")
    assert ingest.lookup(rendered.token("worker-hio-w1")) is None and ingest.lookup(kd) is None


def test_clients_present_the_token_the_servers_know(rendered: Rendered) -> None:
    worker = cfg.build(_config_class("worker"), "worker", file_data=rendered.toml("hio-w1"))
    gateway = cfg.build(_config_class("gateway"), "gateway", file_data=rendered.toml("hio-g1"))
    master = _table(rendered, "hio-m", "master")
    assert master.lookup(worker.presented_token()) == ("worker", "worker-hio-w1")
    assert master.lookup(gateway.presented_token()) == ("gateway", "gateway-hio-g1")
    # The master's status page reads KD's preview from the repository as a viewer.
    master_config = cfg.build(_config_class("master"), "master", file_data=rendered.toml("hio-m"))
    repository = _table(rendered, "hio-m", "repository")
    assert repository.lookup(master_config.presented_token()) == ("viewer", "master-hio-m")


def test_host_certificates_serve_mutual_tls(rendered: Rendered) -> None:
    """The master host's certificate serves; a worker's certificate is accepted as a client."""
    server_settings = cfg.build(ClusterSettings, "cluster", file_data={"cluster": rendered.toml("hio-m")["cluster"]})
    client_settings = cfg.build(ClusterSettings, "cluster", file_data={"cluster": rendered.toml("hio-w1")["cluster"]})
    server, port, health = create_server(server_settings, "127.0.0.1:0")
    server.start()
    try:
        health.start()
        wait_healthy(f"127.0.0.1:{port}", client_settings, timeout=20)
    finally:
        server.stop(0)


def test_certificates_name_the_private_address(rendered: Rendered) -> None:
    from cryptography import x509

    ca = x509.load_pem_x509_certificate((rendered.root / "credentials/tls/ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((rendered.host("hio-w1") / "etc/hio/tls/host.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "hio-w1" in names.get_values_for_type(x509.DNSName)
    assert PRIVATE_IP["hio-w1"] in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    key_mode = stat.S_IMODE((rendered.host("hio-w1") / "etc/hio/tls/host.key").stat().st_mode)
    assert key_mode == 0o640


def test_kd_runs_on_the_spark_group_cluster(rendered: Rendered) -> None:
    kd = cfg.build(_config_class("kd"), "kd", file_data=rendered.toml("hio-m"))
    assert kd.spark_master == f"spark://{PRIVATE_IP['hio-w1']}:7077"
    assert kd.driver_host == PRIVATE_IP["hio-m"]  # where the executors dial the driver back
    assert kd.spark_conf == ("spark.driver.port=7079", "spark.blockManager.port=7090", "spark.executor.memory=1g")


@pytest.mark.parametrize("host", list(SPARK_UNITS))
def test_spark_daemons_run_from_the_virtualenv_on_the_private_address(rendered: Rendered, host: str) -> None:
    root = rendered.host(host)
    # pip puts spark-class beside python: this test's own virtualenv has it where the units look.
    assert (Path(sys.prefix) / "bin" / "spark-class").exists()
    for name in SPARK_UNITS[host]:
        unit = read_unit(root / f"etc/systemd/system/{name}.service")
        command = unit["ExecStart"][0].split()
        assert command[0] == f"{root}/opt/hio/bin/spark-class"
        assert command[2:4] == ["--host", PRIVATE_IP[host]]
        assert f"PYSPARK_PYTHON={root}/opt/hio/bin/python" in unit["Environment"]
        assert f"SPARK_LOCAL_IP={PRIVATE_IP[host]}" in unit["Environment"]
        assert f"SPARK_LOCAL_DIRS={root}/var/lib/hio/spark/scratch" in unit["Environment"]
        assert unit["User"] == [os.environ.get("USER") or unit["User"][0]]
        assert unit["Restart"] == ["on-failure"] and unit["SuccessExitStatus"] == ["143"]
        assert unit["ReadWritePaths"] == [f"{root}/var/lib/hio/spark"]
        if name == "hio-spark-master":
            assert command[1] == "org.apache.spark.deploy.master.Master"
            assert command[4:] == ["--port", "7077", "--webui-port", "8080"]
        else:
            assert command[1] == "org.apache.spark.deploy.worker.Worker"
            assert command[4:] == [
                "--port",
                "7078",
                "--webui-port",
                "8081",
                "--cores",
                "2",
                "--memory",
                "2g",
                "--work-dir",
                f"{root}/var/lib/hio/spark/work",
                f"spark://{PRIVATE_IP['hio-w1']}:7077",
            ]
    assert (root / "var/lib/hio/spark/work").is_dir() and (root / "var/lib/hio/spark/scratch").is_dir()


def test_kd_without_a_spark_group_runs_spark_in_local_mode(tmp_path: Path) -> None:
    require_collections()
    playbook = tmp_path / "render.yml"
    playbook.write_text(RENDER_PLAYBOOK)
    common = {**local_vars(tmp_path), "hio_auth": False}
    groups = {"master": ["hio-a"], "repository": ["hio-a"], "kd": ["hio-a"]}
    inventory = write_inventory(tmp_path / "inventory.yml", groups, {"hio-a": {"hio_private_ip": "10.9.0.40"}}, common)
    run_playbook(playbook, inventory, tmp_path)
    with open(tmp_path / "hio-a/etc/hio/hio.toml", "rb") as fh:
        kd = cfg.build(_config_class("kd"), "kd", file_data=tomllib.load(fh))
    assert (kd.spark_master, kd.driver_host, kd.spark_conf) == ("local[2]", "127.0.0.1", ())
    assert not list((tmp_path / "hio-a/etc/systemd/system").glob("*spark*"))


# ------------------------------------------------------------------ the monitoring role


def prometheus_config(rendered: Rendered) -> dict[str, Any]:
    config = yaml.safe_load((rendered.host(PROMETHEUS) / "etc/prometheus/prometheus.yml").read_text())
    assert isinstance(config, dict)
    return config


def test_prometheus_scrapes_every_role_on_every_host_of_the_inventory(rendered: Rendered) -> None:
    jobs = {job["job_name"]: job for job in prometheus_config(rendered)["scrape_configs"]}
    targets = {
        name: {(t["labels"]["instance"], address) for t in job["static_configs"] for address in t["targets"]}
        for name, job in jobs.items()
        if name.startswith("hio-")
    }
    assert targets == {
        "hio-master": {("hio-m", "10.9.0.10:7080")},
        "hio-repository": {("hio-m", "10.9.0.10:7180")},
        "hio-worker": {("hio-w1", "10.9.0.21:7280"), ("hio-w2", "10.9.0.22:7281")},  # hio-w2's http_listen
        "hio-gateway": {("hio-g1", "10.9.0.31:7380")},
        "hio-kd": {("hio-m", "10.9.0.10:7480")},
    }
    secrets = f"{rendered.host(PROMETHEUS)}/etc/prometheus/hio"
    for name in targets:
        assert jobs[name]["scheme"] == "https"
        assert jobs[name]["authorization"] == {"type": "Bearer", "credentials_file": f"{secrets}/viewer.token"}
        assert jobs[name]["tls_config"] == {
            "ca_file": f"{secrets}/ca.crt",
            "cert_file": f"{secrets}/client.crt",
            "key_file": f"{secrets}/client.key",
        }
    rules = rendered.host(PROMETHEUS) / "etc/prometheus/rules/hio.rules.yml"
    assert prometheus_config(rendered)["rule_files"] == [str(rules)]
    assert rules.read_text() == (REPO / "ansible/roles/monitoring/files/hio.rules.yml").read_text()
    defaults = (rendered.host(PROMETHEUS) / "etc/default/prometheus").read_text()
    assert 'ARGS="--web.listen-address=127.0.0.1:9090 --storage.tsdb.retention.time=15d"' in defaults


def test_promtool_accepts_the_rendered_configuration_and_its_files(rendered: Rendered) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: apt-get install prometheus (Debian's package provides it)")
    config = rendered.host(PROMETHEUS) / "etc/prometheus/prometheus.yml"
    proc = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout and "rules found" in proc.stdout


@pytest.mark.parametrize("host,role", [(h, r) for h, roles in HOST_ROLES.items() for r in roles])
def test_every_role_serves_its_metrics_to_prometheus_token_and_certificate(
    rendered: Rendered, host: str, role: str
) -> None:
    """The role's endpoint as its rendered settings make it (tokens file, certificate, mutual
    TLS), asked as the rendered Prometheus configuration asks: with its viewer token and client
    certificate, verifying the role's certificate against the cluster's CA."""
    settings = cfg.build(_config_class(role), role, file_data=rendered.toml(host))
    endpoint = HttpEndpoint(settings, "127.0.0.1:0", role_routes(role_registry()), name=role).start()
    secrets = rendered.host(PROMETHEUS) / "etc/prometheus/hio"
    context = ssl.create_default_context(cafile=str(secrets / "ca.crt"))
    context.load_cert_chain(str(secrets / "client.crt"), str(secrets / "client.key"))
    token = (secrets / "viewer.token").read_text().strip()
    request = urllib.request.Request(
        f"https://127.0.0.1:{endpoint.port}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            assert reply.status == 200 and b"process_cpu_seconds_total" in reply.read()
    finally:
        endpoint.close()


def test_grafana_gets_the_dashboard_and_a_data_source_for_this_prometheus(rendered: Rendered) -> None:
    grafana = rendered.host(PROMETHEUS) / "etc/grafana/provisioning"
    [source] = yaml.safe_load((grafana / "datasources/hio.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://127.0.0.1:9090"
    [provider] = yaml.safe_load((grafana / "dashboards/hio.yml").read_text())["providers"]
    dashboards = Path(provider["options"]["path"])
    assert dashboards == rendered.host(PROMETHEUS) / "var/lib/grafana/dashboards/hio"
    assert json.loads((dashboards / "hio-dashboard.json").read_text())["uid"] == "hio-cluster"
