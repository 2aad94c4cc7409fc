"""`hio bench-core`: throughput and CPU cost of the streaming core on this machine.

Starts a repository, a master and a worker with synthetic engines, then
streams N tuples of each size through a gateway, directly to the channels and
forced through the backlog queue, and prints tuples/s and MB/s from the first
submit until every tuple's features are stored, and the CPU each role spent
per tuple (from ``/proc``; the gateway is this process). N is what takes about
``--seconds``: where the loopback bound allows more than ``CALIBRATION_TUPLES``
in that time (small tuples), a first run of that many, not reported, measures
the rate N is taken from (and warms the roles up). By default the
tuples are submitted all at once and cost nothing to process; ``--rate``
paces them and ``--cost-ms`` makes each burn CPU, which shows what a tuple
costs at moderate rates, where batches are small. Also prints the loopback
bound of this machine for reference.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Self, TypeVar

from benchmarks.measure import loopback_bandwidth, role_pids
from hio.config import ConfigError, between, positive, setting, size_setting
from hio.settings import ClusterSettings


@dataclasses.dataclass(frozen=True)
class CoreBenchConfig(ClusterSettings):
    sizes: tuple[str, ...] = setting(None, "tuple sizes to measure", factory=lambda: ("1M", "10M"))
    seconds: float = setting(10.0, "approximate time to spend per measurement")
    max_tuples: int = setting(300_000, "at most this many tuples per measurement")
    engines: int = setting(2, "synthetic engines on the worker")
    streams: int = setting(4, "gateway delivery streams")
    modes: tuple[str, ...] = setting(None, "paths to measure", factory=lambda: ("direct", "queue"))
    rate: float = setting(0.0, "tuples per second to offer, paced; 0 = submit them all at once")
    cost_ms: float = setting(0.0, "milliseconds of CPU each tuple burns in its engine")
    secure: bool = setting(
        False,
        "a secure cluster: mutual TLS on every connection, lanes included (a CA and "
        "certificates made in the data dir), and a token checked on every call",
    )
    lanes: bool = setting(
        True, "payloads over the payload lanes; off: gRPC chunks only (the gateway, master and worker)"
    )
    scrape_seconds: float = setting(
        1.0,
        "with metrics on: read every role's /metrics this often while measuring, as a Prometheus "
        "server would (its default is every 15 to 60 s); 0 = never",
    )

    def validate(self) -> None:
        self.validate_cluster()
        positive("seconds", self.seconds)
        between("max_tuples", self.max_tuples, 1)
        between("engines", self.engines, 1, 1024)
        between("streams", self.streams, 1, 256)
        if not self.rate >= 0:
            raise ConfigError(f"rate must be 0 (all at once) or positive, got {self.rate}")
        if not 0 <= self.cost_ms <= 60_000:
            raise ConfigError(f"cost_ms must be between 0 and 60000, got {self.cost_ms}")
        if not self.scrape_seconds >= 0:
            raise ConfigError(f"scrape_seconds must be 0 (never) or positive, got {self.scrape_seconds}")
        for text in self.sizes:
            if size_setting("sizes", text) <= 0:
                raise ConfigError(f"sizes: {text!r} is not a size of one byte or more")
        unknown = sorted(set(self.modes) - {"direct", "queue"})
        if unknown:
            raise ConfigError(f"modes must be direct or queue, got {', '.join(unknown)}")


Secured = TypeVar("Secured", bound=ClusterSettings)

# Tuples of the first, unreported run that measures the rate small tuples' count is taken
# from: their bound-based count would be far too many, and a run this short too noisy.
CALIBRATION_TUPLES = 2000


def tuple_count(config: CoreBenchConfig, size: int, measured_rate: float = 0.0) -> int:
    """Tuples of ``size`` bytes that take about ``config.seconds``: at the paced rate; else at
    ``measured_rate`` (tuples/s of a calibration run); else at 400 MB/s, a loopback bound.
    At least 8, at most ``max_tuples``."""
    rate = config.rate or measured_rate or 400e6 / max(size, 1)
    return max(8, min(config.max_tuples, int(config.seconds * rate)))


def needs_calibration(config: CoreBenchConfig, count: int) -> bool:
    """Whether ``count``, a bound-based :func:`tuple_count`, is more than a calibration run's:
    then the tuples are too small for the bound to say how many take ``seconds``."""
    return config.rate <= 0 and count > CALIBRATION_TUPLES


def measure(config: CoreBenchConfig, data_dir: Path, size: int, mode: str, count: int) -> dict[str, Any]:
    """Stream ``count`` tuples of ``size`` bytes; tuples/s and MB/s until all are stored."""
    from hio.gateway import Gateway

    payload = os.urandom(size)
    attributes = {"cost_ms": f"{config.cost_ms:g}"}
    started = time.perf_counter()
    with Gateway(
        master_address=config.master_address,
        repository_address=config.repository_address,
        data_dir=str(data_dir / f"gw-{mode}-{size}"),
        source=f"bench-{mode}",
        chunk_bytes=config.chunk_bytes,
        streams=config.streams,
        progress=False,
        force_queue=(mode == "queue"),
        token=config.token,
        token_file=config.token_file,
        tls_ca=config.tls_ca,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
        lanes=config.lanes,
    ) as gateway:
        futures = []
        for i in range(count):
            if config.rate > 0 and (wait := started + i / config.rate - time.perf_counter()) > 0:
                time.sleep(wait)
            futures.append(gateway.submit(payload, image="hio/synthetic", name=f"t{i}", attributes=attributes))
        for future in futures:
            future.result(timeout=600)
    elapsed = time.perf_counter() - started  # a STORED receipt means the features are stored
    queued = sum(future.outcome != "stored" for future in futures)
    _wait_done(config, mode, count)  # the master's count, so the next measurement starts from it
    if queued:  # an ENQUEUED receipt does not (direct too: no channel was free): done once the master counts it
        elapsed = time.perf_counter() - started
    return {
        "size": size,
        "mode": mode,
        "tuples": count,
        "queued": queued,
        "seconds": elapsed,
        "tuples_per_s": count / elapsed,
        "mb_per_s": count * size / elapsed / 1e6,
    }


def role_cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each role has used so far: the gateway is this process, the engines
    are the worker's children."""
    from benchmarks.measure import proc_cpu_seconds
    from hio.process.procs import children

    usage = {"gateway": proc_cpu_seconds(os.getpid())}
    for role, pid in pids.items():
        usage[role] = proc_cpu_seconds(pid)
        if role == "worker":
            usage["engines"] = sum(proc_cpu_seconds(child) for child in children(pid))
    return usage


def cpu_per_tuple(before: dict[str, float], after: dict[str, float], tuples: int) -> str:
    """'gateway 0.14, engines 0.14, ... (total 0.41) ms CPU per tuple'."""
    roles = ("gateway", "engines", "master", "repository", "worker")
    per = {role: (after.get(role, 0.0) - before.get(role, 0.0)) * 1000 / max(tuples, 1) for role in roles}
    parts = ", ".join(f"{role} {per[role]:.2f}" for role in roles)
    return f"{parts} (total {sum(per.values()):.2f}) ms CPU per tuple"


def role_disk_bytes(pids: dict[str, int]) -> dict[str, int]:
    """Bytes each durable role has sent, or will send, to its disk so far: ``write_bytes``
    less ``cancelled_write_bytes`` of /proc/<pid>/io (pages dirtied, less those dropped
    unwritten by a truncate or delete). Shows what a 'batch' fsync policy spares the disk."""
    written = {}
    for role, pid in {"gateway": os.getpid(), **pids}.items():
        try:
            fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
            continue
        written[role] = int(fields["write_bytes"]) - int(fields["cancelled_write_bytes"])
    return written


def disk_per_tuple(before: dict[str, int], after: dict[str, int], tuples: int, size: int) -> str:
    """'disk: gateway 0.2, master 9.8, repository 0.0 MB written per tuple of 10.0 MB'."""
    roles = [role for role in ("gateway", "master", "repository") if role in after and role in before]
    parts = ", ".join(f"{role} {(after[role] - before[role]) / max(tuples, 1) / 1e6:.2f}" for role in roles)
    return f"disk: {parts} MB written per tuple of {size / 1e6:g} MB"


_done_before: dict[str, int] = {}


def _wait_done(config: CoreBenchConfig, mode: str, count: int) -> None:
    """Queued tuples are ENQUEUED before processed: wait until the master counts them done."""
    import grpc

    from hio.proto import master_pb2, master_pb2_grpc
    from hio.transport.net import create_channel

    with create_channel(config.master_address, config) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        target = _done_before.get("done", 0) + count
        while True:
            try:
                status = stub.GetStatus(master_pb2.GetStatusRequest(), timeout=5)
            except grpc.RpcError:
                time.sleep(0.05)
                continue
            if status.tuples_done + status.tuples_failed >= target:
                _done_before["done"] = status.tuples_done + status.tuples_failed
                return
            time.sleep(0.01)


class Scraper:
    """Reads every role's ``/metrics`` every ``interval`` seconds while a measurement runs,
    as a Prometheus server would: from a process of its own (on this machine, as a
    Prometheus beside the cluster would be), so that reading the answers costs the roles'
    cores but not the benchmark's gateway its interpreter. Counts the scrapes and the slowest."""

    def __init__(self, config: CoreBenchConfig, addresses: list[str], interval: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._scrapes = context.Value("i", 0)
        self._slowest = context.Value("d", 0.0)
        self._count = len(addresses)
        self._process = context.Process(
            target=scrape_loop,
            args=(config, addresses, interval, self._stop, self._scrapes, self._slowest),
            name="bench-scraper",
            daemon=True,
        )
        self._interval = interval

    def __enter__(self) -> Self:
        if self._interval > 0 and self._count:
            self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._process.is_alive():
            self._process.join(15.0)

    def summary(self) -> str:
        return (
            f"metrics on: {self._scrapes.value} scrapes of {self._count} roles "
            f"(every {self._interval:g} s, from another process), slowest {self._slowest.value * 1000:.0f} ms"
        )


def scrape_loop(
    config: CoreBenchConfig, addresses: list[str], interval: float, stop: Any, scrapes: Any, slowest: Any
) -> None:
    """:class:`Scraper`'s process: GET each ``/metrics`` every ``interval`` s until ``stop``."""
    import urllib.request

    from hio.transport.lanetls import client_context

    tls = client_context(config)
    token = config.presented_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    scheme = "https" if tls is not None else "http"
    while not stop.wait(interval):
        for address in addresses:
            started = time.perf_counter()
            request = urllib.request.Request(f"{scheme}://{address}/metrics", headers=headers)
            with urllib.request.urlopen(request, timeout=10, context=tls) as reply:
                reply.read()
            scrapes.value += 1
            slowest.value = max(slowest.value, time.perf_counter() - started)


def secured(config: Secured, data_dir: Path) -> tuple[Secured, list[str]]:
    """``--secure``: the config with a certificate and a token for every role (one pair, as
    `hio certs` writes them), and the servers' extra flag for mutual TLS (also `hio bench`'s
    hio-secure system)."""
    from hio.transport.certs import generate

    paths = generate(data_dir / "certs", ("cluster",), ("127.0.0.1", "localhost"))
    token = data_dir / "certs" / "token"
    token.write_text(os.urandom(16).hex())
    os.chmod(token, 0o600)
    return dataclasses.replace(
        config,
        tls_cert=str(paths["cluster"]),
        tls_key=str(paths["cluster-key"]),
        tls_ca=str(paths["ca"]),
        token="",
        token_file=str(token),
    ), ["--tls-client-auth"]


def run_core_bench(config: CoreBenchConfig) -> int:
    from hio.cluster import LocalCluster

    data_dir = Path(config.data_dir).expanduser().resolve() / "bench-core"
    servers: list[str] = []  # extra flags of the roles that serve
    if config.secure:
        config, servers = secured(config, data_dir)
    lanes = [] if config.lanes else ["--no-lanes"]
    cluster = LocalCluster(
        data_dir,
        config,
        workers={"": [f"hio/synthetic={config.engines}"]},
        worker_timeout=60,
        master_args=[*servers, *lanes],
        repository_args=servers,
        worker_args=[*servers, *lanes],
    )
    bench = dataclasses.replace(config, master_address=cluster.master, repository_address=cluster.repository)
    bound = loopback_bandwidth()
    pace = f"paced at {config.rate:g}/s" if config.rate > 0 else "submitted at once"
    print(
        f"loopback bandwidth (one TCP stream): {bound / 1e6:,.0f} MB/s; "
        f"{os.cpu_count()} cores; {config.engines} synthetic engines; chunk {config.chunk_bytes} B; "
        f"tuples {pace}, {config.cost_ms:g} ms of CPU each"
        f"{'; secure: mutual TLS and tokens' if config.secure else ''}"
        f"{'' if config.lanes else '; payloads over gRPC only'}"
        f"; metrics {'on' if config.metrics else 'off'}"
    )
    with cluster:
        pids = role_pids(cluster)
        print(f"{'size':>8} {'path':>7} {'tuples':>7} {'seconds':>8} {'tuples/s':>9} {'MB/s':>8} {'of bound':>8}")
        for text in config.sizes:
            size = size_setting("sizes", text)
            for mode in config.modes:
                count = tuple_count(config, size)
                if needs_calibration(config, count):
                    calibration = measure(bench, data_dir, size, mode, CALIBRATION_TUPLES)
                    count = tuple_count(config, size, calibration["tuples_per_s"])
                before, disk_before = role_cpu(pids), role_disk_bytes(pids)
                interval = config.scrape_seconds if config.metrics else 0.0
                with Scraper(config, [a for a in cluster.http.values() if a], interval) as scraper:
                    r = measure(bench, data_dir, size, mode, count)
                print(
                    f"{text:>8} {mode:>7} {r['tuples']:>7.0f} {r['seconds']:>8.2f} {r['tuples_per_s']:>9.1f}"
                    f" {r['mb_per_s']:>8.1f} {r['mb_per_s'] * 1e6 / bound:>8.1%}",
                    flush=True,
                )
                print(f"{'':>17}{cpu_per_tuple(before, role_cpu(pids), int(r['tuples']))}", flush=True)
                if mode == "direct" and r["queued"]:
                    print(f"{'':>17}{r['queued']} tuples went through the master's queue (no channel free)", flush=True)
                if interval:
                    print(f"{'':>17}{scraper.summary()}", flush=True)
                time.sleep(0.3)  # the roles' last flush rounds: their syncs and deletions count
                print(
                    f"{'':>17}{disk_per_tuple(disk_before, role_disk_bytes(pids), int(r['tuples']), size)}", flush=True
                )
    return 0
