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
import time
from pathlib import Path

import pytest

from tests.harness import hio_env, wait_for

pytestmark = pytest.mark.slow

PARENT = """
import json, sys, time
from pathlib import Path
from hio.cluster import LocalCluster

try:
    with LocalCluster(Path(sys.argv[1])) as cluster:
        cluster.add_worker("orphan-check", ["hio/synthetic=2"], args=["--grace-seconds", "1"])
        print(json.dumps({"roles": cluster.pids(), "engines": cluster.engine_pids()}), flush=True)
        time.sleep(600)
except KeyboardInterrupt:
    print(json.dumps({"problems": cluster.problems}), flush=True)
"""


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


def _start_parent(tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, list[int]]]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path / "cluster")], cwd=tmp_path,
                              env=hio_env(), stdout=subprocess.PIPE, text=True)
    try:
        line = _line(parent, 150)
        started = json.loads(line)
    except BaseException:
        parent.kill()
        parent.wait()
        raise
    pids = {"roles": list(started["roles"].values()), "engines": started["engines"]}
    assert len(pids["roles"]) == 3 and len(pids["engines"]) == 2, line
    assert all(_running(pid) for group in pids.values() for pid in group)
    return parent, pids


def _still_running(pids: dict[str, list[int]]) -> list[int]:
    return [pid for group in pids.values() for pid in group if _running(pid)]


def _all_gone(pids: dict[str, list[int]], timeout: float) -> None:
    wait_for(lambda: not _still_running(pids), timeout=timeout, interval=0.1,
             what=lambda: f"every role and engine to go; still running: {_still_running(pids)}")


def test_roles_and_engines_die_when_their_starter_is_killed(tmp_path: Path) -> None:
    parent, pids = _start_parent(tmp_path)
    started = time.monotonic()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    try:
        _all_gone(pids, 10)
    finally:   # never leave them behind, even when the lifeline failed
        for pid in _still_running(pids):
            os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - started < 10


def test_ctrl_c_stops_the_cluster_cleanly(tmp_path: Path) -> None:
    parent, pids = _start_parent(tmp_path)
    parent.send_signal(signal.SIGINT)
    try:
        report = json.loads(_line(parent, 60))
        assert report == {"problems": []}, report
        assert parent.wait(10) == 0
        _all_gone(pids, 5)
    finally:
        parent.kill()
        parent.wait()
