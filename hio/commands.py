"""The ``hio`` commands: for each, its config class, config section, run function and help.

A table of names, imported by the CLI and by the configuration (a ``[cluster]`` table may
hold any role's setting); the modules it names are imported only when a command needs them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from pathlib import Path
from typing import Any


class CommandUnavailable(Exception):
    """A command this installation cannot run; the message says where it runs."""


# name: (config class, config section, run function, help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "up": (
        "hio.up:UpConfig",
        "up",
        "hio.up:run_up",
        "run every role on this machine and stream the sample dataset (the demo)",
    ),
    "master": (
        "hio.master.config:MasterConfig",
        "master",
        "hio.master:run_master",
        "the control plane: worker registry, routing, backlog queue, status",
    ),
    "worker": (
        "hio.worker.config:WorkerConfig",
        "worker",
        "hio.worker:run_worker",
        "a worker controller: starts and supervises processing engines",
    ),
    "engine": (
        "hio.worker.config:EngineConfig",
        "engine",
        "hio.worker:run_engine",
        "one processing engine (started by the worker; rarely by hand)",
    ),
    "gateway": (
        "hio.gateway.config:GatewayConfig",
        "gateway",
        "hio.gateway:run_gateway",
        "the gateway beside the instrument: spool, directory watch, ingest API",
    ),
    "repository": (
        "hio.repository.config:RepositoryConfig",
        "repository",
        "hio.repository:run_repository",
        "the feature repository",
    ),
    "kd": (
        "hio.kd.config:KDConfig",
        "kd",
        "hio.kd:run_kd",
        "knowledge discovery on Spark: cluster new features each interval",
    ),
    "send": (
        "hio.gateway.config:SendConfig",
        "gateway",
        "hio.gateway:run_send",
        "send files as tuples and wait until they are stored",
    ),
    "status": (
        "hio.tools:StatusConfig",
        "status",
        "hio.tools:run_status",
        "show the master's status: workers, channels, queues, throughput",
    ),
    "scale": (
        "hio.tools:ScaleConfig",
        "scale",
        "hio.tools:run_scale",
        "show the elastic plan and its decisions; set worker bounds and pinned engine counts",
    ),
    "knowledge": (
        "hio.tools:KnowledgeConfig",
        "knowledge",
        "hio.tools:run_knowledge",
        "print the knowledge KD last wrote to the repository",
    ),
    "dead-letters": (
        "hio.tools:DeadLettersConfig",
        "dead_letters",
        "hio.tools:run_dead_letters",
        "list tuples that failed too often, or send one again",
    ),
    "certs": (
        "hio.transport.certs:CertsConfig",
        "certs",
        "hio.transport.certs:run_certs",
        "make a private CA and certificates for TLS / mutual TLS between roles",
    ),
    "bench": (
        "benchmarks.grid:BenchConfig",
        "bench",
        "benchmarks.grid:run_bench",
        "benchmark against Spark Structured Streaming over size x cost",
    ),
    "bench-core": (
        "benchmarks.core:CoreBenchConfig",
        "bench_core",
        "benchmarks.core:run_core_bench",
        "measure tuples/s and MB/s of the streaming core, direct and via the queue",
    ),
    "bench-floor": (
        "benchmarks.floor:FloorConfig",
        "bench_floor",
        "benchmarks.floor:run_floor",
        "the least any durable design can do with large tuples here (bare system calls)",
    ),
    "bench-kd": (
        "benchmarks.kd:KDBenchConfig",
        "kd",
        "benchmarks.kd:run_kd_bench",
        "time a KD interval over an empty and a large store",
    ),
    "bench-scale": (
        "benchmarks.scale:ScaleBenchConfig",
        "bench_scale",
        "benchmarks.scale:run_scale_bench",
        "how cost grows with scale: the master's routes/s, the repository's restart and index, KD's interval",
    ),
    "experiment": (
        "benchmarks.phases:PhasesConfig",
        "experiment",
        "benchmarks.phases:run_experiment",
        "the thesis' load phases with elasticity off and on: queue, workers, CPU per worker, plots",
    ),
    "images": (
        "hio.images:ImagesConfig",
        "images",
        "hio.images:run_images",
        "build the processing-engine Docker images (offline-capable)",
    ),
}


# Commands with settings of their own, not the cluster's: a [cluster] table is not for them.
TOOLS = frozenset({"certs", "bench", "bench-core", "bench-floor", "bench-kd", "bench-scale", "experiment", "images"})


@functools.cache
def cluster_setting_names() -> frozenset[str]:
    """Every setting a role (or a command calling roles) has: what a [cluster] table may hold
    (a role ignores those it lacks, so ``max_attempts`` there reaches master, worker and
    gateway; only a name no role knows is a typo)."""
    return frozenset(
        f.name
        for name, (cls_path, *_rest) in COMMANDS.items()
        if name not in TOOLS
        for f in dataclasses.fields(load(cls_path))
    )


def load(path: str) -> Any:
    """The object a ``module:attribute`` path of the table names. Benchmarks are not part of
    the installed package: they run from a source checkout, whose root holds ``benchmarks/``."""
    module, _, attr = path.partition(":")
    if module.split(".")[0] == "benchmarks":
        _checkout_on_path()
    return getattr(importlib.import_module(module), attr)


def _checkout_on_path() -> None:
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__init__.py").is_file():
        raise CommandUnavailable(
            "the benchmarks run from a source checkout (benchmarks/ is not installed "
            "with the package): clone the repository and run `make bench` there"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
