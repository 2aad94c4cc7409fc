"""Settings of the worker controller (`hio worker`) and of one engine (`hio engine`).

Kept free of heavy imports (no grpc, no numpy): the CLI imports this module
to build flags before anything else happens.

The controller hands each engine its :class:`EngineConfig` through the
environment (``HIO_ENGINE_<FIELD>`` plus the cluster's ``HIO_<FIELD>``), so
the same engine code runs as a local process or inside a container. The
engine's own tunables (``store_batch_records``, ``rpc_deadline``, ...) come
from the worker's ``engine_settings``, which the ``[engine]`` table of the
worker's configuration file and ``HIO_ENGINE_<NAME>`` variables of the worker's
environment fill (and, for settings only engines have, ``[cluster]`` and
``HIO_<NAME>``, as for any role; :class:`hio.config.PassedOn`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import ClassVar

from hio.config import (
    ConfigError,
    PassedOn,
    as_text,
    between,
    check_address,
    one_of,
    parse_assignments,
    positive,
    setting,
)
from hio.settings import BUILTIN_IMAGES, ClusterSettings
from hio.worker.api import pipeline_for_image

HTTP_LISTEN = "127.0.0.1:7280"  # where the role's HTTP endpoint listens by default

RUNTIMES = ("auto", "process", "docker")
# Engine settings the worker decides for each engine it starts (not passed on from [engine]).
ENGINE_SLOT_SETTINGS = ("channel_id", "image", "pipeline", "listen", "lane_listen")


@dataclasses.dataclass(frozen=True)
class EngineSettings(ClusterSettings):
    """What a worker and each of its engines must agree on: declared once, the
    worker passes its values on to the engines it starts."""

    tuple_timeout: float = setting(
        600.0,
        "seconds one tuple may spend in process() before the engine "
        "gives it back to the master and restarts; 0 = no limit",
    )
    pull_wait: float = setting(5.0, "seconds an idle engine's queue long-poll stays open")
    max_attempts: int = setting(3, "delivery attempts per tuple (must match the master's)")
    grace_seconds: float = setting(5.0, "on SIGTERM: seconds an engine gets to finish its current tuple")
    pull_batch_seconds: float = setting(
        0.1,
        "processing time an idle engine takes from the queue in one pull: "
        "cheap tuples come several at a time; 0 = always one",
    )
    pull_batch_tuples: int = setting(256, "most tuples one pull from the queue brings")
    pull_batch_bytes: int = setting(
        1024 * 1024, "most payload bytes one pull brings in all (its first tuple comes whatever its size)"
    )
    pull_ahead: bool = setting(
        True,
        "while an engine processes what it pulled from the queue, it fetches "
        "the next pull, so its slot does not wait for the transfer; off = pull only "
        "once idle",
    )
    lanes: bool = setting(
        True,
        "payload lanes (TCP, TLS as gRPC's): a worker's engines serve one (Deliver, on a second "
        "port from engine_ports) that gateways use for payloads; an engine pulls over the "
        "master's lane when it offers one; off = gRPC only",
    )

    def validate_shared(self) -> None:
        """The checks of these settings, the worker's and each engine's."""
        positive("pull_wait", self.pull_wait)
        positive("max_attempts", self.max_attempts)
        positive("grace_seconds", self.grace_seconds)
        between("tuple_timeout", self.tuple_timeout, 0, unit=" (0: no limit)")
        between("pull_batch_seconds", self.pull_batch_seconds, 0, 3600, " (0: one at a time)")
        between("pull_batch_tuples", self.pull_batch_tuples, 1, 1024)
        if not 0 <= self.pull_batch_bytes <= 64 * 1024 * 1024:
            raise ConfigError(f"pull_batch_bytes must be between 0 and 64 MiB, got {self.pull_batch_bytes}")


@dataclasses.dataclass(frozen=True)
class WorkerConfig(EngineSettings):
    worker_id: str = setting("", "this worker's id, unique in the cluster; empty = <hostname>-<pid>")
    listen: str = setting(
        "127.0.0.1:0",
        "host:port of this worker's gRPC health and reflection (ready: in touch with the master and "
        "an engine serving); port 0 = any free port (logged at start)",
    )
    advertise_host: str = setting("127.0.0.1", "host gateways use to reach this worker's engines")
    http_listen: str = setting(
        HTTP_LISTEN, "host:port of the HTTP endpoint (/metrics, /healthz; docs/monitoring.md); empty = none"
    )
    engine_listen_host: str = setting("127.0.0.1", "interface engines listen on")
    engine_ports: str = setting(
        "", "port range engines listen in, e.g. 20000-21000 (for firewalls); empty = any free port"
    )
    engines: tuple[str, ...] = setting(
        BUILTIN_IMAGES,
        "engines to run: IMAGE or IMAGE=COUNT; without a count an image gets cpus / len(engines), at least 1",
    )
    cpus: int = setting(0, "CPUs this worker offers; 0 = all of this machine's")
    runtime: str = setting("auto", "how engines run: auto (docker when usable, else process), process or docker")
    pipelines: tuple[str, ...] = setting((), "extra IMAGE=module:function pipeline mappings (process runtime)")
    engine_memory_bytes: int = setting(0, "memory limit per engine (docker runtime); 0 = no limit")
    engine_cpus: float = setting(1.0, "CPUs per engine (docker runtime)")
    restart_backoff_max: float = setting(30.0, "longest wait, in seconds, before restarting a crashed engine")
    elastic: bool = setting(
        False,
        "run the engines the master's plan gives this worker (a master with scaling = elastic) "
        "instead of a fixed set: engines is then not used",
    )
    owner_pid: int = setting(
        0,
        "stop (engines drained as on SIGTERM) once this process is gone; 0 = never. A master's "
        "local provisioner sets it to the process its cluster ends with",
    )
    engine_settings: tuple[str, ...] = setting(
        (),
        "engine settings passed to every engine this worker starts, "
        "NAME=VALUE (e.g. rpc_deadline=120); with the file's [engine] "
        "table and HIO_ENGINE_<NAME> variables, in the usual "
        "precedence: file < environment < flags",
    )

    #: the file's [engine] table, HIO_ENGINE_<NAME> variables, and the engines' own settings in
    #: [cluster] or as HIO_<NAME> reach the engines through engine_settings
    PASSED_ON: ClassVar[PassedOn] = PassedOn("engine", "engine_settings", lambda: engine_own_settings())  # noqa: PLW0108 - looked up late: defined below

    def engine_overrides(self) -> dict[str, str]:
        """The engine settings to pass on (as environment values), checked as an engine would
        check them: only those a worker does not decide itself, each valid."""
        where = "engine_settings ([engine], HIO_ENGINE_*)"
        refused = dict.fromkeys(ENGINE_SLOT_SETTINGS, "the worker sets it for each engine")
        refused.update(
            (
                f.name,
                (
                    f"set it for the worker ([worker] or [cluster], HIO_WORKER_{f.name.upper()}); "
                    "it passes its value on to its engines"
                ),
            )
            for f in dataclasses.fields(EngineSettings)
        )
        values = parse_assignments(self.engine_settings, EngineConfig, where, refused=refused)
        try:  # an engine refusing its settings would only restart, again and again
            EngineConfig(channel_id="check/0", image="check", **values).validate()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return {name: as_text(value) for name, value in values.items()}

    def validate(self) -> None:
        self.validate_cluster()
        self.validate_serving()
        check_address("listen", self.listen)
        check_address("http_listen", self.http_listen, allow_empty=True)
        self.engine_overrides()
        one_of("runtime", self.runtime, RUNTIMES)
        if self.elastic and self.engines != BUILTIN_IMAGES:
            raise ConfigError(
                "engines and elastic exclude each other: an elastic worker runs the engines the master's plan "
                "gives it (pin counts with `hio scale --pin IMAGE=N`)"
            )
        if not self.engines:
            raise ConfigError("engines is empty: name at least one IMAGE or IMAGE=COUNT")
        engine_counts(self.engines, self.effective_cpus())
        pipeline_for_image("", self.pipelines, builtin=False)  # no entry names image '': each is checked
        between("cpus", self.cpus, 0, unit=" (0: all)")
        between("owner_pid", self.owner_pid, 0, unit=" (0: none)")
        between("engine_memory_bytes", self.engine_memory_bytes, 0, unit=" (0: no limit)")
        positive("engine_cpus", self.engine_cpus)
        positive("restart_backoff_max", self.restart_backoff_max)
        self.validate_shared()
        self.engine_port_range()
        if "/" in self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ConfigError(f"worker_id {self.worker_id!r} must not contain '/' or spaces")

    def engine_port_range(self) -> tuple[int, int] | None:
        """(first, last) of ``engine_ports``, or None for any free port."""
        if not self.engine_ports:
            return None
        first, sep, last = self.engine_ports.partition("-")
        try:
            low, high = int(first), int(last if sep else first)
        except ValueError:
            raise ConfigError(f"engine_ports must look like 20000-21000, got {self.engine_ports!r}") from None
        if not 1 <= low <= high <= 65535:
            raise ConfigError(f"engine_ports {self.engine_ports!r} is not a range of ports (1-65535)")
        return low, high

    def effective_cpus(self) -> int:
        return self.cpus or os.cpu_count() or 1

    def effective_worker_id(self) -> str:
        """The setting, else ``<hostname>-<pid>`` (unique per controller process)."""
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"


def engine_counts(engines: tuple[str, ...], cpus: int) -> list[tuple[str, int]]:
    """Parse ``IMAGE`` / ``IMAGE=COUNT`` entries into (image, count), in order.

    An entry without a count gets ``max(1, cpus // len(engines))`` engines, so
    the default spreads the machine's CPUs over the images it runs.
    """
    share = max(1, cpus // max(1, len(engines)))
    result: list[tuple[str, int]] = []
    seen: set[str] = set()
    for entry in engines:
        image, sep, count_text = entry.strip().partition("=")
        image = image.strip()
        if not image:
            raise ConfigError(f"engines entry {entry!r} names no image")
        if image in seen:
            raise ConfigError(f"engines names image {image!r} twice; give one IMAGE=COUNT instead")
        seen.add(image)
        if not sep:
            result.append((image, share))
            continue
        try:
            count = int(count_text)
        except ValueError:
            raise ConfigError(f"engines entry {entry!r}: count {count_text!r} is not an integer") from None
        if count < 1 or count > 1024:
            raise ConfigError(f"engines entry {entry!r}: count must be between 1 and 1024")
        result.append((image, count))
    return result


def engine_own_settings() -> frozenset[str]:
    """An engine's tunables that the worker has no setting of its own for (``rpc_deadline``,
    ``store_batch_records``, ...): a ``[cluster]`` value or ``HIO_<NAME>`` of the worker's
    environment reaches the engines, as it would any role that has the setting."""
    shared = {f.name for f in dataclasses.fields(EngineSettings)}  # the worker's, which it passes on
    return frozenset(
        f.name for f in dataclasses.fields(EngineConfig) if f.name not in shared and f.name not in ENGINE_SLOT_SETTINGS
    )


@dataclasses.dataclass(frozen=True)
class EngineConfig(EngineSettings):
    channel_id: str = setting("", "this engine's processing channel id (<worker_id>/<n>)")
    image: str = setting("", "the engine image this channel runs; tuples of other images are refused")
    pipeline: str = setting("", "module:function to call; empty = $HIO_PIPELINE, else the built-in for the image")
    listen: str = setting("127.0.0.1:0", "host:port the Engine service listens on")
    lane_listen: str = setting(
        "",
        "host:port of the payload lane (Deliver over TCP, TLS as gRPC's, for large "
        "payloads without gRPC's copies); empty = none",
    )
    store_batch_records: int = setting(256, "most feature records stored in one repository call")
    store_pending_records: int = setting(
        1024, "processed tuples whose features may wait to be stored before processing pauses"
    )
    reservation_seconds: float = setting(15.0, "the master's reservation time; keep-alive reports every third of it")
    rpc_deadline: float = setting(60.0, "seconds to keep retrying the repository or master while unavailable")

    def validate(self) -> None:
        self.validate_cluster()
        if not self.channel_id:
            raise ConfigError("channel_id is required (HIO_ENGINE_CHANNEL_ID)")
        if not self.image:
            raise ConfigError("image is required (HIO_ENGINE_IMAGE)")
        check_address("listen", self.listen)
        check_address("lane_listen", self.lane_listen, allow_empty=True)
        if self.pipeline and ":" not in self.pipeline:
            raise ConfigError(f"pipeline must look like module:function, got {self.pipeline!r}")
        self.validate_shared()
        positive("store_batch_records", self.store_batch_records)
        positive("store_pending_records", self.store_pending_records)
        positive("reservation_seconds", self.reservation_seconds)
        positive("rpc_deadline", self.rpc_deadline)
