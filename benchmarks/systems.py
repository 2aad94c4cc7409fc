"""The systems `hio bench` measures, behind one small interface.

Every system gets the same messages from :class:`MessageGenerator`, runs the
same pipeline per message (:func:`hio.worker.pipelines.synthetic.process`: the
same :func:`~hio.worker.pipelines.synthetic.burn_cpu`, the same features), stores
the features durably, and has two processing slots (our worker with two
``hio/synthetic`` engines; Spark ``local[2]``; two broker consumers). A system
reports, per step tag, which messages it finished and when, so the step runner
can judge every system by the same rules. Finished means the message's features
are durably stored; :data:`ABOUT` says, per system, exactly what that is, when
its latency ends and what survives a crash.

* ``hio-direct`` / ``hio-queue``: a repository, a master and a worker as real
  child processes (:class:`hio.cluster.LocalCluster`), fed by an in-process
  :class:`hio.gateway.Gateway` (``force_queue`` for the queue path); latency is
  ``StoredRecord.durable_unix - meta.accepted_unix``. ``hio-secure``: the direct
  path with mutual TLS and a token on every connection
  (:func:`benchmarks.core.secured`).
* ``spark-file``: Structured Streaming over the ``binaryFile`` source; each
  message is written beside the watched folder and renamed into it
  (atomically); a fresh folder and checkpoint per grid point.
* ``spark-socket``: Structured Streaming over the ``socket`` source (lines of
  text, so the payload is text-safe); we are the server Spark connects to.
* ``rabbitmq``: :mod:`benchmarks.broker`.
* ``nats``: :mod:`benchmarks.jetstream`.

For Spark, ``foreachBatch`` appends the micro-batch's features to a feature log
and fsyncs it; latency is that moment minus the send time the message carries
in its header.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import os
import random
import shutil
import socket
import string
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("hio.bench")

HEADER_BYTES = 48  # "<tag>|<seq>|<sent_unix>|" padded with '.'; ASCII
SLOTS = 2  # processing slots every system gets
HIO_IMAGE = "hio/synthetic"
FOLLOW_WAIT_SECONDS = 1.0  # how long one of StoredFollower's calls waits for a new record
FOLLOW_INTERVAL_SECONDS = 0.25  # its calls' least spacing: at most 4 a second, however fast records come
# (a count is then up to this old: the step's backlog samples pair it with the sends of its time,
# the judgement uses each message's own finish time, and a burst's time its last finish's)


@dataclasses.dataclass(frozen=True)
class About:
    """What the report says of a system: what it is, where its latency ends, what survives."""

    what: str
    latency_end: str
    durability: str


_SPARK_DURABILITY = (
    "a message is taken by the source and nothing is acknowledged to the sender; the features of "
    "a micro-batch are fsynced before it commits (checkpoint). "
)
ABOUT = {
    "hio-direct": About(
        "this system as deployed: gateway (in-process library) -> master route -> worker with two "
        "`hio/synthetic` engines (real processes) -> repository; the master picks direct or queue",
        "the repository's fsync covering the features ended (`StoredRecord.durable_unix`); from the "
        "gateway's acceptance",
        "a submit returns once the tuple is in the gateway's spool (fsynced within 100 ms, `batch`); "
        "STORED once the features are fsynced in the repository. Survives a crash of any process at "
        "any point (spool, backlog and repository on disk; redelivery by tuple id, stored once); a "
        "power loss may take the last 100 ms of the spool",
    ),
    "hio-queue": About(
        "the same, every tuple forced through the master's backlog queue (on disk)",
        "as hio-direct",
        "as hio-direct, and each tuple is in the master's backlog (fsynced, `batch`) before the "
        "gateway forgets it (ENQUEUED)",
    ),
    "hio-secure": About(
        "hio-direct with mutual TLS on every connection (gRPC and payload lanes) and a token checked on "
        "every call (`hio bench-core --secure`'s cluster)",
        "as hio-direct",
        "as hio-direct",
    ),
    "spark-file": About(
        "Spark Structured Streaming (`local[2]`), `binaryFile` source; each message written beside the "
        "watched folder and renamed into it; fresh folder and checkpoint per point",
        "`foreachBatch` appended the micro-batch's features to a feature log and fsynced it; from the "
        "send time in the message",
        _SPARK_DURABILITY + "The message is a file the sender wrote (not fsynced here): it survives a crash of Spark, "
        "which lists the folder again from its checkpoint",
    ),
    "spark-socket": About(
        "Spark Structured Streaming (`local[2]`), `socket` source (lines; text-safe payloads); the "
        "benchmark is the server Spark reads from",
        "as spark-file",
        _SPARK_DURABILITY + "Messages are only in the driver's memory until processed: a crash of "
        "Spark loses them (Spark's documentation calls the source a test source)",
    ),
    "rabbitmq": About(
        "RabbitMQ (Debian's rabbitmq-server), a durable queue, persistent messages with publisher "
        "confirms, two consumer processes with manual acks running the same pipeline",
        "the consumer appended the features to its feature log and fsynced it (before it acks); from "
        "the send time in the message",
        "a publish returns once the broker confirmed it, after writing it to disk; it survives a crash "
        "of the broker or a consumer; a consumer acks only after its features are fsynced (at least "
        "once: a crash between the two processes a message again)",
    ),
    "nats": About(
        "NATS JetStream (Debian's nats-server 2.9), a stream with file storage, publishes acknowledged "
        "by JetStream, two consumer processes on a durable pull consumer with explicit acks running "
        "the same pipeline",
        "as rabbitmq",
        "a publish returns once JetStream acknowledged it (PubAck), after its file store wrote it to "
        "the OS, not to disk: nats-server 2.9 fsyncs its store every 2 minutes and has no setting to "
        "fsync each write (`sync_interval: always` came with 2.10). It survives a crash of the broker "
        "or a consumer; a crash of the machine may lose up to the last 2 minutes of acknowledged "
        "messages. A consumer acks only after its features are fsynced (at least once: a crash "
        "between the two processes a message again)",
    ),
}


# -- messages -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Finished:
    """One message a system finished: its sequence number, send and finish times."""

    seq: int
    sent_unix: float
    done_unix: float


class FinishLog:
    """What a system that learns of its finished messages as they happen keeps of them: each
    step's finished messages, how many finished in all, and the errors seen. Its threads add
    to it while the step runner reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tag: dict[str, list[Finished]] = {}
        self._count = 0
        self._errors: list[str] = []

    def clear(self) -> None:
        """A point starts: forget its predecessor's messages (not the errors)."""
        with self._lock:
            self._by_tag.clear()
            self._count = 0

    def add(self, finished: Iterable[tuple[str, int, float, float]], count: int | None = None) -> None:
        """Messages finished, as (tag, seq, sent, done); ``count`` (default: how many were
        given) counts those whose header could not be read too."""
        with self._lock:
            added = 0
            for tag, seq, sent, done in finished:
                self._by_tag.setdefault(tag, []).append(Finished(seq, sent, done))
                added += 1
            self._count += added if count is None else count

    def error(self, message: str) -> None:
        with self._lock:
            self._errors.append(message)

    def count(self) -> int:
        with self._lock:
            return self._count

    def of(self, tag: str) -> list[Finished]:
        with self._lock:
            return list(self._by_tag.get(tag, []))

    def errors(self) -> list[str]:
        with self._lock:
            return list(self._errors)


class MessageGenerator:
    """The one message source of every system: ``size`` bytes with a header.

    The header (``HEADER_BYTES`` of ASCII) names the step tag, the sequence
    number and the send time, so any system can say which message it
    finished and how long it took. The body is random bytes, or random
    letters when ``text`` (the socket source reads lines). The body is built
    once per generator; each message copies it once behind a fresh header.
    """

    def __init__(self, size: int, *, text: bool, seed: int = 1) -> None:
        if size < HEADER_BYTES:
            raise ValueError(f"message size {size} is below the {HEADER_BYTES}-byte header")
        self.size = size
        rng = random.Random(seed)
        body = max(0, size - HEADER_BYTES)
        if text:
            alphabet = (string.ascii_letters + string.digits).encode()
            block = bytes(rng.choice(alphabet) for _ in range(min(body, 65536)))
        else:
            block = rng.randbytes(min(body, 65536))
        reps = body // max(1, len(block)) + 1
        self._body = (block * reps)[:body] if block else b""

    def message(self, tag: str, seq: int, sent_unix: float) -> bytes:
        """The message ``seq`` of step ``tag`` sent at ``sent_unix``; exactly ``size`` bytes."""
        header = f"{tag}|{seq}|{sent_unix:.6f}|".encode("ascii")
        if len(header) > HEADER_BYTES:
            raise ValueError(f"header {header!r} longer than {HEADER_BYTES} bytes; shorten the tag")
        return header.ljust(HEADER_BYTES, b".") + self._body


def parse_header(head: bytes | str) -> tuple[str, int, float] | None:
    """(tag, seq, sent_unix) from a message's first bytes; None if it is not ours."""
    if isinstance(head, (bytes, bytearray, memoryview)):
        head = bytes(head[:HEADER_BYTES]).decode("ascii", "replace")
    parts = head[:HEADER_BYTES].split("|")
    if len(parts) < 3:
        return None
    try:
        return parts[0], int(parts[1]), float(parts[2])
    except ValueError:
        return None


# -- the interface ----------------------------------------------------------------


class System(abc.ABC):
    """One system under test. ``send`` is called from several threads at once."""

    name: str = ""
    text_payload: bool = False  # needs text-safe messages (line-based source)
    sender_threads: int = 1  # how many threads may call ``send`` concurrently

    @abc.abstractmethod
    def start(self) -> None:
        """Bring the system up (processes, Spark session). Called once per run."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Tear everything down; idempotent."""

    def begin_point(self, size: int, cost_s: float) -> None:
        """A new grid point starts (Spark: a fresh query)."""

    def end_point(self) -> None:
        """The grid point is done."""

    @abc.abstractmethod
    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        """Hand one message to the system's source; may block (back-pressure)."""

    @abc.abstractmethod
    def finished_count(self) -> int:
        """Messages finished since the system (or point) started; cheap, monotonic."""

    def finished_as_of(self) -> tuple[int, float]:
        """:meth:`finished_count` and the monotonic time it was true at: a count learnt from
        the system by a call is as old as that call's answer (the step's backlog samples pair
        it with what had been sent by then)."""
        return self.finished_count(), time.monotonic()

    @abc.abstractmethod
    def finished(self, tag: str) -> list[Finished]:
        """Every message of step ``tag`` finished so far."""

    def errors(self) -> list[str]:
        """Errors seen so far (never cleared; the step runner diffs them)."""
        return []

    def reset(self) -> None:
        """Throw away a backlog left by an overloaded step (restart what holds it)."""

    def watch_folder(self) -> Path | None:
        """A folder whose files become messages (an instrument's dump); None when the system has none."""
        return None


class LoggedSystem(System):
    """A system whose own threads record its finished messages in a :class:`FinishLog` as
    they happen (Spark's batches, the brokers' consumers), not read back from a store."""

    _finishes: FinishLog

    def finished_count(self) -> int:
        return self._finishes.count()

    def finished(self, tag: str) -> list[Finished]:
        return self._finishes.of(tag)

    def errors(self) -> list[str]:
        return self._finishes.errors()


class FeatureFile:
    """An append-only file of features, one line per message, fsynced per batch: the least a
    durable store of features does (the Spark and broker rows store theirs so)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # noqa: SIM115 - kept open across batches, closed by close()

    def append(self, lines: list[bytes]) -> float:
        """Append ``lines`` and fsync; the time (Unix seconds) they are durable."""
        self._file.write(b"".join(lines))
        self._file.flush()
        os.fsync(self._file.fileno())
        return time.time()

    def close(self) -> None:
        self._file.close()


def features_line(body: bytes | str, cost_s: float) -> bytes:
    """What a Spark or broker row stores per message: its header, then the pipeline's features (JSON)."""
    return process_and_store_line(cost_s)(body).encode()


# -- HarmonicIO ---------------------------------------------------------------------


class StoredFollower:
    """How many records the repository holds, followed in a thread with waiting GetOffsets
    calls (one per change, at most one every :data:`FOLLOW_INTERVAL_SECONDS`). The other
    systems count finished messages in-process for free; a call at every look (the step
    runner looks 20 times a second, its sampler 5) would spend CPU of this system's
    repository and of the benchmark's process, charged to the system's result."""

    def __init__(self, stub: Any, on_error: Callable[[str], None]) -> None:
        self._stub = stub
        self._on_error = on_error
        self._count = 0
        self._as_of = time.monotonic()
        self._known = threading.Event()  # a first answer came (or failed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stored-follower", daemon=True)
        self._thread.start()

    def count(self) -> int:
        """The latest count (at most one call old); waits for the first answer."""
        return self.count_as_of()[0]

    def count_as_of(self) -> tuple[int, float]:
        """The latest count and the monotonic time its answer came; waits for the first answer."""
        self._known.wait(FOLLOW_WAIT_SECONDS + 10)
        return self._count, self._as_of

    def _run(self) -> None:
        from hio.proto import repository_pb2

        while not self._stop.is_set():
            request = repository_pb2.GetOffsetsRequest(wait_after=self._count, wait_seconds=FOLLOW_WAIT_SECONDS)
            try:
                reply = self._stub.GetOffsets(request, timeout=FOLLOW_WAIT_SECONDS + 5)
                self._count, self._as_of = max(self._count, int(reply.records)), time.monotonic()
            except Exception as exc:  # noqa: BLE001 - an error of the system under test is a result, recorded
                if self._stop.is_set():
                    return
                self._on_error(f"repository GetOffsets: {exc}")
                self._stop.wait(1.0)
            self._known.set()
            self._stop.wait(FOLLOW_INTERVAL_SECONDS)

    def stop(self) -> None:
        """End the thread (its call in flight ends when the caller closes the channel)."""
        self._stop.set()

    def join(self) -> None:
        self._thread.join(FOLLOW_WAIT_SECONDS + 10)


class HioSystem(System):
    """This system: gateway -> (direct | queue) -> two synthetic engines -> repository."""

    sender_threads = 4

    def __init__(
        self,
        data_dir: Path,
        *,
        force_queue: bool,
        chunk_bytes: int,
        streams: int,
        batch_tuples: int,
        secure: bool = False,
    ) -> None:
        self.name = "hio-secure" if secure else "hio-queue" if force_queue else "hio-direct"
        self.force_queue = force_queue
        self.secure = secure
        self.root = data_dir
        self.chunk_bytes = chunk_bytes
        self.streams = streams
        self.batch_tuples = batch_tuples
        self._generation = 0
        self._cluster: Any = None
        self._gateway: Any = None
        self._watcher: Any = None
        self._repo_channel: Any = None
        self._repo: Any = None
        self._stored: StoredFollower | None = None
        self._master: Any = None
        self._master_channel: Any = None
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._read_offset = 0  # repository offset read up to
        self._failed_seen = 0  # master's failed + dead-lettered count already reported
        self._by_tag: dict[str, list[Finished]] = {}

    # lifecycle
    def start(self) -> None:
        import grpc  # noqa: F401  (fail early if missing)

        from hio.cluster import LocalCluster
        from hio.gateway import Gateway
        from hio.proto import master_pb2_grpc, repository_pb2_grpc
        from hio.settings import ClusterSettings
        from hio.transport.net import create_channel

        self._generation += 1
        data_dir = self.root / f"{self.name}-{self._generation}"
        settings = ClusterSettings(chunk_bytes=self.chunk_bytes)
        servers: list[str] = []
        if self.secure:
            from benchmarks.core import secured

            settings, servers = secured(settings, data_dir)
        self._cluster = LocalCluster(
            data_dir,
            settings,
            workers={"": [f"{HIO_IMAGE}={SLOTS}"]},
            master_args=servers,
            repository_args=servers,
            worker_args=servers,
        ).start()
        settings = self._cluster.settings
        self._repo_channel = create_channel(self._cluster.repository, settings)
        self._repo = repository_pb2_grpc.RepositoryStub(self._repo_channel)
        self._stored = StoredFollower(self._repo, self._record_error)
        self._master_channel = create_channel(self._cluster.master, settings)
        self._master = master_pb2_grpc.MasterStub(self._master_channel)
        self._gateway = Gateway(
            master_address=self._cluster.master,
            repository_address=self._cluster.repository,
            data_dir=str(data_dir),
            source=f"bench-{self.name}",
            chunk_bytes=self.chunk_bytes,
            streams=self.streams,
            batch_tuples=self.batch_tuples,
            force_queue=self.force_queue,
            progress=False,
            grace_seconds=2.0,
            token=settings.token,
            token_file=settings.token_file,
            tls_ca=settings.tls_ca,
            tls_cert=settings.tls_cert,
            tls_key=settings.tls_key,
        )
        self._read_offset = 0
        self._failed_seen = 0
        self._by_tag.clear()

    def watch_folder(self) -> Path:
        """The gateway's watched folder (``hio gateway --watch``, its default settle and poll times)."""
        if self._watcher is None:
            from hio.gateway.config import GatewayConfig
            from hio.gateway.watch import DirectoryWatcher

            defaults = GatewayConfig()
            folder = self.root / f"{self.name}-{self._generation}" / "watch"
            folder.mkdir(parents=True, exist_ok=True)
            self._watcher = DirectoryWatcher(
                self._gateway,
                folder,
                folder.with_name("watch-done"),
                settle_seconds=defaults.settle_seconds,
                poll_seconds=defaults.poll_seconds,
                image=HIO_IMAGE,
            )
            self._watcher.start()
        return Path(self._watcher.watch)

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._gateway is not None:
            try:
                self._gateway.close(timeout=2.0, drain=False)
            except Exception as exc:  # noqa: BLE001 - closing must never hide the benchmark's result
                log.warning("gateway close failed", extra={"error": str(exc)})
            self._gateway = None
        stored, self._stored = self._stored, None
        if stored is not None:
            stored.stop()
        for channel in (self._repo_channel, self._master_channel):
            if channel is not None:
                channel.close()
        self._repo_channel = self._master_channel = None
        if stored is not None:
            stored.join()
        if self._cluster is not None:
            self._cluster.stop()
            self._cluster = None

    def reset(self) -> None:
        """A backlog sits in the gateway spool and the master queue: start afresh.
        The old state (possibly GBs of spooled tuples) goes; its logs stay."""
        self.stop()
        old = self.root / f"{self.name}-{self._generation}"
        for child in old.iterdir() if old.is_dir() else ():
            if child.name != "logs":
                shutil.rmtree(child, ignore_errors=True)
        self.start()

    # data path
    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        future = self._gateway.submit(
            payload, image=HIO_IMAGE, name=f"{tag}|{seq}", attributes={"cost_ms": f"{cost_s * 1000:g}"}
        )
        future.add_done_callback(self._check_future)

    def _check_future(self, future: Any) -> None:
        exc = future.exception()
        if exc is not None:
            with self._lock:
                self._errors.append(f"delivery: {exc}")

    def begin_point(self, size: int, cost_s: float) -> None:
        self.finished("")  # index what is stored so far, then forget it
        self._by_tag.clear()

    def finished_count(self) -> int:
        return self._stored.count() if self._stored is not None else 0

    def finished_as_of(self) -> tuple[int, float]:
        return self._stored.count_as_of() if self._stored is not None else (0, time.monotonic())

    def _record_error(self, error: str) -> None:
        with self._lock:
            self._errors.append(error)

    def finished(self, tag: str) -> list[Finished]:
        """Read new feature records from the repository and index them by step tag."""
        import zstandard

        from hio.proto import features_pb2, repository_pb2

        decompressor = zstandard.ZstdDecompressor()
        request = repository_pb2.ReadFeaturesRequest(after=self._read_offset)
        for batch in self._repo.ReadFeatures(request, timeout=120):
            for stored in batch.records:
                record = features_pb2.FeatureRecord()
                record.ParseFromString(decompressor.decompress(stored.record_zstd))
                self._read_offset = max(self._read_offset, int(stored.offset))
                step, _, seq = record.meta.name.partition("|")
                if not seq.isdigit():
                    continue
                stored_unix = stored.durable_unix or time.time()  # 0: no longer known; now is later
                self._by_tag.setdefault(step, []).append(Finished(int(seq), record.meta.accepted_unix, stored_unix))
        return list(self._by_tag.get(tag, []))

    def errors(self) -> list[str]:
        """Delivery failures, plus one entry each time the master's failure counters rise."""
        from hio.proto import master_pb2

        try:
            status = self._master.GetStatus(master_pb2.GetStatusRequest(), timeout=5)
            failed = int(status.tuples_failed) + int(status.dead_letters)
            if failed > self._failed_seen:
                with self._lock:
                    self._errors.append(f"master: {failed - self._failed_seen} more tuples failed or dead-lettered")
                self._failed_seen = failed
        except Exception as exc:  # noqa: BLE001 - an error of the system under test is a result, recorded
            with self._lock:
                self._errors.append(f"master GetStatus: {exc}")
        with self._lock:
            return list(self._errors)


# -- Spark ------------------------------------------------------------------------------


def build_spark_session(app_name: str, slots: int = SLOTS, conf: tuple[str, ...] = ()) -> Any:
    """``local[slots]``, no UI, two shuffle partitions, Python workers on this interpreter."""
    import warnings

    from pyspark.sql import SparkSession

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark\..*")
    warnings.filterwarnings("ignore", message="Cannot infer the eval type", module=r"pyspark\..*")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(f"local[{slots}]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(slots))
        .config("spark.pyspark.python", sys.executable)
        .config("spark.pyspark.driver.python", sys.executable)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.memory", "4g")
        .config("spark.sql.streaming.minBatchesToRetain", "2")
    )
    for item in conf:
        key, _, value = item.partition("=")
        builder = builder.config(key.strip(), value.strip())
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def spark_alive() -> bool:
    """Whether the JVM pyspark launched for this process still runs."""
    from pyspark import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    return proc is not None and proc.poll() is None


def forget_spark() -> None:
    """After the JVM behind pyspark died: kill what is left of it and drop pyspark's handles to
    it, so that the next SparkSession launches a new JVM instead of calling the dead one."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(10)
    context = SparkContext._active_spark_context
    server = getattr(context, "_accumulatorServer", None)
    if server is not None:
        with contextlib.suppress(Exception):
            server.shutdown()
    if gateway is not None:
        with contextlib.suppress(Exception):
            gateway.close()
    SparkContext._gateway = SparkContext._jvm = SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = SparkSession._activeSession = None


def process_and_store_line(cost_s: float) -> Callable[[Any], str]:
    """The engines' pipeline on a message (the same burn, the same features) and the line a
    Spark or broker row stores for it, its header first so the receiver knows what finished.
    A closure that imports only ``hio``: Spark's Python workers run it and cannot import
    ``benchmarks`` (not installed)."""

    def process(content: Any) -> str:
        import json
        import types

        from hio.worker.pipelines.synthetic import process

        if content is None:
            return ""
        data = content.encode("ascii") if isinstance(content, str) else bytes(content)
        info = types.SimpleNamespace(attributes={"cost_ms": f"{cost_s * 1000:g}"})
        return data[:48].decode("ascii", "replace") + " " + json.dumps(process(data, info)) + "\n"

    return process


class SparkSystem(LoggedSystem):
    """Common part of both Spark sources: the session, the query, the finish log."""

    def __init__(self, data_dir: Path, conf: tuple[str, ...] = ()) -> None:
        self.root = data_dir
        self.conf = conf
        self.spark: Any = None
        self.query: Any = None
        self._finishes = FinishLog()
        self._stopping = False
        self._point = 0
        self._point_dir: Path | None = None
        self._features: FeatureFile | None = None
        self._size = 0
        self._cost = 0.0

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.spark = build_spark_session(f"hio-bench-{self.name}", SLOTS, self.conf)

    def stop(self) -> None:
        try:
            self.end_point()
        finally:
            if self.spark is not None:
                try:
                    self.spark.stop()
                except Exception as exc:  # noqa: BLE001 - its JVM died (out of heap): forget it, go on
                    log.warning("stopping Spark failed", extra={"error": str(exc)[:300]})
                    forget_spark()
                self.spark = None

    def begin_point(self, size: int, cost_s: float) -> None:
        self._point += 1
        self._size, self._cost = size, cost_s
        self._finishes.clear()
        point_dir = self.root / f"{self.name}-p{self._point}"
        point_dir.mkdir(parents=True, exist_ok=True)
        self._point_dir = point_dir
        self._features = FeatureFile(point_dir / "features.log")
        frame = self._source(point_dir)
        from pyspark.sql import functions as F  # noqa: N812 - PySpark's own convention
        from pyspark.sql.types import StringType

        udf = F.udf(process_and_store_line(cost_s), StringType())
        self.query = (
            frame.select(udf(self._column()).alias("line"))
            .writeStream.foreachBatch(self._on_batch)
            .option("checkpointLocation", str(point_dir / "checkpoint"))
            .queryName(f"bench_{self.name.replace('-', '_')}_{self._point}")
            .start()
        )
        self._after_start()

    def end_point(self) -> None:
        if self.query is not None:
            self._stopping = True
            try:
                self.query.stop()
            except Exception as exc:  # noqa: BLE001 - the next point starts a fresh query either way
                log.warning("stopping the Spark query failed", extra={"error": str(exc)})
            finally:
                self._stopping = False
            self.query = None
        self._close_source()
        if self._features is not None:
            self._features.close()
            self._features = None
        if self._point_dir is not None:
            # The point's messages and checkpoint: a full grid writes tens of GB of them.
            shutil.rmtree(self._point_dir, ignore_errors=True)
            self._point_dir = None

    def reset(self) -> None:
        """A fresh query and source: the backlog of the old one is dropped. A JVM that died
        (the socket source holds what it read in the driver's heap) is replaced by a new one."""
        self.end_point()
        if not spark_alive():
            log.warning("Spark's JVM is gone; starting a new one", extra={"system": self.name})
            forget_spark()
            self.start()
        self.begin_point(self._size, self._cost)

    def _on_batch(self, frame: Any, batch_id: int) -> None:
        """Store the micro-batch's features (fsynced) before Spark commits it."""
        try:
            lines = [row[0] for row in frame.collect()]
        except Exception as exc:
            if self._stopping:  # the query is being stopped under a running batch: expected
                return
            self._finishes.error(f"spark batch {batch_id}: {str(exc)[:300]}")
            raise
        features = self._features
        if features is None:  # the point ended under a running batch
            return
        done = features.append([line.encode() for line in lines])
        parsed = [p for p in (parse_header(line) for line in lines) if p is not None]
        self._finishes.add(((tag, seq, sent, done) for tag, seq, sent in parsed), count=len(lines))

    def errors(self) -> list[str]:
        found = super().errors()
        if self.query is not None:
            try:
                exc = self.query.exception()
            except Exception as gone:  # noqa: BLE001 - the JVM is gone: that is the error
                found.append(f"spark: {str(gone)[:300]}")
            else:
                if exc is not None:
                    found.append(f"spark query: {str(exc)[:300]}")
        return found

    @abc.abstractmethod
    def _source(self, point_dir: Path) -> Any:
        """The streaming DataFrame of this point."""

    @abc.abstractmethod
    def _column(self) -> str:
        """The column holding the message."""

    def _after_start(self) -> None:
        """Hook: after the query started (the socket source connects now)."""

    def _close_source(self) -> None:
        """Hook: the point ended."""


class SparkFileSystem(SparkSystem):
    """``binaryFile`` source; messages written beside the folder and renamed into it."""

    name = "spark-file"
    sender_threads = 2

    def __init__(self, data_dir: Path, conf: tuple[str, ...] = ()) -> None:
        super().__init__(data_dir, conf)
        self._incoming: Path | None = None
        self._staging: Path | None = None

    def _source(self, point_dir: Path) -> Any:
        self._incoming = point_dir / "incoming"
        self._staging = point_dir / "staging"
        self._incoming.mkdir(exist_ok=True)
        self._staging.mkdir(exist_ok=True)
        from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType, TimestampType

        schema = StructType(
            [
                StructField("path", StringType(), False),
                StructField("modificationTime", TimestampType(), False),
                StructField("length", LongType(), False),
                StructField("content", BinaryType(), True),
            ]
        )
        return self.spark.readStream.format("binaryFile").schema(schema).load(str(self._incoming))

    def _column(self) -> str:
        return "content"

    def watch_folder(self) -> Path | None:
        """The point's source folder: files dropped there are the stream."""
        return self._incoming

    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        assert self._staging is not None and self._incoming is not None
        name = f"{tag}-{seq:09d}.bin"
        staged = self._staging / name
        with open(staged, "wb") as fh:
            fh.write(payload)
        os.rename(staged, self._incoming / name)  # atomic: Spark never sees a partial file


class SparkSocketSystem(SparkSystem):
    """``socket`` source: Spark connects to our server and reads lines."""

    name = "spark-socket"
    text_payload = True
    sender_threads = 1

    def __init__(self, data_dir: Path, conf: tuple[str, ...] = ()) -> None:
        super().__init__(data_dir, conf)
        self._server: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._send_lock = threading.Lock()

    def _source(self, point_dir: Path) -> Any:
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(1)
        port = self._server.getsockname()[1]
        return self.spark.readStream.format("socket").option("host", "127.0.0.1").option("port", port).load()

    def _column(self) -> str:
        return "value"

    def _after_start(self) -> None:
        assert self._server is not None
        self._server.settimeout(60)
        try:
            self._conn, _ = self._server.accept()
        except TimeoutError:
            raise RuntimeError("Spark's socket source did not connect within 60 s") from None
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conn.settimeout(120)  # a source that stopped reading fails the send, not the run

    def _close_source(self) -> None:
        for sock in (self._conn, self._server):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._conn = self._server = None

    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        with self._send_lock:
            if self._conn is None:
                raise RuntimeError("socket source is not connected")
            try:
                self._conn.sendall(payload + b"\n")
            except OSError as exc:
                self._finishes.error(f"socket send: {exc}")
                raise


SYSTEMS = tuple(ABOUT)


def make_system(
    name: str, data_dir: Path, *, chunk_bytes: int, streams: int, batch_tuples: int, spark_conf: tuple[str, ...] = ()
) -> System:
    """The system called ``name`` (one of :data:`SYSTEMS`), its state under ``data_dir``."""
    if name in ("hio-direct", "hio-queue", "hio-secure"):
        return HioSystem(
            data_dir,
            force_queue=name == "hio-queue",
            secure=name == "hio-secure",
            chunk_bytes=chunk_bytes,
            streams=streams,
            batch_tuples=batch_tuples,
        )
    if name == "spark-file":
        return SparkFileSystem(data_dir, spark_conf)
    if name == "spark-socket":
        return SparkSocketSystem(data_dir, spark_conf)
    if name == "rabbitmq":
        from benchmarks.broker import RabbitSystem

        return RabbitSystem(data_dir)
    if name == "nats":
        from benchmarks.jetstream import NatsSystem

        return NatsSystem(data_dir)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
