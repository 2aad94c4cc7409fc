"""The master: worker registry and heartbeats, tuple ids and routing, the
durable backlog queue with leases and dead letters, status.

    config = MasterConfig(listen="127.0.0.1:0", data_dir=str(tmp))
    server, port, master = create_master_server(config)
    server.start()
    ...
    server.stop(None); master.close()

``hio master`` runs :func:`run_master`.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health

from hio.common.net import create_server, run_until_signal, set_serving
from hio.master.config import MasterConfig
from hio.common.tickets import make_ticket
from hio.master.core import Master
from hio.master.service import POLICY, MasterService
from hio.proto import master_pb2_grpc

__all__ = ["MasterConfig", "Master", "create_master_server", "run_master", "make_ticket", "POLICY"]

log = logging.getLogger("hio.master")


def _build(config: MasterConfig) -> tuple[grpc.Server, int, Master, health.HealthServicer]:
    master = Master(config)
    try:
        service = MasterService(master)
        server, port, health_servicer = create_server(
            config, config.listen, max_workers=config.server_threads, policy=POLICY,
            register=[lambda s: master_pb2_grpc.add_MasterServicer_to_server(service, s)])
    except BaseException:
        master.close()
        raise
    master.start()
    return server, port, master, health_servicer


def create_master_server(config: MasterConfig) -> tuple[grpc.Server, int, Master]:
    """The master's gRPC server (not started), its bound port, and the domain object.

    The caller starts the server, and stops it before ``master.close()``.
    """
    server, port, master, _health = _build(config)
    return server, port, master


def run_master(config: MasterConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain for ``grace_seconds`` and seal the backlog; exit 0."""
    server, port, master, health_servicer = _build(config)
    server.start()
    set_serving(health_servicer, True)
    host = config.listen.rsplit(":", 1)[0]
    log.info("master listening", extra={"address": f"{host}:{port}", "data_dir": config.data_dir,
                                           "queued": master.queue.length()})

    def draining() -> None:
        set_serving(health_servicer, False)
        master.begin_shutdown()

    try:
        return run_until_signal(server, grace=config.grace_seconds, on_stop=[draining])
    finally:
        master.close()
