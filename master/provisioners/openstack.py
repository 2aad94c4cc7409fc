"""The ``openstack`` driver: workers are servers on an OpenStack cloud (SNIC Science Cloud
and alike), asked for and given back through the compute API with openstacksdk.

A server is named ``hio-worker-<worker id>`` and carries two metadata keys,
``hio_cluster`` and ``hio_worker_id``; the metadata, not the name, says which servers
are this cluster's, so a master that restarts finds (:meth:`OpenStackProvisioner.adopt`)
exactly the workers it asked for, and two clusters in one project leave each other's
servers alone. The server's user data is a cloud-init document that installs
HarmonicIO (or finds it in the image), writes the worker's token to a root-only file
and runs ``hio worker`` under systemd; the token is in that file only, never in
metadata, the server's name or the worker's command line.

openstacksdk is imported when a driver connects, so a master with another driver never
imports it (``pip install 'harmonicio[openstack]'``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import json
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hio.config import ConfigError, as_text, parse_assignments, setting
from hio.master.provisioners import ProvisionedWorker, WorkerRequest, WorkerState
from hio.worker.config import WorkerConfig

if TYPE_CHECKING:
    from openstack.compute.v2.server import Server
    from openstack.connection import Connection

CLUSTER_KEY = "hio_cluster"  # server metadata: the cluster that asked for the server
WORKER_KEY = "hio_worker_id"  # server metadata: the worker id it registers under
SERVER_PREFIX = "hio-worker-"

#: Where a worker server keeps HarmonicIO, as site.yml lays a host out (docs/deploy.md).
PREFIX = "/opt/hio"
ETC = "/etc/hio"
DATA_DIR = "/var/lib/hio"
TOKEN_FILE = f"{ETC}/worker.token"
CONFIG_FILE = f"{ETC}/hio.toml"
ENV_FILE = f"{ETC}/worker.env"
UNIT_FILE = "/etc/systemd/system/hio-worker.service"
ADVERTISE_SCRIPT = "/usr/local/lib/hio/advertise-host.py"

#: Worker settings the driver decides itself, refused in ``openstack_worker_settings``.
DRIVER_WORKER_SETTINGS = {
    "worker_id": "the driver sets it to the id the master asked for",
    "master_address": "the driver sets it to the address the master gave",
    "token": "the driver writes the master's token for the worker to a root-only file",
    "token_file": "the driver writes the master's token for the worker to a root-only file",
    "advertise_host": "each server advertises its own address on the master's network",
}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# What a master address may hold on the worker's command line (host:port, [v6]:port, dns:///...)
_ADDRESS_CHARACTERS = re.compile(r"^[A-Za-z0-9.:/\[\]_-]+$")

# Nova's server status -> what it means for a worker. Statuses not listed (REBOOT,
# RESIZE, MIGRATING, UNKNOWN, ...) are a server that exists and is meant to run.
_STATES = {
    "BUILD": WorkerState.BUILDING,
    "ACTIVE": WorkerState.RUNNING,
    "ERROR": WorkerState.FAILED,
    # stopped by someone or something: the worker will not come back by itself
    "SHUTOFF": WorkerState.FAILED,
    "SUSPENDED": WorkerState.FAILED,
    "PAUSED": WorkerState.FAILED,
    "SHELVED": WorkerState.FAILED,
    "SHELVED_OFFLOADED": WorkerState.FAILED,
    "DELETED": WorkerState.GONE,
    "SOFT_DELETED": WorkerState.GONE,
}


class ProvisionError(RuntimeError):
    """The cloud refused or failed a request; the message says what was asked and the
    cloud's words. ``setting`` names the setting to change when one is at fault (an
    unknown flavor, credentials the cloud refuses), else it is ''."""

    def __init__(self, message: str, *, setting: str = "") -> None:
        super().__init__(message)
        self.setting = setting


@dataclasses.dataclass(frozen=True)
class OpenStackSettings:
    """The driver's settings. The names carry the ``openstack_`` prefix so that a role's
    configuration can inherit them as they are (``--openstack-flavor``,
    ``HIO_MASTER_OPENSTACK_FLAVOR``, ``openstack_flavor`` in ``[master]``), and every
    message names the setting as the operator writes it."""

    openstack_cloud: str = setting(
        "", "clouds.yaml entry the workers are created in; empty = $OS_CLOUD, else the OS_* variables"
    )
    openstack_clouds_file: str = setting(
        "",
        "clouds.yaml to read (a secure.yaml beside it is read too); empty = openstacksdk's "
        "places ($OS_CLIENT_CONFIG_FILE, ./clouds.yaml, ~/.config/openstack/, /etc/openstack/)",
    )
    openstack_cluster: str = setting(
        "hio",
        "name in the hio_cluster metadata of this cluster's worker servers; unique per "
        "cluster in a project, or masters adopt each other's workers",
    )
    openstack_flavor: str = setting("ssc.large", "flavor (name or id) of worker servers")
    openstack_image: str = setting(
        "",
        "image (name or id) worker servers boot; with openstack_pip_install empty it must "
        "hold HarmonicIO in /opt/hio (required)",
    )
    openstack_network: str = setting(
        "hio-net", "network (name or id) worker servers join, the one the master and gateways reach them on"
    )
    openstack_security_groups: tuple[str, ...] = setting(
        ("hio-internal", "hio-workers"),
        "security groups of worker servers (provision.yml's: the cluster's ports and the engines' ports)",
    )
    openstack_key_name: str = setting("", "SSH key pair put on worker servers; empty = none")
    openstack_availability_zone: str = setting("", "availability zone of worker servers; empty = the cloud's choice")
    openstack_pip_install: tuple[str, ...] = setting(
        (),
        "pip install arguments that install HarmonicIO into /opt/hio at first boot, e.g. "
        "'harmonicio[docker] @ https://host/harmonicio-0.1.0-py3-none-any.whl'; "
        "empty = the image has it there (boots faster)",
    )
    openstack_python: str = setting(
        "python3.11", "interpreter (an apt package, with its -venv package) /opt/hio is made from for pip installs"
    )
    openstack_worker_settings: tuple[str, ...] = setting(
        (),
        "worker settings NAME=VALUE written to each worker's hio.toml (e.g. runtime=process, "
        "engines=hio/microscopy, tokens_file=...); the driver sets worker_id, "
        "master_address, the token and advertise_host",
    )
    openstack_boot_timeout: float = setting(
        900.0, "seconds a worker server may stay in BUILD before it counts as failed"
    )
    openstack_api_timeout: float = setting(30.0, "seconds one call to the cloud may take")

    @classmethod
    def taken_from(cls, config: object) -> OpenStackSettings:
        """The driver's settings out of a configuration that declares them (the master's)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def validate(self) -> None:
        """Refuse settings the driver cannot work with; each message names the setting."""
        if not self.openstack_image:
            raise ConfigError("openstack_image is empty: name the image worker servers boot")
        if not self.openstack_flavor:
            raise ConfigError("openstack_flavor is empty: name the flavor of worker servers")
        if not _NAME.match(self.openstack_cluster):
            raise ConfigError(
                f"openstack_cluster must be 1-63 letters, digits, '.', '_' or '-', got {self.openstack_cluster!r}"
            )
        for group in self.openstack_security_groups:
            if not group.strip():
                raise ConfigError("openstack_security_groups names an empty group")
        if self.openstack_clouds_file and not Path(self.openstack_clouds_file).expanduser().is_file():
            raise ConfigError(f"openstack_clouds_file {self.openstack_clouds_file} is not a file")
        if self.openstack_pip_install and not re.match(r"^python3(\.\d+)?$", self.openstack_python):
            raise ConfigError(f"openstack_python must look like python3.11, got {self.openstack_python!r}")
        for name in ("openstack_boot_timeout", "openstack_api_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        self.worker_file_settings()

    def worker_file_settings(self) -> dict[str, Any]:
        """``openstack_worker_settings`` checked as the worker would read them, by name and type."""
        where = "openstack_worker_settings"
        values = parse_assignments(self.openstack_worker_settings, WorkerConfig, where, refused=DRIVER_WORKER_SETTINGS)
        for name, value in values.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{where} {name}: must be a finite number, got {value}")
        return values


@dataclasses.dataclass
class _KnownServer:
    server_id: str
    asked_at: float = 0.0  # time.monotonic() of the create call; 0 = found (adopted), not created


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Flavor, image and network as ids: names resolved once, not on every create."""

    flavor_id: str
    image_id: str
    network_id: str


class OpenStackProvisioner:
    """Worker servers on one OpenStack project (see the module's words).

    ``repository_address`` is where workers reach the repository (the master's own
    ``repository_address`` when both are on the cluster's private network). Nothing is
    sent to the cloud until the first call; :meth:`check` makes that call at once so a
    master can refuse to start with a cloud that will not work.
    """

    name = "openstack"

    def __init__(self, settings: OpenStackSettings, *, repository_address: str) -> None:
        settings.validate()
        self.settings = settings
        self.repository_address = repository_address
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._placement: _Placement | None = None
        self._known: dict[str, _KnownServer] = {}

    # -- the Provisioner interface -------------------------------------------

    def create(self, request: WorkerRequest) -> ProvisionedWorker:
        """Ask Nova for the server and return while it builds; a worker id that already
        has a server of this cluster gets that server's state, not a second server."""
        check_request(request)
        user_data = worker_user_data(request, self.settings, self.repository_address)
        with self._lock:
            existing = self._find(request.worker_id)
            if existing is not None:
                return self._describe(request.worker_id, existing)
            placement = self._resolve()
            attributes = self._server_attributes(request.worker_id, placement, user_data)
            try:
                with self._cloud_errors(f"create server {SERVER_PREFIX}{request.worker_id}"):
                    server = self._connection().compute.create_server(**attributes)
            except ProvisionError:
                self._placement = None  # a flavor, image or network may have changed under its name
                raise
            self._known[request.worker_id] = _KnownServer(server.id, asked_at=time.monotonic())
        return ProvisionedWorker(request.worker_id, WorkerState.BUILDING, f"server {server.id} BUILD")

    def state(self, worker_id: str) -> ProvisionedWorker:
        """The server's status as a worker state; ERROR carries Nova's fault message."""
        with self._lock:
            server = self._find(worker_id)
            if server is None:
                return ProvisionedWorker(worker_id, WorkerState.GONE, "no server")
            return self._describe(worker_id, server)

    def delete(self, worker_id: str) -> None:
        """Ask Nova to delete the server and return; a server that is gone is fine."""
        with self._lock:
            server = self._find(worker_id)
            if server is None:
                return
            with self._cloud_errors(f"delete server {server.name} ({server.id})"):
                self._connection().compute.delete_server(server.id, ignore_missing=True)
            self._known.pop(worker_id, None)

    def adopt(self) -> list[ProvisionedWorker]:
        """This cluster's worker servers that still exist, by their metadata."""
        with self._lock:
            found: list[ProvisionedWorker] = []
            for server in self._cluster_servers():
                worker_id = server.metadata[WORKER_KEY]
                self._known.setdefault(worker_id, _KnownServer(server.id))
                described = self._describe(worker_id, server)
                if described.state is not WorkerState.GONE:
                    found.append(described)
            return found

    # -- start-up ---------------------------------------------------------------

    def check(self) -> None:
        """Authenticate and resolve every name in the settings now, so that a master with a
        cloud that will not work stops at start-up with the setting to change (a
        ConfigError); a cloud that cannot be reached raises ProvisionError."""
        with self._lock:
            try:
                self._resolve()
                self._check_security_groups()
                self._check_key_pair()
            except ProvisionError as exc:
                if exc.setting:
                    raise ConfigError(str(exc)) from None
                raise

    def close(self) -> None:
        """Close the connection to the cloud (the servers stay as they are)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # -- the cloud ---------------------------------------------------------------

    def _connection(self) -> Connection:
        """The connection, made on first use: openstacksdk is imported here, not before."""
        if self._conn is None:
            # here, not at the top: only a master that uses this driver loads openstacksdk
            import openstack.config
            import openstack.connection

            settings = self.settings
            with self._cloud_errors("load the credentials", setting="openstack_cloud"):
                config_files = secure_files = None  # None: openstacksdk's own places
                if settings.openstack_clouds_file:
                    clouds = Path(settings.openstack_clouds_file).expanduser()
                    config_files, secure_files = [str(clouds)], [str(clouds.with_name("secure.yaml"))]
                loader = openstack.config.OpenStackConfig(
                    config_files=config_files, secure_files=secure_files, app_name="harmonicio"
                )
                region = loader.get_one(
                    cloud=settings.openstack_cloud or None, api_timeout=settings.openstack_api_timeout
                )
                self._conn = openstack.connection.Connection(config=region)
        return self._conn

    @contextlib.contextmanager
    def _cloud_errors(self, what: str, *, setting: str = "") -> Iterator[None]:
        """openstacksdk's and keystoneauth's exceptions as one ProvisionError that says what
        was asked and what the cloud answered, instead of a traceback."""
        from keystoneauth1 import exceptions as auth_errors
        from openstack import exceptions as sdk_errors

        try:
            yield
        except auth_errors.Unauthorized as exc:
            raise ProvisionError(
                f"{what}: the cloud refused the credentials of {self._cloud_named()}: {cloud_message(exc)}",
                setting="openstack_cloud",
            ) from None
        except (auth_errors.MissingRequiredOptions, auth_errors.NoMatchingPlugin, sdk_errors.ConfigException) as exc:
            raise ProvisionError(
                f"{what}: {self._cloud_named()} cannot be used: {cloud_message(exc)}", setting="openstack_cloud"
            ) from None
        except auth_errors.ConnectTimeout as exc:
            raise ProvisionError(
                f"{what}: the cloud did not answer within openstack_api_timeout "
                f"({self.settings.openstack_api_timeout:g} s): {cloud_message(exc)}"
            ) from None
        except (auth_errors.ConnectionError, auth_errors.DiscoveryFailure) as exc:
            # a failed discovery carries the connection failure behind it (keystoneauth
            # raises it while handling that one)
            if caused_by(exc, auth_errors.ConnectionError):
                raise ProvisionError(f"{what}: the cloud cannot be reached: {cloud_message(exc)}") from None
            raise ProvisionError(
                f"{what}: {self._cloud_named()} cannot be used: {cloud_message(exc)}", setting="openstack_cloud"
            ) from None
        except (auth_errors.ClientException, sdk_errors.SDKException) as exc:
            # a refusal (4xx) is about what was asked; the cloud's own failures (5xx) are not
            refused = 400 <= (getattr(exc, "status_code", None) or getattr(exc, "http_status", None) or 0) < 500
            raise ProvisionError(f"{what}: {cloud_message(exc)}", setting=setting if refused else "") from None

    def _cloud_named(self) -> str:
        """The cloud as the settings name it, for messages."""
        settings = self.settings
        where = f" (in {settings.openstack_clouds_file})" if settings.openstack_clouds_file else ""
        if settings.openstack_cloud:
            return f"openstack_cloud {settings.openstack_cloud!r}{where}"
        return f"the default cloud{where} (openstack_cloud is empty: $OS_CLOUD, else the OS_* variables)"

    def _resolve(self) -> _Placement:
        """Flavor, image and network names as ids, looked up once."""
        if self._placement is None:
            flavor = self._lookup("openstack_flavor", "flavor", "compute", "find_flavor")
            image = self._lookup("openstack_image", "image", "image", "find_image")
            network_id = ""
            if self.settings.openstack_network:
                network_id = self._lookup("openstack_network", "network", "network", "find_network").id
            self._placement = _Placement(flavor.id, image.id, network_id)
        return self._placement

    def _lookup(self, setting_name: str, kind: str, service: str, find: str, wanted: str = "") -> Any:
        """One resource by the name or id a setting holds (``wanted``: one item of it), with
        ``find`` of the ``service`` proxy; missing or ambiguous names the setting."""
        from openstack import exceptions as sdk_errors

        wanted = wanted or getattr(self.settings, setting_name)
        with self._cloud_errors(f"look up the {kind} {wanted!r} ({setting_name})", setting=setting_name):
            try:
                return getattr(getattr(self._connection(), service), find)(wanted, ignore_missing=False)
            except sdk_errors.NotFoundException:
                raise ProvisionError(
                    f"{setting_name}: the cloud has no {kind} {wanted!r}", setting=setting_name
                ) from None
            except sdk_errors.DuplicateResource:
                raise ProvisionError(
                    f"{setting_name}: the cloud has more than one {kind} named {wanted!r}: give its id",
                    setting=setting_name,
                ) from None

    def _check_security_groups(self) -> None:
        for group in self.settings.openstack_security_groups:
            self._lookup("openstack_security_groups", "security group", "network", "find_security_group", group)

    def _check_key_pair(self) -> None:
        if self.settings.openstack_key_name:
            self._lookup("openstack_key_name", "key pair", "compute", "find_keypair")

    def _server_attributes(self, worker_id: str, placement: _Placement, user_data: str) -> dict[str, Any]:
        """The body of Nova's create-server call."""
        settings = self.settings
        attributes: dict[str, Any] = {
            "name": f"{SERVER_PREFIX}{worker_id}",
            "flavor_id": placement.flavor_id,
            "image_id": placement.image_id,
            # microversion 2.37 on: a server names its networks, or asks for "auto"
            "networks": [{"uuid": placement.network_id}] if placement.network_id else "auto",
            "metadata": {CLUSTER_KEY: settings.openstack_cluster, WORKER_KEY: worker_id},
            "user_data": encode_user_data(user_data),
        }
        if settings.openstack_security_groups:
            attributes["security_groups"] = [{"name": group} for group in settings.openstack_security_groups]
        if settings.openstack_key_name:
            attributes["key_name"] = settings.openstack_key_name
        if settings.openstack_availability_zone:
            attributes["availability_zone"] = settings.openstack_availability_zone
        return attributes

    def _find(self, worker_id: str) -> Server | None:
        """This cluster's server of ``worker_id``: by its id when this driver knows it
        (one GET), else among the cluster's servers (a create whose answer was lost,
        a worker from before a restart that was not adopted)."""
        from openstack import exceptions as sdk_errors

        known = self._known.get(worker_id)
        if known is not None:
            with self._cloud_errors(f"get server {known.server_id} of worker {worker_id}"):
                try:
                    return self._connection().compute.get_server(known.server_id)
                except sdk_errors.NotFoundException:
                    del self._known[worker_id]
                    return None
        for server in self._cluster_servers(worker_id):
            if server.metadata.get(WORKER_KEY) == worker_id:
                self._known[worker_id] = _KnownServer(server.id)
                return server
        return None

    def _cluster_servers(self, worker_id: str = "") -> list[Server]:
        """Servers whose metadata says they are this cluster's workers (of ``worker_id``
        when given). Nova filters names by regular expression, so the name is only a
        first cut; the metadata decides."""
        name = f"^{SERVER_PREFIX}{worker_id}$" if worker_id else f"^{SERVER_PREFIX}"
        with self._cloud_errors("list servers"):
            servers = list(self._connection().compute.servers(details=True, name=name))
        return [
            server
            for server in servers
            if (server.metadata or {}).get(CLUSTER_KEY) == self.settings.openstack_cluster
            and (server.metadata or {}).get(WORKER_KEY)
        ]

    def _describe(self, worker_id: str, server: Server) -> ProvisionedWorker:
        """A server as the worker state the scaler acts on."""
        status = (server.status or "UNKNOWN").upper()
        detail = f"server {server.id} {status}"
        if server.task_state == "deleting":
            return ProvisionedWorker(worker_id, WorkerState.GONE, f"{detail}, being deleted")
        state = _STATES.get(status, WorkerState.RUNNING)
        if state is WorkerState.FAILED and status == "ERROR":
            detail = f"{detail}: {fault_message(server)}"
        elif state is WorkerState.BUILDING:
            building = self._building_seconds(worker_id, server)
            if building > self.settings.openstack_boot_timeout:
                state = WorkerState.FAILED
                detail = (
                    f"{detail} for {building:.0f} s, longer than openstack_boot_timeout "
                    f"({self.settings.openstack_boot_timeout:g} s)"
                )
        return ProvisionedWorker(worker_id, state, detail)

    def _building_seconds(self, worker_id: str, server: Server) -> float:
        """How long the server has been building: by this master's clock when it asked for
        it, else by the cloud's creation time."""
        known = self._known.get(worker_id)
        if known is not None and known.asked_at:
            return time.monotonic() - known.asked_at
        created = parse_time(server.created_at)
        if created is None:
            return 0.0
        return (datetime.datetime.now(datetime.UTC) - created).total_seconds()


# -- what a server is asked to run ----------------------------------------------


def check_request(request: WorkerRequest) -> None:
    """Refuse a worker id or master address that would not survive a server name, a
    systemd command line and a TOML file unchanged."""
    if not _NAME.match(request.worker_id):
        raise ProvisionError(
            f"worker id {request.worker_id!r}: the openstack driver takes 1-63 letters, digits, '.', '_' or '-'"
        )
    if not _ADDRESS_CHARACTERS.match(request.master_address):
        raise ProvisionError(f"master address {request.master_address!r} is not host:port")
    if any(c.isspace() for c in request.token):
        raise ProvisionError("the worker's token holds white space")


def worker_user_data(request: WorkerRequest, settings: OpenStackSettings, repository_address: str) -> str:
    """The cloud-init document of one worker server (JSON, which cloud-init reads as the
    YAML it is): install HarmonicIO if asked to, write the token, the configuration and
    the unit, find the server's own address, start ``hio worker``."""
    files = [
        {
            "path": CONFIG_FILE,
            "owner": "root:root",
            "permissions": "0644",
            "content": worker_toml(settings, repository_address),
        },
        {"path": ADVERTISE_SCRIPT, "owner": "root:root", "permissions": "0755", "content": ADVERTISE_HOST_SCRIPT},
        {"path": UNIT_FILE, "owner": "root:root", "permissions": "0644", "content": worker_unit(request, settings)},
    ]
    if request.token:
        files.insert(
            0, {"path": TOKEN_FILE, "owner": "root:root", "permissions": "0600", "content": request.token + "\n"}
        )
    commands: list[list[str]] = []
    document: dict[str, Any] = {}
    if settings.openstack_pip_install:
        python = settings.openstack_python
        document.update(package_update=True, packages=[python, f"{python}-venv"])
        commands += [
            [python, "-m", "venv", PREFIX],
            [f"{PREFIX}/bin/pip", "install", "--disable-pip-version-check", *settings.openstack_pip_install],
        ]
    commands += [
        [
            "sh",
            "-c",
            f"id -u hio >/dev/null 2>&1 || useradd --system --home-dir {DATA_DIR} --shell /usr/sbin/nologin hio",
        ],
        ["sh", "-c", "if getent group docker >/dev/null; then usermod -aG docker hio; fi"],
        ["install", "-d", "-o", "hio", "-g", "hio", "-m", "0750", DATA_DIR],
        ["python3", ADVERTISE_SCRIPT, request.master_address, ENV_FILE],
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "hio-worker.service"],
        ["systemctl", "restart", "hio-worker.service"],
    ]
    document.update(write_files=files, runcmd=commands)
    return "#cloud-config\n" + json.dumps(document, indent=2) + "\n"


def worker_toml(settings: OpenStackSettings, repository_address: str) -> str:
    """The worker's hio.toml: where things are on the server, then the operator's
    ``openstack_worker_settings`` (which win)."""
    values: dict[str, Any] = {"data_dir": DATA_DIR, "engine_listen_host": "0.0.0.0"}
    if repository_address:
        values["repository_address"] = repository_address
    values.update(settings.worker_file_settings())
    lines = [
        f"# HarmonicIO worker of cluster {settings.openstack_cluster}, written by the master's openstack driver.",
        "# worker_id and master_address are on the command line (hio-worker.service), the token",
        f"# in {TOKEN_FILE}, advertise_host in {ENV_FILE}.",
        "[worker]",
    ]
    lines += [f"{name} = {toml_value(value)}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    """A setting's value in TOML (JSON strings are TOML basic strings)."""
    if isinstance(value, bool):
        return as_text(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(str(item)) for item in value) + "]"
    return json.dumps(str(value))


def worker_unit(request: WorkerRequest, settings: OpenStackSettings) -> str:
    """``hio-worker.service``: the worker as an unprivileged user, as site.yml's unit runs
    it; systemd hands it the root-only token file as a credential (``%d``)."""
    command = f"{PREFIX}/bin/hio worker --worker-id {request.worker_id} --master-address {request.master_address}"
    credential = ""
    if request.token:
        command += " --token-file %d/token"
        credential = f"LoadCredential=token:{TOKEN_FILE}\n"
    return (
        "[Unit]\n"
        f"Description=HarmonicIO worker {request.worker_id} (cluster {settings.openstack_cluster})\n"
        "Wants=network-online.target\n"
        "After=network-online.target docker.service\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        "User=hio\n"
        "Group=hio\n"
        f"Environment=HIO_CONFIG={CONFIG_FILE}\n"
        "Environment=PYTHONUNBUFFERED=1\n"
        f"EnvironmentFile=-{ENV_FILE}\n"
        f"{credential}"
        f"WorkingDirectory={DATA_DIR}\n"
        f"ExecStart={command}\n"
        "# SIGTERM drains the worker (its engines finish their tuples) before it exits.\n"
        "KillSignal=SIGTERM\n"
        "KillMode=mixed\n"
        "TimeoutStopSec=60\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "# A configuration error exits 2: retrying cannot fix it.\n"
        "RestartPreventExitStatus=2\n"
        "LimitNOFILE=65536\n"
        "NoNewPrivileges=true\n"
        "PrivateTmp=true\n"
        "ProtectSystem=full\n"
        "ProtectHome=read-only\n"
        f"ReadWritePaths={DATA_DIR}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


#: Run once at first boot: the address this server reaches the master from is the one
#: gateways reach its engines at (the cluster's private network), whatever the image
#: names its interfaces. Retries while the network or DNS comes up.
ADVERTISE_HOST_SCRIPT = '''\
"""Write HIO_WORKER_ADVERTISE_HOST: this server's address on the route to the master."""
import socket
import sys
import time

target, env_file = sys.argv[1], sys.argv[2]
host, _, port = target.rsplit("/", 1)[-1].rpartition(":")
for attempt in range(60):
    try:
        family, kind, _, _, address = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(address)  # UDP: chooses the route and the source address, sends nothing
            own = probe.getsockname()[0]
        break
    except OSError as exc:
        print(f"advertise-host: {target}: {exc}", file=sys.stderr)
        time.sleep(2)
else:
    sys.exit(1)
with open(env_file, "w") as out:
    out.write(f"HIO_WORKER_ADVERTISE_HOST={own}\\n")
'''


def encode_user_data(text: str) -> str:
    """Nova takes user data base64-encoded (at most 65,535 bytes so)."""
    encoded = base64.b64encode(text.encode()).decode("ascii")
    if len(encoded) > 65535:
        raise ProvisionError(f"the worker's user data is {len(encoded)} bytes base64-encoded; Nova takes 65535")
    return encoded


# -- what the cloud says --------------------------------------------------------


def fault_message(server: Server) -> str:
    """Nova's words on why a server is in ERROR (its ``fault``), or that it gave none."""
    fault = server.fault or {}
    message = str(fault.get("message") or "").strip()
    code = fault.get("code")
    if not message:
        return "the cloud gives no fault"
    return f"{message} (code {code})" if code else message


def cloud_message(exc: BaseException) -> str:
    """The cloud's own words of an openstacksdk or keystoneauth exception, without the
    exception's class and URL when the answer carried a message."""
    details = getattr(exc, "details", None)
    status = getattr(exc, "status_code", None) or getattr(exc, "http_status", None)
    if details:
        return f"{details} (HTTP {status})" if status else str(details)
    return str(exc) or type(exc).__name__


def caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is a ``kind`` or was raised while handling or because of one."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def parse_time(text: str | None) -> datetime.datetime | None:
    """A Nova timestamp (``2026-01-02T03:04:05Z``) as an aware datetime; None if unreadable."""
    if not text:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)
