"""CPU per thread of the running hio processes over a window: which thread of which role
spends the CPU a tuple costs.

    python -m benchmarks.thread_cpu 20     # from a checkout, while `hio bench-core ...` runs

Reads utime+stime of every thread from /proc/<pid>/task/*/stat at the start
and the end of the window, and names the threads with `py-spy dump` (their
Python name and top frames). Threads that start and end inside the window
(short-lived stream threads) are not listed, but their CPU is in the
process's total line. Linux only; py-spy must be on PATH or in .venv/bin.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.measure import proc_cpu_seconds

ROLE = re.compile(r"hio(?:\.cli)? (bench-core|bench|up|gateway|master|repository|engine|worker|kd)\b")


def hio_processes() -> dict[int, str]:
    """pid -> role of every `hio <role>` process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        match = ROLE.search(args)
        if match and not args.startswith("timeout"):
            found[int(entry.name)] = match.group(1)
    return found


def thread_seconds(pid: int) -> dict[int, float]:
    """tid -> CPU seconds (user + system) so far."""
    return {int(task.name): proc_cpu_seconds(pid, int(task.name)) for task in Path(f"/proc/{pid}/task").iterdir()}


def thread_names(pid: int) -> dict[int, str]:
    """tid -> 'python name | top frames', from py-spy (empty without it)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists() and not shutil.which(spy):
        return {}
    dump = subprocess.run(
        [spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, check=False
    ).stdout
    names = {}
    for match in re.finditer(r'Thread (\S+) \((\w+)\): "([^"]*)"\n((?:\s+.*\n){0,2})', dump):
        try:
            tid = int(match.group(1), 16) if match.group(1).startswith("0x") else int(match.group(1))
        except ValueError:
            continue
        frames = " / ".join(line.strip() for line in match.group(4).splitlines())
        names[tid] = f"{match.group(3)} | {frames}"
    return names


def main(window: float) -> None:
    processes = hio_processes()
    if not processes:
        sys.exit("no hio processes running")
    names = {pid: thread_names(pid) for pid in processes}
    before = {pid: (proc_cpu_seconds(pid), thread_seconds(pid)) for pid in processes}
    time.sleep(window)
    for pid, role in processes.items():
        try:
            total, threads = proc_cpu_seconds(pid), thread_seconds(pid)
        except OSError:
            continue
        print(f"== {role} {pid}: {(total - before[pid][0]) / window * 1000:.1f} ms of CPU per s")
        rows = sorted(((spent - before[pid][1].get(tid, 0), tid) for tid, spent in threads.items()), reverse=True)
        for spent, tid in rows[:8]:
            if spent:
                print(f"   {spent / window * 1000:7.1f} ms/s  tid {tid}  {names[pid].get(tid, '?')[:140]}")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0)
