"""Never lose a tuple: kill -9 every role in turn, cut connections, count.

500 files are written into the folder a real `hio gateway` watches, while
the gateway, the master, the worker controller, an engine, the repository
and KD are each killed with SIGKILL and restarted, and every connection
through the master's and repository's proxies is cut. At the end each file's
features are in the repository exactly once, and KD counted each once.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from hio.cluster import LocalCluster
from hio.kd.client import RepositoryClient
from hio.proto import features_pb2
from hio.tools import fetch_knowledge
from hio.up import read_features
from tests.harness import CuttingProxy, HioProcess, cluster_engines, free_port, wait_for

pytestmark = [pytest.mark.slow]

TUPLES = int(os.environ.get("FAULT_TUPLES", "500"))


class FaultCluster(LocalCluster):
    """Worker and gateway reach the master and the repository through proxies that cut."""

    def __init__(self, root: Path, with_kd: bool) -> None:
        master, repository = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        super().__init__(
            root,
            master_address=master,
            repository_address=repository,
            process=HioProcess,
            master_args=[
                "--expiry-seconds",
                "3",
                "--heartbeat-interval",
                "0.5",
                "--lease-seconds",
                "10",
                "--reservation-seconds",
                "6",
            ],
        )
        self.with_kd = with_kd
        self.master_proxy = CuttingProxy(master)
        self.repo_proxy = CuttingProxy(repository)
        self.watch = root / "incoming"
        self.watch.mkdir()

    def start(self) -> FaultCluster:
        super().start()
        via = ["--master-address", self.master_proxy.address, "--repository-address", self.repo_proxy.address]
        try:
            self.add_worker("fw", ["hio/synthetic=2"], args=via, name="worker", timeout=60)
            self.add(
                "gateway",
                [
                    "--watch",
                    str(self.watch),
                    "--image",
                    "hio/synthetic",
                    "--settle-seconds",
                    "0.2",
                    "--ingest-listen",
                    "",
                    "--source",
                    "fault",
                    *via,
                ],
            )
            if self.with_kd:
                self.add("kd", ["--interval", "3", "--k", "2", "--log-level", "info"])
        except BaseException:
            self.stop()
            raise
        return self

    def kill_and_restart(self, name: str) -> None:
        proc = self.procs[name]
        if name == "worker":
            # Only the controller dies: its engines must notice and go too.
            assert proc.proc is not None
            os.kill(proc.proc.pid, signal.SIGKILL)
            proc.proc.wait(10)
        else:
            proc.kill()
        time.sleep(random.uniform(0.2, 1.0))
        self.restart(name)

    def kill_an_engine(self) -> bool:
        engines = cluster_engines(self)
        if not engines:
            return False
        os.kill(random.choice(engines), signal.SIGKILL)
        return True

    def knowledge(self) -> features_pb2.Knowledge | None:
        return fetch_knowledge(self.settings)

    def stop(self) -> list[str]:
        problems = super().stop()
        self.master_proxy.close()
        self.repo_proxy.close()
        return problems


def write_files(watch: Path, count: int, seconds: float) -> list[str]:
    names = []
    for i in range(count):
        name = f"tuple-{i:04d}.bin"
        tmp = watch / f".{name}.part"
        tmp.write_bytes(os.urandom(random.randint(2_000, 60_000)))
        tmp.rename(watch / name)  # complete files appear atomically, as a careful instrument writes them
        names.append(name)
        time.sleep(seconds / count)
    return names


def chaos_order(cluster: FaultCluster) -> list[str]:
    """What the chaos does, in turn: kill and restart each role, kill an engine, cut the links."""
    order = ["gateway", "master", "worker", "engine", "repository", "cut"]
    if "kd" in cluster.procs:
        order.insert(5, "kd")
    return order


def chaos(cluster: FaultCluster, stop: threading.Event, log: list[str]) -> None:
    """Every 2-4 s the next fault of :func:`chaos_order`, each logged as 'HH:MM:SS what'; a fault
    that cannot be made is logged as 'failed: ...' and ends the chaos (the test then fails)."""
    order = chaos_order(cluster)
    i = 0
    try:
        while not stop.wait(random.uniform(2.0, 4.0)):
            what = order[i % len(order)]
            i += 1
            if what == "engine":
                cluster.kill_an_engine()
            elif what == "cut":
                cluster.master_proxy.cut()
                cluster.repo_proxy.cut()
            else:
                cluster.kill_and_restart(what)
            log.append(f"{time.strftime('%H:%M:%S')} {what}")
    except Exception as exc:  # noqa: BLE001 - said in the log, which the test asserts on
        log.append(f"failed: {exc!r}")


def count_stored(cluster: FaultCluster, names: list[str]) -> tuple[int, int, int]:
    counts = Counter(r.meta.name for r in read_features(cluster.settings) if r.meta.source == "fault")
    stored = sum(1 for n in names if counts[n] >= 1)
    duplicated = sum(c - 1 for c in counts.values() if c > 1)
    return stored, duplicated, len(names) - stored


def diagnose(cluster: FaultCluster, names: list[str], log: list[str]) -> str:
    """Where the missing tuples are: still in the watch folder, the spool, the queue, dead letters."""
    stored, duplicated, lost = count_stored(cluster, names)
    status = cluster.status()
    waiting = sorted(p.name for p in cluster.watch.iterdir() if p.is_file())
    spooled = sum(1 for p in (cluster.root / "gateway").rglob("*") if p.is_file())
    return (
        f"\nDIAGNOSIS: stored {stored}, duplicated {duplicated}, lost {lost}; "
        f"files not yet taken {len(waiting)} {waiting[:5]}; files under gateway/ {spooled}; "
        f"queues {[(q.image, q.length, q.leased) for q in status.queues]}; dead letters {status.dead_letters}; "
        f"channels free/busy/down {status.channels_free}/{status.channels_busy}/{status.channels_down}; "
        f"warnings {list(status.warnings)}; chaos {log}\n"
        f"--- gateway log tail ---\n{cluster.procs['gateway'].output(3000)}"
    )


def diagnose_kd(cluster: FaultCluster) -> str:
    """How far KD got: its process, its last knowledge, the repository's offsets, its log."""
    kd = cluster.procs["kd"]
    k = cluster.knowledge()
    with RepositoryClient(cluster.settings, deadline=10) as client:
        offsets = client.offsets("kd")
    return (
        f"\nKD DIAGNOSIS: alive {kd.alive()} (exit {kd.proc.poll() if kd.proc else None}); "
        f"knowledge {(k.tuple_count, k.up_to_offset) if k else None}; "
        f"repository offsets {str(offsets).replace(chr(10), ' ')}\n"
        f"--- kd log tail ---\n{kd.output(6000)}"
    )


@pytest.mark.spark
def test_every_role_killed_in_turn_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    random.seed(int(os.environ.get("FAULT_SEED", "5")))
    with_kd = os.environ.get("FAULT_KD", "1") != "0"  # 0: quicker runs while debugging
    cluster = FaultCluster(tmp_path, with_kd=with_kd).start()
    stop, log = threading.Event(), []
    chaos_thread = threading.Thread(target=chaos, args=(cluster, stop, log), daemon=True)
    try:
        chaos_thread.start()
        names = write_files(cluster.watch, TUPLES, seconds=45)
        time.sleep(8)  # let the chaos reach every role while the tail is in flight
        wait_for(
            lambda: {entry.split()[-1] for entry in log} >= set(chaos_order(cluster)) or not chaos_thread.is_alive(),
            timeout=180,
            interval=0.5,
            what=lambda: f"every fault made once (made: {log})",
        )
        stop.set()
        chaos_thread.join(60)
        assert not chaos_thread.is_alive() and not any(entry.startswith("failed:") for entry in log), log
        try:
            wait_for(lambda: count_stored(cluster, names)[2] == 0, timeout=300, interval=1.0, what="every tuple stored")
        except AssertionError:
            print(diagnose(cluster, names, log))
            raise
        stored, duplicated, lost = count_stored(cluster, names)
        print(
            f"\nfault test: sent {len(names)}, stored {stored}, duplicated {duplicated}, lost {lost}; "
            f"chaos: {', '.join(log)}"
        )
        assert duplicated == 0 and lost == 0 and stored == len(names)
        if with_kd:
            started = time.monotonic()
            try:
                k = wait_for(
                    lambda: (k := cluster.knowledge()) is not None and k.tuple_count >= TUPLES and k,
                    timeout=300,
                    interval=1.0,
                    what="KD to count every tuple",
                )
            except AssertionError:
                print(diagnose_kd(cluster))
                raise
            print(f"fault test: KD counted {k.tuple_count} tuples {time.monotonic() - started:.0f} s after")
            assert k.tuple_count == TUPLES, "KD counted each tuple exactly once"
        done = {p.name for p in (cluster.watch / ".hio-done").rglob("*") if p.is_file()}
        assert done == set(names), "every file was moved aside once its features were safe"
    finally:
        stop.set()
        cluster.stop()
