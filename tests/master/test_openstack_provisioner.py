"""The openstack driver against a double of Keystone, Nova, Glance and Neutron over real
HTTP on loopback (tests/openstack_double.py): openstacksdk makes every call it
makes against a cloud, nothing of it is mocked. Its options are given as an operator
gives them, ``provisioner_options`` items, and refused with messages naming them."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openstack")

import yaml

from hio.config import ConfigError, build
from hio.master.config import MasterConfig
from hio.master.provisioners import ProvisionError, WorkerRequest, WorkerState, open_provisioner, parse_options
from hio.master.provisioners.openstack import (
    CLUSTER_KEY,
    TOKEN_FILE,
    WORKER_KEY,
    OpenStackProvisioner,
    OpenStackSettings,
)
from hio.worker.config import WorkerConfig
from tests.harness import hio_env
from tests.openstack_double import CLOUD, OpenStackDouble

TOKEN = "tok-3f9a1c-never-in-metadata"
MASTER = "192.168.100.5:7000"
REPOSITORY = "192.168.100.6:7100"

# openstacksdk's notes on its own future (its internals call what it deprecates)
pytestmark = pytest.mark.filterwarnings("ignore::PendingDeprecationWarning:openstack")


@pytest.fixture
def cloud() -> Iterator[OpenStackDouble]:
    with OpenStackDouble() as double:
        yield double
        assert double.unknown == [], "openstacksdk asked the double for something it does not serve"


def settings_for(cloud: OpenStackDouble, folder: Path, *items: str, password: str = "") -> OpenStackSettings:
    """Settings of a driver that creates workers in the double, with more
    ``provisioner_options`` items (which win)."""
    clouds = cloud.clouds_yaml(folder, **({"password": password} if password else {}))
    base = (f"cloud={CLOUD}", f"clouds_file={clouds}", "image=hio-worker-image", "cluster=physics")
    return OpenStackSettings.from_options(parse_options((*base, *items)))


@pytest.fixture
def driver(cloud: OpenStackDouble, tmp_path: Path) -> Iterator[OpenStackProvisioner]:
    provisioner = OpenStackProvisioner(settings_for(cloud, tmp_path), repository_address=REPOSITORY)
    yield provisioner
    provisioner.close()


def user_data_of(cloud: OpenStackDouble, worker_id: str) -> dict[str, Any]:
    """The cloud-config the server of ``worker_id`` got, read as cloud-init reads it."""
    text = cloud.user_data[cloud.server_named(f"hio-worker-{worker_id}")["id"]]
    assert text.startswith("#cloud-config\n")
    document = yaml.safe_load(text)
    assert isinstance(document, dict)
    return document


def written_file(document: dict[str, Any], path: str) -> dict[str, Any]:
    [entry] = [f for f in document["write_files"] if f["path"] == path]
    return entry


def test_create_answers_building_and_an_active_server_is_running(
    cloud: OpenStackDouble, driver: OpenStackProvisioner
) -> None:
    created = driver.create(WorkerRequest("w1", MASTER, TOKEN))
    assert created.state is WorkerState.BUILDING
    server = cloud.server_named("hio-worker-w1")
    assert server["id"] in created.detail
    assert driver.state("w1").state is WorkerState.BUILDING

    cloud.set_status(server["id"], "ACTIVE")
    running = driver.state("w1")
    assert running.state is WorkerState.RUNNING and "ACTIVE" in running.detail


def test_the_server_is_asked_for_as_the_settings_say(cloud: OpenStackDouble, tmp_path: Path) -> None:
    settings = settings_for(cloud, tmp_path, "key_name=hio", "availability_zone=zone-b")
    OpenStackProvisioner(settings, repository_address=REPOSITORY).create(WorkerRequest("w1", MASTER, TOKEN))
    [post] = cloud.called("POST", r"/compute/v2\.1/servers$")
    asked = post.body["server"]
    assert asked["name"] == "hio-worker-w1"
    assert asked["flavorRef"] == "f-large"  # ssc.large by name
    assert asked["imageRef"] == cloud.images[0]["id"]
    assert asked["networks"] == [{"uuid": cloud.networks[0]["id"]}]  # hio-net by name
    assert asked["security_groups"] == [{"name": "hio-internal"}, {"name": "hio-workers"}]
    assert asked["key_name"] == "hio" and asked["availability_zone"] == "zone-b"
    assert asked["metadata"] == {CLUSTER_KEY: "physics", WORKER_KEY: "w1"}


def test_user_data_starts_the_worker_with_the_token_only_in_a_root_only_file(
    cloud: OpenStackDouble, driver: OpenStackProvisioner
) -> None:
    driver.create(WorkerRequest("w1", MASTER, TOKEN))
    document = user_data_of(cloud, "w1")

    token_file = written_file(document, TOKEN_FILE)
    assert token_file["content"].strip() == TOKEN
    assert (token_file["owner"], token_file["permissions"]) == ("root:root", "0600")
    unit = written_file(document, "/etc/systemd/system/hio-worker.service")["content"]
    [exec_start] = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert exec_start == (
        "ExecStart=/opt/hio/bin/hio worker --elastic --worker-id w1 --master-address 192.168.100.5:7000"
        " --token-file %d/token"
    )
    assert f"LoadCredential=token:{TOKEN_FILE}" in unit
    assert ["systemctl", "restart", "hio-worker.service"] in document["runcmd"]

    # the token is in its file and nowhere else: not the unit, the config, the metadata, the server
    others = [f for f in document["write_files"] if f["path"] != TOKEN_FILE]
    assert TOKEN not in json.dumps(others) and TOKEN not in json.dumps(document["runcmd"])
    [post] = cloud.called("POST", r"/compute/v2\.1/servers$")
    assert TOKEN not in json.dumps({k: v for k, v in post.body["server"].items() if k != "user_data"})
    assert TOKEN not in json.dumps(cloud.server_named("hio-worker-w1"))


def test_the_unit_is_one_systemd_accepts(cloud: OpenStackDouble, driver: OpenStackProvisioner, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    driver.create(WorkerRequest("w1", MASTER, TOKEN))
    unit = tmp_path / "hio-worker.service"
    unit.write_text(written_file(user_data_of(cloud, "w1"), "/etc/systemd/system/hio-worker.service")["content"])
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # this machine has no /opt/hio: that is the one complaint a unit that parses may get
    complaints = [line for line in result.stderr.splitlines() if line.strip()]
    assert all("/opt/hio/bin/hio is not executable" in line for line in complaints), result.stderr


def test_the_workers_configuration_is_one_the_worker_accepts(cloud: OpenStackDouble, tmp_path: Path) -> None:
    settings = settings_for(cloud, tmp_path, "worker_settings=runtime=process grace_seconds=7 log_level=info")
    OpenStackProvisioner(settings, repository_address=REPOSITORY).create(WorkerRequest("w1", MASTER, TOKEN))
    document = user_data_of(cloud, "w1")
    toml = tomllib.loads(written_file(document, "/etc/hio/hio.toml")["content"])
    assert toml["worker"]["repository_address"] == REPOSITORY
    assert toml["worker"]["grace_seconds"] == 7

    # the worker reads it as its file, with the command line's flags (the unit's ExecStart)
    config = build(
        WorkerConfig,
        "worker",
        file_data=toml,
        overrides={"worker_id": "w1", "master_address": MASTER, "elastic": True},
    )
    assert (config.runtime, config.grace_seconds, config.elastic) == ("process", 7.0, True)
    assert (config.engine_listen_host, config.data_dir) == ("0.0.0.0", "/var/lib/hio")
    assert config.http_listen == "0.0.0.0:7280", "its /metrics reachable from the private network"


def test_worker_cpus_is_the_workers_cpus_and_else_the_flavors(cloud: OpenStackDouble, tmp_path: Path) -> None:
    """The packer counts new workers by what the driver says each offers."""
    flavors = OpenStackProvisioner(settings_for(cloud, tmp_path, "flavor=ssc.xlarge"), repository_address=REPOSITORY)
    flavors.check()
    assert flavors.worker_cpus() == 8  # ssc.xlarge's vCPUs
    flavors.create(WorkerRequest("w1", MASTER, TOKEN))
    unit = written_file(user_data_of(cloud, "w1"), "/etc/systemd/system/hio-worker.service")["content"]
    assert "--cpus" not in unit  # the worker counts the server's own

    fewer = OpenStackProvisioner(settings_for(cloud, tmp_path), repository_address=REPOSITORY, worker_cpus=3)
    fewer.check()
    assert fewer.worker_cpus() == 3
    fewer.create(WorkerRequest("w2", MASTER, TOKEN))
    unit = written_file(user_data_of(cloud, "w2"), "/etc/systemd/system/hio-worker.service")["content"]
    assert "--master-address 192.168.100.5:7000 --cpus 3 --token-file" in unit

    more = OpenStackProvisioner(settings_for(cloud, tmp_path), repository_address=REPOSITORY, worker_cpus=6)
    with pytest.raises(ConfigError) as refused:
        more.check()
    assert str(refused.value) == "worker_cpus (6) is more than the 4 vCPUs of provisioner_options flavor 'ssc.large'"


def test_the_server_advertises_its_address_on_the_route_to_the_master(
    cloud: OpenStackDouble, driver: OpenStackProvisioner, tmp_path: Path
) -> None:
    """The script cloud-init runs at first boot, run here: the master is on loopback."""
    driver.create(WorkerRequest("w1", "127.0.0.1:7000", TOKEN))
    document = user_data_of(cloud, "w1")
    [command] = [c for c in document["runcmd"] if c[0] == "python3"]
    script = tmp_path / "advertise-host.py"
    script.write_text(written_file(document, command[1])["content"])
    env_file = tmp_path / "worker.env"
    subprocess.run([sys.executable, str(script), command[2], str(env_file)], check=True, timeout=30)
    assert env_file.read_text() == "HIO_WORKER_ADVERTISE_HOST=127.0.0.1\n"
    assert command[3] == "/etc/hio/worker.env"


def test_pip_install_makes_the_virtualenv_at_first_boot(cloud: OpenStackDouble, tmp_path: Path) -> None:
    wheel = "harmonicio[docker] @ https://files.example.org/harmonicio-0.1.0-py3-none-any.whl"
    settings = settings_for(cloud, tmp_path, f"pip_install='{wheel}' -c https://files.example.org/c.txt")
    OpenStackProvisioner(settings, repository_address=REPOSITORY).create(WorkerRequest("w1", MASTER, TOKEN))
    document = user_data_of(cloud, "w1")
    assert document["packages"] == ["python3.11", "python3.11-venv"]
    install = document["runcmd"].index(["python3.11", "-m", "venv", "/opt/hio"])
    pip = ["/opt/hio/bin/pip", "install", "--disable-pip-version-check", wheel, "-c", "https://files.example.org/c.txt"]
    assert document["runcmd"][install + 1] == pip
    assert document["runcmd"].index(["systemctl", "daemon-reload"]) > install + 1


def test_a_cluster_without_tokens_writes_no_token_file(cloud: OpenStackDouble, driver: OpenStackProvisioner) -> None:
    driver.create(WorkerRequest("w1", MASTER))
    document = user_data_of(cloud, "w1")
    assert TOKEN_FILE not in [f["path"] for f in document["write_files"]]
    unit = written_file(document, "/etc/systemd/system/hio-worker.service")["content"]
    assert "--token-file" not in unit and "LoadCredential" not in unit


def test_a_server_that_fails_to_boot_is_failed_with_the_clouds_fault(
    cloud: OpenStackDouble, driver: OpenStackProvisioner
) -> None:
    driver.create(WorkerRequest("w1", MASTER, TOKEN))
    cloud.fail(cloud.server_named("hio-worker-w1")["id"], "No valid host was found. There are not enough hosts.")
    failed = driver.state("w1")
    assert failed.state is WorkerState.FAILED
    assert "No valid host was found. There are not enough hosts." in failed.detail and "ERROR" in failed.detail


def test_a_stopped_server_is_failed(cloud: OpenStackDouble, driver: OpenStackProvisioner) -> None:
    driver.create(WorkerRequest("w1", MASTER, TOKEN))
    cloud.set_status(cloud.server_named("hio-worker-w1")["id"], "SHUTOFF")
    assert driver.state("w1").state is WorkerState.FAILED


def test_delete_makes_the_worker_gone_and_deleting_again_is_fine(
    cloud: OpenStackDouble, driver: OpenStackProvisioner
) -> None:
    driver.create(WorkerRequest("w1", MASTER, TOKEN))
    cloud.set_status(cloud.server_named("hio-worker-w1")["id"], "ACTIVE")
    driver.delete("w1")
    assert cloud.servers == {}
    assert driver.state("w1").state is WorkerState.GONE
    driver.delete("w1")
    driver.delete("never-asked-for")
    assert len(cloud.called("DELETE", r"/servers/")) == 1


def test_a_worker_id_with_a_server_gets_no_second_one(cloud: OpenStackDouble, tmp_path: Path) -> None:
    """Also after a restart, and when the answer to the first create was lost."""
    first = OpenStackProvisioner(settings_for(cloud, tmp_path), repository_address=REPOSITORY)
    first.create(WorkerRequest("w1", MASTER, TOKEN))
    assert first.create(WorkerRequest("w1", MASTER, TOKEN)).state is WorkerState.BUILDING
    restarted = OpenStackProvisioner(settings_for(cloud, tmp_path), repository_address=REPOSITORY)
    assert restarted.create(WorkerRequest("w1", MASTER, TOKEN)).state is WorkerState.BUILDING
    assert len(cloud.called("POST", r"/servers$")) == 1


def test_a_create_whose_answer_came_too_late_makes_no_second_server(cloud: OpenStackDouble, tmp_path: Path) -> None:
    """Nova created the server, the driver gave up waiting: asking again finds that server."""
    driver = OpenStackProvisioner(settings_for(cloud, tmp_path, "api_timeout=0.5"), repository_address="")
    driver.check()
    cloud.delays[r"^POST /compute/v2\.1/servers$"] = 2.0
    started = time.monotonic()
    with pytest.raises(ProvisionError, match=r"did not answer within provisioner_options api_timeout \(0\.5 s\)"):
        driver.create(WorkerRequest("w1", MASTER, TOKEN))
    assert time.monotonic() - started < 1.9
    assert driver.create(WorkerRequest("w1", MASTER, TOKEN)).state is WorkerState.BUILDING
    assert len(cloud.called("POST", r"/servers$")) == 1


def test_adopt_finds_this_clusters_workers_and_nothing_else(cloud: OpenStackDouble, tmp_path: Path) -> None:
    before = OpenStackProvisioner(settings_for(cloud, tmp_path), repository_address=REPOSITORY)
    for worker_id in ("w1", "w2", "w3"):
        before.create(WorkerRequest(worker_id, MASTER, TOKEN))
    cloud.set_status(cloud.server_named("hio-worker-w1")["id"], "ACTIVE")
    cloud.fail(cloud.server_named("hio-worker-w3")["id"], "Build of instance aborted")
    cloud.add_server("hio-worker-x1", {CLUSTER_KEY: "chemistry", WORKER_KEY: "x1"})  # another cluster's
    cloud.add_server("hio-worker-x2", {})  # a server someone named like ours
    cloud.add_server("login-node", {CLUSTER_KEY: "physics"})  # no worker id: not a worker
    before.close()

    restarted = OpenStackProvisioner(settings_for(cloud, tmp_path), repository_address=REPOSITORY)
    adopted = {worker.worker_id: worker.state for worker in restarted.adopt()}
    assert adopted == {"w1": WorkerState.RUNNING, "w2": WorkerState.BUILDING, "w3": WorkerState.FAILED}
    assert restarted.state("x1").state is WorkerState.GONE  # not ours to see
    restarted.delete("w3")
    restarted.delete("x1")  # not ours to delete
    assert sorted(s["name"] for s in cloud.servers.values()) == [
        "hio-worker-w1",
        "hio-worker-w2",
        "hio-worker-x1",
        "hio-worker-x2",
        "login-node",
    ]


def test_credentials_the_cloud_refuses_are_named(cloud: OpenStackDouble, tmp_path: Path) -> None:
    settings = settings_for(cloud, tmp_path, password="wrong")
    driver = OpenStackProvisioner(settings, repository_address=REPOSITORY)
    with pytest.raises(ConfigError, match=r"refused the credentials of provisioner_options cloud 'double'") as refused:
        driver.check()
    assert "requires authentication" in str(refused.value)
    with pytest.raises(ProvisionError, match="refused the credentials") as raised:
        driver.create(WorkerRequest("w1", MASTER, TOKEN))
    assert raised.value.setting == "provisioner_options cloud"
    assert cloud.servers == {}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("flavor=ssc.huge", "provisioner_options flavor: the cloud has no flavor 'ssc.huge'"),
        ("image=Ubuntu 99.04", "provisioner_options image: the cloud has no image 'Ubuntu 99.04'"),
        ("network=nowhere-net", "provisioner_options network: the cloud has no network 'nowhere-net'"),
        (
            "security_groups=hio-internal open-to-all",
            "provisioner_options security_groups: the cloud has no security group 'open-to-all'",
        ),
        ("key_name=lost-key", "provisioner_options key_name: the cloud has no key pair 'lost-key'"),
    ],
)
def test_names_the_cloud_does_not_know_are_refused_at_start_up(
    cloud: OpenStackDouble, tmp_path: Path, change: str, words: str
) -> None:
    driver = OpenStackProvisioner(settings_for(cloud, tmp_path, change), repository_address=REPOSITORY)
    with pytest.raises(ConfigError) as refused:
        driver.check()
    assert str(refused.value) == words


def test_an_unknown_flavor_at_create_is_a_provision_error_naming_it(cloud: OpenStackDouble, tmp_path: Path) -> None:
    driver = OpenStackProvisioner(settings_for(cloud, tmp_path, "flavor=ssc.huge"), repository_address="")
    with pytest.raises(
        ProvisionError, match=r"provisioner_options flavor: the cloud has no flavor 'ssc\.huge'"
    ) as raised:
        driver.create(WorkerRequest("w1", MASTER, TOKEN))
    assert raised.value.setting == "provisioner_options flavor"


def test_a_security_group_nova_refuses_at_create_is_the_clouds_message(cloud: OpenStackDouble, tmp_path: Path) -> None:
    """Nova, not the driver, checks security groups at create (check() looks them up first)."""
    driver = OpenStackProvisioner(
        settings_for(cloud, tmp_path, "security_groups=gone-group"), repository_address=REPOSITORY
    )
    with pytest.raises(ProvisionError) as raised:
        driver.create(WorkerRequest("w1", MASTER, TOKEN))
    assert str(raised.value) == (
        "create server hio-worker-w1: Unable to find security group with name or id 'gone-group' (HTTP 400)"
    )


def test_the_quota_is_the_clouds_message(cloud: OpenStackDouble, driver: OpenStackProvisioner) -> None:
    cloud.max_servers = 1
    driver.create(WorkerRequest("w1", MASTER, TOKEN))
    with pytest.raises(ProvisionError) as raised:
        driver.create(WorkerRequest("w2", MASTER, TOKEN))
    assert str(raised.value) == (
        "create server hio-worker-w2: Quota exceeded for instances: Requested 1, but already used 1 of 1 "
        "instances (HTTP 403)"
    )
    assert raised.value.setting == ""


def test_a_cloud_not_in_clouds_yaml_is_named(cloud: OpenStackDouble, tmp_path: Path) -> None:
    driver = OpenStackProvisioner(settings_for(cloud, tmp_path, "cloud=snic"), repository_address="")
    with pytest.raises(ConfigError) as refused:
        driver.check()
    assert str(refused.value) == (
        f"load the credentials: provisioner_options cloud 'snic' (in {tmp_path / 'clouds.yaml'}) cannot be used: "
        "Cloud snic was not found."
    )


def test_a_cloud_that_cannot_be_reached_is_a_provision_error(cloud: OpenStackDouble, tmp_path: Path) -> None:
    settings = settings_for(cloud, tmp_path, "api_timeout=5")
    cloud.stop()  # its port now refuses connections
    driver = OpenStackProvisioner(settings, repository_address=REPOSITORY)
    with pytest.raises(ProvisionError, match="cannot be reached") as raised:
        driver.check()
    assert raised.value.setting == ""


@pytest.mark.parametrize(
    ("items", "words"),
    [
        ((), "provisioner_options image is missing"),
        (("image=i", "flavor="), "provisioner_options flavor is empty"),
        (("image=i", "cluster=my cluster"), "provisioner_options cluster must be"),
        (("image=i", "cluster="), "provisioner_options cluster must be"),
        (("image=i", "colour=blue"), "the openstack driver has no option colour; it has cloud, clouds_file,"),
        (("image=i", "clouds_file=/nonexistent/clouds.yaml"), "provisioner_options clouds_file /nonexistent/clouds"),
        (("image=i", "api_timeout=soon"), "provisioner_options api_timeout: 'soon' is not a number"),
        (("image=i", "api_timeout=inf"), "provisioner_options api_timeout must be a positive"),
        (("image=i", "pip_install=x", "python=python; rm"), "provisioner_options python must look like"),
        (("image=i", "pip_install='unclosed"), "provisioner_options pip_install cannot be split"),
        (("image=i", "worker_settings=runtime"), "provisioner_options worker_settings: 'runtime' must look like"),
        (("image=i", "worker_settings=colour=blue"), "provisioner_options worker_settings: unknown setting 'colour'"),
        (("image=i", "worker_settings=grace_seconds=x"), "worker_settings grace_seconds: 'x' is not a number"),
        (("image=i", "worker_settings=token=abc"), "provisioner_options worker_settings: token: the driver writes"),
        (("image=i", "worker_settings=advertise_host=10.0.0.9"), "advertise_host: each server advertises"),
        (("image=i", "worker_settings=engines=hio/synthetic"), "engines: an elastic worker runs the engines"),
        (("image=i", "worker_settings=cpus=4"), "cpus: the master's worker_cpus sets it"),
    ],
)
def test_bad_options_are_refused_naming_the_option(items: tuple[str, ...], words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        OpenStackSettings.from_options(parse_options(items))
    assert words in str(refused.value)


@pytest.mark.parametrize(
    "request_",
    [
        WorkerRequest("w 1", MASTER, TOKEN),
        WorkerRequest("w1/2", MASTER, TOKEN),
        WorkerRequest("%n", MASTER, TOKEN),
        WorkerRequest("w1", "10.0.0.1:7000 --token abc", TOKEN),
        WorkerRequest("w1", MASTER, "two words"),
    ],
)
def test_requests_that_would_not_survive_the_unit_are_refused(
    cloud: OpenStackDouble, driver: OpenStackProvisioner, request_: WorkerRequest
) -> None:
    with pytest.raises(ProvisionError):
        driver.create(request_)
    assert cloud.requests == []


def test_the_driver_does_not_import_openstacksdk_until_it_connects() -> None:
    """A master with another driver never loads openstacksdk."""
    program = (
        "import sys\n"
        "from hio.master.provisioners.openstack import OpenStackProvisioner, OpenStackSettings\n"
        "OpenStackProvisioner(OpenStackSettings(image='i'), repository_address='')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('openstack', 'keystoneauth1')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2]
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# -- chosen by the master: provisioner = "openstack" and provisioner_options ------------------


def master_config(cloud: OpenStackDouble, folder: Path, *items: str, **settings: Any) -> MasterConfig:
    """An elastic master whose openstack driver creates workers in the double."""
    clouds = cloud.clouds_yaml(folder)
    options = (f"cloud={CLOUD}", f"clouds_file={clouds}", "image=hio-worker-image", *items)
    values: dict[str, Any] = {
        "data_dir": str(folder),
        "scaling": "elastic",
        "provisioner": "openstack",
        "provisioner_options": options,
        "advertise_address": MASTER,
        "repository_address": REPOSITORY,
        **settings,
    }
    config = MasterConfig(**values)
    config.validate()
    return config


def test_the_master_opens_the_driver_its_options_describe_checked(cloud: OpenStackDouble, tmp_path: Path) -> None:
    driver = open_provisioner(master_config(cloud, tmp_path, "flavor=ssc.xlarge", "cluster=physics"), tmp_path)
    assert isinstance(driver, OpenStackProvisioner)
    try:
        assert (driver.settings.flavor, driver.settings.cluster) == ("ssc.xlarge", "physics")
        assert driver.worker_cpus() == 8  # looked up at start-up
        assert cloud.called("POST", r"/identity/v3/auth/tokens$")  # logged in at start-up
    finally:
        driver.close()


def test_an_unknown_flavor_refuses_the_masters_start_naming_the_option(cloud: OpenStackDouble, tmp_path: Path) -> None:
    config = master_config(cloud, tmp_path, "flavor=ssc.huge")
    with pytest.raises(ConfigError) as refused:
        open_provisioner(config, tmp_path)
    assert str(refused.value) == "provisioner_options flavor: the cloud has no flavor 'ssc.huge'"


def test_hio_master_refuses_to_start_with_an_unknown_flavor(cloud: OpenStackDouble, tmp_path: Path) -> None:
    clouds = cloud.clouds_yaml(tmp_path)
    argv = [
        sys.executable, "-m", "hio.cli", "master",
        "--data-dir", str(tmp_path),
        "--listen", "127.0.0.1:0",
        "--scaling", "elastic",
        "--provisioner", "openstack",
        "--provisioner-options", f"cloud={CLOUD}",
        "--provisioner-options", f"clouds_file={clouds}",
        "--provisioner-options", "image=hio-worker-image",
        "--provisioner-options", "flavor=ssc.huge",
        "--advertise-address", MASTER,
        "--repository-address", REPOSITORY,
    ]  # fmt: skip
    done = subprocess.run(
        argv,
        env=hio_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "hio master: provisioner_options flavor: the cloud has no flavor 'ssc.huge'" in done.stderr


def test_a_cloud_that_cannot_be_reached_at_start_up_is_logged_and_the_master_starts(
    cloud: OpenStackDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = master_config(cloud, tmp_path, "api_timeout=5")
    cloud.stop()
    with caplog.at_level(logging.WARNING, logger="hio.master.provisioners"):
        driver = open_provisioner(config, tmp_path)
    assert isinstance(driver, OpenStackProvisioner)
    driver.close()
    [warning] = [r for r in caplog.records if "could not be checked" in r.getMessage()]
    assert "cannot be reached" in warning.error  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"advertise_address": ""}, "advertise_address: worker servers would reach the master at 127.0.0.1:7000"),
        ({"advertise_address": "localhost:7000"}, "advertise_address: worker servers would reach the master at"),
        ({"advertise_address": "", "listen": "0.0.0.0:7000"}, "advertise_address: worker servers would reach"),
        ({"repository_address": "127.0.0.1:7100"}, "repository_address: worker servers would reach the repository"),
        ({"repository_address": "[::1]:7100"}, "repository_address: worker servers would reach the repository"),
        ({"worker_prefix": "elastic:workers"}, "worker_prefix 'elastic:workers': the openstack driver names servers"),
        ({"worker_prefix": "w" * 57}, "worker_prefix"),
    ],
)
def test_master_settings_a_worker_server_cannot_use_are_refused(
    cloud: OpenStackDouble, tmp_path: Path, settings: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        open_provisioner(master_config(cloud, tmp_path, **settings), tmp_path)
    assert words in str(refused.value)
    assert cloud.requests == []  # refused before the cloud is asked anything


def test_a_repository_address_in_worker_settings_is_the_one_servers_use(cloud: OpenStackDouble, tmp_path: Path) -> None:
    config = master_config(
        cloud, tmp_path, "worker_settings=repository_address=10.1.0.6:7100", repository_address="127.0.0.1:7100"
    )
    driver = open_provisioner(config, tmp_path)
    assert driver is not None
    try:
        driver.create(WorkerRequest("elastic-1", MASTER, TOKEN))
    finally:
        driver.close()
    toml = tomllib.loads(written_file(user_data_of(cloud, "elastic-1"), "/etc/hio/hio.toml")["content"])
    assert toml["worker"]["repository_address"] == "10.1.0.6:7100"
