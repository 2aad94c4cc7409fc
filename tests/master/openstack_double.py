"""A test double of an OpenStack cloud over real HTTP: Keystone v3, Nova, Glance and
Neutron as far as openstacksdk uses them to create, watch, list and delete servers.

One ``http.server`` in a thread on 127.0.0.1 (a free port) serves every service under
its own path (``/identity``, ``/compute``, ``/image``, ``/network``); the token's
service catalog points openstacksdk at them. Servers do not boot by themselves: a
test moves them (:meth:`OpenStackDouble.set_status`, :meth:`OpenStackDouble.fail`),
so BUILD, ACTIVE and ERROR happen when the test says; :attr:`OpenStackDouble.delays`
holds answers back (a slow cloud, an answer lost to a timeout). A request the double
does not know is answered 404 and kept in :attr:`OpenStackDouble.unknown`, so the
double can grow to fit what a new openstacksdk asks; a test that uses it should
check that list is empty at its end.

Use it as a context manager; :meth:`OpenStackDouble.clouds_yaml` writes the
clouds.yaml a driver reads.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import http.server
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
    """The cloud's state (flavors, images, networks, security groups, key pairs,
    servers) and the HTTP server that serves it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.project_id = uuid.uuid4().hex
        self.user_id = uuid.uuid4().hex
        self.tokens: set[str] = set()
        self.flavors = [
            {"id": "f-large", "name": "ssc.large", "vcpus": 4, "ram": 8192, "disk": 40},
            {"id": "f-xlarge", "name": "ssc.xlarge", "vcpus": 8, "ram": 16384, "disk": 80},
        ]
        self.images = [{"id": str(uuid.uuid4()), "name": "hio-worker-image", "status": "active"}]
        self.networks = [{"id": str(uuid.uuid4()), "name": "hio-net", "status": "ACTIVE"}]
        self.security_groups = [
            {"id": str(uuid.uuid4()), "name": name, "description": ""} for name in ("hio-internal", "hio-workers")
        ]
        self.keypairs = [{"name": "hio", "type": "ssh", "public_key": "ssh-ed25519 AAAA test"}]
        self.servers: dict[str, dict[str, Any]] = {}
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
        if parts[0] == "os-keypairs" and method == "GET":
            if len(parts) == 1:
                return 200, {"keypairs": [{"keypair": pair} for pair in self.keypairs]}
            pair = next((p for p in self.keypairs if p["name"] == parts[1]), None)
            if pair is None:
                return 404, {"itemNotFound": {"code": 404, "message": f"Keypair {parts[1]} not found for user"}}
            return 200, {"keypair": pair}
        if parts[0] == "servers":
            return self._servers(method, parts[1:], query, body)
        return self._unknown(method, f"/compute/{rest}")

    def _servers(self, method: str, parts: list[str], query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        if method == "POST" and not parts:
            return self._create_server((body or {}).get("server", {}))
        if method == "GET" and parts in ([], ["detail"]):
            listed = list(self.servers.values())
            if "name" in query:
                listed = [s for s in listed if re.search(query["name"][0], s["name"])]
            return 200, {"servers": listed}
        if len(parts) == 1 and method in ("GET", "DELETE"):
            server = self.servers.get(parts[0])
            if server is None:
                return 404, {"itemNotFound": {"code": 404, "message": f"Instance {parts[0]} could not be found."}}
            if method == "DELETE":
                del self.servers[parts[0]]
                return 204, None
            return 200, {"server": server}
        return self._unknown(method, "/compute/v2.1/servers/" + "/".join(parts))

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
        if method == "GET" and parts[:2] == ["v2.0", "networks"]:
            return self._listed_or_one("network", self.networks, parts[2:], query)
        if method == "GET" and parts[:2] == ["v2.0", "security-groups"]:
            return self._listed_or_one("security_group", self.security_groups, parts[2:], query)
        return self._unknown(method, f"/network/{rest}")

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
