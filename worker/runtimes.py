"""Which runtime runs a worker's engines: local processes (:class:`ProcessLauncher`) or
Docker containers (``hio.worker.docker_launcher``), chosen once at the worker's start."""

from __future__ import annotations

import logging
from typing import Any

from hio.config import ConfigError
from hio.settings import BUILTIN_IMAGES
from hio.worker.config import WorkerConfig, engine_counts
from hio.worker.launcher import EngineLauncher, ProcessLauncher

log = logging.getLogger("hio.worker")


def _docker_module() -> Any | None:
    """``hio.worker.docker_launcher`` if it can be imported (docker SDK installed), else None."""
    try:
        from hio.worker import docker_launcher as module
    except ImportError as exc:
        log.debug("docker launcher unavailable", extra={"reason": str(exc)})
        return None
    return module


def _docker_usable(module: Any, images: list[str]) -> bool:
    try:
        if not module.docker_available():
            return False
        return all(module.DockerLauncher.has_image(image) for image in images)
    except Exception as exc:  # noqa: BLE001 - "auto" must fall back, whatever docker says
        log.info("docker not usable; running engines as processes", extra={"reason": str(exc)})
        return False


def select_launcher(config: WorkerConfig, worker_id: str | None = None) -> EngineLauncher:
    """The launcher for ``config.runtime``.

    ``process``: local processes. ``docker``: containers, or ConfigError when
    Docker is not usable. ``auto``: containers when the docker launcher
    imports, the daemon answers and every configured image exists locally (an
    elastic worker, whose images come from the master's plan later: the
    built-in ones); else local processes.
    """
    if config.runtime == "process":
        return ProcessLauncher(config, worker_id)
    module = _docker_module()
    # an elastic worker's images come later, from the master's plan: "auto" asks for the built-in ones
    counts = engine_counts(BUILTIN_IMAGES if config.elastic else config.engines, config.effective_cpus())
    images = [image for image, _ in counts]
    if config.runtime == "docker":
        if module is None:
            raise ConfigError(
                "runtime is 'docker' but the Docker launcher cannot be imported (pip install 'harmonicio[docker]')"
            )
        if not module.docker_available():
            raise ConfigError(
                "runtime is 'docker' but no Docker engine answers (is the daemon running "
                "and may this user reach its socket?)"
            )
        return module.DockerLauncher(config, worker_id)
    if module is not None and _docker_usable(module, images):
        log.info("engines run in docker containers")
        return module.DockerLauncher(config, worker_id)
    return ProcessLauncher(config, worker_id)
