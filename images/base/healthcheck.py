"""Container health probe: is the engine in this container serving gRPC?

Docker runs this (HEALTHCHECK in images/base/Dockerfile) inside the
container. It asks the standard gRPC health service at HIO_ENGINE_LISTEN,
using the same TLS settings as the engine (HIO_TLS_*), and exits 0 only on
SERVING. Host networking means a wildcard listen address is reachable on
loopback.
"""

from __future__ import annotations

import os
import sys

PROBE_SECONDS = float(os.environ.get("HIO_HEALTH_PROBE_SECONDS", "3"))


def main() -> int:
    listen = os.environ.get("HIO_ENGINE_LISTEN", "")
    if not listen.rpartition(":")[2].isdigit():
        print(f"healthcheck: HIO_ENGINE_LISTEN is not host:port: {listen!r}", file=sys.stderr)
        return 1
    from hio import config
    from hio.settings import ClusterSettings
    from hio.transport.net import ROLE_SERVICES, wait_healthy

    settings = config.build(ClusterSettings, "engine")
    try:
        host, _, port = listen.rpartition(":")
        address = f"{config.local_host(host)}:{port}"  # a wildcard listen address is reachable on loopback
        wait_healthy(address, settings, timeout=PROBE_SECONDS, service=ROLE_SERVICES["engine"])
    except TimeoutError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
