"""Tokens, roles and TLS as every role's server and channel apply them."""

import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from hio.process.procs import free_port
from hio.settings import ClusterSettings
from hio.transport.certs import generate
from hio.transport.net import connect_hint, create_channel, create_server, rpc_error_text, wait_healthy


def echo_server(settings: ClusterSettings, policy=None):
    handler = grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Say": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
            "Admin": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"ok"),
        },
    )
    server, port, health = create_server(
        settings, "127.0.0.1:0", policy=policy, register=[lambda s: s.add_generic_rpc_handlers((handler,))]
    )
    server.start()
    health.start()
    return server, f"127.0.0.1:{port}"


def say(address: str, settings: ClusterSettings, method: str = "Say", token: str | None = None) -> bytes:
    with create_channel(address, settings, token=token) as channel:
        return channel.unary_unary(f"/test.Echo/{method}")(b"hi", timeout=5)


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# token role name\ngw-secret gateway gw1\nwk-secret worker w1\nadm-secret admin ops\n")
    return path


def test_calls_without_a_valid_token_are_unauthenticated(tokens: Path) -> None:
    server, address = echo_server(ClusterSettings(tokens_file=str(tokens)))
    try:
        client = ClusterSettings()
        for token, message in ((None, "missing token"), ("wrong", "invalid token")):
            with pytest.raises(grpc.RpcError) as err:
                say(address, client, token=token or "")
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in err.value.details()
        assert say(address, client, token="gw-secret") == b"hi"
        with grpc.insecure_channel(address) as channel:  # the header as other clients write it
            call = channel.unary_unary("/test.Echo/Say")
            assert call(b"hi", metadata=[("authorization", "bearer gw-secret")], timeout=5) == b"hi"
            for header in ("gw-secret", "Basic Z3c6c2VjcmV0", "Bearer "):
                with pytest.raises(grpc.RpcError) as err:
                    call(b"hi", metadata=[("authorization", header)], timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "the authorization metadata is not 'Bearer <token>'" in err.value.details()
        wait_healthy(address, client, timeout=5)  # health stays open for probes
    finally:
        server.stop(0)


def test_roles_limit_methods(tokens: Path) -> None:
    server, address = echo_server(ClusterSettings(tokens_file=str(tokens)), policy={"Admin": {"worker"}})
    try:
        with pytest.raises(grpc.RpcError) as err:
            say(address, ClusterSettings(), "Admin", token="gw-secret")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "gateway" in err.value.details()
        assert say(address, ClusterSettings(), "Admin", token="wk-secret") == b"ok"
        assert say(address, ClusterSettings(), "Admin", token="adm-secret") == b"ok"
    finally:
        server.stop(0)


def test_token_file_is_what_a_client_presents(tmp_path: Path, tokens: Path) -> None:
    mine = tmp_path / "my-token"
    mine.write_text("wk-secret\n")
    server, address = echo_server(ClusterSettings(tokens_file=str(tokens)))
    try:
        assert say(address, ClusterSettings(token_file=str(mine))) == b"hi"
    finally:
        server.stop(0)


def test_tls_and_mutual_tls(tmp_path: Path) -> None:
    certs = generate(tmp_path / "certs", ("server", "client"), ("127.0.0.1", "localhost"))
    other = generate(tmp_path / "other", ("client",), ("127.0.0.1",))
    serve = ClusterSettings(
        tls_cert=str(certs["server"]), tls_key=str(certs["server-key"]), tls_ca=str(certs["ca"]), tls_client_auth=True
    )
    server, address = echo_server(serve)
    try:
        good = ClusterSettings(tls_cert=str(certs["client"]), tls_key=str(certs["client-key"]), tls_ca=str(certs["ca"]))
        assert say(address, good) == b"hi"
        for bad in (
            ClusterSettings(tls_ca=str(certs["ca"])),  # no client certificate
            ClusterSettings(
                tls_cert=str(other["client"]), tls_key=str(other["client-key"]), tls_ca=str(certs["ca"])
            ),  # client cert from another CA
            ClusterSettings(),
        ):  # plaintext to a TLS port
            with pytest.raises(grpc.RpcError) as err:
                say(address, bad)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # the server hung up in the handshake: the text says which setting to look at
            assert "client certificate" in rpc_error_text(err.value, bad)
    finally:
        server.stop(0)


def test_a_call_that_never_connected_says_which_tls_setting_to_fix(tmp_path: Path) -> None:
    certs = generate(tmp_path / "certs", ("server",), ("127.0.0.1",))
    other = generate(tmp_path / "other", ("server",), ("127.0.0.1",))
    by_name = generate(tmp_path / "by-name", ("server",), ("localhost",))
    tls, tls_address = echo_server(ClusterSettings(tls_cert=str(certs["server"]), tls_key=str(certs["server-key"])))
    named, named_address = echo_server(
        ClusterSettings(tls_cert=str(by_name["server"]), tls_key=str(by_name["server-key"]))
    )
    plain, plain_address = echo_server(ClusterSettings())
    cases = [
        (tls_address, ClusterSettings(tls_ca=str(other["ca"])), "check that tls_ca is the CA that signed"),
        (plain_address, ClusterSettings(tls_ca=str(certs["ca"])), "the server does not speak TLS"),
        (tls_address, ClusterSettings(), "if it serves TLS, set tls_ca"),
        (named_address, ClusterSettings(tls_ca=str(by_name["ca"])), "does not name the host or IP"),
        (f"127.0.0.1:{free_port()}", ClusterSettings(), None),  # refused: nothing to add
    ]
    try:
        for address, settings, advice in cases:
            with pytest.raises(grpc.RpcError) as err:
                say(address, settings)
            text = rpc_error_text(err.value, settings)
            assert text.startswith("UNAVAILABLE: failed to connect to all addresses")
            if advice is None:
                assert not connect_hint(err.value.details(), speaks_tls=False)
            else:
                assert advice in text, text
    finally:
        for server in (tls, named, plain):
            server.stop(0)


def test_servicer_errors_become_statuses_and_aborts_pass_through() -> None:
    from hio.transport.errors import ResourceExhausted, grpc_errors, retry_after

    class Servicer:
        @grpc_errors
        def full(self, request, context):
            raise ResourceExhausted("queue full (4 GiB of 4 GiB)", retry_after=1.5)

        @grpc_errors
        def aborts(self, request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "going away")

        @grpc_errors
        def bug(self, request, context):
            raise KeyError("secret internals")

    s = Servicer()
    handler = grpc.method_handlers_generic_handler(
        "test.Err", {name: grpc.unary_unary_rpc_method_handler(getattr(s, name)) for name in ("full", "aborts", "bug")}
    )
    server, port, _ = create_server(
        ClusterSettings(), "127.0.0.1:0", register=[lambda srv: srv.add_generic_rpc_handlers((handler,))]
    )
    server.start()
    try:
        with create_channel(f"127.0.0.1:{port}", ClusterSettings()) as channel:

            def call(name):
                with pytest.raises(grpc.RpcError) as err:
                    channel.unary_unary(f"/test.Err/{name}")(b"", timeout=5)
                return err.value

            e = call("full")
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in e.details()
            assert retry_after(e) == 1.5
            assert call("aborts").code() == grpc.StatusCode.UNAVAILABLE
            e = call("bug")
            assert e.code() == grpc.StatusCode.INTERNAL and "secret" not in e.details() and "ref" in e.details()
    finally:
        server.stop(0)


def test_a_channel_reaches_a_server_another_channel_found_down() -> None:
    """A restarted engine often gets its old port back: a channel opened to it must not fail
    because another channel of the process failed to connect there and is backing off."""
    from hio.process.procs import free_port

    settings = ClusterSettings()
    port = free_port()
    # Another channel of the process with the same settings (so gRPC's process-wide pool, were it
    # used, would share its connection): it fails, and backs off.
    with create_channel(f"127.0.0.1:{port}", settings) as earlier:
        with pytest.raises(grpc.RpcError) as refused:
            earlier.unary_unary("/test.Echo/Say")(b"hi", timeout=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        handler = grpc.method_handlers_generic_handler(
            "test.Echo", {"Say": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
        )
        server, bound, _ = create_server(
            settings, f"127.0.0.1:{port}", register=[lambda s: s.add_generic_rpc_handlers((handler,))]
        )
        server.start()
        try:
            assert bound == port
            assert say(f"127.0.0.1:{port}", settings) == b"hi"
        finally:
            server.stop(0).wait(5)


def test_a_tokens_file_with_an_unknown_role_is_refused_by_line(tmp_path: Path) -> None:
    from hio.config import ConfigError
    from hio.transport.net import TokenTable

    path = tmp_path / "tokens"
    path.write_text("gw-secret gateway gw1\nwk-secret workers w1\n")  # 'workers' would refuse w1 on every call
    with pytest.raises(ConfigError, match=r"tokens:2: unknown role 'workers'; known: admin, any, gateway, instrument"):
        TokenTable.from_settings(ClusterSettings(tokens_file=str(path)))


def test_every_role_a_service_grants_is_a_known_token_role() -> None:
    """The roles named in each service's policy are the ones a tokens file may grant."""
    from hio.gateway.ingest import POLICY as INGEST
    from hio.master.service import POLICY as MASTER
    from hio.repository.service import POLICY as REPOSITORY
    from hio.transport.net import TOKEN_ROLES
    from hio.worker.engine import POLICY as ENGINE

    granted = {role for policy in (INGEST, MASTER, REPOSITORY, ENGINE) for roles in policy.values() for role in roles}
    assert granted <= set(TOKEN_ROLES), granted - set(TOKEN_ROLES)


def test_role_services_are_the_services_the_protos_define() -> None:
    from hio.proto import engine_pb2, ingest_pb2, master_pb2, repository_pb2
    from hio.transport.net import ROLE_SERVICES

    defined = {
        module.DESCRIPTOR.services_by_name[name].full_name
        for module, name in (
            (master_pb2, "Master"),
            (repository_pb2, "Repository"),
            (ingest_pb2, "Ingest"),
            (engine_pb2, "Engine"),
        )
    }
    assert set(ROLE_SERVICES.values()) == defined


def test_a_probe_naming_its_service_is_not_fooled_by_another_server_on_the_port() -> None:
    from hio.transport.net import ROLE_SERVICES

    settings = ClusterSettings()
    server, port, health = create_server(settings, "127.0.0.1:0", service=ROLE_SERVICES["repository"])
    server.start()
    health.start()
    address = f"127.0.0.1:{port}"
    try:
        wait_healthy(address, settings, timeout=5)  # any server
        wait_healthy(address, settings, timeout=5, service=ROLE_SERVICES["repository"])  # the right one
        with pytest.raises(TimeoutError, match=r"does not serve hio\.proto\.Master: another process holds the port"):
            wait_healthy(address, settings, timeout=1, service=ROLE_SERVICES["master"])
        health.stop()
        with pytest.raises(TimeoutError):
            wait_healthy(address, settings, timeout=1, service=ROLE_SERVICES["repository"])
    finally:
        server.stop(0)


def test_free_port_never_gives_one_process_the_same_port_twice() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_free_port_keeps_the_port_after_each_for_its_lane() -> None:
    """A server's lane listens on its port + 1 by default: no other role may be given that port."""
    ports = [free_port() for _ in range(500)]
    lanes = {port + 1 for port in ports}
    assert not lanes & set(ports), sorted(lanes & set(ports))


def test_free_ports_lie_in_this_process_share_lanes_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallel test workers each draw from their own share: one worker's ports, and the lane
    ports beside them, are never another's. Here: the two halves of this process's share."""
    from hio.process import procs

    index, count = procs.PORT_SHARE
    span = (procs.ephemeral_low() - procs.PORT_FLOOR) // (2 * count)
    for half in (2 * index, 2 * index + 1):
        monkeypatch.setattr(procs, "PORT_SHARE", (half, 2 * count))
        first = procs.PORT_FLOOR + half * span
        ports = [procs.free_port() for _ in range(200)]
        assert all(first <= port and port + 1 < first + span for port in ports), (first, span, ports)


def test_free_ports_are_below_the_ports_outgoing_connections_take() -> None:
    """A role started again on its port must find it free: outgoing connections take their local
    ports from the ephemeral range, so a port from there may be held by one when it restarts."""
    from hio.process.procs import PORT_FLOOR, ephemeral_low

    low = ephemeral_low()
    assert low > PORT_FLOOR + 1000  # this machine leaves room below its ephemeral range
    ports = [free_port() for _ in range(200)]
    assert all(PORT_FLOOR <= port < low for port in ports), [p for p in ports if not PORT_FLOOR <= p < low]
    with socket.create_server(("127.0.0.1", ports[0])):  # each one free when given
        pass


def _idle_then_call(monkeypatch: pytest.MonkeyPatch, *, client_ms: int, server_ms: int) -> list[str]:
    """A server built with keepalive ``server_ms``, a client with ``client_ms``: call, stay idle
    six client intervals, call again; the client channel's states after its first READY."""
    import time

    from hio.transport import net

    monkeypatch.setattr(net, "KEEPALIVE_MS", server_ms)
    server, address = echo_server(ClusterSettings())
    monkeypatch.setattr(net, "KEEPALIVE_MS", client_ms)
    states: list[str] = []
    try:
        with create_channel(address, ClusterSettings()) as channel:
            channel.subscribe(lambda state: states.append(state.name), try_to_connect=False)
            assert channel.unary_unary("/test.Echo/Say")(b"hi", timeout=5) == b"hi"
            time.sleep(6 * client_ms / 1000)
            assert channel.unary_unary("/test.Echo/Say")(b"again", timeout=5) == b"again"
    finally:
        server.stop(None)
    return states[states.index("READY") :]


def test_an_idle_client_keeps_its_connection_across_many_keepalive_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients ping every KEEPALIVE_MS and servers accept a ping every half of it: a client idle
    for several intervals is not sent away (GOAWAY ENHANCE_YOUR_CALM "too_many_pings", which
    would drop the connection: the channel would leave READY)."""
    assert _idle_then_call(monkeypatch, client_ms=1000, server_ms=1000) == ["READY"]


def test_a_client_pinging_faster_than_its_server_allows_is_sent_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the test above would see if the settings disagreed (as when the server's option had
    a name gRPC does not read, and it allowed one ping in 5 minutes)."""
    states = _idle_then_call(monkeypatch, client_ms=1000, server_ms=60_000)
    assert states[0] == "READY" and len(states) > 1, states


_SIGNAL_WHILE_WAITING = """
import os, signal, threading
from hio.transport.net import stop_on_signals
stop = threading.Event()
stop_on_signals(stop)
with stop._cond:                        # the lock stop.wait() holds while it starts and ends waiting
    os.kill(os.getpid(), signal.SIGTERM)   # the handler runs here, on this thread, lock held
print("stopped" if stop.wait(5) else "not stopped", flush=True)
"""


def test_a_signal_arriving_while_the_main_thread_holds_the_stop_event_s_lock_still_stops_the_role() -> None:
    """A handler that set the event itself would wait for that lock for ever (this run would
    time out); stop_on_signals sets it from a thread of its own."""
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_WAITING], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "stopped", proc.stderr
