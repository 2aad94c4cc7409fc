"""The worker role: a controller that supervises processing engines, and the
engine runtime itself.

``import hio.worker`` stays light: names are imported on first use, so the
CLI can build flags without loading grpc, zstandard or a pipeline.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "EngineConfig",
    "EngineLauncher",
    "EngineSpec",
    "TupleInfo",
    "WorkerConfig",
    "run_engine",
    "run_worker",
]

_EXPORTS = {
    "WorkerConfig": "hio.worker.config",
    "EngineConfig": "hio.worker.config",
    "TupleInfo": "hio.worker.api",
    "EngineLauncher": "hio.worker.launcher",
    "EngineSpec": "hio.worker.launcher",
    "run_worker": "hio.worker.controller",
    "run_engine": "hio.worker.engine",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hio.worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
