"""Settings of knowledge discovery (``hio kd``). Imports nothing heavy: the CLI
builds this before deciding whether Spark is needed at all."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from hio.config import ConfigError, between, check_address, only_this_host, positive, setting
from hio.settings import ClusterSettings

HTTP_LISTEN = "127.0.0.1:7480"  # where the role's HTTP endpoint listens by default
LOCAL_MASTER = re.compile(r"local\[(\d+|\*)(,\s*\d+)?\]")
STANDALONE_MASTER = re.compile(r"spark://[^,/\s:]+:\d{1,5}(,[^,/\s:]+:\d{1,5})*")


@dataclasses.dataclass(frozen=True)
class KDConfig(ClusterSettings):
    listen: str = setting(
        "127.0.0.1:0",
        "host:port of KD's gRPC health and reflection (ready: its streaming query runs); "
        "port 0 = any free port (logged at start)",
    )
    interval: float = setting(60.0, "seconds between knowledge-discovery intervals (micro-batches)")
    once: bool = setting(False, "process what the repository holds now (in rate-limited batches), then exit")
    consumer: str = setting("kd", "consumer name whose offset KD commits in the repository")
    http_listen: str = setting(
        HTTP_LISTEN, "host:port of the HTTP endpoint (/metrics, /healthz; docs/monitoring.md); empty = none"
    )
    spark_master: str = setting(
        "local[2]", "Spark master URL: local[N], or spark://host:port for a Spark standalone cluster"
    )
    spark_driver_host: str = setting(
        "",
        "address Spark executors reach this driver (KD) at; empty = 127.0.0.1 for local[N] or a "
        "spark:// master on loopback, else Spark's choice (the address of this host's name)",
    )
    spark_conf: tuple[str, ...] = setting((), "extra Spark settings as key=value (repeatable)", factory=tuple)
    parquet_path: str = setting("", "folder of accumulated features (Parquet); empty = data_dir/kd/features.parquet")
    checkpoint_path: str = setting("", "Structured Streaming checkpoint folder; empty = data_dir/kd/checkpoint")
    preview_path: str = setting("", "preview PNG written each interval; empty = data_dir/kd/preview.png")
    k: int = setting(4, "number of clusters (capped by the number of distinct points)")
    image: str = setting(
        "",
        "image whose largest group fills the knowledge's top-level (main) fields; "
        "empty = the largest group of any image (every group is clustered regardless)",
    )
    max_groups: int = setting(8, "most groups (image + feature set) clustered each interval, largest first")
    fit_parallelism: int = setting(2, "groups fitted at the same time (concurrent Spark jobs from the driver)")
    max_records_per_interval: int = setting(50_000, "most repository records read in one micro-batch")
    read_partitions: int = setting(2, "Spark partitions a micro-batch's offset range is split into (at most)")
    sample_size: int = setting(10_000, "most points BisectingKMeans is fitted on each interval (uniform sample)")
    max_iterations: int = setting(10, "BisectingKMeans iterations per level of the hierarchy (each one a Spark job)")
    max_assignments: int = setting(100_000, "most tuple->cluster assignments written to the knowledge (most recent)")
    max_record_bytes: int = setting(16 * 1024 * 1024, "largest decompressed feature record accepted")
    preview_points: int = setting(5_000, "most points drawn in each of the preview's scatter plots")
    preview_groups: int = setting(4, "most groups drawn in the preview (a row each, largest first)")
    rpc_deadline: float = setting(30.0, "seconds to keep retrying an unavailable repository before an interval fails")
    restart_delay: float = setting(5.0, "seconds before restarting the streaming query after it failed")
    max_failures: int = setting(3, "--once: query failures in a row before KD gives up (exit 1)")
    seed: int = setting(1, "random seed for sampling and clustering (reproducible knowledge)")

    def validate(self) -> None:
        self.validate_cluster()
        check_address("listen", self.listen)
        positive("interval", self.interval)
        positive("max_records_per_interval", self.max_records_per_interval)
        positive("read_partitions", self.read_partitions)
        positive("sample_size", self.sample_size)
        positive("max_iterations", self.max_iterations)
        positive("max_record_bytes", self.max_record_bytes)
        positive("rpc_deadline", self.rpc_deadline)
        positive("preview_points", self.preview_points)
        positive("preview_groups", self.preview_groups)
        positive("max_groups", self.max_groups)
        positive("fit_parallelism", self.fit_parallelism)
        positive("max_failures", self.max_failures)
        between("k", self.k, 1, 1000)
        between("max_assignments", self.max_assignments, 0)
        between("restart_delay", self.restart_delay, 0, unit=" s")
        if not self.consumer.strip():
            raise ConfigError("consumer must not be empty")
        check_address("http_listen", self.http_listen, allow_empty=True)
        check_spark_conf(self.spark_conf)
        self._validate_spark_master()

    def _validate_spark_master(self) -> None:
        """A master KD can run on, and a repository its executors can reach."""
        if self.spark_master == "local" or LOCAL_MASTER.fullmatch(self.spark_master):
            return
        if not STANDALONE_MASTER.fullmatch(self.spark_master):
            raise ConfigError(
                f"spark_master must be local[N] or spark://host:port[,host:port...] (a Spark standalone "
                f"cluster), got {self.spark_master!r}"
            )
        if not self.master_on_loopback and only_this_host(self.repository_address):
            raise ConfigError(
                f"repository_address {self.repository_address} names whatever host dials it, but the "
                f"executors of {self.spark_master} run on other hosts and read the repository "
                "themselves: give the repository's address on the cluster's network"
            )

    @property
    def master_on_loopback(self) -> bool:
        """Whether the driver and every executor are on this host (local[N], or a standalone
        master on loopback, whose workers must then be here too)."""
        if not self.spark_master.startswith("spark://"):
            return True
        hosts = self.spark_master.removeprefix("spark://").split(",")
        return all(only_this_host(host) for host in hosts)

    @property
    def driver_host(self) -> str:
        """``spark_driver_host``, else loopback when everything is on this host, else "" (Spark's choice)."""
        if self.spark_driver_host:
            return self.spark_driver_host
        return "127.0.0.1" if self.master_on_loopback else ""

    def _under_data_dir(self, value: str, name: str) -> Path:
        return Path(value).expanduser() if value else Path(self.data_dir).expanduser() / "kd" / name

    @property
    def parquet_dir(self) -> Path:
        return self._under_data_dir(self.parquet_path, "features.parquet")

    @property
    def checkpoint_dir(self) -> Path:
        return self._under_data_dir(self.checkpoint_path, "checkpoint")

    @property
    def preview_file(self) -> Path:
        return self._under_data_dir(self.preview_path, "preview.png")


def check_spark_conf(items: tuple[str, ...]) -> None:
    """Each extra Spark setting is KEY=VALUE (KD's and the benchmarks' Spark sessions)."""
    for item in items:
        key, eq, _value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"spark_conf entry '{item}' is not key=value")
