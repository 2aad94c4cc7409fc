"""Processing engines as Docker containers (the worker's ``docker`` runtime): each engine
is one container of the image its tuples name, through the docker SDK, with host
networking, our labels, limits, the image's HEALTHCHECK, its settings and credentials,
and an image never pulled. docs/containers.md ("The docker runtime") says each in full.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import re
import tarfile
from pathlib import Path
from typing import Any

import docker
import docker.errors

from hio import images
from hio.worker.config import WorkerConfig
from hio.worker.cpu import CpuUsage, cgroup_cpu_seconds, container_cgroup, tree_wait_seconds
from hio.worker.launcher import EngineHandle, EngineLauncher, EngineSpec

log = logging.getLogger("hio.worker")

LABEL_MANAGED = "io.harmonicio.managed"
LABEL_WORKER = "io.harmonicio.worker"
LABEL_CHANNEL = "io.harmonicio.channel"
ENGINE_COMMAND = ["engine"]  # the base image's ENTRYPOINT is the `hio` command
PING_TIMEOUT = 2  # seconds; docker_available(): a daemon that answers slower is not usable
API_TIMEOUT = 60  # seconds one Docker API call may take
PIDS_LIMIT = 4096  # processes/threads per engine container
LOG_MAX_SIZE = "10m"  # json-file log rotation per container
LOG_MAX_FILES = "3"
SECRETS_DIR = "/run/hio"  # where credential files are copied inside the container
EXITED_STATES = ("exited", "dead")
REMOVABLE_STATES = (*EXITED_STATES, "created")  # what cleanup() removes of ours

# Settings that name files on the worker's host. Inside the container they are
# copied in; the token file is read and passed as HIO_TOKEN instead.
_FILE_SETTINGS = ("tls_cert", "tls_key", "tls_ca", "tokens_file", "ticket_key_file")
# Settings the container decides itself: its scratch data lives under its own
# working directory, and an image that names its pipeline (ENV HIO_PIPELINE)
# runs that one whatever the worker's process-runtime mappings say.
_IMAGE_OWNED = ("data_dir",)


class ImageMissing(RuntimeError):
    """The engine image is not in the local image store (we never pull)."""


@functools.cache
def _shared_client() -> Any:
    return docker.from_env(timeout=API_TIMEOUT)


def docker_available() -> bool:
    """Does a Docker engine answer within :data:`PING_TIMEOUT` seconds?"""
    try:
        with contextlib.closing(docker.from_env(timeout=PING_TIMEOUT)) as client:
            return bool(client.ping())
    except Exception as exc:  # noqa: BLE001 - any failure means "not available"
        log.debug("docker not available", extra={"reason": str(exc)[:200]})
        return False


def container_name(worker_id: str, channel_id: str) -> str:
    """A Docker container name for a channel: ``hio-<worker>-<n>``, only [A-Za-z0-9_.-]."""
    scoped = channel_id if channel_id.startswith(f"{worker_id}/") else f"{worker_id}/{channel_id}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "hio-" + scoped.replace("/", "-"))[:200]


class DockerLauncher(EngineLauncher):
    """Runs each engine as a labelled container of its image on this host."""

    def __init__(self, config: WorkerConfig, worker_id: str | None = None) -> None:
        self._worker_id = worker_id or config.effective_worker_id()
        self._client = _shared_client()
        self._seen_healthy: set[str] = set()  # container ids Docker has reported healthy

    @classmethod
    def has_image(cls, image: str) -> bool:
        """Is ``image`` in the local image store? Never asks a registry."""
        return images.has_image(_shared_client(), image)

    def start(self, spec: EngineSpec) -> EngineHandle:
        """Create and start the channel's container; ImageMissing if the image is not local."""
        try:
            image = self._client.images.get(spec.image)
        except docker.errors.ImageNotFound:
            raise ImageMissing(f"image {spec.image} not found locally; build it with `make images`") from None
        name = container_name(self._worker_id, spec.channel_id)
        self._remove_stale(name)
        env, files = self._container_env(spec.env, image_pipeline(image) is not None)
        container = self._client.containers.create(
            image.id,
            command=ENGINE_COMMAND,
            name=name,
            detach=True,
            environment=env,
            labels={
                LABEL_MANAGED: "true",
                LABEL_WORKER: self._worker_id,
                LABEL_CHANNEL: spec.channel_id,
                "io.harmonicio.image": spec.image,
            },
            network_mode="host",
            init=True,
            nano_cpus=int(spec.cpus * 1e9) if spec.cpus > 0 else None,
            mem_limit=spec.memory_bytes or None,
            memswap_limit=spec.memory_bytes or None,
            pids_limit=PIDS_LIMIT,
            security_opt=["no-new-privileges"],
            cap_drop=["ALL"],
            log_config={"type": "json-file", "config": {"max-size": LOG_MAX_SIZE, "max-file": LOG_MAX_FILES}},
        )
        try:
            if files:
                container.put_archive("/", _secrets_tar(files, image.attrs.get("Config", {}).get("User", "")))
            container.start()
        except Exception:
            _remove_quietly(container)
            raise
        return EngineHandle(spec=spec, ident=container.short_id, native=container)  # the controller logs the start

    def _remove_stale(self, name: str) -> None:
        """A container of ours with this name is a leftover (a crash, a restart): remove it.
        Someone else's container with the name is never touched."""
        try:
            old = self._client.containers.get(name)
        except docker.errors.NotFound:
            return
        if not self._is_ours(old):
            raise RuntimeError(
                f"container name {name} is taken by a container HarmonicIO did not start; "
                "rename it or give this worker another worker_id"
            )
        log.info("removing leftover engine container", extra={"container": name, "status": old.status})
        old.remove(force=True)

    def _is_ours(self, container: Any) -> bool:
        labels = container.labels or {}
        return labels.get(LABEL_MANAGED) == "true" and labels.get(LABEL_WORKER) == self._worker_id

    @staticmethod
    def _container_env(spec_env: dict[str, str], image_names_pipeline: bool) -> tuple[dict[str, str], dict[str, bytes]]:
        """The container's environment, and credential files to copy in (path -> bytes)."""
        env: dict[str, str] = {}
        files: dict[str, bytes] = {}
        owned = (*_IMAGE_OWNED, "pipeline") if image_names_pipeline else _IMAGE_OWNED
        for key, value in spec_env.items():
            prefix = next((p for p in ("HIO_ENGINE_", "HIO_") if key.startswith(p)), None)
            setting = None if prefix is None else key[len(prefix) :].lower()  # HIO_ENGINE_TLS_KEY: tls_key
            if setting in owned:
                continue
            if setting == "token_file" and value:
                env["HIO_TOKEN"] = Path(value).expanduser().read_text().strip()
            elif setting in _FILE_SETTINGS and value:
                inside = f"{SECRETS_DIR}/{setting}"
                files[inside] = Path(value).expanduser().read_bytes()
                env[key] = inside
            else:
                env[key] = value
        return env, files

    def poll(self, handle: EngineHandle) -> int | None:
        """Exit code once the container has exited; None while it runs.

        A container that was healthy and turned unhealthy (its engine stopped
        answering) is killed, so the controller sees it exit and restarts it.
        One that never was healthy is left to start up: a pipeline's
        ``setup()`` may take longer than the health check's start period.
        A container removed behind our back counts as exited with -1.
        """
        container = handle.native
        try:
            container.reload()
        except docker.errors.NotFound:
            self._seen_healthy.discard(container.id)
            return -1
        state = container.attrs.get("State", {})
        if container.status in EXITED_STATES:
            self._seen_healthy.discard(container.id)
            return int(state.get("ExitCode", -1))
        health = (state.get("Health") or {}).get("Status")
        if health == "healthy":
            self._seen_healthy.add(container.id)
        elif health == "unhealthy" and container.id in self._seen_healthy:
            log.warning(
                "engine container unhealthy; killing it",
                extra={"channel": handle.spec.channel_id, "container": handle.ident},
            )
            _kill_quietly(container)
        return None

    def stop(self, handle: EngineHandle, timeout: float) -> None:
        """SIGTERM, SIGKILL after ``timeout`` seconds, then remove the container."""
        container = handle.native
        try:
            container.stop(timeout=max(1, math.ceil(timeout)))
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            log.warning(
                "stopping engine container failed; killing it",
                extra={"container": handle.ident, "error": str(exc)[:200]},
            )
            _kill_quietly(container)
        _remove_quietly(container)

    def logs(self, handle: EngineHandle, lines: int = 50) -> str:
        if lines <= 0:
            return ""
        try:
            data = handle.native.logs(stdout=True, stderr=True, tail=lines)
        except docker.errors.NotFound:
            return ""
        return data.decode("utf-8", errors="replace").rstrip("\n")

    def cpu_usage(self, handle: EngineHandle) -> CpuUsage | None:
        """CPU seconds from the container's cgroup counter (found once from its main process;
        the Docker stats API only where the cgroup file cannot be read, as for a worker in a
        container of its own), and the wait of the processes under its main process."""
        container = handle.native
        pid = int((container.attrs.get("State") or {}).get("Pid") or 0)
        if handle.cpu_source is None:
            handle.cpu_source = container_cgroup(container.id, pid) or "api"
        cpu = cgroup_cpu_seconds(handle.cpu_source) if handle.cpu_source != "api" else _stats_cpu_seconds(container)
        if cpu is None:
            return None
        return CpuUsage(cpu_seconds=cpu, wait_seconds=tree_wait_seconds(pid) if pid > 0 else None)

    def cleanup(self) -> None:
        """Remove exited containers carrying our labels and this worker's id. Running
        containers and anyone else's are left alone: asked of the API's filters, and checked
        again here, so that an API that reads the filters otherwise cannot make us remove one."""
        filters = {
            "label": [f"{LABEL_MANAGED}=true", f"{LABEL_WORKER}={self._worker_id}"],
            "status": list(REMOVABLE_STATES),
        }
        for container in self._client.containers.list(all=True, filters=filters):
            if self._is_ours(container) and container.status in REMOVABLE_STATES:
                log.info("removing exited engine container", extra={"container": container.name})
                _remove_quietly(container)


def _stats_cpu_seconds(container: Any) -> float | None:
    """The container's CPU seconds from the Docker stats API (one sample, not a stream)."""
    try:
        stats = container.stats(stream=False, one_shot=True)
        return float(stats["cpu_stats"]["cpu_usage"]["total_usage"]) / 1e9
    except Exception:  # noqa: BLE001 - requests' and docker's errors, or a reply without the figure
        return None


def image_pipeline(image: Any) -> str | None:
    """The ``module:function`` an image names in ``ENV HIO_PIPELINE``, else None."""
    for item in (image.attrs.get("Config") or {}).get("Env") or []:
        key, _, value = item.partition("=")
        if key == "HIO_PIPELINE" and value:
            return value
    return None


def _secrets_tar(files: dict[str, bytes], user: str) -> bytes:
    """A tar of credential files for put_archive, owned by the image's user, mode 0400."""
    uid, gid = _numeric_user(user)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        folder = tarfile.TarInfo(SECRETS_DIR.lstrip("/"))
        folder.type, folder.mode, folder.uid, folder.gid = tarfile.DIRTYPE, 0o500, uid, gid
        tar.addfile(folder)
        for path, data in files.items():
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.uid, info.gid = len(data), 0o400, uid, gid
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _numeric_user(user: str) -> tuple[int, int]:
    """uid, gid from an image's ``USER`` ("10001:10001", "10001"); root otherwise."""
    uid_text, _, gid_text = (user or "0").partition(":")
    uid = int(uid_text) if uid_text.isdigit() else 0
    gid = int(gid_text) if gid_text.isdigit() else uid
    return uid, gid


def _kill_quietly(container: Any) -> None:
    with contextlib.suppress(docker.errors.APIError):  # already gone or exited: the next poll sees it
        container.kill()


def _remove_quietly(container: Any) -> None:
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        log.warning("could not remove container", extra={"container": container.short_id, "error": str(exc)[:200]})
