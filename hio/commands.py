"""The ``hio`` commands: for each, its config class, config section, run function and help.

A table of names, imported by the CLI and by the configuration (a ``[cluster]`` table may
hold any role's setting); the modules it names are imported only when a command needs them.
"""

from __future__ import annotations

import dataclasses
import functools
import pkgutil
import sys
from pathlib import Path
from typing import Any


class CommandUnavailable(Exception):
    """A command this installation cannot run; the message says where it runs."""


# name: "config class  run function"
_PATHS = {
    "up": "hio.up:UpConfig hio.up:run_up",
    "master": "hio.master.config:MasterConfig hio.master:run_master",
    "worker": "hio.worker.config:WorkerConfig hio.worker:run_worker",
    "engine": "hio.worker.config:EngineConfig hio.worker:run_engine",
    "gateway": "hio.gateway.config:GatewayConfig hio.gateway:run_gateway",
    "repository": "hio.repository.config:RepositoryConfig hio.repository:run_repository",
    "kd": "hio.kd.config:KDConfig hio.kd:run_kd",
    "send": "hio.gateway.config:SendConfig hio.gateway:run_send",
    "status": "hio.tools:StatusConfig hio.tools:run_status",
    "scale": "hio.tools:ScaleConfig hio.tools:run_scale",
    "knowledge": "hio.tools:KnowledgeConfig hio.tools:run_knowledge",
    "dead-letters": "hio.tools:DeadLettersConfig hio.tools:run_dead_letters",
    "certs": "hio.transport.certs:CertsConfig hio.transport.certs:run_certs",
    "bench": "benchmarks.grid:BenchConfig benchmarks.grid:run_bench",
    "bench-core": "benchmarks.core:CoreBenchConfig benchmarks.core:run_core_bench",
    "bench-floor": "benchmarks.floor:FloorConfig benchmarks.floor:run_floor",
    "bench-kd": "benchmarks.kd:KDBenchConfig benchmarks.kd:run_kd_bench",
    "bench-scale": "benchmarks.scale:ScaleBenchConfig benchmarks.scale:run_scale_bench",
    "experiment": "benchmarks.phases:PhasesConfig benchmarks.phases:run_experiment",
    "images": "hio.images:ImagesConfig hio.images:run_images",
}
_HELP = {
    "up": "run every role on this machine and stream the sample dataset (the demo)",
    "master": "the control plane: worker registry, routing, backlog queue, status",
    "worker": "a worker controller: starts and supervises processing engines",
    "engine": "one processing engine (started by the worker; rarely by hand)",
    "gateway": "the gateway beside the instrument: spool, directory watch, ingest API",
    "repository": "the feature repository",
    "kd": "knowledge discovery on Spark: cluster new features each interval",
    "send": "send files as tuples and wait until they are stored",
    "status": "show the master's status: workers, channels, queues, throughput",
    "scale": "show the elastic plan and its decisions; set worker bounds and pinned engine counts",
    "knowledge": "print the knowledge KD last wrote to the repository",
    "dead-letters": "list tuples that failed too often, or send one again",
    "certs": "make a private CA and certificates for TLS / mutual TLS between roles",
    "bench": "benchmark against Spark Structured Streaming over size x cost",
    "bench-core": "measure tuples/s and MB/s of the streaming core, direct and via the queue",
    "bench-floor": "the least any durable design can do with large tuples here (bare system calls)",
    "bench-kd": "time a KD interval over an empty and a large store",
    "bench-scale": "how cost grows with scale: the master's routes/s, the repository's restart and index, "
    "KD's interval",
    "experiment": "the thesis' load phases with elasticity off and on: queue, workers, CPU per worker, plots",
    "images": "build the processing-engine Docker images (offline-capable)",
}
# a command's config section is its name with "_" for "-", but for these (they read the role's settings)
_SECTIONS = {"send": "gateway", "bench-kd": "kd"}

# name: (config class, config section, run function, help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    name: (cls_path, _SECTIONS.get(name, name.replace("-", "_")), run_path, _HELP[name])
    for name, (cls_path, run_path) in ((name, paths.split()) for name, paths in _PATHS.items())
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
    if path.startswith("benchmarks."):
        root = Path(__file__).resolve().parent.parent
        if not (root / "benchmarks" / "__init__.py").is_file():
            raise CommandUnavailable(
                "the benchmarks run from a source checkout (benchmarks/ is not installed "
                "with the package): clone the repository and run `make bench` there"
            )
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    return pkgutil.resolve_name(path)
