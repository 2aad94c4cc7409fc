"""``hio gateway``: the long-running gateway beside the instrument.

Resumes spooled tuples, serves the ingest API, watches a folder. On SIGTERM it
stops accepting, lets in-flight streams finish within ``grace_seconds`` and
exits 0; undelivered tuples stay spooled for the next start.
"""

from __future__ import annotations

import logging
import threading
import time

from hio.gateway.client import Gateway
from hio.gateway.config import GatewayConfig
from hio.gateway.ingest import POLICY, IngestServicer
from hio.gateway.metrics import gateway_registry
from hio.gateway.watch import DirectoryWatcher
from hio.process.log import NOTICE
from hio.proto import ingest_pb2_grpc
from hio.transport.http import serve_http
from hio.transport.net import ROLE_SERVICES, create_server, stop_on_signals, wait_for_stop

log = logging.getLogger("hio.gateway")


def run_gateway(config: GatewayConfig, stop_event: threading.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or ``stop_event``); 0 after a clean stop. Blocks."""
    stop = stop_event or threading.Event()
    stop_on_signals(stop)
    gateway = Gateway(config)
    servicer = server = health = watcher = http = None
    try:
        http = serve_http(
            config, config.http_listen, gateway_registry(gateway) if config.metrics else None, name="gateway"
        )
        if config.ingest_listen:
            servicer = IngestServicer(gateway)
            server, _port, health = create_server(
                config,
                config.ingest_listen,
                max_workers=80,  # Submit streams, each for its life: 60 at once, the rest for status and health
                policy=POLICY,
                register=[lambda s: ingest_pb2_grpc.add_IngestServicer_to_server(servicer, s)],
                service=ROLE_SERVICES["gateway"],
            )
            server.start()
            health.start(lambda: gateway.spool.disk_failure)  # ready until its spool's fsync fails
        if config.watch:
            watcher = DirectoryWatcher(
                gateway,
                config.watch,
                config.resolved_done_dir(),
                settle_seconds=config.settle_seconds,
                poll_seconds=config.poll_seconds,
                image=config.image,
            )
            watcher.start()
        log.log(
            NOTICE,
            "gateway ready",
            extra={
                "ingest": config.ingest_listen or "off",
                "http": http.address if http else "off",
                "watch": config.watch or "off",
                "resumed": len(gateway.resumed_futures),
                "master": config.master_address,
            },
        )
        wait_for_stop(stop)
    finally:  # stop taking tuples, finish in-flight work within the grace period, keep the spool
        start = time.monotonic()
        grace = config.grace_seconds
        log.info("stopping", extra={"grace_s": grace})
        if watcher is not None:
            watcher.stop()
        if servicer is not None:  # a tuple arriving may finish; a second is left to say why it did not
            servicer.stop_accepting(finish_seconds=max(0.0, grace / 2 - 1.0))
        if server is not None and health is not None:
            health.stop()
            server.stop(grace / 2).wait(grace / 2 + 1.0)
        gateway.close(max(0.0, grace - (time.monotonic() - start)), drain=False)
        if http is not None:
            http.close()
    return 0
