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

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
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


def thread_ticks(pid: int) -> dict[int, int]:
    """tid -> CPU clock ticks (user + system) so far."""
    ticks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])
    return ticks


def process_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


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
    before = {pid: (process_ticks(pid), thread_ticks(pid)) for pid in processes}
    time.sleep(window)
    for pid, role in processes.items():
        try:
            total, threads = process_ticks(pid), thread_ticks(pid)
        except OSError:
            continue
        print(f"== {role} {pid}: {(total - before[pid][0]) / HZ / window * 1000:.1f} ms of CPU per s")
        rows = sorted(((ticks - before[pid][1].get(tid, 0), tid) for tid, ticks in threads.items()), reverse=True)
        for ticks, tid in rows[:8]:
            if ticks:
                print(f"   {ticks / HZ / window * 1000:7.1f} ms/s  tid {tid}  {names[pid].get(tid, '?')[:140]}")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0)
