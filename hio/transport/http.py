"""Every role's one HTTP endpoint: ``/metrics`` (Prometheus text format), ``/healthz``,
and the pages a role adds (the repository's preview page and its files).

    endpoint = HttpEndpoint(config, config.http_listen, role_routes(registry, pages), name="master")
    endpoint.start()          # serves from daemon threads
    ...
    endpoint.close()

A stdlib server (:class:`http.server.ThreadingHTTPServer`): a thread per connection, at
most :data:`MAX_CONNECTIONS` at once (one more is closed at once), each idle for at most
:data:`IDLE_SECONDS`. It follows the rules of the role's gRPC server
(:func:`hio.transport.net.create_server`): with a tokens file (or a shared token) a
request presents ``Authorization: Bearer <token>``, checked by the same
:class:`~hio.transport.net.TokenTable` and :func:`~hio.transport.net.refuse_caller`, and
answered 401 without a known token, 403 for a role the path does not allow; with
``tls_cert`` it speaks TLS with the role's certificate, and with ``tls_client_auth`` it
requires a client certificate signed by ``tls_ca``. ``/healthz`` is open, as gRPC's health
service is.

A page is a function of the query string that returns a :class:`Reply`; it runs on the
connection's thread, so a slow page delays only its own caller.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import grpc

from hio.config import ConfigError, local_host, split_address
from hio.settings import ClusterSettings
from hio.transport.lanetls import server_context
from hio.transport.net import AUTH_HEADER, TokenTable, refuse_caller

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("hio.http")

MAX_CONNECTIONS = 32  # connections served at once; one more is closed unanswered
IDLE_SECONDS = 30.0  # a connection (its TLS handshake included) silent this long is closed
#: Token roles that may read /metrics ('admin' and the shared token's 'any' may read everything).
METRICS_ROLES = frozenset({"viewer"})
_STATUS = {grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403}
_TEXT = "text/plain; charset=utf-8"


@dataclasses.dataclass(frozen=True)
class Reply:
    """What a page answers."""

    status: int
    body: bytes
    content_type: str = _TEXT


Page = Callable[[Mapping[str, list[str]]], Reply]  # the query's parameters -> the reply


@dataclasses.dataclass(frozen=True)
class Route:
    """A path's page, and the token roles that may read it (None: anyone, no token asked)."""

    page: Page
    roles: frozenset[str] | None


def text(status: int, words: str) -> Reply:
    return Reply(status, (words.rstrip("\n") + "\n").encode())


def healthz(_query: Mapping[str, list[str]]) -> Reply:
    """The process serves HTTP: it is alive."""
    return text(200, "ok")


def metrics_page(registry: CollectorRegistry | None) -> Page:
    """``/metrics``: the registry in Prometheus' text format; 404 when metrics are off."""
    from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

    def page(_query: Mapping[str, list[str]]) -> Reply:
        if registry is None:
            return text(404, "metrics are off in this role (metrics = false)")
        return Reply(200, generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4)  # what every Prometheus reads

    return page


def role_routes(registry: CollectorRegistry | None, pages: Mapping[str, Route] | None = None) -> dict[str, Route]:
    """``/metrics`` (``registry``; None = metrics off), ``/healthz``, and a role's own ``pages``."""
    return {
        "/metrics": Route(metrics_page(registry), METRICS_ROLES),
        "/healthz": Route(healthz, None),
        **(pages or {}),
    }


class HttpEndpoint:
    """A role's HTTP server (see the module's doc). ``port``: the bound port; ``address``:
    where a client on this machine reaches it."""

    def __init__(
        self, settings: ClusterSettings, listen: str, routes: Mapping[str, Route], *, name: str = "hio"
    ) -> None:
        self.routes = dict(routes)
        self.name = name
        self.table = TokenTable.from_settings(settings)
        self.tls = server_context(settings)
        # refuse_caller's policy is keyed by a call's last path segment: a path's own, here
        self.policy = {_key(path): set(route.roles) for path, route in self.routes.items() if route.roles is not None}
        try:
            host, port = split_address(listen)
            self._server = _Server((host or "0.0.0.0", port), self)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"http_listen: cannot listen on {listen} ({exc}); stop what holds the port, or choose another "
                "address (empty = no HTTP endpoint)"
            ) from None
        self.port: int = self._server.server_address[1]
        local = local_host(host)
        self.address = f"[{local}]:{self.port}" if ":" in local else f"{local}:{self.port}"
        self.scheme = "https" if self.tls is not None else "http"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name=f"{name}-http", daemon=True
        )

    def start(self) -> HttpEndpoint:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port (connections being answered finish on their own)."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def answer(self, request: _Handler) -> None:
        """One request: its route, the caller's token, the page."""
        url = urlsplit(request.path)
        route = self.routes.get(url.path)
        if route is None:
            request.reply(text(404, f"not found: {url.path}; try /metrics or /healthz"))
            return
        if route.roles is not None and self.table is not None:
            header = request.headers.get(AUTH_HEADER, "")
            token = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
            refusal = refuse_caller(self.table, self.policy, url.path, token)  # keyed by its last segment
            if refusal is not None:
                code, words = refusal
                request.reply(text(_STATUS[code], words), bearer=code == grpc.StatusCode.UNAUTHENTICATED)
                return
        try:
            reply = route.page(parse_qs(url.query))
        except Exception:  # a page must never take the server down, nor go unanswered
            log.exception("http page failed", extra={"path": url.path})
            reply = text(500, f"internal error; see the {self.name} log")
        request.reply(reply)


def _key(path: str) -> str:
    return path.rsplit("/", 1)[-1]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 2 * MAX_CONNECTIONS  # the listen backlog: connections that arrive together wait, not retry

    def __init__(self, address: tuple[str, int], endpoint: HttpEndpoint) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.endpoint = endpoint
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        """On the connection's thread: the TLS handshake first (when TLS is on), so a slow or
        refused client holds up no one else."""
        tls = self.endpoint.tls
        if tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(IDLE_SECONDS)
        try:
            wrapped = tls.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as exc:  # no certificate, a wrong one, plaintext, silence
            log.debug("http TLS handshake failed", extra={"peer": client_address[0], "error": str(exc)})
            return
        try:
            super().finish_request(wrapped, client_address)
        finally:
            wrapped.close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = IDLE_SECONDS
    sys_version = ""

    def version_string(self) -> str:
        return f"hio-{self.server.endpoint.name}"

    def do_GET(self) -> None:
        self.server.endpoint.answer(self)

    def do_HEAD(self) -> None:
        self.server.endpoint.answer(self)

    def reply(self, reply: Reply, *, bearer: bool = False) -> None:
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.send_header("Cache-Control", "no-store")
        if bearer:
            self.send_header("WWW-Authenticate", 'Bearer realm="hio"')
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("http " + format, *args)  # noqa: G003 - the stdlib's %-format and its args, kept lazy


def serve_http(
    settings: ClusterSettings,
    listen: str,
    registry: CollectorRegistry | None,
    *,
    name: str,
    pages: Mapping[str, Route] | None = None,
) -> HttpEndpoint | None:
    """A role's endpoint on ``listen`` (``/metrics`` of ``registry``, ``/healthz``, ``pages``),
    started; None when ``listen`` is empty (the role serves no HTTP)."""
    if not listen:
        return None
    return HttpEndpoint(settings, listen, role_routes(registry, pages), name=name).start()
