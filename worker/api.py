"""What a processing pipeline sees (the contract: :mod:`hio.worker.pipelines`), and how an
image name finds its pipeline. Engines are persistent: a pipeline is loaded once and then
called for every tuple.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Callable, Mapping
from typing import Any

from hio.config import ConfigError
from hio.settings import BUILTIN_IMAGES

# An engine whose pipeline cannot be loaded exits with this (EX_CONFIG) after one line saying why:
# its worker shows that line as the channel's state, and does not take it for a port in use.
PIPELINE_EXIT_CODE = 78
_NO_ATTRIBUTES: Mapping[str, str] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class TupleInfo:
    """Metadata of the tuple being processed (never its payload).

    ``attributes`` are the user's key/values from the instrument (pipeline
    parameters, experiment labels), read-only.
    """

    tuple_id: int
    source: str
    image: str
    name: str
    size: int
    created_unix: float
    attributes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_meta(cls, meta: Any) -> TupleInfo:
        """From a ``hio.proto.TupleMeta`` (duck-typed so this module stays light).

        Runs once per tuple: it fills the instance's ``__dict__`` at once instead of
        calling the frozen ``__init__`` (an ``object.__setattr__`` per field), which is
        a visible part of an engine's work per small tuple. The fields are the same.
        """
        attributes = meta.attributes
        info = object.__new__(cls)
        info.__dict__.update(
            tuple_id=int(meta.tuple_id),
            source=meta.source,
            image=meta.image,
            name=meta.name,
            size=int(meta.size),
            created_unix=float(meta.created_unix),
            attributes=types.MappingProxyType(dict(attributes)) if attributes else _NO_ATTRIBUTES,
        )
        return info


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A loaded pipeline: the function to call and what KD should cluster on."""

    spec: str
    process: Callable[[bytes, TupleInfo], Mapping[str, Any]]
    kd_features: tuple[str, ...] = ()


def load_pipeline(spec: str) -> Pipeline:
    """Import ``module:function``, run the module's ``setup()`` once, read ``KD_FEATURES``.

    Raises ConfigError naming the spec when it cannot be imported or is not
    callable; exceptions from ``setup()`` propagate (a broken pipeline must
    stop the engine, so the controller reports it down with the reason).
    """
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"pipeline {spec!r} must look like module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"pipeline {spec!r}: cannot import {module_name}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"pipeline {spec!r}: {module_name} has no function {func_name!r}")
    kd = getattr(module, "KD_FEATURES", ())
    if isinstance(kd, str) or not all(isinstance(name, str) for name in kd):
        raise ConfigError(f"pipeline {spec!r}: KD_FEATURES must be a list of feature names")
    setup = getattr(module, "setup", None)
    if callable(setup):
        setup()
    return Pipeline(spec=spec, process=func, kd_features=tuple(kd))


def pipeline_for_image(image: str, extra_mappings: tuple[str, ...] | list[str] = (), *, builtin: bool = True) -> str:
    """The ``module:function`` that processes ``image``.

    Extra ``IMAGE=module:function`` mappings win over the built-ins
    ``hio/<name>`` → ``hio.worker.pipelines.<name>:process``. Without ``builtin`` (engines in
    containers: an image names its own pipeline), '' when no mapping names the image.
    """
    for mapping in extra_mappings:
        name, sep, spec = mapping.partition("=")
        if not sep or not name.strip() or ":" not in spec:
            raise ConfigError(f"pipelines entry {mapping!r} must look like IMAGE=module:function")
        if name.strip() == image:
            return spec.strip()
    if not builtin:
        return ""
    if image in BUILTIN_IMAGES:
        return f"hio.worker.pipelines.{image.removeprefix('hio/')}:process"
    known = [*BUILTIN_IMAGES, *(m.partition("=")[0].strip() for m in extra_mappings)]
    raise ConfigError(
        f"no pipeline for image {image!r}; known images: {', '.join(known)} "
        '(add one with pipelines = ["IMAGE=module:function"])'
    )
