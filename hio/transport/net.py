"""gRPC servers and channels, built one way for every role.

``create_server`` applies message bounds, keepalive, authentication, TLS, the
standard health service (:class:`RoleHealth`: readiness and liveness) and server
reflection; ``run_until_signal`` drains on SIGTERM/SIGINT within a deadline.
``create_channel`` is the client side: the same bounds, TLS, and the caller's
token on every call.
"""

from __future__ import annotations

import functools
import hmac
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hio.config import ConfigError
from hio.settings import ClusterSettings, message_limit
from hio.transport.frames import ChunkFrame, TupleFrame, TupleReceipt, WireFrame, parse_frame, serialize_frame

if TYPE_CHECKING:
    from hio.proto import master_pb2

    _Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    _Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], _Handler | None]

log = logging.getLogger("hio.net")

AUTH_HEADER = "authorization"


NEVER_CONNECTED = "failed to connect to all addresses"  # gRPC's words when no connection was made


def connect_hint(details: str, *, speaks_tls: bool) -> str:
    """What a call that never connected should tell its user; "" when there is nothing to add.

    gRPC reports every failure to connect the same way (UNAVAILABLE, "failed to
    connect to all addresses") whether the port was closed or the TLS handshake
    failed; the cause is buried at the end of the details, and a TLS mistake then
    reads like a server that is down. This names the likely setting to fix.
    """
    if NEVER_CONNECTED not in details:
        return ""
    if "Hostname Verification" in details or "not in peer certificate" in details:
        return (
            "TLS: the server's certificate does not name the host or IP this address uses; "
            "connect by a name in the certificate, or issue it with this name"
        )
    if "WRONG_VERSION_NUMBER" in details:
        return "TLS: the server does not speak TLS; drop tls_ca/tls_cert here, or give the server a certificate"
    if "handshake failed" in details.lower() or "SSL_ERROR" in details:  # "Tls handshake failed (...)"
        reason = details.removesuffix(": OK").rpartition(": ")[2].strip()  # OpenSSL's last words
        return f"TLS handshake failed ({reason}): check that tls_ca is the CA that signed the server's certificate"
    if "Socket closed" in details:
        if speaks_tls:
            return (
                "the server closed the connection during the TLS handshake: it may require a client "
                "certificate signed by its CA (tls_cert, tls_key)"
            )
        return (
            "the server closed the connection at once: if it serves TLS, set tls_ca (and tls_cert, "
            "tls_key if it requires client certificates)"
        )
    return ""


def rpc_status(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """(code, details) of a failed call; lane errors and plain RpcErrors alike."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return code, details or ""


def rpc_error_text(exc: grpc.RpcError, settings: ClusterSettings) -> str:
    """'CODE: details' of a failed call, with :func:`connect_hint`'s advice when it never
    connected. ``settings`` are the caller's: the advice depends on whether it speaks TLS."""
    code, details = rpc_status(exc)
    hint = connect_hint(details, speaks_tls=settings.speaks_tls)
    text = f"{code.name if code else 'error'}: {details}"
    return f"{text} ({hint})" if hint else text


#: The roles a tokens file may grant ("any": every call, as the shared --token does).
TOKEN_ROLES = ("admin", "any", "gateway", "instrument", "kd", "viewer", "worker")


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None


class TokenTable:
    """Accepted tokens and the role each grants; compared in constant time."""

    def __init__(self, entries: Sequence[tuple[str, str, str]]) -> None:
        self._entries = [(t.encode(), role, name) for t, role, name in entries]

    @classmethod
    def from_settings(cls, settings: ClusterSettings) -> TokenTable | None:
        """From --tokens-file ('token role name' a line), else the shared token; None = open."""
        if settings.tokens_file:
            entries = []
            for n, raw in enumerate(_read(settings.tokens_file, "tokens file").decode().splitlines(), 1):
                parts = raw.split("#", 1)[0].split()
                if not parts:
                    continue
                if len(parts) < 2:
                    raise ConfigError(f"{settings.tokens_file}:{n}: expected 'token role [name]'")
                if parts[1] not in TOKEN_ROLES:  # a typo would refuse that client on every call
                    raise ConfigError(
                        f"{settings.tokens_file}:{n}: unknown role '{parts[1]}'; known: {', '.join(TOKEN_ROLES)}"
                    )
                entries.append((parts[0], parts[1], parts[2] if len(parts) > 2 else parts[1]))
            return cls(entries)
        shared = settings.presented_token()
        return cls([(shared, "any", "cluster")]) if shared else None

    def lookup(self, token: str) -> tuple[str, str] | None:
        """(role, name) for a known token, else None. Every entry is compared."""
        given = token.encode()
        found = None
        for expected, role, name in self._entries:
            if hmac.compare_digest(expected, given):
                found = (role, name)
        return found


class _AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without a known bearer token; roles limit which methods."""

    OPEN_METHODS = ("/grpc.health.v1.Health/",)

    def __init__(self, table: TokenTable, policy: dict[str, set[str]] | None) -> None:
        self._table = table
        self._policy = policy or {}

    def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> _Handler | None:
        method = handler_call_details.method
        if method.startswith(self.OPEN_METHODS):
            return continuation(handler_call_details)
        token, malformed = "", False
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_HEADER and isinstance(value, str):
                scheme, _, rest = value.partition(" ")
                if scheme.lower() == "bearer" and rest.strip():  # the scheme is case-insensitive (RFC 7235)
                    token = rest.strip()
                else:
                    malformed = True
        if malformed and not token:
            return _refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the {AUTH_HEADER} metadata is not 'Bearer <token>': present a valid token (--token-file)",
            )
        refusal = refuse_caller(self._table, self._policy, method, token)
        return _refusal(*refusal) if refusal is not None else continuation(handler_call_details)


def refuse_caller(
    table: TokenTable, policy: dict[str, set[str]], method: str, token: str
) -> tuple[grpc.StatusCode, str] | None:
    """Why a caller presenting ``token`` may not call ``method`` (status, message); None = it may.
    Shared by the gRPC services and the engine's payload lane."""
    who = table.lookup(token) if token else None
    if who is None:
        reason = "missing token" if not token else "invalid token"
        return grpc.StatusCode.UNAUTHENTICATED, f"{reason}: present a valid token (--token-file)"
    role, _name = who
    allowed = policy.get(method.rsplit("/", 1)[-1])
    if role != "any" and allowed is not None and role not in allowed and role != "admin":
        return grpc.StatusCode.PERMISSION_DENIED, f"role '{role}' may not call {method}"
    return None


class _Wrapping(grpc.ServerInterceptor):
    """Serves each method by ``wrap`` of its handler, made once and kept (the server's
    methods are fixed), not built again on every call."""

    def __init__(self, wrap: Callable[[_Handler], _Handler]) -> None:
        self._wrap = wrap
        self._wrapped: dict[str, _Handler] = {}  # method -> its wrapped handler; only served methods

    def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> _Handler | None:
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            handler = continuation(handler_call_details)
            if handler is None:  # no such method: not kept, so callers cannot grow the table
                return None
            wrapped = self._wrapped[method] = self._wrap(handler)
        return wrapped


def _parsed_inside(handler: _Handler) -> _Handler:
    """``handler`` parsing its requests itself, so unparseable bytes are INVALID_ARGUMENT.

    grpc answers a request deserializer that raises with INTERNAL before any
    servicer code runs; a client's bug would then look like a server crash.
    """
    if handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer
    type_name = getattr(getattr(parse, "__self__", None), "__name__", "request")
    if parse == TupleFrame.FromString:  # frame streams: large chunks read in place
        parse = parse_frame
    serialize = handler.response_serializer
    if serialize == TupleFrame.SerializeToString:  # ... and sent as encoded by the sender
        serialize = serialize_frame

    def decode(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {type_name}: {exc}")

    def decode_all(raws: Iterable[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        for raw in raws:
            yield decode(raw, context)

    kinds: list[tuple[Any, Any, Callable[[Any, grpc.ServicerContext], Any]]] = [
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler, decode),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler, decode),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler, decode_all),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler, decode_all),
    ]
    inner, make, read = next(kind for kind in kinds if kind[0] is not None)  # a handler is of one kind
    return make(lambda raw, ctx: inner(read(raw, ctx), ctx), response_serializer=serialize)


class _StreamLimit:
    """At most ``streams`` streaming calls at once; the one past it is refused at once with
    RESOURCE_EXHAUSTED. A stream holds a thread of the server's pool for its whole life (a
    client waiting for its receipts, a long poll), so without a bound, open streams would take
    every thread and leave unary calls, health checks included, waiting unanswered; the pool
    keeps threads beyond the bound for them."""

    def __init__(self, streams: int) -> None:
        self._streams = streams
        self._open = threading.BoundedSemaphore(streams)

    def _admit(self, context: grpc.ServicerContext) -> None:
        if not self._open.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this server has {self._streams} streams open, the most it serves at once; "
                "retry once one has ended (with backoff)",
            )

    def wrap(self, handler: _Handler) -> _Handler:
        if not (handler.request_streaming or handler.response_streaming):
            return handler

        def unary_result(request: Any, context: grpc.ServicerContext) -> Any:
            self._admit(context)
            try:
                return handler.stream_unary(request, context)  # type: ignore[misc]  # set for this kind
            finally:
                self._open.release()

        def streamed_result(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._admit(context)
            try:
                yield from (handler.unary_stream or handler.stream_stream)(request, context)  # type: ignore[misc]  # one is set for this kind
            finally:
                self._open.release()

        make = {
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        body = streamed_result if handler.response_streaming else unary_result
        return make(
            body,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _refusal(code: grpc.StatusCode, message: str) -> _Handler:
    def deny(request_or_iterator: object, context: grpc.ServicerContext) -> None:
        context.abort(code, message)

    # A stream-stream handler refuses every kind of call before reading it.
    return grpc.stream_stream_rpc_method_handler(deny)


# Keepalive, the same for every client and server (with or without calls); a server accepts a
# ping every half of it. gRPC's default allowance is one in 5 minutes: past two pings sooner it
# sends the client away (GOAWAY ENHANCE_YOUR_CALM "too_many_pings") and its next call fails.
KEEPALIVE_MS = 20_000


def _options(settings: ClusterSettings, *more: tuple[str, int]) -> list[tuple[str, int]]:
    """Message bounds and keepalive, the same for every client and server, then ``more``."""
    limit = message_limit(settings)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        *more,
    ]


_FROM_SETTINGS: Any = object()


def stream_bound(threads: int) -> int:
    """Streams a server of ``threads`` threads serves at once: all but a quarter of them, kept
    for unary calls (:class:`_StreamLimit`)."""
    return threads - max(1, threads // 4)


def create_server(
    settings: ClusterSettings,
    listen: str,
    *,
    max_workers: int = 32,
    policy: dict[str, set[str]] | None = None,
    register: Iterable[Callable[[grpc.Server], None]] = (),
    table: TokenTable | None = _FROM_SETTINGS,
    service: str = "",
) -> tuple[grpc.Server, int, RoleHealth]:
    """Build a started-not-yet server bound to ``listen`` ('host:port', port 0 = any).

    Returns (server, bound port, health servicer). The caller adds servicers via
    ``register`` callbacks, then calls ``server.start()``. ``table``: the accepted
    tokens (None = open); by default read from the settings, but a role that also
    authenticates elsewhere (the engine's payload lane) passes the one it read.
    ``service``: the role's gRPC service (``hio.proto.Master``), for which the
    health service answers too, so a probe can tell which role holds a port.
    ``max_workers``: the server's threads; streams may hold all but a quarter of them
    (:class:`_StreamLimit`), which are kept for unary calls.
    """
    if table is _FROM_SETTINGS:
        table = TokenTable.from_settings(settings)
    auth = [_AuthInterceptor(table, policy)] if table is not None else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[*auth, _Wrapping(_StreamLimit(stream_bound(max_workers)).wrap), _Wrapping(_parsed_inside)],
        options=_options(
            settings, ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2), ("grpc.so_reuseport", 0)
        ),
    )
    for add in register:
        add(server)
    health_servicer = RoleHealth(service)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # grpcurl and other tools list the services and read their messages from the server itself.
    served = [name for name in (service, health.SERVICE_NAME, reflection.SERVICE_NAME) if name]
    reflection.enable_server_reflection(served, server)
    if settings.tls_cert:
        creds = grpc.ssl_server_credentials(
            [(_read(settings.tls_key, "TLS key"), _read(settings.tls_cert, "TLS certificate"))],
            root_certificates=_read(settings.tls_ca, "TLS CA") if settings.tls_ca else None,
            require_client_auth=settings.tls_client_auth,
        )
    try:
        port = server.add_secure_port(listen, creds) if settings.tls_cert else server.add_insecure_port(listen)
    except RuntimeError:  # grpcio's refusal of a port it cannot bind
        raise ConfigError(
            f"cannot listen on {listen}: the port is in use (another hio process there?) or the "
            "address is not this machine's; stop that process or choose another address"
        ) from None
    return server, port, health_servicer


ROLE_SERVICES = {  # the gRPC service each role's server is for (proto/hio/proto/*.proto)
    "master": "hio.proto.Master",
    "repository": "hio.proto.Repository",
    "gateway": "hio.proto.Ingest",
    "engine": "hio.proto.Engine",
}

#: The health service name of liveness: SERVING from a role's start to its stop, whatever
#: its readiness ("" and the role's service name) says.
LIVENESS = "liveness"
READINESS_SECONDS = 2.0  # how often a role's readiness is looked at between probes (a Check looks at once)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RoleHealth(health.HealthServicer):
    """The standard health service of one role's server: readiness ("" and the role's gRPC
    service by name: SERVING while the role can do its job; its ``readiness`` says why not,
    and a change is logged) and liveness (:data:`LIVENESS`: SERVING from :meth:`start` to
    :meth:`stop`, whatever readiness says). ``docs/architecture.md`` ("Health and
    reflection") says what each means to probes, and why there are two."""

    def __init__(self, service: str = "") -> None:
        super().__init__(experimental_non_blocking=True)
        self.service = service
        self.not_ready = "not started"  # why the role is not ready; '' when it is
        self._readiness: Callable[[], str] | None = None  # start's, if given: then looked at
        self._changing = threading.Lock()  # not _lock: the servicer has one
        self._stopped = threading.Event()
        self._readiness_names = ("", service) if service else ("",)
        for name in (*self._readiness_names, LIVENESS):
            self.set(name, _NOT_SERVING)  # gRPC's servicer starts with "" SERVING

    def start(self, readiness: Callable[[], str] | None = None) -> None:
        """The role serves: live until :meth:`stop`; ready while ``readiness()`` returns ''
        (else it says why not), looked at every :data:`READINESS_SECONDS`."""
        self.set(LIVENESS, _SERVING)
        if readiness is not None:
            self._readiness = readiness
            _watch_readiness(self)
        self.refresh()

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Any:
        """A probe is answered with readiness as it is now, not as last looked at."""
        if self._readiness is not None:
            self.refresh()
        return super().Check(request, context)

    def refresh(self) -> None:
        """Look at readiness now; publish and log a change."""
        with self._changing:
            if self._stopped.is_set():
                return
            try:
                reason = self._readiness() if self._readiness is not None else ""
            except Exception as exc:  # noqa: BLE001 - a check that fails says so instead of stopping probes
                reason = f"readiness cannot be told: {type(exc).__name__}: {exc}"
            if reason == self.not_ready:
                return
            was, self.not_ready = self.not_ready, reason
            for name in self._readiness_names:
                self.set(name, _NOT_SERVING if reason else _SERVING)
        if reason:  # a warning when it was ready (a master waiting for its first worker is no news)
            log.log(logging.WARNING if not was else logging.INFO, "not ready", extra={"reason": reason})
        elif was != "not started":
            log.info("ready again", extra={"was": was})

    def stop(self) -> None:
        """The role stops: neither ready nor live from now on."""
        with self._changing:
            self._stopped.set()
            self.not_ready = "stopping"
            for name in (*self._readiness_names, LIVENESS):
                self.set(name, _NOT_SERVING)


# The started roles' health, refreshed by one thread per process. Held weakly: a server
# dropped without RoleHealth.stop (tests, in-process roles) is not kept, nor watched, for ever.
_WATCHED: weakref.WeakSet[RoleHealth] = weakref.WeakSet()
_WATCHED_LOCK = threading.Lock()
_watching = False


def _watch_readiness(role_health: RoleHealth) -> None:
    global _watching
    with _WATCHED_LOCK:
        _WATCHED.add(role_health)
        if not _watching:
            threading.Thread(target=_refresh_watched, name="readiness", daemon=True).start()
            _watching = True


def _refresh_watched() -> None:
    while True:
        time.sleep(READINESS_SECONDS)
        with _WATCHED_LOCK:
            healths = list(_WATCHED)
        for role_health in healths:
            role_health.refresh()


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._md = (AUTH_HEADER, f"Bearer {token}")

    def _intercept(self, continuation: Callable[[grpc.ClientCallDetails, Any], Any], details: Any, request: Any) -> Any:
        """Every kind of call: the token added to its metadata (grpc's call details are a
        namedtuple)."""
        return continuation(details._replace(metadata=[*(details.metadata or ()), self._md]), request)

    intercept_unary_unary = intercept_unary_stream = _intercept  # type: ignore[assignment]  # one for each kind
    intercept_stream_unary = intercept_stream_stream = _intercept  # type: ignore[assignment]  # (the stubs type them apart)


def send_frames(
    channel: grpc.Channel, service: str, method: str
) -> grpc.StreamStreamMultiCallable[WireFrame, TupleReceipt]:
    """A frames-in, receipts-out call (``Engine.Deliver``, ``Master.Enqueue``,
    ``Ingest.Submit``) that sends large chunks as encoded (:func:`frames.encode_frame`).
    The generated stubs would call ``SerializeToString`` on them."""
    return channel.stream_stream(
        _method_path(service, method), request_serializer=serialize_frame, response_deserializer=TupleReceipt.FromString
    )


def pull_frames(
    channel: grpc.Channel,
) -> grpc.UnaryStreamMultiCallable[master_pb2.PullTupleRequest, TupleFrame | ChunkFrame]:
    """``Master.PullTuple`` whose large chunks are read in place (:func:`frames.parse_frame`)."""
    from hio.proto import master_pb2

    return channel.unary_stream(
        _method_path("Master", "PullTuple"),
        request_serializer=master_pb2.PullTupleRequest.SerializeToString,
        response_deserializer=parse_frame,
    )


@functools.cache
def _method_path(service: str, method: str) -> str:
    """'/hio.proto.Engine/Deliver' for ('Engine', 'Deliver'), checked against the protos."""
    from hio.proto import engine_pb2, ingest_pb2, master_pb2

    for module in (engine_pb2, master_pb2, ingest_pb2):
        found = module.DESCRIPTOR.services_by_name.get(service)
        if found is not None and method in found.methods_by_name:
            return f"/{found.full_name}/{method}"
    raise ValueError(f"no rpc {service}.{method} in the protos")


def create_channel(address: str, settings: ClusterSettings, token: str | None = None) -> grpc.Channel:
    """A channel to another role with our bounds, TLS if configured, and the token."""
    options = _options(
        settings,
        ("grpc.enable_retries", 0),
        # Each channel its own connections: with gRPC's process-wide pool, a channel to an
        # address another channel failed to reach (a role that was down, a port reused by a
        # restarted engine) fails fast with UNAVAILABLE until that channel's backoff ends.
        ("grpc.use_local_subchannel_pool", 1),
        # A restarted role is reached again within seconds, not gRPC's default of up to 2 min.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    )
    if settings.speaks_tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(settings.tls_ca, "TLS CA") if settings.tls_ca else None,
            private_key=_read(settings.tls_key, "TLS key") if settings.tls_key else None,
            certificate_chain=_read(settings.tls_cert, "TLS certificate") if settings.tls_cert else None,
        )
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    token = settings.presented_token() if token is None else token
    if token:
        channel = grpc.intercept_channel(channel, _TokenClientInterceptor(token))
    return channel


def wait_healthy(
    address: str,
    settings: ClusterSettings,
    timeout: float = 30.0,
    alive: Callable[[], bool] | None = None,
    service: str = "",
    *,
    ready: bool = True,
) -> None:
    """Block until the server at ``address`` is ready, or (``ready`` false) has started;
    else raise TimeoutError.

    Ready: it reports SERVING for ``service`` ("" = the server as a whole). Started: it
    reports SERVING for :data:`LIVENESS` (a master with no worker yet has started, and
    is not ready). ``service`` (optional): the gRPC service expected there; a server
    that does not serve it (another role that holds the port) is not taken for the one
    awaited. ``alive`` (optional) is polled too: when it turns false, give up at once.
    """
    deadline = time.monotonic() + timeout
    last: Exception | str | None = None
    with create_channel(address, settings) as channel:
        # What HealthStub(channel).Check is (the stubs of grpcio-health-checking do not declare it).
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )

        def status(name: str) -> int:
            return int(check(health_pb2.HealthCheckRequest(service=name), timeout=2.0).status)

        while time.monotonic() < deadline:
            if alive is not None and not alive():
                last = "the process exited"
                break
            try:
                if service and not ready:
                    status(service)  # NOT_FOUND: the server there is another role's
                if status(service if ready else LIVENESS) == _SERVING:
                    return
                last = "it reports NOT_SERVING" if ready else "not started yet"
            except grpc.RpcError as exc:
                last = exc
                if service and exc.code() == grpc.StatusCode.NOT_FOUND:
                    last = f"the server there does not serve {service}: another process holds the port?"
            time.sleep(0.1)
    what = "ready" if ready else "started"
    raise TimeoutError(f"{address} did not become {what} within {timeout:.0f}s ({last})")


def wait_for_stop(stop: threading.Event) -> None:
    """Wait until ``stop`` is set, waking every second.

    Why: Python runs a signal handler only when the main thread runs. A
    signal the kernel hands to another thread (gRPC has many) does not
    interrupt an untimed wait, so SIGTERM could go unanswered.
    """
    while not stop.wait(1.0):
        pass


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` (from the main thread only, where Python allows handlers).

    The handler hands the set to a thread of its own: Python runs it on the main thread
    between two bytecodes, and when those are inside ``stop.wait`` holding the event's lock,
    setting the event right there would wait for that lock for ever.
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(*_: object) -> None:
        threading.Thread(target=stop.set, name="stop-signal", daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def run_until_signal(
    server: grpc.Server,
    *,
    grace: float = 5.0,
    on_stop: Sequence[Callable[[], None]] = (),
) -> int:
    """Serve until SIGTERM/SIGINT; drain within ``grace`` seconds.

    Exit code 0 after a clean stop. ``on_stop`` callbacks run before the server
    stops accepting, so roles can deregister and flush.
    """
    stop = threading.Event()
    stop_on_signals(stop)
    wait_for_stop(stop)
    log.info("stopping", extra={"grace_s": grace})
    for callback in on_stop:
        try:
            callback()
        except Exception:  # keep stopping whatever a callback does
            log.exception("stop callback failed")
    server.stop(grace).wait(grace + 1.0)
    return 0
