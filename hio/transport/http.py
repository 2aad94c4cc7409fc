"""Every role's one HTTP endpoint (:func:`serve_http`): ``/metrics`` (Prometheus text
format), ``/healthz``, and the pages a role adds (the repository's preview page and its files).

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

Browsers cannot add an ``Authorization`` header to a page load. A page for people
(``Route(..., login=True)``) answers a caller without an accepted token with a sign-in form
instead of a plain 401; the form posts the token once to ``/login``, which checks it as a
header would be checked and answers with a session cookie (a random id, never the token:
``HttpOnly``, ``SameSite=Strict``, ``Secure`` when the endpoint speaks TLS; for
:data:`SESSION_SECONDS`). The endpoint keeps at most :data:`MAX_SESSIONS` sessions in
memory (a restarted role asks again); a request with that cookie is taken as one presenting
the token, on every path, with the token's roles.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import html
import logging
import secrets
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from http.cookies import CookieError, SimpleCookie
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
HTML = "text/html; charset=utf-8"
LOGIN_PATH = "/login"  # where a sign-in form posts its token
SESSION_SECONDS = 12 * 3600.0  # a browser's sign-in lasts this long
MAX_SESSIONS = 256  # sign-ins kept at once; one more ends the oldest
MAX_FORM_BYTES = 4096  # the largest sign-in form accepted


@dataclasses.dataclass(frozen=True)
class Reply:
    """What a page answers; ``headers``: more of them (a page's Content-Security-Policy)."""

    status: int
    body: bytes
    content_type: str = _TEXT
    headers: tuple[tuple[str, str], ...] = ()


Page = Callable[[Mapping[str, list[str]]], Reply]  # the query's parameters -> the reply


@dataclasses.dataclass(frozen=True)
class Route:
    """A path's page, and the token roles that may read it (None: anyone, no token asked).
    ``login``: a page for browsers, whose refusals are a sign-in form."""

    page: Page
    roles: frozenset[str] | None
    login: bool = False


def script_hash(source: str) -> str:
    """A Content-Security-Policy source that allows exactly this inline script or style."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


def html_page(status: int, document: str, *, scripts: tuple[str, ...] = (), styles: tuple[str, ...] = ()) -> Reply:
    """An HTML reply whose policy lets the browser run only the inline ``scripts`` and
    ``styles`` given (their text), fetch from this endpoint only and post forms only to it:
    nothing from outside the cluster is loaded, even when a shown name holds markup."""
    allowed_scripts = " ".join(map(script_hash, scripts)) or "'none'"
    allowed_styles = " ".join(map(script_hash, styles)) or "'none'"
    policy = (
        f"default-src 'none'; script-src {allowed_scripts}; style-src {allowed_styles}; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    )
    headers = (
        ("Content-Security-Policy", policy),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "same-origin"),  # a form's post carries its origin, which sign_in checks
    )
    return Reply(status, document.encode(), HTML, headers)


_LOGIN_STYLE = (
    "body{font:15px/1.4 system-ui,sans-serif;margin:0;background:#f4f5f7;color:#1d2733}"
    "main{max-width:26em;margin:12vh auto;background:#fff;padding:1.5em 2em;border-radius:8px;"
    "box-shadow:0 1px 4px #0002}h1{font-size:1.3em;margin:0 0 .6em}.why{color:#a4262c}"
    "input[type=password]{width:100%;box-sizing:border-box;padding:.45em;margin:.3em 0 .9em}"
    "button{padding:.45em 1.2em}.note{color:#5b6773;font-size:.85em}"
)


def login_form(status: int, why: str, target: str, name: str, *, secure: bool) -> Reply:
    """The sign-in form a page for browsers answers a refused caller with."""
    kept = "over TLS only, " if secure else ""
    document = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>HarmonicIO {html.escape(name)}: sign in</title><style>{_LOGIN_STYLE}</style></head>
<body><main><h1>HarmonicIO {html.escape(name)}</h1>
<p class="why" id="refusal">{html.escape(why)}</p>
<form method="post" action="{LOGIN_PATH}">
<label for="token">Token</label>
<input type="password" id="token" name="token" autocomplete="current-password" required autofocus>
<input type="hidden" name="next" value="{html.escape(target)}">
<button type="submit">Sign in</button></form>
<p class="note">The token is checked once; this browser then holds a session cookie
({kept}HttpOnly, for {SESSION_SECONDS / 3600:.0f} hours), never the token.</p>
</main></body></html>
"""
    return html_page(status, document, styles=(_LOGIN_STYLE,))


class Sessions:
    """Browsers signed in at one endpoint: a random id -> the token it stands for, until it expires. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()

    def open(self, token: str) -> str:
        """A new session for ``token``: its id."""
        session = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[session] = (token, self._clock() + SESSION_SECONDS)
            while len(self._tokens) > MAX_SESSIONS:
                self._tokens.popitem(last=False)
        return session

    def token(self, session: str) -> str:
        """The token a live session stands for; '' for an unknown or expired one."""
        with self._lock:
            token, until = self._tokens.get(session, ("", 0.0))
            if token and until <= self._clock():
                del self._tokens[session]
                return ""
        return token


def text(status: int, words: str) -> Reply:
    return Reply(status, (words.rstrip("\n") + "\n").encode())


def role_routes(registry: CollectorRegistry | None, pages: Mapping[str, Route] | None = None) -> dict[str, Route]:
    """``/metrics`` (``registry`` in Prometheus' text format; None = metrics off, 404),
    ``/healthz`` (the process serves HTTP: it is alive), and a role's own ``pages``."""
    from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

    def metrics(_query: Mapping[str, list[str]]) -> Reply:
        if registry is None:
            return text(404, "metrics are off in this role (metrics = false)")
        return Reply(200, generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4)  # what every Prometheus reads

    return {
        "/metrics": Route(metrics, METRICS_ROLES),
        "/healthz": Route(lambda _query: text(200, "ok"), None),
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
        self.sessions = Sessions()
        # refuse_caller's policy is keyed by a call's last path segment: a path's own, here
        self.policy = {
            path.rsplit("/", 1)[-1]: set(route.roles) for path, route in self.routes.items() if route.roles is not None
        }
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
        # per port: a browser sends a host's cookies to each of its ports, and roles share hosts
        self.cookie = f"hio_session_{self.port}"
        self._thread = threading.Thread(target=self._server.serve, name=f"{name}-http", daemon=True)

    def start(self) -> HttpEndpoint:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port (connections being answered finish on their own)."""
        if self._thread.is_alive():
            self._server.stop()
            self._thread.join()
        self._server.server_close()

    def answer(self, request: _Handler) -> None:
        """One request: its route, the caller's token, the page."""
        url = urlsplit(request.path)
        route = self.routes.get(url.path)
        if route is None:
            request.reply(text(404, f"not found: {url.path}; try /metrics or /healthz"))
            return
        if route.roles is not None and self.table is not None:
            refusal = refuse_caller(self.table, self.policy, url.path, self._token(request))  # keyed by last segment
            if refusal is not None:
                code, words = refusal
                if route.login:
                    request.reply(login_form(_STATUS[code], words, url.path, self.name, secure=self.tls is not None))
                else:
                    request.reply(text(_STATUS[code], words), bearer=code == grpc.StatusCode.UNAUTHENTICATED)
                return
        try:
            reply = route.page(parse_qs(url.query))
        except Exception:  # a page must never take the server down, nor go unanswered
            log.exception("http page failed", extra={"path": url.path})
            reply = text(500, f"internal error; see the {self.name} log")
        request.reply(reply)

    def _token(self, request: _Handler) -> str:
        """The caller's token: its bearer header's, else the one its session cookie stands for."""
        header = request.headers.get(AUTH_HEADER, "")
        if header.startswith("Bearer "):
            return header[len("Bearer ") :]
        try:
            cookie = SimpleCookie(request.headers.get("Cookie", "")).get(self.cookie)
        except CookieError:
            return ""
        return self.sessions.token(cookie.value) if cookie is not None else ""

    def sign_in(self, request: _Handler) -> None:
        """``POST /login``: the form's token, checked for the page it asks for; a session
        cookie and a redirect to that page, or the form again with the refusal."""
        pages = [path for path, route in self.routes.items() if route.login]
        if urlsplit(request.path).path != LOGIN_PATH or not pages:
            request.close_connection = True  # its body is left unread
            request.reply(text(405, f"POST is taken only at {LOGIN_PATH}, by a page's sign-in form"))
            return
        origin = request.headers.get("Origin", "")
        if origin and urlsplit(origin).netloc != request.headers.get("Host", ""):  # another site's form
            request.close_connection = True
            request.reply(text(403, "a sign-in is taken only from this endpoint's own form"))
            return
        try:
            length = int(request.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_FORM_BYTES:
            request.close_connection = True
            request.reply(text(413, f"a sign-in form has a Content-Length of at most {MAX_FORM_BYTES} bytes"))
            return
        form = parse_qs(request.rfile.read(length).decode("utf-8", "replace"))
        target = form.get("next", [""])[-1]
        target = target if target in pages else pages[0]
        token = form.get("token", [""])[-1].strip()
        if self.table is None:  # an open endpoint: nothing to sign in to
            request.reply(Reply(303, b"", headers=(("Location", target),)))
            return
        refusal = refuse_caller(self.table, self.policy, target, token)
        if refusal is not None:
            code, words = refusal
            request.reply(login_form(_STATUS[code], words, target, self.name, secure=self.tls is not None))
            return
        cookie = f"{self.cookie}={self.sessions.open(token)}; Path=/; Max-Age={SESSION_SECONDS:.0f}; HttpOnly"
        cookie += "; SameSite=Strict" + ("; Secure" if self.tls is not None else "")
        request.reply(Reply(303, b"", headers=(("Location", target), ("Set-Cookie", cookie))))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 2 * MAX_CONNECTIONS  # the listen backlog: connections that arrive together wait, not retry
    timeout = 0.0  # handle_request takes a connection that is there, never waits for one (serve does)

    def __init__(self, address: tuple[str, int], endpoint: HttpEndpoint) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.endpoint = endpoint
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stopping = False
        self._wake, self._waker = socket.socketpair()
        super().__init__(address, _Handler)

    def serve(self) -> None:
        """Accept connections until :meth:`stop`. It sleeps until a connection or the stop
        comes (``serve_forever`` wakes every poll interval to look for a stop: CPU an idle
        role spends for nothing)."""
        with selectors.DefaultSelector() as selector:
            selector.register(self, selectors.EVENT_READ)
            selector.register(self._wake, selectors.EVENT_READ)
            while not self._stopping:
                for key, _events in selector.select():
                    if key.fileobj is self and not self._stopping:
                        self.handle_request()

    def stop(self) -> None:
        """End :meth:`serve` (the caller joins its thread)."""
        self._stopping = True
        self._waker.send(b"\0")

    def server_close(self) -> None:
        super().server_close()
        self._wake.close()
        self._waker.close()

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

    def version_string(self) -> str:
        return f"hio-{self.server.endpoint.name}"

    def do_GET(self) -> None:
        self.server.endpoint.answer(self)

    do_HEAD = do_GET  # noqa: N815 - the name BaseHTTPRequestHandler looks up

    def do_POST(self) -> None:
        self.server.endpoint.sign_in(self)

    def reply(self, reply: Reply, *, bearer: bool = False) -> None:
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in reply.headers:
            self.send_header(name, value)
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
