"""`hio up`: every role on this machine, and the demo that streams the sample dataset.

Starts the repository, the master and a worker (one engine per image, local
processes or containers), generates the sample dataset (microscopy images and
stochastic reaction-diffusion realizations, made deterministically on this
machine), streams it through an in-process gateway with a progress bar,
waits until every tuple's features are stored, runs knowledge discovery
(Spark) over them, and ends with a summary read back from the repository.
With ``--keep`` everything stays up (KD on its interval) until Ctrl-C.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import signal
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import zstandard

from hio.cluster import LocalCluster
from hio.config import between, check_address, make_folder, one_of, positive, setting, split_address
from hio.gateway.config import HTTP_LISTEN as GATEWAY_HTTP
from hio.kd.config import HTTP_LISTEN as KD_HTTP
from hio.master.config import HTTP_LISTEN as MASTER_HTTP
from hio.master.config import SCALING_MODES
from hio.process.procs import bindable
from hio.proto import features_pb2, repository_pb2, repository_pb2_grpc
from hio.repository.config import HTTP_LISTEN as REPOSITORY_HTTP
from hio.settings import ClusterSettings
from hio.transport.net import create_channel
from hio.worker.config import HTTP_LISTEN as WORKER_HTTP
from hio.worker.config import RUNTIMES


@dataclasses.dataclass(frozen=True)
class UpConfig(ClusterSettings):
    http_listen: str = setting(
        REPOSITORY_HTTP, "the repository's HTTP endpoint: the preview page, /metrics (docs/monitoring.md); empty = none"
    )
    # named so that no HIO_<ROLE>_HTTP_LISTEN (a role's own variable) reads as one of these, shared
    http_listen_master: str = setting(
        MASTER_HTTP, "the master's HTTP endpoint (its status page, /metrics); empty = none"
    )
    http_listen_worker: str = setting(
        WORKER_HTTP, "the worker's HTTP endpoint (/metrics; elastic workers: free ports); empty = none"
    )
    http_listen_kd: str = setting(KD_HTTP, "KD's HTTP endpoint (/metrics); empty = none")
    http_listen_gateway: str = setting(
        GATEWAY_HTTP, "with --keep: the gateway's HTTP endpoint (/metrics); empty = none"
    )
    ingest_listen: str = setting(
        "127.0.0.1:7300",
        "with --keep: host:port of the gateway's ingest API (hio.proto.Ingest, docs/ingest.md); empty = no gateway",
    )
    engines: tuple[str, ...] = setting(
        None, "engines of the worker (IMAGE or IMAGE=COUNT)", factory=lambda: ("hio/microscopy", "hio/simulation")
    )
    runtime: str = setting("auto", "engine runtime: auto, process or docker")
    scaling: str = setting(
        "fixed",
        "'fixed': one worker with --engines; 'elastic': the master starts workers on this machine "
        "(local provisioner) and engines on them as the load asks (docs/elasticity.md)",
    )
    max_workers: int = setting(4, "with --scaling elastic: most workers the master starts")
    samples_dir: str = setting("", "where the sample dataset is generated (default DATA_DIR/samples)")
    kd: bool = setting(True, "run knowledge discovery on Spark over the demo's features")
    keep: bool = setting(False, "keep every role running after the demo, until Ctrl-C")
    kd_interval: float = setting(30.0, "with --keep: seconds between KD intervals")
    timeout: float = setting(600.0, "give up on the demo after this many seconds")

    def validate(self) -> None:
        self.validate_cluster()
        addresses = ("http_listen", "http_listen_master", "http_listen_worker", "http_listen_kd", "http_listen_gateway")
        for name in (*addresses, "ingest_listen"):
            check_address(name, getattr(self, name), allow_empty=True)
        one_of("runtime", self.runtime, RUNTIMES)
        one_of("scaling", self.scaling, SCALING_MODES)
        between("max_workers", self.max_workers, 1)
        positive("kd_interval", self.kd_interval)
        positive("timeout", self.timeout)


def _say(message: str) -> None:
    print(f"hio up: {message}", flush=True)


def _stream_samples(config: UpConfig, data_dir: Path, files: list[tuple[Path, str]]) -> list[int]:
    """Send the sample files through an in-process gateway, with a progress bar."""
    from tqdm import tqdm

    from hio.gateway import Gateway

    total = sum(path.stat().st_size for path, _ in files)
    ids: list[int] = []
    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(ClusterSettings)}
    with Gateway(**{**shared, "data_dir": str(data_dir)}, source="hio-up-demo", progress=False) as gateway:
        futures = [(path, gateway.submit_file(str(path), image=image)) for path, image in files]
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="streaming samples", disable=None, file=sys.stdout
        ) as bar:
            end = time.monotonic() + config.timeout
            for path, future in futures:
                while not future.done() and time.monotonic() < end:  # short waits: SIGTERM and Ctrl-C
                    concurrent.futures.wait([future], timeout=0.5)  # reach this (main) thread at once
                ids.append(future.result(timeout=0))
                bar.update(path.stat().st_size)
    return ids


def _wait_stored(config: UpConfig, count: int, deadline: float) -> None:
    with create_channel(config.repository_address, config) as channel:
        stub = repository_pb2_grpc.RepositoryStub(channel)
        while time.monotonic() < deadline:
            if stub.GetOffsets(repository_pb2.GetOffsetsRequest(), timeout=5).records >= count:
                return
            time.sleep(0.2)
    raise RuntimeError(f"not all {count} tuples' features reached the repository in time")


def read_features(config: ClusterSettings) -> list[features_pb2.FeatureRecord]:
    """Every feature record in the repository (for summaries of small stores)."""
    records = []
    decompressor = zstandard.ZstdDecompressor()
    with create_channel(config.repository_address, config) as channel:
        stub = repository_pb2_grpc.RepositoryStub(channel)
        for batch in stub.ReadFeatures(repository_pb2.ReadFeaturesRequest(after=0), timeout=60):
            for stored in batch.records:
                record = features_pb2.FeatureRecord()
                record.ParseFromString(decompressor.decompress(stored.record_zstd))
                records.append(record)
    return records


def format_summary(records: list[features_pb2.FeatureRecord]) -> str:
    """Per image: tuples, bytes, processing time, and the mean of its KD features."""
    by_image: dict[str, list[features_pb2.FeatureRecord]] = defaultdict(list)
    for record in records:
        by_image[record.meta.image].append(record)
    lines = [f"{len(records)} feature records in the repository"]
    for image, group in sorted(by_image.items()):
        size = sum(r.meta.size for r in group)
        cpu = sum(r.processing_seconds for r in group)
        lines.append(f"  {image}: {len(group)} tuples, {size / 1e6:.1f} MB, {cpu:.2f} s of processing")
        names = list(group[0].kd_features) or [
            k for k, v in group[0].features.items() if v.WhichOneof("kind") == "number"
        ]
        for name in names[:8]:
            values = [
                r.features[name].number
                for r in group
                if name in r.features and r.features[name].WhichOneof("kind") == "number"
            ]
            if values:
                lines.append(
                    f"      {name:<28} mean {sum(values) / len(values):>14.4g}"
                    f"   min {min(values):>12.4g}   max {max(values):>12.4g}"
                )
    engines = Counter(r.engine for r in records)
    lines.append("  processed by: " + ", ".join(f"{e} ({n})" for e, n in sorted(engines.items())))
    return "\n".join(lines)


def _http(config: UpConfig) -> dict[str, str]:
    """Where the HTTP endpoint of each role hio up starts listens (elastic workers, which the
    master starts, serve theirs on free ports)."""
    http = {"repository": config.http_listen, "master": config.http_listen_master}
    if config.scaling != "elastic":
        http["worker"] = config.http_listen_worker
    if config.kd:
        http["kd"] = config.http_listen_kd
    if config.keep and config.ingest_listen:
        http["gateway"] = config.http_listen_gateway
    return http


def _ports_in_use(config: UpConfig) -> list[str]:
    """The addresses hio up would listen on that something already holds (another hio up?):
    its roles would fail to start, while the health checks found the other system's."""
    wanted = [("repository", config.repository_address), ("master", config.master_address)]
    wanted += [(f"{role}'s HTTP endpoint", address) for role, address in _http(config).items() if address]
    if config.keep and config.ingest_listen:
        wanted.append(("gateway's ingest API", config.ingest_listen))
    return [f"{address} ({what})" for what, address in wanted if not bindable(*split_address(address))]


def run_up(config: UpConfig) -> int:
    taken = _ports_in_use(config)
    if taken:
        _say(
            f"cannot start: {', '.join(taken)} already in use (another hio up or hio role running?). "
            "Stop it (hio up --keep stops with Ctrl-C), or choose other addresses "
            "(--master-address, --repository-address, --ingest-listen, --http-listen, --http-listen-master, ...)"
        )
        return 2
    data_dir = Path(config.data_dir).expanduser().resolve()
    make_folder("data_dir", data_dir)
    deadline = time.monotonic() + config.timeout
    from hio.worker.pipelines.samples import generate_demo_dataset

    samples_dir = Path(config.samples_dir) if config.samples_dir else data_dir / "samples"
    _say(f"generating the sample dataset in {samples_dir} (cached after the first run)")
    files = generate_demo_dataset(samples_dir)
    shared = dataclasses.replace(config, log_level=config.log_level if config.log_level != "warning" else "info")
    elastic = config.scaling == "elastic"
    # the master's flags for elastic scaling with workers on this machine
    elastic_args = ["--scaling", "elastic", "--provisioner", "local", "--max-workers", str(config.max_workers)]
    cluster = LocalCluster(
        data_dir,
        shared,
        master_address=config.master_address,
        repository_address=config.repository_address,
        http=_http(config),
        workers={} if elastic else {"": config.engines},
        master_args=[*elastic_args, "--provisioner-options", f"runtime={config.runtime}"] if elastic else (),
        runtime=config.runtime,
        worker_timeout=config.timeout,
    )
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops the demo too, as Ctrl-C does
    try:
        workers = "workers as the load asks (hio scale shows them)" if elastic else "a worker"
        _say(
            f"starting repository ({config.repository_address}), master ({config.master_address}) "
            f"and {workers}; logs in {cluster.logs}"
        )
        cluster.start()
        _say(f"streaming {len(files)} sample tuples ({sum(p.stat().st_size for p, _ in files) / 1e6:.1f} MB)")
        started = time.monotonic()
        ids = _stream_samples(config, data_dir, files)
        _wait_stored(config, len(ids), deadline)
        elapsed = time.monotonic() - started
        _say(f"all {len(ids)} tuples processed and stored in {elapsed:.1f} s")
        records = read_features(config)
        print(format_summary(records))
        if config.kd:
            _say("running knowledge discovery on Spark (local) over the stored features")
            kd = cluster.add("kd", ["--once"])
            assert kd.proc is not None
            code = kd.proc.wait(max(30.0, deadline - time.monotonic()))
            cluster.remove("kd")
            if code != 0:
                _say(f"knowledge discovery failed (exit {code}); see {kd.log_path}")
                return 1
            from hio.kd.report import format_knowledge
            from hio.tools import fetch_knowledge

            knowledge = fetch_knowledge(config)
            if knowledge is not None:
                print(format_knowledge(knowledge))
            preview = data_dir / "kd" / "preview.png"
            if config.keep and config.http_listen:
                _say(f"preview: http://{config.http_listen}/  (image: http://{config.http_listen}/preview.png)")
            else:
                _say(
                    f"preview image: {preview}  (`hio up --keep` keeps every role running and serves it "
                    f"at http://{config.http_listen or '127.0.0.1:7180'}/)"
                )
        if config.keep:
            if config.kd:
                cluster.add("kd", ["--interval", str(config.kd_interval)])
            if ingest := config.ingest_listen:
                # whose ingest API instrument software in any language streams to; its source
                # names its spool, which hio send (the host's name) then does not share
                cluster.add("gateway", ["--ingest-listen", ingest, "--source", "hio-up"], health=ingest)
                _say(f"gateway ingest API at {ingest} (gRPC service hio.proto.Ingest; docs/ingest.md)")
            metrics = ", ".join(f"{role} http://{address}/metrics" for role, address in cluster.http.items() if address)
            _say(f"Prometheus metrics (docs/monitoring.md): {metrics}")
            if config.http_listen_master:
                _say(f"the master's status page: http://{config.http_listen_master}/")
            _say(
                "everything keeps running; `hio status` shows it, `hio send FILE --image IMG` adds tuples; Ctrl-C stops"
            )
            try:
                while True:
                    time.sleep(1.0)
            except KeyboardInterrupt:
                pass
        return 0
    except RuntimeError as exc:
        _say(str(exc))
        return 1
    finally:
        for problem in cluster.stop():
            _say(problem)
