"""`hio bench-floor`: the least any design can do with a large tuple on this machine.

The benchmark's bound, min(loopback bandwidth / size, slots / cost), counts
what one TCP stream moves from one buffer to another and nothing else. A
system that keeps our guarantees has more to do with each tuple, whatever it
is written in: the generator builds the message; the gateway computes its
CRC-32 and appends it to a durable spool (fsynced about every 100 ms, as the
gateway's 'batch' policy) before it goes anywhere; the kernel moves it to the
engine, which reads it into a buffer of its own and checks the CRC.

This command does exactly those steps and nothing else (no RPC, no master,
no repository, no features): the spool is the gateway's own, and a tuple is
finished, as a receipt would finish it, once sent; the rest is bare system
calls. One sender process has a thread per stream, each to a receiver
process of its own (as two engines); it prints what they reach as a
fraction of the loopback bound, with the CPU each tuple cost. The path
'memory' leaves the spool out, to show what durability costs.
Nothing that keeps the spool can beat the 'spool' row on this machine, so it
is the yardstick for the 'at least 50% of the loopback bound' target.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from benchmarks.measure import loopback_bandwidth, proc_cpu_seconds
from hio.config import ConfigError, setting, size_setting
from hio.gateway.spool import Spool
from hio.proto.tuple_pb2 import TupleMeta
from hio.settings import MiB
from hio.storage.files import write_all
from hio.transport.frames import crc32

PATHS = ("memory", "spool")
HEADER_BYTES = 16  # the generator's per-message part (a sequence number and a time)


@dataclasses.dataclass(frozen=True)
class FloorConfig:
    sizes: tuple[str, ...] = setting(None, "tuple sizes to measure", factory=lambda: ("1M", "10M"))
    seconds: float = setting(4.0, "time to stream each size on each path")
    streams: int = setting(2, "sender threads, each to a receiver process of its own (as two engines)")
    paths: tuple[str, ...] = setting(
        None, "'memory' (no spool) and/or 'spool' (durable, as the gateway's)", factory=lambda: PATHS
    )
    data_dir: str = setting("./var", "folder for the spool segments (a subfolder bench-floor is used)")
    disk_probe: str = setting("512M", "bytes to write and fdatasync there first, to measure the disk (0: skip)")
    log_level: str = setting("warning", "log level")
    log_json: bool = setting(False, "log as JSON")

    def validate(self) -> None:
        unknown = sorted(set(self.paths) - set(PATHS))
        if unknown:
            raise ConfigError(f"paths must be memory or spool, got {', '.join(unknown)}")
        if not self.paths:
            raise ConfigError("paths: give at least one of memory, spool")
        if not 0 < self.seconds <= 600:
            raise ConfigError(f"seconds must be between 0 and 600, got {self.seconds}")
        if not 1 <= self.streams <= 16:
            raise ConfigError(f"streams must be between 1 and 16, got {self.streams}")
        if size_setting("disk_probe", self.disk_probe) < 0:
            raise ConfigError(f"disk_probe must be 0 or more bytes, got {self.disk_probe!r}")
        for text in self.sizes:
            if size_setting("sizes", text) <= HEADER_BYTES:
                raise ConfigError(f"sizes: {text!r} is too small; a tuple here is more than {HEADER_BYTES} bytes")


@dataclasses.dataclass(frozen=True)
class FloorResult:
    size: int
    path: str
    tuples: int
    seconds: float
    cpu_seconds: float  # every process of the run: sender (with its fsync thread) and receivers

    @property
    def bytes_per_s(self) -> float:
        return self.tuples * self.size / self.seconds

    @property
    def cpu_ms_per_tuple(self) -> float:
        return self.cpu_seconds * 1000 / max(self.tuples, 1)


def receive(port: int, size: int) -> None:
    """An engine at its least: each tuple read into a fresh buffer, its CRC checked."""
    with socket.create_connection(("127.0.0.1", port)) as sock, sock.makefile("rb") as reader:
        while len(data := reader.read(size)) == size:
            crc32(data)


def stream(size: int, path: str, seconds: float, streams: int, root: Path) -> FloorResult:
    """One size on one path: build, CRC, (spool,) send; receivers read and check."""
    body = os.urandom(size - HEADER_BYTES)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(streams)
    context = multiprocessing.get_context("fork")
    receivers = [
        context.Process(target=receive, args=(server.getsockname()[1], size), daemon=True) for _ in range(streams)
    ]
    for proc in receivers:
        proc.start()
    pids = [proc.pid for proc in receivers if proc.pid is not None]  # all of them: started
    conns = [server.accept()[0] for _ in range(streams)]
    server.close()
    spool = _fresh_spool(root / "spool") if path == "spool" else None
    counts = [0] * streams
    cpu_before = proc_cpu_seconds(os.getpid()) + sum(proc_cpu_seconds(pid) for pid in pids)
    start = time.monotonic()
    stop = start + seconds

    def send(i: int, conn: socket.socket) -> None:
        seq = 0
        while time.monotonic() < stop:
            message = seq.to_bytes(8, "little") + time.time_ns().to_bytes(8, "little") + body
            if spool is None:
                crc32(message)
                conn.sendall(message)
            else:
                entry = spool.put_bytes(message, TupleMeta(name=f"{i}-{seq}"), timeout=None)  # and its CRC
                with spool.open_payload(entry) as fh:
                    conn.sendfile(fh, entry.offset, size)
                spool.remove_many([entry])
            seq += 1
        counts[i] = seq

    threads = [threading.Thread(target=send, args=(i, conn)) for i, conn in enumerate(conns)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if spool is not None:
        spool.close()  # the last fsync belongs to the run: it is the promise the spool makes
        shutil.rmtree(spool.root)
    for conn in conns:
        conn.shutdown(socket.SHUT_WR)
    cpu_receivers = 0.0
    for pid, conn in zip(pids, conns, strict=True):
        conn.recv(1)  # the receiver closes once it has read everything
        cpu_receivers += proc_cpu_seconds(pid)
        conn.close()
    elapsed = time.monotonic() - start
    cpu = proc_cpu_seconds(os.getpid()) + cpu_receivers - cpu_before
    for proc in receivers:
        proc.join(10)
    return FloorResult(size, path, sum(counts), elapsed, cpu)


def _fresh_spool(root: Path) -> Spool:
    """The gateway's spool with its default policy ('batch'), empty, keeping no payload in memory
    (a tuple is sent from its spooled copy, as a large one is)."""
    shutil.rmtree(root, ignore_errors=True)
    return Spool(root, 4096 * MiB, fsync="batch", memory_bytes=0)


def disk_write_bandwidth(root: Path, total: int, block: int = 4 * 1024 * 1024) -> float:
    """Bytes/s written to ``root``'s file system and made durable with ``fdatasync``: a durable
    spool's other ceiling, which the loopback bound leaves out (also `hio bench`'s bursts' bound)."""
    target = root / "disk-probe"
    data = os.urandom(block)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start = time.monotonic()
        for done in range(0, total, block):
            write_all(fd, memoryview(data)[: min(block, total - done)])
        os.fdatasync(fd)
        return total / (time.monotonic() - start)
    finally:
        os.close(fd)
        target.unlink()


def run_floor(config: FloorConfig) -> int:
    root = Path(config.data_dir).expanduser().resolve() / "bench-floor"
    root.mkdir(parents=True, exist_ok=True)
    bound = loopback_bandwidth()
    probe = size_setting("disk_probe", config.disk_probe)
    disk = f"{disk_write_bandwidth(root, probe) / 1e6:,.0f} MB/s" if probe else "not measured"
    print(
        f"loopback bandwidth (one TCP stream): {bound / 1e6:,.0f} MB/s; disk, written and fdatasynced: {disk}; "
        f"{os.cpu_count()} cores; {config.streams} streams",
        flush=True,
    )
    print(
        f"{'size':>8} {'path':>7} {'tuples':>7} {'seconds':>8} {'tuples/s':>9} {'MB/s':>8} {'of bound':>8}"
        f" {'CPU ms/tuple':>12} {'cores':>6}",
        flush=True,
    )
    for text in config.sizes:
        size = size_setting("sizes", text)
        for path in config.paths:
            r = stream(size, path, config.seconds, config.streams, root)
            print(
                f"{text:>8} {path:>7} {r.tuples:>7} {r.seconds:>8.2f} {r.tuples / r.seconds:>9.1f}"
                f" {r.bytes_per_s / 1e6:>8.1f} {r.bytes_per_s / bound:>8.1%} {r.cpu_ms_per_tuple:>12.2f}"
                f" {r.cpu_seconds / r.seconds:>6.2f}",
                flush=True,
            )
    return 0
