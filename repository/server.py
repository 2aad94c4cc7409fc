"""Running the repository: gRPC service, HTTP endpoint (metrics and pages), lifecycle."""

from __future__ import annotations

import logging

import grpc

from hio.process.log import NOTICE
from hio.proto import repository_pb2_grpc
from hio.repository.config import RepositoryConfig
from hio.repository.http import pages
from hio.repository.metrics import repository_registry
from hio.repository.service import POLICY, RepositoryService
from hio.repository.store import FeatureStore
from hio.transport.errors import HioError
from hio.transport.http import serve_http
from hio.transport.net import ROLE_SERVICES, RoleHealth, create_server, run_until_signal

log = logging.getLogger("hio.repository")


def _build(config: RepositoryConfig) -> tuple[grpc.Server, int, RoleHealth, FeatureStore]:
    store = FeatureStore.from_config(config)
    service = RepositoryService(
        store,
        read_batch_records=config.read_batch_records,
        read_batch_bytes=config.read_batch_bytes,
        max_waiters=max(1, config.max_workers // 4),
    )
    try:
        server, port, health_servicer = create_server(
            config,
            config.listen,
            max_workers=config.max_workers,
            policy=POLICY,
            service=ROLE_SERVICES["repository"],
            register=[lambda s: repository_pb2_grpc.add_RepositoryServicer_to_server(service, s)],
        )
    except BaseException:
        store.close()
        raise
    return server, port, health_servicer, store


def create_repository_server(config: RepositoryConfig) -> tuple[grpc.Server, int, FeatureStore]:
    """(server, bound port, store), not started; for in-process use and tests.

    The caller starts the server, and stops it and closes the store when done.
    """
    server, port, health_servicer, store = _build(config)
    health_servicer.start(lambda: store.disk.failure)
    return server, port, store


def run_repository(config: RepositoryConfig) -> int:
    """Serve until SIGTERM/SIGINT; exit code 0 after a clean stop, 1 if the store cannot open."""
    try:
        server, port, health_servicer, store = _build(config)
    except HioError as exc:
        log.error("repository cannot start", extra={"reason": exc.message})
        return 1
    http = None
    try:
        registry = repository_registry(store) if config.metrics else None
        http = serve_http(config, config.http_listen, registry, name="repository", pages=pages(store))
        server.start()
        health_servicer.start(lambda: store.disk.failure)
        log.log(
            NOTICE,
            "repository serving",
            extra={"port": port, "records": store.latest(), "http": http.address if http else "off"},
        )
        return run_until_signal(server, on_stop=[health_servicer.stop])
    finally:
        if http is not None:
            http.close()
        server.stop(0)
        store.close()
