"""Every role's server: readiness and liveness on the standard health service, and server
reflection (what grpcurl lists and reads), over plain and TLS connections."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from hio.master import MasterConfig, create_master_server
from hio.settings import ClusterSettings
from hio.transport.certs import generate
from hio.transport.net import LIVENESS, create_channel, create_server, wait_healthy
from tests.harness import health_of, wait_for


def test_readiness_follows_the_role_and_liveness_runs_from_start_to_stop() -> None:
    settings = ClusterSettings()
    server, port, health = create_server(settings, "127.0.0.1:0", service="hio.proto.Repository")
    server.start()
    address = f"127.0.0.1:{port}"
    problem = ["the disk is full"]
    names = ("", "hio.proto.Repository", LIVENESS)
    try:
        assert [health_of(address, name) for name in names] == ["NOT_SERVING"] * 3  # not started
        health.start(lambda: problem[0])
        assert [health_of(address, name) for name in names] == ["NOT_SERVING", "NOT_SERVING", "SERVING"]
        assert health.not_ready == "the disk is full"
        wait_healthy(address, settings, timeout=5, service="hio.proto.Repository", ready=False)  # started
        with pytest.raises(TimeoutError, match="did not become ready"):
            wait_healthy(address, settings, timeout=1, service="hio.proto.Repository")
        problem[0] = ""  # the condition ends: ready again, without anyone asking
        wait_for(lambda: health_of(address) == "SERVING", timeout=5, what="readiness back to SERVING")
        assert health_of(address, "hio.proto.Repository") == "SERVING"
        wait_healthy(address, settings, timeout=5, service="hio.proto.Repository")
        problem[0] = "the disk is full again"  # a probe sees it at once, not at the next look
        assert health_of(address, "hio.proto.Repository") == "NOT_SERVING"
        assert health.not_ready == "the disk is full again"
        health.stop()
        assert [health_of(address, name) for name in names] == ["NOT_SERVING"] * 3
        assert health_of(address, "hio.proto.Master") == "NOT_FOUND"  # another role's name
    finally:
        server.stop(0)


def test_a_master_without_workers_has_started_but_is_not_ready_until_one_registers(tmp_path: Path) -> None:
    from tests.master.helpers import register

    config = MasterConfig(listen="127.0.0.1:0", data_dir=str(tmp_path), fsync="never")
    server, port, master = create_master_server(config)
    server.start()
    address = f"127.0.0.1:{port}"
    try:
        assert health_of(address, LIVENESS) == "SERVING"
        assert health_of(address) == health_of(address, "hio.proto.Master") == "NOT_SERVING"
        assert "no worker runs an engine" in master.not_ready()
        wait_healthy(address, config, timeout=5, service="hio.proto.Master", ready=False)  # how hio up waits
        with create_channel(address, config) as channel:
            from hio.proto import master_pb2_grpc

            register(master_pb2_grpc.MasterStub(channel), "w1")
        wait_for(lambda: health_of(address) == "SERVING", timeout=5, what="the master ready once a worker registered")
        assert health_of(address, "hio.proto.Master") == "SERVING"
    finally:
        master.begin_shutdown()
        server.stop(0)
        master.close()


@pytest.fixture(params=["plain", "tls"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, ClusterSettings]]:
    """A master's server (plain or TLS, with a token), and the settings a client reaches it with."""
    tls: dict[str, str] = {}
    client = ClusterSettings(token="secret")
    if request.param == "tls":
        certs = generate(tmp_path / "certs", ("master",), ("127.0.0.1",))
        tls = {"tls_cert": str(certs["master"]), "tls_key": str(certs["master-key"]), "tls_ca": str(certs["ca"])}
        client = ClusterSettings(token="secret", tls_ca=str(certs["ca"]))
    config = MasterConfig(listen="127.0.0.1:0", data_dir=str(tmp_path / "m"), fsync="never", token="secret", **tls)
    server, port, master = create_master_server(config)
    server.start()
    try:
        yield f"127.0.0.1:{port}", client
    finally:
        master.begin_shutdown()
        server.stop(0)
        master.close()


def test_reflection_lists_the_role_s_services_and_resolves_their_methods(served: tuple[str, ClusterSettings]) -> None:
    address, client = served
    with create_channel(address, client) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert set(database.get_services()) == {
            "hio.proto.Master",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName("hio.proto.Master").FindMethodByName("Enqueue")
        assert method.input_type.full_name == "hio.proto.TupleFrame"
        assert method.output_type.full_name == "hio.proto.TupleReceipt"
        assert method.client_streaming and method.server_streaming
        assert "queued" in method.output_type.fields_by_name  # the message as the server knows it
        route = pool.FindServiceByName("hio.proto.Master").FindMethodByName("RouteTuples")  # docs/architecture.md
        assert (route.input_type.full_name, route.output_type.full_name) == (
            "hio.proto.RouteTuplesRequest",
            "hio.proto.RouteTuplesResponse",
        )


def test_reflection_asks_for_a_token_where_the_server_does(served: tuple[str, ClusterSettings]) -> None:
    address, client = served
    anonymous = ClusterSettings(tls_ca=client.tls_ca)
    with create_channel(address, anonymous) as channel, pytest.raises(grpc.RpcError) as refused:
        ProtoReflectionDescriptorDatabase(channel).get_services()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert health_of(address, LIVENESS, anonymous) == "SERVING"  # health stays open for probes


def test_streams_past_the_bound_are_refused_and_unary_calls_are_still_answered() -> None:
    """Open streams hold a server thread each for their life: the one past the bound is
    refused at once, naming the bound, and health checks (unary) are answered meanwhile; a
    stream that ends makes room for the next."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    settings = ClusterSettings()
    server, port, health = create_server(
        settings, "127.0.0.1:0", max_workers=3
    )  # 2 streams, a thread kept for unary calls
    server.start()
    health.start(lambda: "")
    try:
        with create_channel(f"127.0.0.1:{port}", settings) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(service=LIVENESS)) for _ in range(2)]
            for watch in watches:  # each stream answers its first status and stays open
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.Watch(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=5))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 streams open, the most it serves at once" in str(refused.value.details())
            for _ in range(40):  # more unary calls than the server's threads: none waits for a stream
                assert (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    == health_pb2.HealthCheckResponse.SERVING
                )
            watches[0].cancel()
            wait_for(lambda: _watch_opens(stub), timeout=10, what="a stream once another ended")
            watches[1].cancel()
    finally:
        server.stop(None)


def _watch_opens(stub: Any) -> bool:
    from grpc_health.v1 import health_pb2

    watch = stub.Watch(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=5)
    try:
        next(watch)
        return True
    except grpc.RpcError:
        return False
    finally:
        watch.cancel()
