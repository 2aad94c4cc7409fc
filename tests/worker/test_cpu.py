"""An engine's CPU time: its whole process tree (threads, children, waited-for children),
or its container's cgroup counter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from hio.process.procs import children
from hio.worker.cpu import cgroup_cpu_seconds, process_cpu_seconds, tree_cpu_seconds, tree_usage

# A parent that burns 0.2 s of CPU in a thread and starts a child that burns 0.3 s, then
# waits for a line: "reap" makes it kill and wait for the child, "exit" ends it.
PARENT = """
import subprocess, sys, threading, time
def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
thread = threading.Thread(target=burn, args=(0.2,))
thread.start(); thread.join()
child.stdout.readline()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "reap":
        child.kill(); child.wait()
        print("reaped", flush=True)
    else:
        break
"""
CHILD = """
import time
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("burnt", flush=True)
time.sleep(600)
"""


def test_a_process_tree_counts_its_threads_and_children_live_and_waited_for() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", f"CHILD = {CHILD!r}\n{PARENT}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        own = process_cpu_seconds(proc.pid)
        tree = tree_cpu_seconds(proc.pid)
        assert own is not None and tree is not None
        assert own >= 0.2  # the thread's work is the process's
        assert tree >= own + 0.3  # the live child's work is the tree's
        proc.stdin.write("reap\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "reaped"
        reaped = tree_cpu_seconds(proc.pid)
        assert reaped is not None and reaped >= tree - 0.05  # a child waited for stays counted (cutime)
    finally:
        proc.kill()
        proc.wait()
    assert tree_cpu_seconds(proc.pid) is None


def test_cgroup_counters_are_read_in_v2_and_v1_form(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpuacct.usage").write_text("1500000000\n")
    assert cgroup_cpu_seconds(v2) == 2.5
    assert cgroup_cpu_seconds(v1) == 1.5
    assert cgroup_cpu_seconds(tmp_path / "gone") is None


def test_processes_that_wait_for_a_cpu_are_counted_as_waiting() -> None:
    # Three busy children of one process with one core between them (taskset, inherited):
    # while one runs, the others are ready and wait for the core.
    script = """
import subprocess, sys
burn = (
    "import time\\nend = time.process_time() + 0.3\\n"
    "while time.process_time() < end: pass\\nprint(1, flush=True)\\ninput()"
)
kids = [subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(3)]
for kid in kids:
    kid.stdout.readline()
print("done", flush=True)
input()
"""
    proc = subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "done"
        usage = tree_usage(proc.pid)
        assert usage is not None and usage.wait_seconds is not None
        assert usage.cpu_seconds >= 0.9
        assert usage.wait_seconds >= 0.3  # three on one core: while one runs, two wait
    finally:
        for pid in children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


# A parent with one sleeping child whose threads start and end all the time.
CHURNING_PARENT = """
import subprocess, sys, threading
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
while True:
    threads = [threading.Thread(target=lambda: None) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
"""


def test_a_process_keeps_its_children_while_its_threads_come_and_go() -> None:
    """A thread that ends between the listing of the process's threads and the reading of its
    children file does not hide the process's children."""
    proc = subprocess.Popen([sys.executable, "-c", CHURNING_PARENT], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = 0
    try:
        child = int(proc.stdout.readline())
        seen = [children(proc.pid) for _ in range(3000)]
        assert all(found == [child] for found in seen), f"{sum(found != [child] for found in seen)} of 3000 missed it"
    finally:
        proc.kill()
        proc.wait()
        if child:
            os.kill(child, signal.SIGKILL)
