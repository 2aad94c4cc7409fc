"""The worker role: a controller that supervises processing engines, and the
engine runtime itself.

``import hio.worker`` stays light: names are imported on first use, so the
CLI can build flags without loading grpc, zstandard or a pipeline.
"""

from __future__ import annotations

from hio import lazy_exports

_WHERE = {
    "WorkerConfig": "config",
    "EngineConfig": "config",
    "TupleInfo": "api",
    "EngineLauncher": "launcher",
    "EngineSpec": "launcher",
    "run_worker": "controller",
    "run_engine": "engine",
}
__all__ = ["EngineConfig", "EngineLauncher", "EngineSpec", "TupleInfo", "WorkerConfig", "run_engine", "run_worker"]
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
