"""KD end to end on a real local Spark session against a real repository:
empty intervals, several intervals, restarts (KD, repository, lost
checkpoint, replayed batch), malformed records, and clustering that finds
distributions it was not told about."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import uuid
from itertools import permutations
from pathlib import Path

import pytest

from hio.kd.config import KDConfig
from hio.kd.job import build_session, run
from hio.kd.report import format_knowledge
from tests.harness import HioProcess, free_port, health_of, wait_for
from tests.kd.helpers import Repo, blobs_records, record, repository, simulation_records
from tests.kd.standalone import spark_home

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark(tmp_path_factory):  # type: ignore[no-untyped-def]
    where = tmp_path_factory.mktemp("spark")
    session = build_session(KDConfig(spark_master="local[2]", data_dir=str(where)), app_name="hio-kd-tests")
    yield session
    session.stop()


def kd_config(tmp_path: Path, repo: Repo, **overrides) -> KDConfig:  # type: ignore[no-untyped-def]
    settings: dict[str, object] = {
        "repository_address": repo.address,
        "data_dir": str(tmp_path / "var"),
        "once": True,
        "k": 3,
        "rpc_deadline": 10.0,
        "restart_delay": 0.2,
        "max_records_per_interval": 400,
        "max_iterations": 5,
        "http_listen": "",
    }
    settings.update(overrides)
    return KDConfig(**settings)  # type: ignore[arg-type]


def purity(knowledge, truth_by_id: dict[int, int]) -> float:  # type: ignore[no-untyped-def]
    """Share of tuples whose cluster maps to their true blob under the best matching."""
    pairs = [(truth_by_id[a.tuple_id], a.cluster) for a in knowledge.assignments]
    best = 0
    for perm in permutations(range(len(knowledge.clusters))):
        best = max(best, sum(1 for t, c in pairs if perm[c] == t))
    return best / len(pairs)


def test_empty_repository_writes_nothing(spark, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    with repository(tmp_path / "repo") as repo:
        config = kd_config(tmp_path, repo)
        assert run(config, spark=spark) == 0
        assert capsys.readouterr().out == "hio kd: 0 new feature records (0 stored in all); knowledge unchanged\n"
        assert run(config, spark=spark) == 0  # a second empty pass, from the checkpoint
        assert repo.knowledge() is None
        assert not list(config.parquet_dir.glob("part-*"))


def test_intervals_cluster_distinct_distributions_and_skip_malformed(
    spark,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    capsys,
) -> None:
    records, truth = blobs_records(1, 900)
    broken = record(5000, {"a": 1.0}, kd=("a", "absent"))
    other = record(5001, {"x": 1.0}, image="hio/other")
    with repository(tmp_path / "repo") as repo:
        repo.put([*records[:450], broken, other, *records[450:]])
        config = kd_config(tmp_path, repo)
        assert run(config, spark=spark) == 0  # 902 records in 3 micro-batches of <= 400
        assert len(list(config.parquet_dir.glob("part-*.parquet"))) == 3
        knowledge = repo.knowledge()
        assert knowledge is not None
        assert (knowledge.tuple_count, knowledge.malformed_records, knowledge.up_to_offset) == (900, 1, 902)
        assert list(knowledge.feature_names) == ["a", "b", "c"]
        assert sorted(c.count for c in knowledge.clusters) == [300, 300, 300]
        assert len(knowledge.dendrogram) == 2 and len(knowledge.assignments) == 900
        assert [(g.image, g.tuple_count) for g in knowledge.groups] == [("hio/synthetic", 900), ("hio/other", 1)]
        assert knowledge.assignments_omitted == 0
        truth_by_id = {r.tuple_id: int(t) for r, t in zip(records, truth, strict=True)}
        assert purity(knowledge, truth_by_id) == 1.0
        assert repo.offsets().committed == 902
        assert config.preview_file.read_bytes().startswith(b"\x89PNG")
        assert repo.preview().startswith(b"\x89PNG")
        text = format_knowledge(knowledge)
        assert "malformed:     1 records" in text and "#2" in text

        more, more_truth = blobs_records(10_000, 300, seed=7)
        repo.put(more)
        capsys.readouterr()
        assert run(config, spark=spark) == 0
        knowledge = repo.knowledge()
        assert (knowledge.tuple_count, knowledge.new_records) == (1200, 300)
        assert capsys.readouterr().out == (
            "hio kd: 300 new feature records (1,201 stored in all); published "
            "knowledge of 2 groups, 3 clusters (see it: hio knowledge)\n"
        )
        truth_by_id.update({r.tuple_id: int(t) for r, t in zip(more, more_truth, strict=True)})
        assert purity(knowledge, truth_by_id) == 1.0


def test_every_image_group_is_published_and_separated(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    micro, micro_truth = blobs_records(1, 600, image="hio/microscopy")
    sim, sim_truth = simulation_records(5000, 300)
    truth = {r.tuple_id: int(t) for r, t in zip(micro + sim, list(micro_truth) + sim_truth, strict=True)}
    with repository(tmp_path / "repo") as repo:
        repo.put(micro[:300] + sim[:150] + micro[300:] + sim[150:])  # interleaved pipelines
        config = kd_config(tmp_path, repo, max_assignments=750)
        assert run(config, spark=spark) == 0
        knowledge = repo.knowledge()
        groups = {g.image: g for g in knowledge.groups}
        assert [g.image for g in knowledge.groups] == ["hio/microscopy", "hio/simulation"]
        assert list(groups["hio/microscopy"].feature_names) == ["a", "b", "c"]
        assert list(groups["hio/simulation"].feature_names) == ["energy", "pressure"]
        # exactly once: per group and in all
        assert [g.tuple_count for g in knowledge.groups] == [600, 300]
        assert sorted(c.count for c in groups["hio/simulation"].clusters) == [100, 100, 100]
        assert sorted(c.count for c in groups["hio/microscopy"].clusters) == [200, 200, 200]
        # each clustered on its own: every tuple with its own blob
        for group in knowledge.groups:
            assert purity(group, truth) == 1.0
            assert len(group.dendrogram) == 2
        # the assignment bound holds over all groups: the most recent 750 tuples
        listed = sorted(a.tuple_id for g in knowledge.groups for a in g.assignments)
        assert len(listed) == 750 and knowledge.assignments_omitted == 150
        assert listed == sorted(r.tuple_id for r in (micro[:300] + sim[:150] + micro[300:] + sim[150:])[150:])
        # top level: the main (largest) group, as old readers expect
        assert (knowledge.tuple_count, list(knowledge.feature_names)) == (600, ["a", "b", "c"])
        assert list(knowledge.clusters) == list(groups["hio/microscopy"].clusters)
        text = format_knowledge(knowledge)
        assert "image hio/microscopy, 600 tuples (main" in text and "image hio/simulation, 300 tuples" in text
        assert "energy=" in text and "tuples:        900" in text

        repo.put(simulation_records(9000, 600)[0])  # simulation becomes the larger group
        assert run(config, spark=spark) == 0
        knowledge = repo.knowledge()
        assert [(g.image, g.tuple_count) for g in knowledge.groups] == [
            ("hio/simulation", 900),
            ("hio/microscopy", 600),
        ]
        assert (knowledge.tuple_count, knowledge.new_records, knowledge.up_to_offset) == (900, 600, 1500)
        preferred = kd_config(
            tmp_path, repo, image="hio/microscopy", max_groups=1, consumer="kd2", data_dir=str(tmp_path / "var2")
        )
        assert run(preferred, spark=spark) == 0
        knowledge = repo.knowledge()
        assert list(knowledge.feature_names) == ["a", "b", "c"] and len(knowledge.clusters) == 3
        skipped = next(g for g in knowledge.groups if g.image == "hio/simulation")
        assert skipped.tuple_count == 900 and not skipped.clusters and "max_groups" in skipped.algorithm


def test_restarts_never_count_a_tuple_twice(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    first, _ = blobs_records(1, 600)
    second, _ = blobs_records(1000, 300)
    third, _ = blobs_records(2000, 100)
    with repository(tmp_path / "repo") as repo:
        repo.put(first)
        config = kd_config(tmp_path, repo, max_records_per_interval=300)
        assert run(config, spark=spark) == 0
        assert repo.knowledge().tuple_count == 600
        # KD died after storing batch 1 but before Spark logged it: Spark replays it.
        commits = config.checkpoint_dir / "commits"
        last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
        (commits / str(last)).unlink()
        (commits / f".{last}.crc").unlink(missing_ok=True)
        assert run(config, spark=spark) == 0
        assert repo.knowledge().tuple_count == 600
    with repository(tmp_path / "repo") as repo:  # the repository restarted
        repo.put(second)
        config = kd_config(tmp_path, repo, max_records_per_interval=300)
        assert run(config, spark=spark) == 0
        assert repo.knowledge().tuple_count == 900
        shutil.rmtree(config.checkpoint_dir)  # the checkpoint is lost
        repo.put(third)
        assert run(config, spark=spark) == 0
        knowledge = repo.knowledge()
        assert (knowledge.tuple_count, knowledge.up_to_offset) == (1000, 1000)
        ids = [a.tuple_id for a in knowledge.assignments]
        assert len(ids) == len(set(ids)) == 1000


def test_a_driver_killed_while_writing_its_first_batch_does_not_stop_kd_for_ever(  # type: ignore[no-untyped-def]
    spark, tmp_path: Path
) -> None:
    """Spark writes a checkpoint entry to a hidden temporary and renames it; a driver
    killed between the two leaves the temporary, which Spark refuses on batch 0."""
    records, _ = blobs_records(1, 200)
    with repository(tmp_path / "repo") as repo:
        repo.put(records)
        config = kd_config(tmp_path, repo, max_failures=2)
        for log_folder in ("offsets", "commits"):
            folder = config.checkpoint_dir / log_folder
            folder.mkdir(parents=True)
            (folder / f".0.{uuid.uuid4()}.tmp").write_text("v1\n")
            (folder / f"..0.{uuid.uuid4()}.tmp.crc").write_bytes(b"crc")
        assert run(config, spark=spark) == 0
        assert repo.knowledge().tuple_count == 200
        assert not list(config.checkpoint_dir.rglob("*.tmp*"))
        assert (config.checkpoint_dir / "commits" / "0").is_file()


def test_continuous_intervals_until_stopped(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """... and KD's own gRPC server (listen) says it is alive, and ready while its query runs."""
    listen = f"127.0.0.1:{free_port()}"
    with repository(tmp_path / "repo") as repo:
        config = kd_config(tmp_path, repo, once=False, interval=0.5, max_assignments=50, listen=listen)
        stop = threading.Event()
        outcome: list[int] = []
        runner = threading.Thread(target=lambda: outcome.append(run(config, stop=stop, spark=spark)))
        runner.start()
        try:
            wait_for(lambda: health_of(listen) == "SERVING", timeout=60, what="KD ready: its query runs")
            assert health_of(listen, "liveness") == "SERVING"
            repo.put(blobs_records(1, 200)[0])
            wait_for(lambda: (k := repo.knowledge()) and k.tuple_count == 200, timeout=120, what="first interval")
            repo.put(blobs_records(1000, 100)[0])
            wait_for(lambda: repo.knowledge().tuple_count == 300, timeout=120, what="second interval")
        finally:
            stop.set()
            runner.join(60)
        assert outcome == [0]
        knowledge = repo.knowledge()
        assert len(knowledge.assignments) == 50  # bounded: the most recent tuples
        assert knowledge.assignments[-1].tuple_id == 1099


def _driver_jvm(kd: HioProcess) -> int:
    """The pid of the Spark driver JVM that ``hio kd`` launched."""
    assert kd.proc is not None
    out = subprocess.run(
        ["pgrep", "-P", str(kd.proc.pid), "java"], capture_output=True, text=True, check=False
    ).stdout.split()
    assert len(out) == 1, f"expected one driver JVM under hio kd, found {out}"
    return int(out[0])


def _after_kill(repo: Repo, kd: HioProcess) -> str:
    """What a failed wait shows first: the count reached and KD's own log lines
    (short enough to survive a truncated CI report), then every thread's stack."""
    own = [line for line in kd.output().splitlines() if " hio.kd: " in line]
    return (
        f"knowledge after the driver died (tuple_count {repo.knowledge().tuple_count}); "
        f"KD's log:\n" + "\n".join(own[-20:]) + f"\n{kd.stacks()}"
    )


def _spark_home_whose_driver_fails(root: Path, launch: int) -> tuple[Path, Path]:
    """A SPARK_HOME that is the pyspark package's, except that the ``launch``-th driver
    started from it exits before it answers, as a JVM that cannot start does; and the
    file that counts the launches (a line each)."""
    real = spark_home()
    home, launches = root / "spark-home", root / "spark-launches"
    (home / "bin").mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "bin":
            (home / entry.name).symlink_to(entry)
    for entry in (real / "bin").iterdir():
        if entry.name != "spark-submit":
            (home / "bin" / entry.name).symlink_to(entry)
    submit = home / "bin" / "spark-submit"
    submit.write_text(
        "#!/bin/sh\n"
        f'echo launch >> "{launches}"\n'
        f'if [ "$(wc -l < "{launches}")" -eq {launch} ]; then echo "this driver does not start" >&2; exit 1; fi\n'
        f'exec "{real}/bin/spark-submit" "$@"\n'
    )
    submit.chmod(0o755)
    return home, launches


def _kd_args(repo: Repo, data: Path, *more: str) -> list[str]:
    """``hio kd``'s arguments for a driver-failure test: k 3, info logs, a retry after 1 s."""
    return [
        *("--repository-address", repo.address, "--data-dir", str(data)),
        *("--k", "3", "--log-level", "info", "--restart-delay", "1", *more),
    ]


def test_hio_kd_whose_first_spark_driver_does_not_start_tries_again(tmp_path: Path) -> None:
    """The driver KD starts with exits before it answers (as on a machine under load): a
    --once run counts it as a failure, starts another after restart_delay, and learns."""
    spark_home_, launches = _spark_home_whose_driver_fails(tmp_path, launch=1)
    with repository(tmp_path / "repo") as repo:
        repo.put(blobs_records(1, 150)[0])
        args = _kd_args(repo, tmp_path / "var", "--once")
        with HioProcess("kd", args, tmp_path, env={"SPARK_HOME": str(spark_home_)}) as kd:
            assert kd.proc is not None
            code = kd.proc.wait(timeout=300)
            assert code == 0, kd.output()
            assert "a new Spark session did not start; trying again" in kd.output()
        assert len(launches.read_text().splitlines()) == 2  # the one that failed, its retry
        knowledge = repo.knowledge()
        assert knowledge is not None and knowledge.tuple_count == 150


@pytest.mark.slow
def test_hio_kd_process_outlives_its_spark_driver_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """The driver JVM is killed; the first one started in its place exits before it answers:
    KD tries again, carries on from its checkpoint, and stops cleanly."""
    spark_home_, launches = _spark_home_whose_driver_fails(tmp_path, launch=2)  # the killed one's replacement
    with repository(tmp_path / "repo") as repo:
        repo.put(blobs_records(1, 150)[0])
        args = _kd_args(repo, tmp_path / "var", "--interval", "1")
        with HioProcess("kd", args, tmp_path, env={"SPARK_HOME": str(spark_home_)}) as kd:
            wait_for(
                lambda: (k := repo.knowledge()) and k.tuple_count == 150,
                timeout=180,
                what=lambda: f"knowledge from hio kd:\n{kd.stacks()}",
            )
            first_jvm = _driver_jvm(kd)
            os.kill(first_jvm, signal.SIGKILL)  # the driver dies (OOM killer, operator): KD must carry on
            repo.put(blobs_records(151, 150)[0])

            def all_known() -> bool:
                assert kd.alive(), _after_kill(repo, kd)  # a KD that ended fails at once, not in 240 s
                knowledge = repo.knowledge()
                return knowledge is not None and knowledge.tuple_count == 300

            wait_for(all_known, timeout=240, what=lambda: _after_kill(repo, kd))
            assert kd.alive() and _driver_jvm(kd) != first_jvm
            assert "the Spark session is dead; starting a new one" in kd.output()
            assert "a new Spark session did not start; trying again" in kd.output()
            assert "not ready reason=a new Spark session did not start" in kd.output()  # its health said why
            assert len(launches.read_text().splitlines()) == 3  # the first, the one that failed, its retry
            code = kd.stop(timeout=60)
        assert code == 0, kd.output()
