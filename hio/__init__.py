"""HarmonicIO: stream large scientific tuples to processing engines, store
their features, and keep a live preview of what the data says.

Roles are subpackages: ``hio.gateway``, ``hio.master``, ``hio.worker``,
``hio.repository``, ``hio.kd``; the wire contract is ``hio.proto``. Code
shared by several roles is grouped by subject: ``hio.config`` and ``hio.settings``
(every role's configuration), ``hio.transport`` (how roles talk), ``hio.storage``
(durable state on disk) and ``hio.process`` (process tools). The command line is
``hio``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a package whose public names (``where``: name ->
    the module of the package that holds it) are imported on first use, so that importing
    the package (the CLI does, to build flags) loads neither grpc nor a pipeline."""

    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return getattr_, dir_
