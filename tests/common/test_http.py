"""The HTTP endpoint every role serves (hio.transport.http), over loopback: its paths,
the gRPC server's token rules (401 without a known token, 403 for a role not allowed),
TLS and mutual TLS with the role's certificates, and its bound on connections."""

from __future__ import annotations

import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from hio.config import ConfigError
from hio.metrics import Scraped, gauge, role_registry
from hio.settings import ClusterSettings
from hio.transport.certs import generate
from hio.transport.http import MAX_CONNECTIONS, HttpEndpoint, Reply, Route, serve_http

TOKENS = {"viewer": "v-token", "gateway": "g-token", "admin": "a-token"}


def get(url: str, token: str = "", context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a GET."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def registry_with(value: float) -> CollectorRegistry:
    return role_registry(Scraped(lambda: [gauge("hio_test_answer", "What the test set", value)]))


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("".join(f"{token} {role} {role}-1\n" for role, token in TOKENS.items()))
    return path


@pytest.fixture
def open_endpoint() -> Iterator[HttpEndpoint]:
    endpoint = serve_http(ClusterSettings(), "127.0.0.1:0", registry_with(42.0), name="test")
    assert endpoint is not None
    yield endpoint
    endpoint.close()


def test_metrics_are_served_in_prometheus_text_format_and_healthz_says_alive(open_endpoint: HttpEndpoint) -> None:
    status, headers, body = get(f"http://{open_endpoint.address}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["hio_test_answer"].samples[0].value == 42.0
    assert "process_cpu_seconds" in families, "every role's registry carries the process's own figures"
    assert get(f"http://{open_endpoint.address}/healthz")[:3:2] == (200, b"ok\n")


def test_an_unknown_path_is_not_found_and_names_the_known_ones(open_endpoint: HttpEndpoint) -> None:
    status, _, body = get(f"http://{open_endpoint.address}/metrics/extra")
    assert status == 404 and b"/metrics" in body


def test_with_metrics_off_the_endpoint_says_so_at_metrics_and_still_serves_health() -> None:
    endpoint = serve_http(ClusterSettings(), "127.0.0.1:0", None, name="test")
    assert endpoint is not None
    try:
        status, _, body = get(f"http://{endpoint.address}/metrics")
        assert status == 404 and b"metrics = false" in body
        assert get(f"http://{endpoint.address}/healthz")[0] == 200
    finally:
        endpoint.close()


def test_a_page_that_fails_answers_500_and_the_endpoint_serves_on() -> None:
    def broken(_query: object) -> Reply:
        raise RuntimeError("boom")

    endpoint = HttpEndpoint(ClusterSettings(), "127.0.0.1:0", {"/broken": Route(broken, None)}, name="test").start()
    try:
        status, _, body = get(f"http://{endpoint.address}/broken")
        assert status == 500 and b"test log" in body and b"boom" not in body
        assert get(f"http://{endpoint.address}/broken")[0] == 500
    finally:
        endpoint.close()


def test_a_port_in_use_is_refused_naming_http_listen(open_endpoint: HttpEndpoint) -> None:
    with pytest.raises(ConfigError, match="http_listen: cannot listen on"):
        serve_http(ClusterSettings(), open_endpoint.address, None, name="test")


@pytest.fixture
def guarded(tokens_file: Path) -> Iterator[str]:
    endpoint = serve_http(ClusterSettings(tokens_file=str(tokens_file)), "127.0.0.1:0", registry_with(1.0), name="t")
    assert endpoint is not None
    yield f"http://{endpoint.address}"
    endpoint.close()


def test_with_a_tokens_file_metrics_need_a_known_token(guarded: str) -> None:
    status, headers, body = get(f"{guarded}/metrics")
    assert status == 401 and b"missing token" in body and headers["WWW-Authenticate"].startswith("Bearer")
    status, _, body = get(f"{guarded}/metrics", token="not-a-token")
    assert status == 401 and b"invalid token" in body


def test_a_role_not_allowed_to_read_metrics_is_forbidden(guarded: str) -> None:
    status, _, body = get(f"{guarded}/metrics", token=TOKENS["gateway"])
    assert status == 403 and b"role 'gateway'" in body


@pytest.mark.parametrize("role", ["viewer", "admin"])
def test_a_viewer_or_an_admin_reads_metrics(guarded: str, role: str) -> None:
    status, _, body = get(f"{guarded}/metrics", token=TOKENS[role])
    assert status == 200 and b"hio_test_answer 1.0" in body


def test_health_is_open_as_grpc_health_is(guarded: str) -> None:
    assert get(f"{guarded}/healthz")[0] == 200


def test_a_shared_token_is_asked_for_as_grpc_asks_for_it() -> None:
    endpoint = serve_http(ClusterSettings(token="shared"), "127.0.0.1:0", None, name="t")
    assert endpoint is not None
    try:
        assert get(f"http://{endpoint.address}/metrics")[0] == 401
        assert get(f"http://{endpoint.address}/metrics", token="shared")[0] == 404  # through, and metrics are off
    finally:
        endpoint.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("certs")
    paths = generate(root / "good", ("server", "prometheus"), ("localhost", "127.0.0.1"))
    other = generate(root / "other", ("stranger",), ("localhost", "127.0.0.1"))
    return {**paths, "stranger": other["stranger"], "stranger-key": other["stranger-key"]}


def tls_endpoint(certs: dict[str, Path], *, client_auth: bool) -> HttpEndpoint:
    settings = ClusterSettings(
        tls_cert=str(certs["server"]),
        tls_key=str(certs["server-key"]),
        tls_ca=str(certs["ca"]),
        tls_client_auth=client_auth,
    )
    endpoint = serve_http(settings, "127.0.0.1:0", registry_with(7.0), name="t")
    assert endpoint is not None and endpoint.scheme == "https"
    return endpoint


def client(certs: dict[str, Path], *, ca: bool = True, cert: str = "") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs["ca"]) if ca else None)
    if cert:
        context.load_cert_chain(str(certs[cert]), str(certs[f"{cert}-key"]))
    return context


def test_tls_is_served_with_the_roles_certificate_and_a_client_without_its_ca_fails(certs: dict[str, Path]) -> None:
    endpoint = tls_endpoint(certs, client_auth=False)
    url = f"https://{endpoint.address}/metrics"
    try:
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(url, context=client(certs, ca=False))
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext against TLS
            get(f"http://{endpoint.address}/metrics")
        status, _, body = get(url, context=client(certs))
        assert status == 200 and b"hio_test_answer 7.0" in body
    finally:
        endpoint.close()


@pytest.mark.parametrize("cert", ["", "stranger"])
def test_mutual_tls_refuses_a_client_without_a_certificate_of_its_ca(certs: dict[str, Path], cert: str) -> None:
    endpoint = tls_endpoint(certs, client_auth=True)
    url = f"https://{endpoint.address}/metrics"
    try:
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            get(url, context=client(certs, cert=cert))
        assert get(url, context=client(certs, cert="prometheus"))[0] == 200
    finally:
        endpoint.close()


def test_connections_past_the_bound_are_closed_and_room_comes_back(open_endpoint: HttpEndpoint) -> None:
    host, port = open_endpoint.address.rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # the server has taken them all
        extra = socket.create_connection((host, int(port)), timeout=5)
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert extra.recv(100) == b"", "one past the bound is closed unanswered"
        extra.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while get(f"http://{open_endpoint.address}/healthz")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert get(f"http://{open_endpoint.address}/healthz")[0] == 200
