"""Measurements of this machine and of running processes, shared by the benchmarks:
the loopback bound, and what a process uses (/proc; Linux only)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hio.cluster import LocalCluster


def role_pids(cluster: LocalCluster) -> dict[str, int]:
    """The pids of a cluster's running roles, by name."""
    return {name: proc.pid for name, proc in cluster.procs.items() if proc.alive()}


def worker_processes(root: Path) -> dict[str, int]:
    """Every live ``hio worker`` process whose data folder is ``root`` (a cluster's own and those
    its master's local provisioner started): worker id -> pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or b"hio.cli" not in argv or b"worker" not in argv or str(root).encode() not in argv:
            continue
        named = argv.index(b"--worker-id") + 1 if b"--worker-id" in argv else 0
        found[argv[named].decode() if named else f"{socket.gethostname()}-{entry.name}"] = int(entry.name)
    return found


def loopback_bandwidth(seconds: float = 1.0, block: int = 1 << 20) -> float:
    """Bytes/s one TCP stream moves over loopback (sender and receiver threads)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    received = [0]

    def receive() -> None:
        conn, _ = server.accept()
        buf = bytearray(block)
        while (n := conn.recv_into(buf)) > 0:
            received[0] += n
        conn.close()

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    sender = socket.create_connection(("127.0.0.1", port))
    payload = os.urandom(block)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        sender.sendall(payload)
    sender.close()
    thread.join()
    elapsed = time.perf_counter() - start
    server.close()
    return received[0] / elapsed


@dataclasses.dataclass(frozen=True)
class Usage:
    """What one role uses at one moment (summed over its processes)."""

    rss_kib: int
    fds: int
    threads: int
    processes: int


def proc_usage(pid: int) -> Usage | None:
    """RSS, open files and threads of ``pid``; None when it is gone."""
    try:
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.strip()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return Usage(
        rss_kib=int(fields.get("VmRSS", "0 kB").split()[0]),
        fds=fds,
        threads=int(fields.get("Threads", "0")),
        processes=1,
    )


def proc_cpu_seconds(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) ``pid`` (or its thread ``tid``) has used; 0 when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def total(usages: list[Usage | None]) -> Usage:
    alive = [u for u in usages if u is not None]
    return Usage(
        rss_kib=sum(u.rss_kib for u in alive),
        fds=sum(u.fds for u in alive),
        threads=sum(u.threads for u in alive),
        processes=len(alive),
    )


def machine_description() -> str:
    """What a run measured on, for the results file: CPU model, architecture, cores, memory,
    and whether it is a virtual machine (the ``hypervisor`` CPU flag)."""
    import platform

    model, virtual = "", False
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and "hypervisor" in value.split():
                virtual = True
    except OSError:
        pass
    memory = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f", {int(line.split()[1]) / 2**20:.0f} GiB"
                break
    except (OSError, ValueError, IndexError):
        pass
    cpu = " ".join(part for part in (model, platform.machine()) if part) or "unknown CPU"
    return f"{cpu}, {os.cpu_count()} cores{memory}{', virtual machine' if virtual else ''}"


def source_commit(root: Path | None = None) -> str:
    """The commit of the checkout the benchmark runs from (short hash), with ``+changes`` when
    files other than the documentation differ from it; empty outside a git checkout."""
    import subprocess

    root = root or Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return ""
        changed = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)docs",
                ":(exclude)*.md",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")
