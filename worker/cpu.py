"""How much CPU an engine has used, and wanted: what the master's profile of each image is
built from (docs/elasticity.md, "The loop": why the wait counts too).

A process engine's CPU time is that of its process tree (the engine, its threads,
whatever its pipeline starts): user and system time of every live process, plus what
the kernel charged each for children it waited for (``cutime``/``cstime``), from
``/proc``. A container's is its cgroup's counter (v2 ``cpu.stat``, or v1
``cpuacct.usage``). The wait is the scheduler's run delay of the threads
(``/proc/<pid>/task/<tid>/schedstat``; for a container, of the processes under its
main process, which the host sees).

All are cumulative seconds since the engine started; the master turns the
differences between heartbeats into a share of a core. A value can drop when a
process of the tree ends without being waited for: the master takes a drop as a
new start and only uses the next difference.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from hio.process.procs import children, read_proc

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_TREE = 4096  # processes counted in one tree: a fork bomb must not stall the heartbeat


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process (all its threads) and of the children it
    waited for; None when it is gone."""
    try:
        stat = read_proc(f"/proc/{pid}/stat")
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()  # the command name may hold spaces and parentheses
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return (utime + stime + cutime + cstime) / _TICKS


@dataclasses.dataclass(frozen=True)
class CpuUsage:
    """An engine's cumulative CPU seconds, and seconds its threads waited for a CPU."""

    cpu_seconds: float
    wait_seconds: float | None = None  # None: the scheduler's figures cannot be read here


def process_wait_seconds(pid: int) -> float | None:
    """Seconds the threads of one process spent runnable but waiting for a CPU; None when
    the kernel does not say (no schedstat) or the process is gone."""
    total = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        try:
            fields = read_proc(f"/proc/{pid}/task/{task}/schedstat").split()
        except OSError:  # the thread ended meanwhile, or no schedstat in this kernel
            continue
        if len(fields) >= 2:
            total += int(fields[1]) / 1e9
    return total


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live process under it (at most :data:`MAX_TREE`)."""
    found, pending, seen = [pid], children(pid), {pid}
    while pending and len(seen) < MAX_TREE:
        child = pending.pop()
        if child in seen:
            continue
        seen.add(child)
        found.append(child)
        pending += children(child)
    return found


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of ``pid`` and every live process under it; None when ``pid`` is gone."""
    usage = tree_usage(pid)
    return None if usage is None else usage.cpu_seconds


def tree_usage(pid: int) -> CpuUsage | None:
    """CPU and wait seconds of ``pid``'s process tree; None when ``pid`` is gone."""
    own = process_cpu_seconds(pid)
    if own is None:
        return None
    members = process_tree(pid)  # pid first
    cpu = sum((process_cpu_seconds(member) or 0.0 for member in members[1:]), own)
    return CpuUsage(cpu_seconds=cpu, wait_seconds=tree_wait_seconds(pid, members))


def tree_wait_seconds(pid: int, members: list[int] | None = None) -> float | None:
    """Seconds the threads of ``pid``'s process tree (``members``, when already listed) waited
    for a CPU; None when unknown."""
    waits = [waited for member in members or process_tree(pid) if (waited := process_wait_seconds(member)) is not None]
    return sum(waits) if waits else None


def cgroup_of(pid: int) -> Path | None:
    """The folder of ``pid``'s cgroup that holds its CPU counter (v2, else v1 cpuacct);
    None when /proc or the cgroup folder cannot tell."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2)[1:] for line in lines]  # (controllers, path)
    for controllers, path in entries:
        if controllers == "" and (CGROUP_ROOT / path.lstrip("/") / "cpu.stat").is_file():
            return CGROUP_ROOT / path.lstrip("/")
    for controllers, path in entries:
        if "cpuacct" in controllers.split(","):
            for mount in ("cpuacct", "cpu,cpuacct", "cpuacct,cpu"):
                folder = CGROUP_ROOT / mount / path.lstrip("/")
                if (folder / "cpuacct.usage").is_file():
                    return folder
    return None


def container_cgroup(container_id: str, pid: int = 0) -> Path | None:
    """The cgroup folder of a Docker container: from its main process's /proc entry when
    that pid is known, else the places the systemd and cgroupfs drivers put it."""
    if pid > 0 and (found := cgroup_of(pid)) not in (None, CGROUP_ROOT):
        return found
    candidates = (
        CGROUP_ROOT / "system.slice" / f"docker-{container_id}.scope",
        CGROUP_ROOT / "docker" / container_id,
        CGROUP_ROOT / "cpuacct" / "docker" / container_id,
        CGROUP_ROOT / "cpu,cpuacct" / "docker" / container_id,
        CGROUP_ROOT / "cpuacct" / "system.slice" / f"docker-{container_id}.scope",
    )
    for folder in candidates:
        if (folder / "cpu.stat").is_file() or (folder / "cpuacct.usage").is_file():
            return folder
    return None


def cgroup_cpu_seconds(folder: Path) -> float | None:
    """CPU seconds a cgroup has used (every process in it, ever); None when it is gone."""
    try:
        if (folder / "cpu.stat").is_file():
            for line in (folder / "cpu.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "usage_usec":
                    return int(value) / 1e6
            return None
        return int((folder / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return None
