"""The master: worker registry and heartbeats, tuple ids and routing, the
durable backlog queue with leases and dead letters, status.

    config = MasterConfig(listen="127.0.0.1:0", data_dir=str(tmp))
    server, port, master = create_master_server(config)
    server.start()
    ...
    server.stop(None); master.close()

``hio master`` runs :func:`run_master`. Names are imported on first use, so that
importing the config (the CLI does, to build flags) does not import gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hio import lazy_exports

_WHERE = {
    "Master": "core",
    "MasterConfig": "config",
    "POLICY": "service",
    "create_master_server": "server",
    "run_master": "server",
}
__all__ = ["POLICY", "Master", "MasterConfig", "create_master_server", "run_master"]
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

if TYPE_CHECKING:
    from hio.master.config import MasterConfig
    from hio.master.core import Master
    from hio.master.server import create_master_server, run_master
    from hio.master.service import POLICY
