"""``hio bench-kd``: does an interval cost what is new, or what is stored?

Against a real repository (in-process, port 0, in a temporary folder) and one
Spark session, it times one KD interval with ``new`` new feature records
twice: over an empty store, and over a store that already holds ``stored``
records (accumulated by KD in rate-limited catch-up batches first). A warm-up
pass runs before either, so neither pays for Python workers starting or the
JVM warming up. The interval time is measured inside the micro-batch (read
from the repository by executors, accumulate, cluster, preview, publish) and
broken down; the bound is ``ratio_bound`` x (default 2x). Exit code 1 when the
bound is exceeded.

It also prints what the large store cost to build: the catch-up's time and
rate (every record read by the executors and accumulated by the driver),
the bytes the repository and KD's Parquet store hold, and the driver's peak
memory (this process, and the Spark driver JVM it started). ``spark_master``
may be a standalone cluster (``spark://host:port``): the same intervals then
run on its executors (``docs/deploy.md``, "KD on a Spark cluster").
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hio.config import ConfigError, positive, setting
from hio.settings import ClusterSettings

WARMUP_RECORDS = 500


@dataclasses.dataclass(frozen=True)
class KDBenchConfig(ClusterSettings):
    stored: int = setting(200_000, "feature records already accumulated in the large-store case")
    new: int = setting(1_000, "new feature records in the timed interval")
    features: int = setting(6, "numeric features per record")
    groups: int = setting(2, "image groups the records are spread over (round robin), each its own feature set")
    k: int = setting(4, "clusters")
    sample_size: int = setting(10_000, "KD's clustering sample bound")
    max_records_per_interval: int = setting(50_000, "KD's micro-batch bound (the catch-up uses it)")
    spark_master: str = setting("local[2]", "Spark master URL: local[N], or spark://host:port (a standalone cluster)")
    spark_conf: tuple[str, ...] = setting((), "extra Spark settings as key=value (repeatable)", factory=tuple)
    ratio_bound: float = setting(2.0, "largest accepted ratio large-store / empty-store interval time")
    work_dir: str = setting("", "folder for the repository and KD state; empty = a temporary folder, removed after")
    seed: int = setting(1, "random seed")

    def validate(self) -> None:
        self.validate_cluster()
        for name in (
            "stored",
            "new",
            "features",
            "groups",
            "k",
            "sample_size",
            "max_records_per_interval",
            "ratio_bound",
        ):
            positive(name, getattr(self, name))
        if self.features > 64:
            raise ConfigError(f"features must be at most 64, got {self.features}")
        if self.groups > 16:
            raise ConfigError(f"groups must be at most 16, got {self.groups}")
        self.kd_config(".").validate()

    def kd_config(self, data_dir: str, **settings: Any) -> Any:
        """The KD settings of a pass (a ``hio.kd.KDConfig``; imported here, not at the CLI's start)."""
        from hio.kd.config import KDConfig

        fields: dict[str, Any] = {
            "repository_address": self.repository_address,
            "data_dir": data_dir,
            "spark_master": self.spark_master,
            "spark_conf": self.spark_conf,
            "k": self.k,
            "sample_size": self.sample_size,
            "max_records_per_interval": self.max_records_per_interval,
            "seed": self.seed,
        }
        return KDConfig(**{**fields, **settings})


def feature_uploads(first_id: int, count: int, features: int, groups: int, seed: int) -> list[Any]:
    """PutFeatures uploads of ``count`` records drawn from ``features``-d blobs,
    tuple id ``i`` in group ``i % groups`` (image ``hio/bench-<g>``, features ``g<g>_f<j>``)."""
    import zstandard

    from hio.proto import features_pb2, repository_pb2
    from hio.transport.frames import crc32

    rng = np.random.default_rng(seed + first_id)
    centres = rng.uniform(-20, 20, size=(5, features))
    points = centres[rng.integers(0, len(centres), count)] + rng.normal(size=(count, features))
    names = [[f"g{g}_f{j}" for j in range(features)] for g in range(groups)]
    compressor = zstandard.ZstdCompressor()
    uploads = []
    for offset, row in enumerate(points.tolist()):
        tuple_id = first_id + offset
        group = tuple_id % groups
        record = features_pb2.FeatureRecord(tuple_id=tuple_id, processed_unix=time.time(), kd_features=names[group])
        record.meta.tuple_id = tuple_id
        record.meta.image = f"hio/bench-{group}"
        for name, value in zip(names[group], row, strict=True):
            record.features[name].number = value
        data = compressor.compress(record.SerializeToString())
        uploads.append(repository_pb2.FeaturesUpload(tuple_id=tuple_id, record_zstd=data, crc32=crc32(data)))
    return uploads


class _Bench:
    """One repository + one Spark session; KD runs are `--once` passes."""

    def __init__(self, config: KDBenchConfig, work: Path) -> None:
        from hio.kd.job import build_session
        from hio.proto import repository_pb2_grpc
        from hio.repository import RepositoryConfig, create_repository_server
        from hio.transport.net import create_channel

        self.config = config
        self.work = work
        # Spark first: launching the JVM forks, which gRPC threads started before it dislike.
        self.spark = build_session(config.kd_config(str(work)), app_name="hio-bench-kd")
        repo_config = RepositoryConfig(listen="127.0.0.1:0", http_listen="", data_dir=str(work / "repo"), fsync="never")
        self.server, port, self.repo_store = create_repository_server(repo_config)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = create_channel(self.address, ClusterSettings())
        self.stub = repository_pb2_grpc.RepositoryStub(self.channel)
        self.next_id = 1

    def close(self) -> None:
        self.spark.stop()
        self.channel.close()
        self.server.stop(0).wait(5)
        self.repo_store.close()

    def put(self, count: int) -> None:
        from hio.proto import repository_pb2

        for start in range(0, count, 5000):
            n = min(5000, count - start)
            uploads = feature_uploads(self.next_id, n, self.config.features, self.config.groups, self.config.seed)
            self.stub.PutFeatures(repository_pb2.PutFeaturesRequest(records=uploads), timeout=120)
            self.next_id += n

    @property
    def stored(self) -> int:
        """Records put so far (tuple ids run from 1)."""
        return self.next_id - 1

    def commit(self, consumer: str, offset: int) -> None:
        from hio.proto import repository_pb2

        self.stub.CommitOffset(repository_pb2.CommitOffsetRequest(consumer=consumer, offset=offset), timeout=10)

    def kd_pass(self, name: str) -> Any:
        """One `hio kd --once` pass with state under ``work/name``; the job (with its timings)."""
        import threading

        from hio.kd.job import KnowledgeJob, SparkSessionKeeper, supervise
        from hio.kd.store import AccumulatedStore

        kd = self.config.kd_config(str(self.work / name), repository_address=self.address, once=True, consumer=name)
        job = KnowledgeJob(kd, self.spark, AccumulatedStore(kd.parquet_dir).open())
        try:
            if supervise(SparkSessionKeeper(kd, self.spark), kd, job, threading.Event()) != 0:
                raise RuntimeError(f"KD pass {name} failed")
        finally:
            job.close()
        return job


@dataclasses.dataclass
class Measured:
    """What one run found: the timed intervals, and what the largest store cost."""

    cases: list[tuple[str, int, Any]]  # (case, records stored before the timed interval, its job)
    catch_up_records: int = 0  # the last catch-up: to the largest store, from the one before
    catch_up_seconds: float = 0.0
    repository_bytes: int = 0  # the repository's data folder: every record, zstd
    parquet_bytes: int = 0  # KD's Parquet store of the large case
    driver_peak_rss: int = 0  # this process: the store's matrices, Arrow batches, clustering
    jvm_peak_rss: int = 0  # the Spark driver JVM this process started


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _driver_jvm_peak_rss() -> int:
    """Peak resident bytes of the Spark driver JVM under this process (0 if none is found)."""
    from hio.process.procs import children

    for pid in children(os.getpid()):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "java":
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            continue
    return 0


def measure_intervals(config: KDBenchConfig, work: Path, stored: Sequence[int]) -> Measured:
    """The empty store's interval first, then one over each size of ``stored`` in ascending
    order; measured before the session and the folders go. One repository and one KD consumer
    ("large") serve every size: it catches up to each size in turn, so a larger size costs only
    what it adds."""
    bench = _Bench(config, work)
    try:
        bench.put(WARMUP_RECORDS)
        bench.kd_pass("warmup")  # start Python workers, warm the JVM
        bench.commit("empty", WARMUP_RECORDS)  # the empty-store case starts after them
        bench.put(config.new)
        cases = [("empty store", 0, bench.kd_pass("empty"))]  # timed: `new` records over an empty store
        catch_up_records, catch_up_seconds, large = 0, 0.0, None
        for size in sorted(stored):
            before = bench.stored
            bench.put(max(0, size - before))
            started = time.monotonic()
            caught_up = bench.kd_pass("large")  # catch up on `size` records, in batches
            catch_up_records, catch_up_seconds = caught_up.store.total - before, time.monotonic() - started
            bench.put(config.new)
            large = bench.kd_pass("large")  # timed: `new` records over `size`
            cases.append(("large store", caught_up.store.total, large))
        return Measured(
            cases=cases,
            catch_up_records=catch_up_records,
            catch_up_seconds=catch_up_seconds,
            repository_bytes=_folder_bytes(work / "repo"),
            parquet_bytes=_folder_bytes(large.config.parquet_dir) if large is not None else 0,
            driver_peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            jvm_peak_rss=_driver_jvm_peak_rss(),
        )
    finally:
        bench.close()


def _mib(count: int) -> str:
    return f"{count / (1 << 20):,.0f} MiB"


def run_kd_bench(config: KDBenchConfig) -> int:
    """Print both interval times, their breakdown and the ratio, and what the large store
    cost (catch-up, sizes, driver memory); 1 if over the bound."""
    if config.stored < WARMUP_RECORDS + config.new:
        raise ConfigError(f"stored must be at least {WARMUP_RECORDS + config.new}")
    work = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="hio-bench-kd-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        measured = measure_intervals(config, work, [config.stored])
    finally:
        if not config.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    results = measured.cases
    print(
        f"KD interval with new records, {config.groups} groups, k={config.k}, {config.features} features, "
        f"sample bound {config.sample_size}, Spark {config.spark_master}"
    )
    print(f"{'case':<12} {'stored before':>13} {'new':>6} {'interval s':>10}  breakdown (s)")
    for name, stored, job in results:
        breakdown = ", ".join(f"{k} {v:.3f}" for k, v in job.last_timings.items())
        new = job.store.total - stored
        print(f"{name:<12} {stored:>13} {new:>6} {job.last_seconds:>10.3f}  {breakdown}")
    rate = measured.catch_up_records / max(measured.catch_up_seconds, 1e-9)
    print(
        f"catch-up    {measured.catch_up_records:,} records in {measured.catch_up_seconds:.1f} s "
        f"({rate:,.0f} records/s, batches of {config.max_records_per_interval:,})"
    )
    print(
        f"stored      repository {_mib(measured.repository_bytes)}, KD's Parquet {_mib(measured.parquet_bytes)}; "
        f"driver peak RSS: Python {_mib(measured.driver_peak_rss)}, JVM {_mib(measured.jvm_peak_rss)}"
    )
    ratio = results[1][2].last_seconds / max(results[0][2].last_seconds, 1e-9)
    verdict = "within" if ratio <= config.ratio_bound else "EXCEEDS"
    print(f"ratio large/empty = {ratio:.2f} ({verdict} the {config.ratio_bound:.1f}x bound)")
    return 0 if ratio <= config.ratio_bound else 1
