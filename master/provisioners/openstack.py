"""The ``openstack`` driver: workers are servers on an OpenStack cloud (SNIC Science Cloud
and alike), asked for and given back through the compute API with openstacksdk, which is
imported only when a driver connects. docs/deploy.md ("Elastic workers on OpenStack") says what
each option does, how a server is named and marked as this cluster's (its metadata decides,
not its name), what its cloud-init runs (the token in a root-only file only), and what the
driver checks at start-up.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shlex
import threading
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hio.config import ConfigError, as_text, only_this_host, parse_assignments, setting
from hio.master.provisioners import ProvisionedWorker, ProvisionError, WorkerRequest, WorkerState, check_options
from hio.worker.config import WorkerConfig

if TYPE_CHECKING:
    from openstack.compute.v2.server import Server
    from openstack.connection import Connection

    from hio.master.config import MasterConfig

log = logging.getLogger("hio.master.provisioners")

CLUSTER_KEY = "hio_cluster"  # server metadata: the cluster that asked for the server
WORKER_KEY = "hio_worker_id"  # server metadata: the worker id it registers under
SERVER_PREFIX = "hio-worker-"
OPTIONS = "provisioner_options"  # the master setting the driver's options come in

#: Where a worker server keeps HarmonicIO, as site.yml lays a host out (docs/deploy.md).
PREFIX = "/opt/hio"
ETC = "/etc/hio"
DATA_DIR = "/var/lib/hio"
TOKEN_FILE = f"{ETC}/worker.token"
CONFIG_FILE = f"{ETC}/hio.toml"
ENV_FILE = f"{ETC}/worker.env"
UNIT_FILE = "/etc/systemd/system/hio-worker.service"
ADVERTISE_SCRIPT = "/usr/local/lib/hio/advertise-host.py"

#: Worker settings the driver or the master decides, refused in the ``worker_settings`` option.
DRIVER_WORKER_SETTINGS = {
    "worker_id": "the driver sets it to the id the master asked for",
    "master_address": "the driver sets it to the master's advertise_address",
    "token": "the driver writes the master's token for the worker (worker_token_file) to a root-only file",
    "token_file": "the driver writes the master's token for the worker (worker_token_file) to a root-only file",
    "advertise_host": "each server advertises its own address on the master's network",
    "elastic": "the driver starts every worker with --elastic",
    "engines": "an elastic worker runs the engines the master's plan gives it",
    "cpus": "the master's worker_cpus sets it (0: the flavor's vCPUs), as the packer counts them",
}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# What a master address may hold on the worker's command line (host:port, [v6]:port, dns:///...)
_ADDRESS_CHARACTERS = re.compile(r"^[A-Za-z0-9.:/\[\]_-]+$")
_WORKER_NUMBER_DIGITS = 6  # room left in a worker id for the scaler's <prefix>-<n>

# Nova's server status -> what it means for a worker. Statuses not listed (REBOOT,
# RESIZE, MIGRATING, UNKNOWN, ...) are a server that exists and is meant to run.
_STATES = {
    "BUILD": WorkerState.BUILDING,
    "ACTIVE": WorkerState.RUNNING,
    "ERROR": WorkerState.FAILED,
    # stopped by someone or something: the worker will not come back by itself
    **dict.fromkeys(("SHUTOFF", "SUSPENDED", "PAUSED", "SHELVED", "SHELVED_OFFLOADED"), WorkerState.FAILED),
    **dict.fromkeys(("DELETED", "SOFT_DELETED"), WorkerState.GONE),
}


def option(name: str) -> str:
    """One of the driver's options as messages name it: the master setting and the item."""
    return f"{OPTIONS} {name}"


def create_provisioner(config: MasterConfig, state_dir: Path, options: dict[str, str]) -> OpenStackProvisioner:
    """The driver the master's ``provisioner_options`` describe, checked against the master's
    settings and then against the cloud (a name it does not know, or credentials it refuses:
    a ConfigError naming the option; a cloud that does not answer is logged, and the master
    starts). ``state_dir`` is not used: the servers' metadata is the driver's record."""
    settings = OpenStackSettings.from_options(options)
    check_master_settings(config, settings)
    driver = OpenStackProvisioner(
        settings, repository_address=config.repository_address, worker_cpus=config.worker_cpus
    )
    try:
        driver.check()
    except ProvisionError as exc:
        log.warning("the cloud could not be checked at start-up; the scaler asks it again", extra={"error": str(exc)})
    except BaseException:
        driver.close()
        raise
    return driver


def check_master_settings(config: MasterConfig, settings: OpenStackSettings) -> None:
    """Refuse master settings a worker server could not work with: worker ids that are no
    server name, a master or repository address that on a server means the server itself."""
    longest = f"{config.worker_prefix}-{'9' * _WORKER_NUMBER_DIGITS}"
    if not _NAME.match(longest):
        raise ConfigError(
            f"worker_prefix {config.worker_prefix!r}: the openstack driver names servers after workers, "
            f"<prefix>-<n>: at most {63 - 1 - _WORKER_NUMBER_DIGITS} letters, digits, '.', '_' or '-'"
        )
    master = config.worker_master_address()
    if not _ADDRESS_CHARACTERS.match(master) or only_this_host(master):
        raise ConfigError(
            f"advertise_address: worker servers would reach the master at {master}, which on a server is "
            "that server: set advertise_address to the master's host:port on the workers' network"
        )
    repository = settings.worker_file_settings().get("repository_address", config.repository_address)
    if only_this_host(repository):
        raise ConfigError(
            f"repository_address: worker servers would reach the repository at {repository}, which on a "
            "server is that server: set the master's repository_address, or repository_address=HOST:PORT "
            f"in {option('worker_settings')}, to its address on the workers' network"
        )


@dataclasses.dataclass(frozen=True)
class OpenStackSettings:
    """The driver's options, one field each under the name it has in ``provisioner_options``
    (``flavor=ssc.xlarge``). A list (``security_groups``, ``pip_install``,
    ``worker_settings``) is one item whose value is split as a shell would split it."""

    cloud: str = setting("", "clouds.yaml entry the workers are created in; empty = $OS_CLOUD, else the OS_* variables")
    clouds_file: str = setting(
        "",
        "clouds.yaml to read (a secure.yaml beside it is read too); empty = openstacksdk's "
        "places ($OS_CLIENT_CONFIG_FILE, ./clouds.yaml, ~/.config/openstack/, /etc/openstack/)",
    )
    cluster: str = setting(
        "hio",
        "name in the hio_cluster metadata of this cluster's worker servers; unique per "
        "cluster in a project, or masters adopt each other's workers",
    )
    flavor: str = setting("ssc.large", "flavor (name or id) of worker servers")
    image: str = setting(
        "",
        "image (name or id) worker servers boot; with pip_install empty it must hold HarmonicIO in /opt/hio (required)",
    )
    network: str = setting(
        "hio-net", "network (name or id) worker servers join, the one the master and gateways reach them on"
    )
    security_groups: tuple[str, ...] = setting(
        ("hio-internal", "hio-workers"),
        "security groups of worker servers (provision.yml's: the cluster's ports and the engines' ports)",
    )
    key_name: str = setting("", "SSH key pair put on worker servers; empty = none")
    availability_zone: str = setting("", "availability zone of worker servers; empty = the cloud's choice")
    pip_install: tuple[str, ...] = setting(
        (),
        "pip install arguments that install HarmonicIO into /opt/hio at first boot, e.g. "
        "'harmonicio[docker] @ https://host/harmonicio-0.1.0-py3-none-any.whl'; "
        "empty = the image has it there (boots faster)",
    )
    python: str = setting(
        "python3.11", "interpreter (an apt package, with its -venv package) /opt/hio is made from for pip installs"
    )
    worker_settings: tuple[str, ...] = setting(
        (),
        "worker settings NAME=VALUE written to each worker's hio.toml (e.g. runtime=process, "
        "tls_ca=/etc/hio/ca.pem); the driver and the master set worker_id, master_address, "
        "the token, advertise_host, elastic, engines and cpus",
    )
    api_timeout: float = setting(30.0, "seconds one call to the cloud may take")

    @classmethod
    def from_options(cls, options: dict[str, str]) -> OpenStackSettings:
        """The settings ``provisioner_options`` give (parsed into a dict), checked; an option
        the driver does not have is refused naming ``provisioner_options``."""
        check_options("openstack", options, [f.name for f in dataclasses.fields(cls)])
        types = typing.get_type_hints(cls)
        lists = [name for name in options if typing.get_origin(types[name]) is tuple]  # split as a shell would
        plain = tuple(f"{name}={text}" for name, text in options.items() if name not in lists)
        values = parse_assignments(plain, cls, OPTIONS, refused={})
        for name in lists:
            try:
                values[name] = tuple(shlex.split(options[name]))
            except ValueError as exc:
                raise ConfigError(f"{option(name)} cannot be split as a shell would: {exc}") from None
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Refuse settings the driver cannot work with; each message names the option."""
        if not self.image:
            raise ConfigError(f"{option('image')} is missing: name the image worker servers boot (image=NAME)")
        if not self.flavor:
            raise ConfigError(f"{option('flavor')} is empty: name the flavor of worker servers")
        if not _NAME.match(self.cluster):
            raise ConfigError(
                f"{option('cluster')} must be 1-63 letters, digits, '.', '_' or '-', got {self.cluster!r}"
            )
        if any(not group.strip() for group in self.security_groups):
            raise ConfigError(f"{option('security_groups')} names an empty group")
        if self.clouds_file and not Path(self.clouds_file).expanduser().is_file():
            raise ConfigError(f"{option('clouds_file')} {self.clouds_file} is not a file")
        if self.pip_install and not re.match(r"^python3(\.\d+)?$", self.python):
            raise ConfigError(f"{option('python')} must look like python3.11, got {self.python!r}")
        if not (math.isfinite(self.api_timeout) and self.api_timeout > 0):
            raise ConfigError(f"{option('api_timeout')} must be a positive number of seconds, got {self.api_timeout}")
        self.worker_file_settings()

    def worker_file_settings(self) -> dict[str, Any]:
        """``worker_settings`` checked as the worker would read them, by name and type."""
        where = option("worker_settings")
        values = parse_assignments(self.worker_settings, WorkerConfig, where, refused=DRIVER_WORKER_SETTINGS)
        for name, value in values.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{where} {name}: must be a finite number, got {value}")
        return values


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Flavor, image and network as ids: names resolved once, not on every create."""

    flavor_id: str
    image_id: str
    network_id: str


class OpenStackProvisioner:
    """Worker servers on one OpenStack project (see the module's words). ``repository_address``
    is where workers reach the repository (the master's own ``repository_address`` when both are
    on the cluster's private network; a ``repository_address`` in the ``worker_settings`` option
    wins). ``worker_cpus`` is what each worker offers (``--cpus``); 0 = its flavor's vCPUs.
    Nothing is sent to the cloud until the first call; :meth:`check` makes that call at once so
    a master can refuse to start with a cloud that will not work."""

    def __init__(self, settings: OpenStackSettings, *, repository_address: str, worker_cpus: int = 0) -> None:
        settings.validate()
        self.settings = settings
        self.repository_address = repository_address
        self._worker_cpus = worker_cpus
        self._flavor_cpus = 0  # the flavor's vCPUs, once looked up
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._placement: _Placement | None = None
        self._known: dict[str, str] = {}  # worker id -> its server's id

    # -- the Provisioner interface -------------------------------------------

    def create(self, request: WorkerRequest) -> ProvisionedWorker:
        """Ask Nova for the server and return while it builds; a worker id that already
        has a server of this cluster gets that server's state, not a second server."""
        check_request(request)
        user_data = worker_user_data(request, self.settings, self.repository_address, self._worker_cpus)
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
            self._known[request.worker_id] = server.id
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
                self._known.setdefault(worker_id, server.id)
                described = self._describe(worker_id, server)
                if described.state is not WorkerState.GONE:
                    found.append(described)
            return found

    # -- start-up ---------------------------------------------------------------

    def check(self) -> None:
        """Authenticate and resolve every name in the settings now, so that a master with a
        cloud that will not work stops at start-up with the option to change (a
        ConfigError); a cloud that cannot be reached raises ProvisionError. A
        ``worker_cpus`` above the flavor's vCPUs is refused too: the packer would put
        more engines on a worker than it has cores for."""
        with self._lock:
            try:
                self._resolve()
                for group in self.settings.security_groups:
                    self._lookup("security_groups", "security group", "network", "find_security_group", group)
                if self.settings.key_name:
                    self._lookup("key_name", "key pair", "compute", "find_keypair")
            except ProvisionError as exc:
                if exc.setting:
                    raise ConfigError(str(exc)) from None
                raise
            if self._worker_cpus > self._flavor_cpus > 0:
                raise ConfigError(
                    f"worker_cpus ({self._worker_cpus}) is more than the {self._flavor_cpus} vCPUs of "
                    f"{option('flavor')} {self.settings.flavor!r}"
                )

    def worker_cpus(self) -> int:
        """What each worker offers: ``worker_cpus``, else its flavor's vCPUs. Before the
        flavor was ever looked up (the cloud did not answer at start-up) the master's
        rule for ``worker_cpus`` 0 holds: this machine's."""
        return self._worker_cpus or self._flavor_cpus or os.cpu_count() or 1

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
            import openstack.config
            import openstack.connection

            settings = self.settings
            with self._cloud_errors("load the credentials", setting=option("cloud")):
                config_files = secure_files = None  # None: openstacksdk's own places
                if settings.clouds_file:
                    clouds = Path(settings.clouds_file).expanduser()
                    config_files, secure_files = [str(clouds)], [str(clouds.with_name("secure.yaml"))]
                loader = openstack.config.OpenStackConfig(
                    config_files=config_files, secure_files=secure_files, app_name="harmonicio"
                )
                region = loader.get_one(cloud=settings.cloud or None, api_timeout=settings.api_timeout)
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
                setting=option("cloud"),
            ) from None
        except (auth_errors.MissingRequiredOptions, auth_errors.NoMatchingPlugin, sdk_errors.ConfigException) as exc:
            raise ProvisionError(
                f"{what}: {self._cloud_named()} cannot be used: {cloud_message(exc)}", setting=option("cloud")
            ) from None
        except auth_errors.ConnectTimeout as exc:
            raise ProvisionError(
                f"{what}: the cloud did not answer within {option('api_timeout')} "
                f"({self.settings.api_timeout:g} s): {cloud_message(exc)}"
            ) from None
        except (auth_errors.ConnectionError, auth_errors.DiscoveryFailure) as exc:
            # a failed discovery carries the connection failure behind it (keystoneauth
            # raises it while handling that one)
            if caused_by(exc, auth_errors.ConnectionError):
                raise ProvisionError(f"{what}: the cloud cannot be reached: {cloud_message(exc)}") from None
            raise ProvisionError(
                f"{what}: {self._cloud_named()} cannot be used: {cloud_message(exc)}", setting=option("cloud")
            ) from None
        except (auth_errors.ClientException, sdk_errors.SDKException) as exc:
            # a refusal (4xx) is about what was asked; the cloud's own failures (5xx) are not
            refused = 400 <= (getattr(exc, "status_code", None) or getattr(exc, "http_status", None) or 0) < 500
            raise ProvisionError(f"{what}: {cloud_message(exc)}", setting=setting if refused else "") from None

    def _cloud_named(self) -> str:
        """The cloud as the options name it, for messages."""
        settings = self.settings
        where = f" (in {settings.clouds_file})" if settings.clouds_file else ""
        if settings.cloud:
            return f"{option('cloud')} {settings.cloud!r}{where}"
        return f"the default cloud{where} ({option('cloud')} is not set: $OS_CLOUD, else the OS_* variables)"

    def _resolve(self) -> _Placement:
        if self._placement is None:
            flavor = self._lookup("flavor", "flavor", "compute", "find_flavor")
            image = self._lookup("image", "image", "image", "find_image")
            network_id = ""
            if self.settings.network:
                network_id = self._lookup("network", "network", "network", "find_network").id
            self._placement = _Placement(flavor.id, image.id, network_id)
            self._flavor_cpus = int(flavor.vcpus or 0)
        return self._placement

    def _lookup(self, name: str, kind: str, service: str, find: str, wanted: str = "") -> Any:
        """One resource by the name or id the option ``name`` holds (``wanted``: one item of
        it), with ``find`` of the ``service`` proxy; missing or ambiguous names the option."""
        from openstack import exceptions as sdk_errors

        wanted = wanted or getattr(self.settings, name)
        named = option(name)
        with self._cloud_errors(f"look up the {kind} {wanted!r} ({named})", setting=named):
            try:
                return getattr(getattr(self._connection(), service), find)(wanted, ignore_missing=False)
            except sdk_errors.NotFoundException:
                raise ProvisionError(f"{named}: the cloud has no {kind} {wanted!r}", setting=named) from None
            except sdk_errors.DuplicateResource:
                raise ProvisionError(
                    f"{named}: the cloud has more than one {kind} named {wanted!r}: give its id", setting=named
                ) from None

    def _server_attributes(self, worker_id: str, placement: _Placement, user_data: str) -> dict[str, Any]:
        """The body of Nova's create-server call."""
        settings = self.settings
        attributes: dict[str, Any] = {
            "name": f"{SERVER_PREFIX}{worker_id}",
            "flavor_id": placement.flavor_id,
            "image_id": placement.image_id,
            # microversion 2.37 on: a server names its networks, or asks for "auto"
            "networks": [{"uuid": placement.network_id}] if placement.network_id else "auto",
            "metadata": {CLUSTER_KEY: settings.cluster, WORKER_KEY: worker_id},
            "user_data": encode_user_data(user_data),
        }
        if settings.security_groups:
            attributes["security_groups"] = [{"name": group} for group in settings.security_groups]
        optional = {"key_name": settings.key_name, "availability_zone": settings.availability_zone}
        return attributes | {name: value for name, value in optional.items() if value}

    def _find(self, worker_id: str) -> Server | None:
        """This cluster's server of ``worker_id``: by its id when this driver knows it
        (one GET), else among the cluster's servers (a create whose answer was lost,
        a worker from before a restart that was not adopted)."""
        from openstack import exceptions as sdk_errors

        known = self._known.get(worker_id)
        if known is not None:
            with self._cloud_errors(f"get server {known} of worker {worker_id}"):
                try:
                    return self._connection().compute.get_server(known)
                except sdk_errors.NotFoundException:
                    del self._known[worker_id]
                    return None
        for server in self._cluster_servers(worker_id):
            if server.metadata.get(WORKER_KEY) == worker_id:
                self._known[worker_id] = server.id
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
            if (server.metadata or {}).get(CLUSTER_KEY) == self.settings.cluster
            and (server.metadata or {}).get(WORKER_KEY)
        ]

    def _describe(self, worker_id: str, server: Server) -> ProvisionedWorker:
        """A server as the worker state the scaler acts on. A server that builds for too
        long is the scaler's to give back (``provision_timeout``), as is an ACTIVE one
        whose worker never registers."""
        status = (server.status or "UNKNOWN").upper()
        detail = f"server {server.id} {status}"
        if server.task_state == "deleting":
            return ProvisionedWorker(worker_id, WorkerState.GONE, f"{detail}, being deleted")
        state = _STATES.get(status, WorkerState.RUNNING)
        if state is WorkerState.FAILED and status == "ERROR":
            detail = f"{detail}: {fault_message(server)}"
        return ProvisionedWorker(worker_id, state, detail)


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


def worker_user_data(
    request: WorkerRequest, settings: OpenStackSettings, repository_address: str, cpus: int = 0
) -> str:
    """The cloud-init document of one worker server (JSON, which cloud-init reads as the
    YAML it is): install HarmonicIO if asked to, write the token, the configuration and
    the unit, find the server's own address, start ``hio worker --elastic`` (offering
    ``cpus`` vCPUs; 0 = the server's)."""
    files = [
        _root_file(CONFIG_FILE, worker_toml(settings, repository_address)),
        _root_file(ADVERTISE_SCRIPT, ADVERTISE_HOST_SCRIPT, "0755"),
        _root_file(UNIT_FILE, worker_unit(request, settings, cpus)),
    ]
    if request.token:
        files.insert(0, _root_file(TOKEN_FILE, request.token + "\n", "0600"))
    commands: list[list[str]] = []
    document: dict[str, Any] = {}
    if settings.pip_install:
        python = settings.python
        document.update(package_update=True, packages=[python, f"{python}-venv"])
        commands += [
            [python, "-m", "venv", PREFIX],
            [f"{PREFIX}/bin/pip", "install", "--disable-pip-version-check", *settings.pip_install],
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


def _root_file(path: str, content: str, permissions: str = "0644") -> dict[str, str]:
    """One of cloud-init's ``write_files``, owned by root."""
    return {"path": path, "owner": "root:root", "permissions": permissions, "content": content}


def worker_toml(settings: OpenStackSettings, repository_address: str) -> str:
    """The worker's hio.toml: where things are on the server, then the operator's
    ``worker_settings`` option (which win)."""
    # engines and the worker's /metrics on the server's network (the security groups open them
    # to the private network: hio-workers, hio-internal)
    values: dict[str, Any] = {"data_dir": DATA_DIR, "engine_listen_host": "0.0.0.0", "http_listen": "0.0.0.0:7280"}
    if repository_address:
        values["repository_address"] = repository_address
    values.update(settings.worker_file_settings())
    lines = [
        f"# HarmonicIO worker of cluster {settings.cluster}, written by the master's openstack driver.",
        "# --elastic, worker_id, master_address and cpus are on the command line (hio-worker.service), the token",
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


def worker_unit(request: WorkerRequest, settings: OpenStackSettings, cpus: int = 0) -> str:
    """``hio-worker.service``: the elastic worker as an unprivileged user, as site.yml's
    unit runs a worker; systemd hands it the root-only token file as a credential (``%d``)."""
    command = (
        f"{PREFIX}/bin/hio worker --elastic --worker-id {request.worker_id} --master-address {request.master_address}"
    )
    if cpus:
        command += f" --cpus {cpus}"
    credential = ""
    if request.token:
        command += " --token-file %d/token"
        credential = f"LoadCredential=token:{TOKEN_FILE}\n"
    return (
        "[Unit]\n"
        f"Description=HarmonicIO worker {request.worker_id} (cluster {settings.cluster})\n"
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
