"""The gateway beside the instrument: spool, deliver, watch a folder, ingest API.

Public surface (imported lazily, so ``import hio.gateway`` stays light):

* :class:`Gateway` - the client library for instrument software and scripts
  (``submit``/``send``/``send_file``/``send_many``/``flush``/``close``/``status``);
* :class:`GatewayConfig`, :class:`SendConfig` - settings;
* :func:`run_gateway` - the ``hio gateway`` daemon; :func:`run_send` - ``hio send``;
* errors: :class:`DeliveryError`, :class:`DeliveryTimeout`, :class:`SpoolFull`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from hio.gateway.client import DeliveryError, DeliveryTimeout, Gateway, GatewayStatus, TupleFuture
    from hio.gateway.config import GatewayConfig, SendConfig
    from hio.gateway.daemon import run_gateway
    from hio.gateway.send import run_send
    from hio.gateway.spool import SpoolFull


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hio.gateway' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"hio.gateway.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
