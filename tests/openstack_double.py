"""A test fixture standing in for an external system, an OpenStack cloud, over real HTTP:
Keystone v3, Nova, Glance and Neutron as far as openstacksdk uses them for the master's
``openstack`` driver (create, watch, list and delete servers) and for
``ansible/provision.yml`` through the ``openstack.cloud`` collection (networks, subnets,
routers with their interfaces and external gateway, ports, security groups and their
rules, floating IPs, key pairs, servers). Nothing more: it is not a cloud, it answers
the requests those two make, in the shapes and with the refusals the real services
give (a subnet, network, router or security group still in use is not deleted; a
floating IP needs a router from the external network to the server's subnet).

One ``http.server`` in a thread on 127.0.0.1 (a free port) serves every service under
its own path (``/identity``, ``/compute``, ``/image``, ``/network``); the token's
service catalog points openstacksdk at them. Every address it hands out (fixed and
floating) is one the test chooses or a loopback one, so a connection made to a
"server" by mistake stays on this machine.

``OpenStackDouble()`` is a project as provision.yml leaves it (network ``hio-net``,
groups ``hio-internal`` and ``hio-workers``, key pair ``hio``), the driver's setting;
``OpenStackDouble(empty=True)`` a project that holds nothing of its own yet, the
playbook's. Servers do not boot by themselves unless ``boot_seconds`` says after how
long they do: a test moves them (:meth:`OpenStackDouble.set_status`,
:meth:`OpenStackDouble.fail`), so BUILD, ACTIVE and ERROR happen when the test says;
:attr:`OpenStackDouble.delays` holds answers back (a slow cloud, an answer lost to a
timeout). A request the double does not know is answered 404 and kept in
:attr:`OpenStackDouble.unknown`, so the double can grow to fit what a new openstacksdk
asks; a test that uses it should check that list is empty at its end.

Use it as a context manager; :meth:`OpenStackDouble.clouds_yaml` writes the
clouds.yaml a driver or a playbook reads.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import http.server
import ipaddress
import itertools
import json
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

CLOUD = "double"
USER = "hio-operator"
PASSWORD = "correct horse battery staple"
PROJECT = "hio-project"
REGION = "RegionOne"
COMPUTE_MICROVERSION = "2.96"
EXTERNAL_NETWORK = "public"
# Floating IPs and router gateways come from here: loopback, so nothing dialled leaves the machine.
EXTERNAL_CIDR = "127.0.200.0/24"


NEUTRON_COLLECTIONS = {  # URL segment -> resource kind
    "networks": "network",
    "subnets": "subnet",
    "routers": "router",
    "ports": "port",
    "security-groups": "security_group",
    "security-group-rules": "security_group_rule",
    "floatingips": "floatingip",
}
KIND_PATHS = {kind: segment for segment, kind in NEUTRON_COLLECTIONS.items()}
PAGING_KEYS = {"fields", "limit", "marker", "sort_key", "sort_dir", "page_reverse"}


class NeutronError(Exception):
    """A refusal as Neutron words it: HTTP status, error type, message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _matches(item: dict[str, Any], query: dict[str, list[str]]) -> bool:
    """Neutron's list filter: every attribute asked for has one of the values given."""
    return all(_as_query(item[key]) in values for key, values in query.items() if key not in PAGING_KEYS)


def _as_query(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return "" if value is None else str(value)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class Request:
    """One request the double answered: what openstacksdk sent."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


class OpenStackDouble:
    """The cloud's state (flavors, images, key pairs, servers, Neutron's resources)
    and the HTTP server that serves it."""

    def __init__(self, *, empty: bool = False, boot_seconds: float | None = None) -> None:
        """``empty``: the project has no network, security group or key pair of its own;
        ``boot_seconds``: a server becomes ACTIVE this long after it was asked for (None:
        when a test says)."""
        self.lock = threading.RLock()
        self.project_id = uuid.uuid4().hex
        self.user_id = uuid.uuid4().hex
        self.tokens: set[str] = set()
        self.boot_seconds = boot_seconds
        self.flavors = [
            {"id": "f-large", "name": "ssc.large", "vcpus": 4, "ram": 8192, "disk": 40},
            {"id": "f-xlarge", "name": "ssc.xlarge", "vcpus": 8, "ram": 16384, "disk": 80},
        ]
        self.images = [{"id": str(uuid.uuid4()), "name": "hio-worker-image", "status": "active"}]
        self.networks: list[dict[str, Any]] = []
        self.subnets: list[dict[str, Any]] = []
        self.routers: list[dict[str, Any]] = []
        self.ports: list[dict[str, Any]] = []
        self.security_groups: list[dict[str, Any]] = []
        self.security_group_rules: list[dict[str, Any]] = []
        self.floating_ips: list[dict[str, Any]] = []
        self.keypairs: list[dict[str, Any]] = []
        if not empty:
            self._create_network({"name": "hio-net"})
            for name in ("hio-internal", "hio-workers"):
                self._create_security_group({"name": name, "description": ""})
            self.keypairs.append({"name": "hio", "type": "ssh", "public_key": "ssh-ed25519 AAAA test"})
        # the provider's network, shared with every project: where floating IPs come from
        external = self._create_network({"name": EXTERNAL_NETWORK, "router:external": True, "shared": True})
        self._create_subnet({"name": f"{EXTERNAL_NETWORK}-subnet", "network_id": external["id"], "cidr": EXTERNAL_CIDR})
        self.servers: dict[str, dict[str, Any]] = {}
        self._asked_at: dict[str, float] = {}  # server id -> time.monotonic() when it was asked for
        self.user_data: dict[str, str] = {}  # server id -> decoded user data, as the server would read it
        self.max_servers = 20  # the project's instance quota
        self.requests: list[Request] = []
        # seconds to hold the answer to requests "METHOD path" that match a regular
        # expression (the request is carried out at once, its answer comes late)
        self.delays: dict[str, float] = {}
        self.unknown: list[str] = []
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- running ---------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="openstack-double", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    @property
    def url(self) -> str:
        assert self._httpd is not None, "the double is not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def clouds_yaml(self, folder: Path, *, password: str = PASSWORD, cloud: str = CLOUD) -> Path:
        """A clouds.yaml naming this double as ``cloud`` (password auth, as an OpenStack RC)."""
        path = folder / "clouds.yaml"
        entry = {
            "auth_type": "password",
            "auth": {
                "auth_url": f"{self.url}/identity/v3",
                "username": USER,
                "password": password,
                "project_name": PROJECT,
                "user_domain_name": "Default",
                "project_domain_name": "Default",
            },
            "region_name": REGION,
            "interface": "public",
            "identity_api_version": 3,
        }
        path.write_text(json.dumps({"clouds": {cloud: entry}}, indent=2))  # JSON is YAML
        return path

    # -- what a test does to the cloud -----------------------------------------------

    def server_named(self, name: str) -> dict[str, Any]:
        with self.lock:
            matches = [server for server in self.servers.values() if server["name"] == name]
        assert len(matches) == 1, f"{len(matches)} servers named {name}"
        return matches[0]

    def holdings(self) -> dict[str, list[str]]:
        """What the project holds, by kind: names (ports: device owner and device, floating
        IPs: address); the provider's external network and its subnet are not the project's."""
        with self.lock:
            external = {n["id"] for n in self.networks if n["router:external"]}
            return {
                "servers": sorted(s["name"] for s in self.servers.values()),
                "networks": sorted(n["name"] for n in self.networks if n["id"] not in external),
                "subnets": sorted(s["name"] for s in self.subnets if s["network_id"] not in external),
                "routers": sorted(r["name"] for r in self.routers),
                "ports": sorted(f"{p['device_owner']} {p['device_id']}" for p in self.ports),
                "security_groups": sorted(g["name"] for g in self.security_groups),
                "floating_ips": sorted(ip["floating_ip_address"] for ip in self.floating_ips),
                "keypairs": sorted(k["name"] for k in self.keypairs),
            }

    def set_status(self, server_id: str, status: str) -> None:
        """Move a server on (BUILD -> ACTIVE, ACTIVE -> SHUTOFF, ...)."""
        with self.lock:
            server = self.servers[server_id]
            server["status"] = status
            server["OS-EXT-STS:vm_state"] = status.lower()
            server["OS-EXT-STS:task_state"] = None
            server["updated"] = _now()

    def fail(self, server_id: str, message: str, code: int = 500) -> None:
        """The server failed to boot, as Nova says it: ERROR with a fault."""
        with self.lock:
            server = self.servers[server_id]
            server.update(status="ERROR", fault={"code": code, "message": message, "created": _now()})
            server["OS-EXT-STS:vm_state"] = "error"
            server["OS-EXT-STS:task_state"] = None

    def add_server(self, name: str, metadata: dict[str, str], status: str = "ACTIVE") -> str:
        """A server someone else made (another cluster, a person): returns its id."""
        server_id = str(uuid.uuid4())
        with self.lock:
            self.servers[server_id] = self._server(server_id, name, metadata, status=status)
        return server_id

    def delay_of(self, method: str, path: str) -> float:
        with self.lock:
            return max((s for p, s in self.delays.items() if re.search(p, f"{method} {path}")), default=0.0)

    def called(self, method: str, pattern: str) -> list[Request]:
        """The requests of ``method`` whose path matches ``pattern`` (a regular expression)."""
        with self.lock:
            return [r for r in self.requests if r.method == method and re.search(pattern, r.path)]

    # -- the services ------------------------------------------------------------------

    def answer(self, method: str, path: str, query: dict[str, list[str]], body: Any, token: str) -> tuple[int, Any]:
        """(status, JSON body) for one request; the handler adds the headers."""
        with self.lock:
            self.requests.append(Request(method, path, query, body))
        service, _, rest = path.strip("/").partition("/")
        if service == "identity":
            return self._identity(method, rest, body)
        if service in ("compute", "image", "network"):
            if rest and token not in self.tokens:
                return 401, {"error": {"code": 401, "title": "Unauthorized", "message": "Invalid token"}}
            with self.lock:
                return getattr(self, f"_{service}")(method, rest, query, body)
        return self._unknown(method, path)

    def _unknown(self, method: str, path: str) -> tuple[int, Any]:
        with self.lock:
            self.unknown.append(f"{method} {path}")
        return 404, {"error": {"code": 404, "message": f"the OpenStack double does not know {method} {path}"}}

    # Keystone v3 ------------------------------------------------------------------

    def _identity(self, method: str, rest: str, body: Any) -> tuple[int, Any]:
        version = {
            "id": "v3.14",
            "status": "stable",
            "updated": "2020-04-07T00:00:00Z",
            "links": [{"rel": "self", "href": f"{self.url}/identity/v3/"}],
            "media-types": [{"base": "application/json", "type": "application/vnd.openstack.identity-v3+json"}],
        }
        if method == "GET" and rest == "":
            return 300, {"versions": {"values": [version]}}
        if method == "GET" and rest == "v3":
            return 200, {"version": version}
        if method == "POST" and rest == "v3/auth/tokens":
            return self._issue_token(body)
        return self._unknown(method, f"/identity/{rest}")

    def _issue_token(self, body: Any) -> tuple[int, Any]:
        identity = (body or {}).get("auth", {}).get("identity", {})
        user = identity.get("password", {}).get("user", {})
        if "password" not in identity.get("methods", []) or (user.get("name"), user.get("password")) != (
            USER,
            PASSWORD,
        ):
            return 401, {
                "error": {
                    "code": 401,
                    "title": "Unauthorized",
                    "message": "The request you have made requires authentication.",
                }
            }
        token = uuid.uuid4().hex
        with self.lock:
            self.tokens.add(token)
        domain = {"id": "default", "name": "Default"}
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        return 201, {
            "token": {
                "id": token,  # the handler moves it to X-Subject-Token
                "methods": ["password"],
                "expires_at": expires.strftime("%Y-%m-%dT%H:%M:%S.000000Z"),
                "issued_at": _now(),
                "user": {"id": self.user_id, "name": USER, "domain": domain},
                "project": {"id": self.project_id, "name": PROJECT, "domain": domain},
                "roles": [{"id": "r-member", "name": "member"}],
                "catalog": [
                    self._catalog_entry("identity", "keystone", "/identity/v3"),
                    self._catalog_entry("compute", "nova", "/compute/v2.1"),
                    self._catalog_entry("image", "glance", "/image"),
                    self._catalog_entry("network", "neutron", "/network"),
                ],
            }
        }

    def _catalog_entry(self, kind: str, name: str, path: str) -> dict[str, Any]:
        return {
            "type": kind,
            "name": name,
            "id": uuid.uuid4().hex,
            "endpoints": [
                {
                    "id": uuid.uuid4().hex,
                    "interface": "public",
                    "region": REGION,
                    "region_id": REGION,
                    "url": f"{self.url}{path}",
                }
            ],
        }

    # Nova -----------------------------------------------------------------------------

    def _compute(self, method: str, rest: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        version = {
            "id": "v2.1",
            "status": "CURRENT",
            "version": COMPUTE_MICROVERSION,
            "min_version": "2.1",
            "updated": "2013-07-23T11:33:21Z",
            "links": [{"rel": "self", "href": f"{self.url}/compute/v2.1/"}],
        }
        parts = rest.split("/")[1:] if rest.startswith("v2.1") else None
        if method == "GET" and rest == "":
            return 200, {"versions": [version]}
        if parts is None:
            return self._unknown(method, f"/compute/{rest}")
        if method == "GET" and parts in ([], [""]):
            return 200, {"version": version}
        if parts[0] == "flavors" and method == "GET":
            return self._listed_or_one("flavor", self.flavors, parts[1:], query, detail_word="detail")
        if parts[0] == "os-keypairs":
            return self._keypairs(method, parts[1:], body)
        if parts[0] == "servers":
            return self._servers(method, parts[1:], query, body)
        return self._unknown(method, f"/compute/{rest}")

    def _keypairs(self, method: str, parts: list[str], body: Any) -> tuple[int, Any]:
        if method == "GET" and not parts:
            return 200, {"keypairs": [{"keypair": pair} for pair in self.keypairs]}
        if method == "POST" and not parts:
            asked = (body or {}).get("keypair", {})
            if any(p["name"] == asked.get("name") for p in self.keypairs):
                return 409, {"conflictingRequest": {"code": 409, "message": "Key pair already exists."}}
            pair = {"name": asked["name"], "type": asked.get("type", "ssh"), "public_key": asked["public_key"]}
            self.keypairs.append(pair)
            return 200, {"keypair": {**pair, "user_id": self.user_id, "fingerprint": "00:00"}}
        if method == "GET" and len(parts) == 1:
            pair = next((p for p in self.keypairs if p["name"] == parts[0]), None)
            if pair is None:
                return 404, {"itemNotFound": {"code": 404, "message": f"Keypair {parts[0]} not found for user"}}
            return 200, {"keypair": pair}
        return self._unknown(method, "/compute/v2.1/os-keypairs/" + "/".join(parts))

    def _servers(self, method: str, parts: list[str], query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        if method == "POST" and not parts:
            return self._create_server((body or {}).get("server", {}))
        if method == "GET" and parts in ([], ["detail"]):
            listed = list(self.servers.values())
            if "name" in query:
                listed = [s for s in listed if re.search(query["name"][0], s["name"])]
            return 200, {"servers": [self._server_view(s) for s in listed]}
        server = self.servers.get(parts[0]) if parts else None
        if server is None:
            return 404, {"itemNotFound": {"code": 404, "message": f"Instance {parts[0]} could not be found."}}
        if method == "DELETE" and len(parts) == 1:
            self._delete_server(server["id"])
            return 204, None
        if method == "GET" and len(parts) == 1:
            return 200, {"server": self._server_view(server)}
        if method == "GET" and parts[1:] == ["os-security-groups"]:
            return 200, {"security_groups": [self._nova_security_group(g) for g in self._groups_of(server)]}
        return self._unknown(method, "/compute/v2.1/servers/" + "/".join(parts))

    def _server_view(self, server: dict[str, Any]) -> dict[str, Any]:
        """A server as Nova shows it: booted if its time has come, its addresses those of
        its ports (fixed) and of the floating IPs on them."""
        waited = time.monotonic() - self._asked_at.get(server["id"], time.monotonic())
        if server["status"] == "BUILD" and self.boot_seconds is not None and waited >= self.boot_seconds:
            self.set_status(server["id"], "ACTIVE")
        addresses: dict[str, list[dict[str, Any]]] = {}
        for port in self._ports_of(server["id"]):
            network = next(n["name"] for n in self.networks if n["id"] == port["network_id"])
            listed = addresses.setdefault(network, [])
            mac = {"OS-EXT-IPS-MAC:mac_addr": port["mac_address"], "version": 4}
            listed += [{"addr": f["ip_address"], "OS-EXT-IPS:type": "fixed", **mac} for f in port["fixed_ips"]]
            listed += [
                {"addr": ip["floating_ip_address"], "OS-EXT-IPS:type": "floating", **mac}
                for ip in self.floating_ips
                if ip["port_id"] == port["id"]
            ]
        return {**server, "addresses": addresses}

    def _ports_of(self, device_id: str) -> list[dict[str, Any]]:
        return [port for port in self.ports if port["device_id"] == device_id]

    def _groups_of(self, server: dict[str, Any]) -> list[dict[str, Any]]:
        names = {group["name"] for group in server["security_groups"]}
        return [group for group in self.security_groups if group["name"] in names]

    def _nova_security_group(self, group: dict[str, Any]) -> dict[str, Any]:
        return {"id": group["id"], "name": group["name"], "description": group["description"], "rules": []}

    def _delete_server(self, server_id: str) -> None:
        """Nova deletes the server's ports; a floating IP on one stays allocated, unattached."""
        for port in self._ports_of(server_id):
            self._delete_port(port)
        del self.servers[server_id]
        self._asked_at.pop(server_id, None)

    def _create_server(self, asked: dict[str, Any]) -> tuple[int, Any]:
        """Nova's checks in Nova's words, then a server in BUILD."""

        def bad(message: str) -> tuple[int, Any]:
            return 400, {"badRequest": {"code": 400, "message": message}}

        if not any(f["id"] == asked.get("flavorRef") for f in self.flavors):
            return bad(f"Flavor {asked.get('flavorRef')} could not be found.")
        if not any(i["id"] == asked.get("imageRef") for i in self.images):
            return bad(f"Image {asked.get('imageRef')} could not be found.")
        networks = asked.get("networks")
        if networks is None:
            return bad("Multiple possible networks found, use a Network ID to be more specific.")
        if networks != "auto":
            for wanted in networks:
                if not any(n["id"] == wanted.get("uuid") for n in self.networks):
                    return bad(f"Network {wanted.get('uuid')} could not be found.")
        for group in asked.get("security_groups", []):
            if not any(g["name"] == group["name"] for g in self.security_groups):
                return bad(f"Unable to find security group with name or id '{group['name']}'")
        if "key_name" in asked and not any(k["name"] == asked["key_name"] for k in self.keypairs):
            return bad("Invalid key_name provided.")
        if len(self.servers) >= self.max_servers:
            used = len(self.servers)
            return 403, {
                "forbidden": {
                    "code": 403,
                    "message": f"Quota exceeded for instances: Requested 1, but already used {used} of "
                    f"{self.max_servers} instances",
                }
            }
        server_id = str(uuid.uuid4())
        server = self._server(server_id, asked["name"], asked.get("metadata", {}), status="BUILD")
        server["flavor"] = {"id": asked["flavorRef"]}
        server["image"] = {"id": asked["imageRef"]}
        server["key_name"] = asked.get("key_name")
        server["security_groups"] = asked.get("security_groups", [])
        server["OS-EXT-AZ:availability_zone"] = asked.get("availability_zone", "nova")
        self.servers[server_id] = server
        self._asked_at[server_id] = time.monotonic()
        group_ids = [group["id"] for group in self._groups_of(server)]
        for wanted in networks if networks != "auto" else []:
            self._plug(server_id, wanted["uuid"], group_ids)
        if "user_data" in asked:
            self.user_data[server_id] = base64.b64decode(asked["user_data"]).decode()
        return 202, {
            "server": {
                "id": server_id,
                "links": server["links"],
                "OS-DCF:diskConfig": "MANUAL",
                "security_groups": server["security_groups"],
                "adminPass": "not-for-workers",
            }
        }

    def _server(self, server_id: str, name: str, metadata: dict[str, str], *, status: str) -> dict[str, Any]:
        return {
            "id": server_id,
            "name": name,
            "status": status,
            "metadata": dict(metadata),
            "tenant_id": self.project_id,
            "user_id": self.user_id,
            "created": _now(),
            "updated": _now(),
            "addresses": {},
            "flavor": {"id": self.flavors[0]["id"]},
            "image": {"id": self.images[0]["id"]},
            "OS-EXT-STS:vm_state": status.lower(),
            "OS-EXT-STS:task_state": "scheduling" if status == "BUILD" else None,
            "OS-EXT-STS:power_state": 0,
            "tags": [],
            "links": [{"rel": "self", "href": f"{self.url}/compute/v2.1/servers/{server_id}"}],
        }

    # Glance ---------------------------------------------------------------------------

    def _image(self, method: str, rest: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        if method == "GET" and rest == "":
            return 300, {
                "versions": [
                    {"id": "v2.16", "status": "CURRENT", "links": [{"rel": "self", "href": f"{self.url}/image/v2/"}]}
                ]
            }
        parts = rest.split("/")
        if method == "GET" and parts[:2] == ["v2", "images"]:
            return self._listed_or_one("image", self.images, parts[2:], query, wrapped=False)
        return self._unknown(method, f"/image/{rest}")

    # Neutron ----------------------------------------------------------------------------

    def _network(self, method: str, rest: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        if method == "GET" and rest == "":
            return 200, {
                "versions": [
                    {
                        "id": "v2.0",
                        "status": "CURRENT",
                        "links": [{"rel": "self", "href": f"{self.url}/network/v2.0/"}],
                    }
                ]
            }
        parts = rest.split("/")
        kind = NEUTRON_COLLECTIONS.get(parts[1]) if parts[0] == "v2.0" and len(parts) > 1 else None
        if kind is None:
            return self._unknown(method, f"/network/{rest}")
        try:
            return self._neutron(kind, method, parts[2:], query, body or {})
        except NeutronError as refused:
            return refused.status, {"NeutronError": {"type": refused.kind, "message": str(refused), "detail": ""}}

    def _neutron(
        self, kind: str, method: str, parts: list[str], query: dict[str, list[str]], body: dict[str, Any]
    ) -> tuple[int, Any]:
        """One Neutron resource call: list (filtered by any attribute), show, create
        (one, or a list where Neutron takes one), delete, the router's interfaces."""
        path = f"/network/v2.0/{KIND_PATHS[kind]}/" + "/".join(parts)
        if method == "GET" and not parts:
            # a filter on an attribute the double's resources lack would match nothing: say so
            unfiltered = set(query) - PAGING_KEYS - {key for item in self._items(kind) for key in item}
            if unfiltered and self._items(kind):
                return self._unknown(method, f"{path}?{','.join(sorted(unfiltered))}")
            listed = [self._view(kind, item) for item in self._items(kind) if _matches(item, query)]
            return 200, {f"{kind}s": listed}
        if method == "POST" and not parts:
            create = getattr(self, f"_create_{kind}", None)
            if create is None:
                return self._unknown(method, path)
            if f"{kind}s" in body:
                return 201, {f"{kind}s": [self._view(kind, create(one)) for one in body[f"{kind}s"]]}
            return 201, {kind: self._view(kind, create(body[kind]))}
        item = next((i for i in self._items(kind) if i["id"] == parts[0]), None)
        if item is None:
            noun = kind.replace("_", " ").title().replace(" ", "").replace("Floatingip", "FloatingIP")
            raise NeutronError(404, f"{noun}NotFound", f"{noun} {parts[0]} could not be found.")
        if method == "GET" and len(parts) == 1:
            return 200, {kind: self._view(kind, item)}
        if method == "DELETE" and len(parts) == 1:
            getattr(self, f"_delete_{kind}")(item)
            return 204, None
        if method == "PUT" and kind == "floatingip" and len(parts) == 1:
            return 200, {kind: self._update_floatingip(item, body[kind])}
        if method == "PUT" and kind == "router" and parts[1:] == ["add_router_interface"]:
            return 200, self._add_router_interface(item, body["subnet_id"])
        if method == "PUT" and kind == "router" and parts[1:] == ["remove_router_interface"]:
            return 200, self._remove_router_interface(item, body["port_id"])
        return self._unknown(method, path)

    def _items(self, kind: str) -> list[dict[str, Any]]:
        return {
            "network": self.networks,
            "subnet": self.subnets,
            "router": self.routers,
            "port": self.ports,
            "security_group": self.security_groups,
            "security_group_rule": self.security_group_rules,
            "floatingip": self.floating_ips,
        }[kind]

    def _view(self, kind: str, item: dict[str, Any]) -> dict[str, Any]:
        """What Neutron shows: a network lists its subnets, a group carries its rules."""
        if kind == "network":
            return {**item, "subnets": [s["id"] for s in self.subnets if s["network_id"] == item["id"]]}
        if kind == "security_group":
            rules = [r for r in self.security_group_rules if r["security_group_id"] == item["id"]]
            return {**item, "security_group_rules": rules}
        return item

    def _owned(self, asked: dict[str, Any], **fields: Any) -> dict[str, Any]:
        """A new resource of this project: an id, the project, ``fields``, then what was asked."""
        now = _now()
        stamp = {"created_at": now, "updated_at": now, "revision_number": 0, "tags": [], "description": ""}
        own = {"id": str(uuid.uuid4()), "project_id": self.project_id, "tenant_id": self.project_id}
        return own | stamp | fields | asked

    def _network_by_id(self, network_id: str) -> dict[str, Any]:
        network = next((n for n in self.networks if n["id"] == network_id), None)
        if network is None:
            raise NeutronError(404, "NetworkNotFound", f"Network {network_id} could not be found.")
        return network

    def _create_network(self, asked: dict[str, Any]) -> dict[str, Any]:
        network = self._owned(
            asked,
            status="ACTIVE",
            admin_state_up=True,
            shared=False,
            mtu=1450,
            port_security_enabled=True,
            availability_zone_hints=[],
            **{"router:external": False},
        )
        self.networks.append(network)
        return network

    def _delete_network(self, network: dict[str, Any]) -> None:
        if any(port["network_id"] == network["id"] for port in self.ports):
            raise NeutronError(
                409,
                "NetworkInUse",
                f"Unable to complete operation on network {network['id']}. "
                "There are one or more ports still in use on the network.",
            )
        self.subnets[:] = [s for s in self.subnets if s["network_id"] != network["id"]]
        self.networks.remove(network)

    def _create_subnet(self, asked: dict[str, Any]) -> dict[str, Any]:
        self._network_by_id(asked["network_id"])
        cidr = ipaddress.ip_network(asked["cidr"])
        hosts = list(itertools.islice(cidr.hosts(), 2))
        subnet = self._owned(
            asked,
            ip_version=cidr.version,
            enable_dhcp=True,
            gateway_ip=str(hosts[0]),
            allocation_pools=[{"start": str(hosts[1]), "end": str(cidr.broadcast_address - 1)}],
            dns_nameservers=[],
            host_routes=[],
            ipv6_address_mode=None,
            ipv6_ra_mode=None,
            subnetpool_id=None,
            use_default_subnet_pool=None,
            prefix_length=None,
        )
        subnet["cidr"] = str(cidr)
        self.subnets.append(subnet)
        return subnet

    def _delete_subnet(self, subnet: dict[str, Any]) -> None:
        if any(f["subnet_id"] == subnet["id"] for port in self.ports for f in port["fixed_ips"]):
            raise NeutronError(
                409,
                "SubnetInUse",
                f"Unable to complete operation on subnet {subnet['id']}: "
                "One or more ports have an IP allocation from this subnet.",
            )
        self.subnets.remove(subnet)

    def _free_address(self, subnet: dict[str, Any]) -> str:
        """The first address of the subnet's pool that no port, router gateway or floating IP holds."""
        taken = {f["ip_address"] for port in self.ports for f in port["fixed_ips"]}
        taken |= {
            f["ip_address"]
            for r in self.routers
            for f in (r["external_gateway_info"] or {}).get("external_fixed_ips", [])
        }
        taken |= {ip["floating_ip_address"] for ip in self.floating_ips}
        pool = subnet["allocation_pools"][0]
        first, last = int(ipaddress.ip_address(pool["start"])), int(ipaddress.ip_address(pool["end"]))
        for host in ipaddress.ip_network(subnet["cidr"]).hosts():
            if first <= int(host) <= last and str(host) not in taken:
                return str(host)
        raise NeutronError(
            409, "IpAddressGenerationFailure", f"No more IP addresses available on network {subnet['network_id']}."
        )

    def _plug(self, device_id: str, network_id: str, group_ids: list[str]) -> dict[str, Any]:
        """The port Nova asks for when a server joins a network: an address from its first subnet."""
        subnet = next((s for s in self.subnets if s["network_id"] == network_id), None)
        fixed = [{"subnet_id": subnet["id"], "ip_address": self._free_address(subnet)}] if subnet else []
        port = self._owned(
            {},
            name="",
            network_id=network_id,
            device_id=device_id,
            device_owner="compute:nova",
            fixed_ips=fixed,
            mac_address="fa:16:3e:" + uuid.uuid4().bytes[:3].hex(":"),
            status="ACTIVE",
            admin_state_up=True,
            security_groups=group_ids,
        )
        self.ports.append(port)
        return port

    def _delete_port(self, port: dict[str, Any]) -> None:
        for ip in self.floating_ips:
            if ip["port_id"] == port["id"]:
                ip.update(port_id=None, fixed_ip_address=None, router_id=None, status="DOWN")
        self.ports.remove(port)

    def _create_router(self, asked: dict[str, Any]) -> dict[str, Any]:
        gateway = asked.get("external_gateway_info")
        if gateway:
            network = self._network_by_id(gateway["network_id"])
            if not network["router:external"]:
                raise NeutronError(
                    400, "BadRequest", f"Bad router request: Network {network['id']} is not an external network."
                )
            subnet = next(s for s in self.subnets if s["network_id"] == network["id"])
            fixed = [{"subnet_id": subnet["id"], "ip_address": self._free_address(subnet)}]
            gateway = {"enable_snat": True, "external_fixed_ips": fixed} | gateway
        router = self._owned(asked, status="ACTIVE", admin_state_up=True, routes=[]) | {
            "external_gateway_info": gateway or None
        }
        self.routers.append(router)
        return router

    def _delete_router(self, router: dict[str, Any]) -> None:
        if self._ports_of(router["id"]):
            raise NeutronError(409, "RouterInUse", f"Router {router['id']} still has ports")
        self.routers.remove(router)

    def _add_router_interface(self, router: dict[str, Any], subnet_id: str) -> dict[str, Any]:
        subnet = next((s for s in self.subnets if s["id"] == subnet_id), None)
        if subnet is None:
            raise NeutronError(404, "SubnetNotFound", f"Subnet {subnet_id} could not be found.")
        if any(f["subnet_id"] == subnet_id for p in self._ports_of(router["id"]) for f in p["fixed_ips"]):
            raise NeutronError(
                400, "BadRequest", f"Bad router request: Router already has a port on subnet {subnet_id}."
            )
        port = self._plug(router["id"], subnet["network_id"], [])
        port.update(
            device_owner="network:router_interface",
            fixed_ips=[{"subnet_id": subnet_id, "ip_address": subnet["gateway_ip"]}],
        )
        return self._interface_answer(router, port)

    def _remove_router_interface(self, router: dict[str, Any], port_id: str) -> dict[str, Any]:
        port = next((p for p in self._ports_of(router["id"]) if p["id"] == port_id), None)
        if port is None:
            raise NeutronError(
                404, "RouterInterfaceNotFound", f"Router {router['id']} does not have an interface with id {port_id}"
            )
        subnet_id = port["fixed_ips"][0]["subnet_id"]
        behind = {f["ip_address"] for p in self.ports for f in p["fixed_ips"] if f["subnet_id"] == subnet_id}
        if any(ip["router_id"] == router["id"] and ip["fixed_ip_address"] in behind for ip in self.floating_ips):
            raise NeutronError(
                409,
                "RouterInterfaceInUseByFloatingIP",
                f"Router interface for subnet {subnet_id} on router {router['id']} cannot be deleted, "
                "as it is required by one or more floating IPs.",
            )
        self.ports.remove(port)
        return self._interface_answer(router, port)

    def _interface_answer(self, router: dict[str, Any], port: dict[str, Any]) -> dict[str, Any]:
        subnet_id = port["fixed_ips"][0]["subnet_id"]
        return {
            "id": router["id"],
            "port_id": port["id"],
            "subnet_id": subnet_id,
            "subnet_ids": [subnet_id],
            "network_id": port["network_id"],
            "project_id": self.project_id,
            "tenant_id": self.project_id,
        }

    def _create_security_group(self, asked: dict[str, Any]) -> dict[str, Any]:
        """A group, with the two egress rules Neutron gives every new group."""
        group = self._owned(asked, stateful=True)
        self.security_groups.append(group)
        for ethertype in ("IPv4", "IPv6"):
            self._create_security_group_rule(
                {"security_group_id": group["id"], "direction": "egress", "ethertype": ethertype}
            )
        return group

    def _delete_security_group(self, group: dict[str, Any]) -> None:
        if any(group["id"] in port["security_groups"] for port in self.ports):
            raise NeutronError(409, "SecurityGroupInUse", f"Security Group {group['id']} in use.")
        self.security_group_rules[:] = [r for r in self.security_group_rules if r["security_group_id"] != group["id"]]
        self.security_groups.remove(group)

    def _create_security_group_rule(self, asked: dict[str, Any]) -> dict[str, Any]:
        if not any(g["id"] == asked["security_group_id"] for g in self.security_groups):
            raise NeutronError(
                404, "SecurityGroupNotFound", f"Security group {asked['security_group_id']} does not exist"
            )
        rule = self._owned(
            asked,
            protocol=None,
            port_range_min=None,
            port_range_max=None,
            remote_ip_prefix=None,
            remote_group_id=None,
            remote_address_group_id=None,
            normalized_cidr=asked.get("remote_ip_prefix"),
        )
        self.security_group_rules.append(rule)
        return rule

    def _delete_security_group_rule(self, rule: dict[str, Any]) -> None:
        self.security_group_rules.remove(rule)

    def _create_floatingip(self, asked: dict[str, Any]) -> dict[str, Any]:
        """An address from the external network, attached to ``port_id`` when one is
        given: a router must join that network to the port's subnet."""
        network = self._network_by_id(asked["floating_network_id"])
        subnet = next(s for s in self.subnets if s["network_id"] == network["id"])
        ip = self._owned(
            asked,
            floating_ip_address=self._free_address(subnet),
            port_id=None,
            fixed_ip_address=None,
            router_id=None,
            status="DOWN",
            port_details=None,
            dns_domain="",
            dns_name="",
            port_forwardings=[],
            qos_policy_id=None,
        )
        if asked.get("port_id"):
            ip.update(self._association(network, asked["port_id"]))
        self.floating_ips.append(ip)
        return ip

    def _update_floatingip(self, ip: dict[str, Any], asked: dict[str, Any]) -> dict[str, Any]:
        """Attach the address to ``port_id``, or detach it (``port_id`` None)."""
        if asked.get("port_id"):
            ip.update(self._association(self._network_by_id(ip["floating_network_id"]), asked["port_id"]))
        elif "port_id" in asked:
            ip.update(port_id=None, fixed_ip_address=None, router_id=None, status="DOWN")
        ip.update({key: value for key, value in asked.items() if key in ("description",)})
        return ip

    def _association(self, network: dict[str, Any], port_id: str) -> dict[str, Any]:
        port = next((p for p in self.ports if p["id"] == port_id), None)
        if port is None:
            raise NeutronError(404, "PortNotFound", f"Port {port_id} could not be found.")
        fixed = port["fixed_ips"][0]
        for router in self.routers:
            gateway = router["external_gateway_info"] or {}
            inside = any(
                f["subnet_id"] == fixed["subnet_id"] for p in self._ports_of(router["id"]) for f in p["fixed_ips"]
            )
            if gateway.get("network_id") == network["id"] and inside:
                return {
                    "port_id": port_id,
                    "fixed_ip_address": fixed["ip_address"],
                    "router_id": router["id"],
                    "status": "ACTIVE",
                }
        raise NeutronError(
            404,
            "ExternalGatewayForFloatingIPNotFound",
            f"External network {network['id']} is not reachable from subnet {fixed['subnet_id']}.  "
            f"Therefore, cannot associate Port {port_id} with a Floating IP.",
        )

    def _delete_floatingip(self, ip: dict[str, Any]) -> None:
        self.floating_ips.remove(ip)

    # -- shared ---------------------------------------------------------------------------

    def _listed_or_one(
        self,
        kind: str,
        items: list[dict[str, Any]],
        parts: list[str],
        query: dict[str, list[str]],
        *,
        detail_word: str = "",
        wrapped: bool = True,
    ) -> tuple[int, Any]:
        """GET of a collection (filtered by ``name`` and ``id``) or of one item by id."""
        if parts in ([], [""]) or (detail_word and parts == [detail_word]):
            listed = [
                item
                for item in items
                if all(item.get(key) == values[0] for key, values in query.items() if key in ("name", "id"))
            ]
            return 200, {f"{kind}s": listed}
        item = next((i for i in items if i["id"] == parts[0]), None)
        if item is None or len(parts) > 1:
            noun = kind.replace("_", " ").capitalize()
            return 404, {"itemNotFound": {"code": 404, "message": f"{noun} {parts[0]} could not be found."}}
        return 200, ({kind: item} if wrapped else item)


def _handler_for(double: OpenStackDouble) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # headers and body go out as two writes: without this, Nagle's algorithm holds
            # the body for the client's delayed acknowledgement (40 ms a request)
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def do_HEAD(self) -> None:
            self._serve("HEAD")

        def _serve(self, method: str) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            token = self.headers.get("X-Auth-Token", "")
            status, answer = double.answer(method, url.path, parse_qs(url.query), body, token)
            time.sleep(double.delay_of(method, url.path))
            headers = {"x-openstack-request-id": f"req-{uuid.uuid4()}"}
            if isinstance(answer, dict) and "token" in answer and "id" in answer["token"]:
                headers["X-Subject-Token"] = answer["token"].pop("id")
            if url.path.startswith("/compute"):
                headers["OpenStack-API-Version"] = f"compute {COMPUTE_MICROVERSION}"
                headers["X-OpenStack-Nova-API-Version"] = COMPUTE_MICROVERSION
            payload = b"" if answer is None else json.dumps(answer).encode()
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if answer is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the name BaseHTTPRequestHandler gives it
            """Quiet: the double's requests are in ``double.requests``."""

    return Handler
