"""``hio kd --spark-master spark://...`` on a real Spark standalone cluster on this
machine (a master and two workers of 1 core each, started once for the module):
it learns what ``local[2]`` learns from the same stored features, and counts
every record exactly once while a Spark worker dies and comes back and while
KD itself is killed and started again."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from google.protobuf.message import Message

from hio.proto import features_pb2
from tests.harness import HioProcess, hio_env, wait_for
from tests.kd.helpers import Repo, blobs_records, repository, simulation_records
from tests.kd.standalone import SparkStandalone

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkStandalone]:
    """Slow to start (three JVMs): one per module, always stopped."""
    with SparkStandalone(tmp_path_factory.mktemp("spark-standalone"), workers=2, cores=1, memory="1g") as cluster:
        yield cluster


def kd_args(repo: Repo, data_dir: Path, spark_master: str, *extra: str) -> list[str]:
    return [
        "--repository-address",
        repo.address,
        "--data-dir",
        str(data_dir),
        "--spark-master",
        spark_master,
        "--k",
        "3",
        "--max-iterations",
        "5",
        "--rpc-deadline",
        "20",
        "--restart-delay",
        "1",
        "--log-level",
        "info",
        *extra,
    ]


def run_kd_once(repo: Repo, data_dir: Path, spark_master: str, consumer: str) -> str:
    """``hio kd --once`` as a user runs it; its output (the test fails with it on a bad exit)."""
    args = kd_args(repo, data_dir, spark_master, "--once", "--consumer", consumer, "--max-records-per-interval", "400")
    proc = subprocess.run(
        [sys.executable, "-m", "hio.cli", "kd", *args],
        env=hio_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, (
        f"hio kd --spark-master {spark_master} exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    )
    return proc.stdout


def _round_doubles(message: Message, digits: int = 9) -> None:
    """Round every double of a message (nested ones too): equal knowledge up to float noise."""
    for field, value in message.ListFields():
        repeated = field.is_repeated
        if field.type == field.TYPE_DOUBLE:
            if repeated:
                value[:] = [round(v, digits) for v in value]
            else:
                setattr(message, field.name, round(value, digits))
        elif field.type == field.TYPE_MESSAGE:
            for item in value if repeated else [value]:
                _round_doubles(item, digits)


def comparable(knowledge: features_pb2.Knowledge | None) -> features_pb2.Knowledge:
    """The knowledge without when it was computed and how long that took."""
    assert knowledge is not None, "KD published no knowledge"
    copy = features_pb2.Knowledge()
    copy.CopyFrom(knowledge)
    copy.ClearField("computed_unix")
    copy.ClearField("interval_seconds")
    _round_doubles(copy)
    return copy


def test_the_cluster_learns_what_local_spark_learns_from_the_same_features(
    spark_cluster: SparkStandalone, tmp_path: Path
) -> None:
    micro, _ = blobs_records(1, 900, image="hio/microscopy")
    sim, _ = simulation_records(5000, 300)
    with repository(tmp_path / "repo") as repo:
        repo.put(micro[:450] + sim + micro[450:])
        learned = {}
        for name, master in (("local", "local[2]"), ("cluster", spark_cluster.url)):
            out = run_kd_once(repo, tmp_path / name, master, consumer=f"kd-{name}")
            assert "1,200 new feature records" in out and "2 groups, 3 clusters" in out, out
            learned[name] = comparable(repo.knowledge())
    assert learned["cluster"] == learned["local"]
    knowledge = learned["cluster"]
    assert [(g.image, g.tuple_count, len(g.clusters)) for g in knowledge.groups] == [
        ("hio/microscopy", 900, 3),
        ("hio/simulation", 300, 3),
    ]
    assert sorted(c.count for c in knowledge.groups[1].clusters) == [100, 100, 100]
    # The run was the cluster's: an application that had both workers' cores.
    apps = [app for app in spark_cluster.state()["completedapps"] if app["name"] == "hio-kd"]
    assert [app["cores"] for app in apps] == [2]


def committed(repo: Repo) -> int:
    return int(repo.offsets().committed)


def app_cores(cluster: SparkStandalone) -> int:
    """Cores the cluster gives the running KD (one per worker it has an executor on)."""
    return sum(int(app["cores"]) for app in cluster.state()["activeapps"] if app["name"] == "hio-kd")


def assert_stored_once(parquet_dir: Path, expected_ids: set[int]) -> None:
    """KD's own store holds every record once: offsets 1..N without a gap or a repeat, each id once."""
    table = pq.read_table(sorted(parquet_dir.glob("part-*.parquet")))
    offsets = sorted(table.column("offset").to_pylist())
    ids = table.column("tuple_id").to_pylist()
    assert offsets == list(range(1, len(expected_ids) + 1))
    assert len(ids) == len(set(ids)) and set(ids) == expected_ids


def wait_busy(cluster: SparkStandalone, workers: Sequence[int]) -> None:
    """Wait until an executor on one of ``workers`` runs a task (a kill then cuts an interval)."""
    wait_for(
        lambda: any(cluster.running_tasks(w) for w in workers),
        timeout=240,
        interval=0.05,
        what=f"a task running on worker(s) {list(workers)}",
    )


def test_each_record_counts_once_across_a_spark_worker_restart_and_a_kd_restart(
    spark_cluster: SparkStandalone, tmp_path: Path
) -> None:
    first, _ = blobs_records(1, 4000)
    second, _ = blobs_records(10_000, 4000)
    with repository(tmp_path / "repo") as repo:
        repo.put(first)
        # Batches of 1,000 records, read as two partitions: both executors read during an interval.
        args = kd_args(
            repo, tmp_path / "var", spark_cluster.url, "--interval", "2", "--max-records-per-interval", "1000"
        )
        kd = HioProcess("kd", args, tmp_path, name="kd-first").start()
        try:
            wait_for(lambda: committed(repo) >= 1000, timeout=240, what=lambda: f"a first interval:\n{kd.output()}")
            wait_for(
                lambda: app_cores(spark_cluster) == 2,
                timeout=60,
                what=lambda: f"executors on both workers:\n{spark_cluster.output()}",
            )
            wait_busy(spark_cluster, [0])
            spark_cluster.kill_worker(0)  # with its executor, mid-task
            assert spark_cluster.running_tasks(0), "the task ended before the kill: nothing was cut off"
            at_kill = committed(repo)
            wait_for(
                lambda: committed(repo) >= min(at_kill + 1000, 4000),
                timeout=240,
                what=lambda: f"intervals on the one worker left:\n{kd.output()}",
            )
            assert app_cores(spark_cluster) == 1 and "Lost executor" in kd.output()
            spark_cluster.start_worker(0)
            wait_for(
                lambda: app_cores(spark_cluster) == 2,
                timeout=120,
                what=lambda: f"an executor on the returned worker:\n{spark_cluster.output()}",
            )
            repo.put(second)
            wait_for(lambda: committed(repo) > 4000, timeout=240, what=lambda: f"catching up:\n{kd.output()}")
            assert kd.alive()
            wait_busy(spark_cluster, [0, 1])
            kd.kill()  # SIGKILL: hio kd and its Spark driver, mid interval
        finally:
            kd.stop()
        assert committed(repo) < 8000, "KD caught up before it was killed: no restart mid catch-up"
        with HioProcess("kd", args, tmp_path, name="kd-second") as kd:
            wait_for(
                lambda: (k := repo.knowledge()) and k.tuple_count == 8000 and committed(repo) == 8000,
                timeout=300,
                what=lambda: f"KD to catch up after its restart:\n{kd.output()}",
            )
        knowledge = repo.knowledge()
        assert (knowledge.tuple_count, knowledge.up_to_offset, knowledge.malformed_records) == (8000, 8000, 0)
        ids = [a.tuple_id for a in knowledge.assignments]
        assert len(ids) == len(set(ids)) == 8000
        assert sum(c.count for c in knowledge.clusters) == 8000
    assert_stored_once(tmp_path / "var" / "kd" / "features.parquet", {r.tuple_id for r in first + second})
