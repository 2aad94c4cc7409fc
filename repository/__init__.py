"""The feature repository: zstd feature records stored once per tuple id, read
incrementally by named consumers through offsets; knowledge written back.

Public surface: :class:`RepositoryConfig`, :func:`run_repository`,
:func:`create_repository_server`, :class:`FeatureStore`. Loaded lazily so that
importing the config (the CLI does, to build flags) does not import gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hio import lazy_exports
from hio.repository.config import RepositoryConfig

if TYPE_CHECKING:
    from hio.repository.server import create_repository_server, run_repository
    from hio.repository.store import FeatureStore

_WHERE = {"run_repository": "server", "create_repository_server": "server", "FeatureStore": "store"}
__all__ = ["FeatureStore", "RepositoryConfig", "create_repository_server", "run_repository"]
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
