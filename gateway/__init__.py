"""The gateway beside the instrument: spool, deliver, watch a folder, ingest API.

Public surface (imported lazily, so ``import hio.gateway`` stays light):

* :class:`Gateway` - the client library for instrument software and scripts
  (``submit``/``send``/``send_file``/``send_many``/``flush``/``close``/``status``);
* :class:`GatewayConfig`, :class:`SendConfig` - settings;
* :func:`run_gateway` - the ``hio gateway`` daemon; :func:`run_send` - ``hio send``;
* errors: :class:`DeliveryError`, :class:`DeliveryTimeout`, :class:`SpoolFull`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hio import lazy_exports

_WHERE = {
    "Gateway": "client",
    "GatewayStatus": "client",
    "TupleFuture": "client",
    "DeliveryError": "client",
    "DeliveryTimeout": "client",
    "SpoolFull": "spool",
    "GatewayConfig": "config",
    "SendConfig": "config",
    "run_gateway": "daemon",
    "run_send": "send",
}
__all__ = [
    "DeliveryError",
    "DeliveryTimeout",
    "Gateway",
    "GatewayConfig",
    "GatewayStatus",
    "SendConfig",
    "SpoolFull",
    "TupleFuture",
    "run_gateway",
    "run_send",
]
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

if TYPE_CHECKING:
    from hio.gateway.client import DeliveryError, DeliveryTimeout, Gateway, GatewayStatus, TupleFuture
    from hio.gateway.config import GatewayConfig, SendConfig
    from hio.gateway.daemon import run_gateway
    from hio.gateway.send import run_send
    from hio.gateway.spool import SpoolFull
