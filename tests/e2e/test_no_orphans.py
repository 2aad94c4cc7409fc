"""No role outlives the process that started it: not when that process is killed
with -9 (as a stopped test run or a killed `hio up`), and not when Ctrl-C stops it.

A small script plays the test session: it starts a cluster with the builder
(a repository, a master, a worker with two process engines), prints every pid
of it, and waits to be stopped.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness import HioProcess, free_port, hio_env, wait_for

pytestmark = pytest.mark.slow

PARENT = """
import json, sys, time
from pathlib import Path
from hio.cluster import LocalCluster
from hio.process.procs import children

root, worker_id, runtime = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
try:
    with LocalCluster(root) as cluster:
        cluster.add_worker(worker_id, ["hio/synthetic=2"], runtime=runtime, args=["--grace-seconds", "1"])
        live = {name: proc for name, proc in cluster.procs.items() if proc.alive()}
        roles = {name: proc.pid for name, proc in live.items()}
        engines = [pid for proc in live.values() if proc.command == "worker" for pid in children(proc.pid)]
        print(json.dumps({"roles": roles, "engines": engines}), flush=True)
        # short sleeps: a SIGINT that lands between the print and a sleep's system call (the test
        # sends it as soon as it reads the line) is only noticed when Python next checks for
        # signals, which one long sleep would put off for its whole length
        for _ in range(6000):
            time.sleep(0.1)
except KeyboardInterrupt:
    print(json.dumps({"problems": cluster.problems}), flush=True)
"""

#: What the cluster's stop may take: three roles, each SIGKILLed after the builder's 20 s.
STOP_BOUND = 3 * 20 + 15


def _line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The next line ``proc`` prints, or AssertionError after ``timeout``."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"the parent printed nothing in {timeout:.0f} s")
    return proc.stdout.readline()


def _running(pid: int) -> bool:
    """``pid`` is a live `hio` process (not gone, not a zombie, not a new process with its number)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and b"hio.cli" in cmdline


def start_parent(
    tmp_path: Path,
    worker_id: str = "orphan-check",
    runtime: str = "process",
) -> tuple[subprocess.Popen[str], dict[str, list[int]]]:
    """A process that starts a cluster with a worker of two ``hio/synthetic`` engines; it and
    the pids of the cluster's roles and (process) engines."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "cluster"), worker_id, runtime],
        cwd=tmp_path,
        env=hio_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = _line(parent, 150)
        started = json.loads(line)
    except BaseException:
        parent.kill()
        parent.wait()
        raise
    pids = {"roles": list(started["roles"].values()), "engines": started["engines"]}
    assert len(pids["roles"]) == 3 and len(pids["engines"]) == (2 if runtime == "process" else 0), line
    assert all(_running(pid) for group in pids.values() for pid in group)
    return parent, pids


def still_running(pids: dict[str, list[int]]) -> list[int]:
    return [pid for group in pids.values() for pid in group if _running(pid)]


def all_gone(pids: dict[str, list[int]], timeout: float) -> None:
    wait_for(
        lambda: not still_running(pids),
        timeout=timeout,
        interval=0.1,
        what=lambda: f"every role and engine to go; still running: {still_running(pids)}",
    )


def test_roles_and_engines_die_when_their_starter_is_killed(tmp_path: Path) -> None:
    parent, pids = start_parent(tmp_path)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    try:
        all_gone(pids, 10)
    finally:  # never leave them behind, even when the lifeline failed
        for pid in still_running(pids):
            os.kill(pid, signal.SIGKILL)


def role_logs(tmp_path: Path, limit: int = 2000) -> str:
    """The end of each role's log of the cluster ``start_parent`` started (for a failure's message)."""
    logs = sorted((tmp_path / "cluster" / "logs").glob("*.log"))
    return "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-limit:]}" for log in logs)


def test_ctrl_c_stops_the_cluster_cleanly(tmp_path: Path) -> None:
    parent, pids = start_parent(tmp_path)
    parent.send_signal(signal.SIGINT)
    try:
        try:
            report = json.loads(_line(parent, STOP_BOUND))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; still running: {still_running(pids)}\n{role_logs(tmp_path)}") from None
        assert report == {"problems": []}, report
        assert parent.wait(10) == 0
        all_gone(pids, 5)
    finally:
        parent.kill()
        parent.wait()


INTERRUPTED_SESSION = """
import json, os, signal
from pathlib import Path

import pytest

from tests.harness import cluster_engines, local_cluster

REPORT = Path(os.environ["REPORT"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = local_cluster(tmp_path_factory.mktemp("c"), workers={"w": ["hio/synthetic=1"]})
    try:
        with c:
            roles = [proc.pid for proc in c.procs.values() if proc.alive()]
            REPORT.write_text(json.dumps({"roles": roles, "engines": cluster_engines(c)}))
            os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C while the fixture is being set up
            yield c
    finally:
        REPORT.with_suffix(".stopped").write_text(json.dumps(c.problems))


def test_never_runs(cluster):
    raise AssertionError("the session was interrupted before")
"""


CHECKOUT = str(Path(__file__).resolve().parents[2])  # where `tests.harness` is imported from


def test_a_test_session_interrupted_while_starting_a_cluster_stops_it(tmp_path: Path) -> None:
    (tmp_path / "test_interrupted.py").write_text(INTERRUPTED_SESSION)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "pids.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(tmp_path / "pytest.ini"),
            str(tmp_path / "test_interrupted.py"),
        ],
        cwd=tmp_path,
        env={**hio_env(), "REPORT": str(report), "PYTHONPATH": CHECKOUT},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "KeyboardInterrupt" in run.stdout + run.stderr, run.stdout + run.stderr
    pids = json.loads(report.read_text())
    assert len(pids["roles"]) == 3 and len(pids["engines"]) == 1, pids
    assert json.loads(report.with_suffix(".stopped").read_text()) == [], "every role stopped cleanly"
    all_gone(pids, 1)


def test_a_role_started_from_a_thread_outlives_the_thread(tmp_path: Path) -> None:
    """The kernel's signal follows the thread that started a child: a role a test's thread
    starts (the fault test restarts roles from one) must not die when that thread ends."""
    address = f"127.0.0.1:{free_port()}"
    started: list[HioProcess] = []

    def start() -> None:  # and live on until the role asked for its death signal (it serves by then)
        started.append(HioProcess("master", ["--listen", address, "--data-dir", str(tmp_path)], tmp_path).start())
        started[0].wait_started(address)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    [master] = started
    try:
        time.sleep(0.5)
        master.wait_started(address)
        assert master.alive()
    finally:
        assert master.stop() == 0, master.output()
