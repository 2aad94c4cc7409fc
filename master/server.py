"""The master's gRPC server and payload lane around the domain object (:mod:`hio.master.core`)."""

from __future__ import annotations

import logging

import grpc

from hio.master.config import MasterConfig
from hio.master.core import Master
from hio.master.service import POLICY, MasterService
from hio.master.statuspage import StatusPage
from hio.process.log import NOTICE
from hio.proto import master_pb2_grpc
from hio.transport.http import serve_http
from hio.transport.lane import LaneServer, create_server_with_lane
from hio.transport.net import ROLE_SERVICES, RoleHealth, run_until_signal

log = logging.getLogger("hio.master")

# Connections at once on the lane, kept ones included: Enqueue (gateways' delivery threads) and
# PullTuple (each idle engine holds one). One beyond it closes the connection kept idle the
# longest; with none idle it is closed at once, and its caller uses gRPC for a while.
LANE_CONNECTIONS = 512


def _build(config: MasterConfig) -> tuple[grpc.Server, int, Master, RoleHealth]:
    master = Master(config)
    try:
        service = MasterService(master)
        server, port, health_servicer, master.lane = create_server_with_lane(
            config,
            config.listen,
            lane_listen=config.lane_address(),
            lane=lambda table: LaneServer(
                config,
                service="Master",
                uploads={"Enqueue": service.enqueue},  # uploads arrive in pieces of chunk_bytes
                downloads={"PullTuple": service.pull_for_lane},
                table=table,
                policy=POLICY,
                max_connections=LANE_CONNECTIONS,
                piece_bytes=config.chunk_bytes,
            ),
            derived=not config.lane_listen,
            logger=log,
            max_workers=config.server_threads,
            policy=POLICY,
            service=ROLE_SERVICES["master"],
            register=[lambda s: master_pb2_grpc.add_MasterServicer_to_server(service, s)],
        )
    except BaseException:
        master.close()
        raise
    master.listen_port = port
    master.start()
    return server, port, master, health_servicer


def create_master_server(config: MasterConfig) -> tuple[grpc.Server, int, Master]:
    """The master's gRPC server (not started), its bound port, and the domain object; the
    caller starts the server, and stops it before ``master.close()``."""
    server, port, master, health = _build(config)
    health.start(master.not_ready)
    return server, port, master


def run_master(config: MasterConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain for ``grace_seconds`` and seal the backlog; exit 0."""
    server, port, master, health_servicer = _build(config)
    page = StatusPage(master)
    try:
        registry = master.metrics.registry if master.metrics else None
        http = serve_http(config, config.http_listen, registry, name="master", pages=page.routes())
    except BaseException:
        master.close()
        raise
    server.start()
    health_servicer.start(master.not_ready)
    host = config.listen.rsplit(":", 1)[0]
    log.log(
        NOTICE,
        "master listening",
        extra={
            "address": f"{host}:{port}",
            "data_dir": config.data_dir,
            "lane_port": master.lane_port,
            "http": http.address if http else "off",
            "queued": master.queue.length(),
        },
    )

    def draining() -> None:
        health_servicer.stop()
        # waiting pulls return and the lane stops, before the gRPC server drains; a tuple still
        # arriving over gRPC may finish, and a second is left to say why it did not
        master.begin_shutdown(finish_seconds=max(0.0, config.grace_seconds - 1.0))

    try:
        return run_until_signal(server, grace=config.grace_seconds, on_stop=[draining])
    finally:
        if http is not None:
            http.close()
        page.close()
        master.close()
