"""The feature repository: zstd feature records stored once per tuple id, read
incrementally by named consumers through offsets; knowledge written back.

Public surface: :class:`RepositoryConfig`, :func:`run_repository`,
:func:`create_repository_server`, :class:`FeatureStore`. Loaded lazily so that
importing the config (the CLI does, to build flags) does not import gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hio.repository.config import RepositoryConfig

if TYPE_CHECKING:
    from hio.repository.server import create_repository_server, run_repository
    from hio.repository.store import FeatureStore

__all__ = ["FeatureStore", "RepositoryConfig", "create_repository_server", "run_repository"]

_LAZY = {
    "run_repository": "hio.repository.server",
    "create_repository_server": "hio.repository.server",
    "FeatureStore": "hio.repository.store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hio.repository' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
