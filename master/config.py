"""Settings of the master (``hio master``). Imports nothing heavy: the CLI loads
this module to build flags before it knows which role runs."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from hio.config import (
    FSYNC_POLICIES,
    ConfigError,
    between,
    check_address,
    lane_listen_address,
    local_host,
    one_of,
    positive,
    same_port,
    setting,
)
from hio.master.provisioners import DRIVERS, parse_options
from hio.settings import BUILTIN_IMAGES, ClusterSettings, GiB, MiB
from hio.transport.net import stream_bound

HTTP_LISTEN = "127.0.0.1:7080"  # where the role's HTTP endpoint listens by default

SCALING_MODES = ("fixed", "elastic")
MAX_EXPIRY_SECONDS = 10.0


#: Settings that must be finite and positive, and those that must be finite and zero or more.
POSITIVE = (
    "queue_bytes",
    "segment_bytes",
    "heartbeat_interval",
    "expiry_seconds",
    "reservation_seconds",
    "lease_seconds",
    "max_attempts",
    "server_threads",
    "pull_waiters",
    "dead_list_limit",
    "forget_seconds",
    "profile_seconds",
    "default_share",
    "predict_interval",
    "packing_interval",
    "engine_idle_seconds",
    "large_step",
    "small_step",
)
NON_NEGATIVE = (
    "queue_memory_bytes",
    "upper_rate",
    "lower_rate",
    "queue_limit",
    "cooldown_seconds",
    "min_workers",
    "worker_grace_seconds",
    "provision_timeout",
    "worker_cpus",
)


@dataclasses.dataclass(frozen=True)
class MasterConfig(ClusterSettings):
    listen: str = setting("127.0.0.1:7000", "host:port the master serves on")
    queue_bytes: int = setting(4 * GiB, "bound of the backlog queue on disk (payload bytes, all images)")
    queue_memory_bytes: int = setting(
        64 * MiB, "queued payload cached in memory; larger tuples are read back from disk chunk by chunk"
    )
    segment_bytes: int = setting(64 * MiB, "size at which a backlog segment file is sealed")
    fsync: str = setting(
        "batch",
        "durability of the backlog: 'batch' (fsync at most every 100 ms; senders wait while "
        "256 MiB wait for the disk), 'always' "
        "(before every receipt and acknowledgement) or 'never' (leave it to the OS)",
    )
    heartbeat_interval: float = setting(1.0, "seconds between worker heartbeats (told to workers)")
    expiry_seconds: float = setting(6.0, "a worker silent this long leaves routing (at most 10)")
    reservation_seconds: float = setting(
        15.0, "a channel routed to (or told to pull) without any report for this long is free again"
    )
    lease_seconds: float = setting(60.0, "a pulled tuple without reports from its channel for this long is redelivered")
    max_attempts: int = setting(3, "processing attempts of a tuple before it becomes a dead letter")
    images: tuple[str, ...] = setting(BUILTIN_IMAGES, "images always accepted, even before a worker offers them")
    grace_seconds: float = setting(5.0, "on SIGTERM, seconds to let calls in flight finish")
    server_threads: int = setting(
        80, "gRPC handler threads; streams (long-polling PullTuple calls, Enqueue) may hold three quarters"
    )
    pull_waiters: int = setting(
        48, "at most this many PullTuple calls wait at once; more are refused with RESOURCE_EXHAUSTED"
    )
    dead_list_limit: int = setting(1000, "at most this many dead letters in one ListDeadLetters answer")
    forget_seconds: float = setting(600.0, "an expired worker is forgotten (and its warning dropped) after this long")
    lanes: bool = setting(
        True,
        "also take Enqueue on a payload lane (TCP, TLS as gRPC's; about half of gRPC's "
        "CPU per MB), which gateways use for the queue path",
    )
    lane_listen: str = setting(
        "", "host:port of the payload lane; empty = listen's host and port + 1 (any free port when listen's port is 0)"
    )
    http_listen: str = setting(
        HTTP_LISTEN,
        "host:port of the HTTP endpoint (the status page at /, /metrics, /healthz; docs/monitoring.md); empty = none",
    )
    profile_seconds: float = setting(
        20.0, "profiling interval: each image's CPU share and processing rate are averaged over this many seconds"
    )
    default_share: float = setting(
        0.125, "cores one engine of an image not yet measured is taken to use (the packer's size for it)"
    )
    scaling: str = setting(
        "fixed",
        "'fixed': workers run the engines they were started with; 'elastic': the master decides "
        "how many engines of each image run, packs them onto workers and asks for workers "
        "(docs/elasticity.md)",
    )
    predict_interval: float = setting(1.0, "elastic: seconds between looks at each image's backlog")
    upper_rate: float = setting(5.0, "elastic: a backlog growing faster than this (tuples/s) adds large_step engines")
    lower_rate: float = setting(2.0, "elastic: a backlog growing faster than this (tuples/s) adds small_step engines")
    slowdown_rate: float = setting(
        -2.0,
        "elastic: a backlog above queue_limit adds large_step engines unless it shrinks faster "
        "than this (tuples/s, zero or negative), else small_step",
    )
    queue_limit: int = setting(10, "elastic: a backlog (tuples) above this adds engines")
    large_step: int = setting(2, "elastic: engines added on a strong signal")
    small_step: int = setting(1, "elastic: engines added on a weak signal")
    cooldown_seconds: float = setting(
        10.0, "elastic: an image's engine count changes at most once per this many seconds, up or down"
    )
    engine_idle_seconds: float = setting(30.0, "elastic: an engine without work for this long is given back")
    packing_interval: float = setting(1.0, "elastic: seconds between packings of the wanted engines onto workers")
    pack_margin: float = setting(
        0.1, "elastic: share of each worker's vCPUs kept free when packing engines onto it (0 to 0.9)"
    )
    provisioner: str = setting(
        "",
        "elastic: what adds and removes workers: 'local' (hio worker processes on this machine), "
        "'openstack' (servers), or empty: the workers started by hand are all there are",
    )
    provisioner_options: tuple[str, ...] = setting(
        (), "elastic: the provisioner's own settings, NAME=VALUE (docs/elasticity.md lists each driver's)"
    )
    worker_prefix: str = setting("elastic", "elastic: workers the provisioner starts are named <prefix>-<n>")
    min_workers: int = setting(0, "elastic: fewest workers the provisioner keeps")
    max_workers: int = setting(8, "elastic: most workers the provisioner asks for")
    worker_grace_seconds: float = setting(
        30.0, "elastic: a provisioned worker without engines for this long may be given back"
    )
    provision_timeout: float = setting(
        300.0, "elastic: a worker asked for that has not registered after this long is given back"
    )
    advertise_address: str = setting(
        "", "elastic: host:port workers the provisioner starts reach this master at; empty = listen's"
    )
    worker_token_file: str = setting(
        "",
        "elastic: the token workers the provisioner starts present (a worker token of tokens_file); "
        "empty = the token this master presents",
    )
    worker_cpus: int = setting(
        0,
        "elastic: vCPUs of a worker the provisioner adds (its --cpus; the packer counts new workers "
        "by it); 0 = local: this machine's, openstack: the flavor's",
    )

    def new_worker_cpus(self) -> int:
        """vCPUs of a worker the provisioner adds, as far as the settings say (a driver may know
        better: the openstack driver's flavor)."""
        return self.worker_cpus or os.cpu_count() or 1

    def worker_master_address(self) -> str:
        """Where workers the provisioner starts reach this master."""
        if self.advertise_address:
            return self.advertise_address
        host, _, port = self.listen.rpartition(":")
        return f"{local_host(host)}:{port}"

    def worker_token(self) -> str:
        """The token workers the provisioner starts present ('' for none)."""
        if self.worker_token_file:
            try:
                return Path(self.worker_token_file).expanduser().read_text().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read worker_token_file {self.worker_token_file}: {exc.strerror}") from None
        return self.presented_token()

    def lane_address(self) -> str:
        """Where the payload lane listens; '' when there is none (turned off)."""
        return lane_listen_address(self.listen, self.lane_listen, offered=self.lanes)

    def validate(self) -> None:
        """Refuse settings the master cannot run with; each message names the setting. The
        elastic settings are checked in fixed mode too: a file switched to elastic later must
        not fail then."""
        self.validate_cluster()
        parse_options(self.provisioner_options)  # refused even while no provisioner reads them
        self.validate_serving()
        check_address("listen", self.listen)
        check_address("lane_listen", self.lane_listen, allow_empty=True)
        lane = self.lane_address()  # refuses a listen port without a port + 1 for the lane
        if self.lane_listen and same_port(self.lane_listen, self.listen):
            raise ConfigError(f"lane_listen {self.lane_listen} takes listen's port: choose another")
        check_address("http_listen", self.http_listen, allow_empty=True)
        for other, address in (("listen", self.listen), ("the lane", lane)):
            if self.http_listen and address and same_port(self.http_listen, address):
                raise ConfigError(f"http_listen {self.http_listen} takes {other}'s port ({address}): choose another")
        for name in POSITIVE:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value}")
            positive(name, value)
        for name in NON_NEGATIVE:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number, zero or more, got {value}")
        if not MiB <= self.segment_bytes <= GiB:
            raise ConfigError(f"segment_bytes must be between 1 MiB and 1 GiB, got {self.segment_bytes}")
        one_of("fsync", self.fsync, FSYNC_POLICIES)
        if self.expiry_seconds > MAX_EXPIRY_SECONDS:
            raise ConfigError(f"expiry_seconds must be at most {MAX_EXPIRY_SECONDS:g}, got {self.expiry_seconds}")
        if self.expiry_seconds <= self.heartbeat_interval:
            raise ConfigError(
                f"expiry_seconds ({self.expiry_seconds}) must exceed heartbeat_interval "
                f"({self.heartbeat_interval}), or live workers expire"
            )
        between("grace_seconds", self.grace_seconds, 0)
        if self.pull_waiters >= stream_bound(self.server_threads):
            raise ConfigError(
                f"pull_waiters ({self.pull_waiters}) must be below the {stream_bound(self.server_threads)} streams "
                f"server_threads ({self.server_threads}) serve at once, or waiting pulls leave no room for Enqueue"
            )
        for image in self.images:
            if not image or len(image) > 256:
                raise ConfigError(f"images: invalid image name {image!r}")
        between("default_share", self.default_share, 0, 64, " cores per engine")
        one_of("scaling", self.scaling, SCALING_MODES)
        if not math.isfinite(self.slowdown_rate) or self.slowdown_rate > 0:
            raise ConfigError(f"slowdown_rate must be zero or negative (a shrinking backlog), got {self.slowdown_rate}")
        between("pack_margin", self.pack_margin, 0, 0.9, " (a share of a worker's vCPUs)")
        if self.provisioner:
            one_of("provisioner", self.provisioner, tuple(DRIVERS))
        if self.provisioner and self.scaling != "elastic":
            raise ConfigError(f"provisioner {self.provisioner!r} needs scaling = elastic (it is {self.scaling!r})")
        between("max_workers", self.max_workers, 1)
        for low, high in (("lower_rate", "upper_rate"), ("small_step", "large_step"), ("min_workers", "max_workers")):
            if getattr(self, low) > getattr(self, high):
                raise ConfigError(f"{low} ({getattr(self, low)}) must not exceed {high} ({getattr(self, high)})")
        check_address("advertise_address", self.advertise_address, allow_empty=True)
        if not self.worker_prefix or "/" in self.worker_prefix or any(c.isspace() for c in self.worker_prefix):
            raise ConfigError(f"worker_prefix {self.worker_prefix!r} must be a name without '/' or spaces")
        if self.provisioner and self.tokens_file and not self.worker_token_file:
            raise ConfigError(
                "worker_token_file is needed with a provisioner and a tokens_file: the workers it starts "
                "must present a worker token"
            )
