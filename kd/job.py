"""The KD streaming job: Spark session, the query over the repository source,
and what each micro-batch (interval) does.

Order inside an interval, chosen so that every tuple counts exactly once:

1. executors read the batch's offset range from the repository (``toArrow``);
2. the driver appends the rows not stored yet to the Parquet store (atomic
   rename: the interval's commit point; replays and overlaps are filtered by
   offset and tuple id);
3. knowledge and preview are computed from the store and written back;
4. Spark records the batch in its checkpoint commit log, then calls the
   source's ``commit``, which moves the consumer offset in the repository.

A crash after (2) replays the batch: (2) then accepts nothing and (3) runs
again. A crash before (2) replays it in full. Nothing is counted twice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any

import pyarrow.compute as pc

from hio.config import make_folder
from hio.kd.client import RepositoryClient, connection_options
from hio.kd.config import KDConfig
from hio.kd.metrics import KDMetrics
from hio.kd.model import cluster_groups, plan, to_knowledge
from hio.kd.preview import render
from hio.kd.store import AccumulatedStore
from hio.process.log import NOTICE
from hio.proto import features_pb2
from hio.storage.files import atomic_write, clean_temporaries
from hio.transport.http import serve_http
from hio.transport.net import create_server, stop_on_signals

log = logging.getLogger("hio.kd")


LOG4J = """# Written by hio kd: Spark quiet unless something is wrong.
rootLogger.level = error
# A PySpark driver is a shell to Spark: without a level of its own for the shell's main class it
# announces one ("Setting default log level to WARN") and logs at it.
logger.shell.name = org.apache.spark.api.python.PythonGatewayServer
logger.shell.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yyyy-MM-dd'T'HH:mm:ss.SSS} %p spark %c{1}: %m%n
"""


def _quiet_jvm_options(config: KDConfig) -> str:
    """-D option pointing the driver's log4j at a config that logs errors only."""
    path = config.checkpoint_dir.parent / "log4j2.properties"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != LOG4J:
        path.write_text(LOG4J)
    return f"-Dlog4j2.configurationFile=file:{path}"


def build_session(config: KDConfig, app_name: str = "hio-kd") -> Any:
    """A Spark session for ``config.spark_master``: quiet, small shuffles, no UI."""
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")
    from pyspark.sql import SparkSession

    # Python workers (data source planning and reading; on a cluster, every
    # executor's) must run this interpreter, which has hio installed; Spark's
    # default is `python3`. A cluster's hosts need it at the same path.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(config.spark_master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", _quiet_jvm_options(config))
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.pyspark.driver.python", sys.executable)
        .config("spark.sql.streaming.minBatchesToRetain", "20")
        # Python workers start slowly on a busy machine; the default 15 s fails queries.
        .config("spark.python.authenticate.socketTimeout", "120s")
    )
    if config.driver_host:
        # Executors (a standalone cluster's) dial the driver back at this address.
        builder = builder.config("spark.driver.host", config.driver_host)
        builder = builder.config("spark.driver.bindAddress", config.driver_host)
    for item in config.spark_conf:
        key, _, value = item.partition("=")
        builder = builder.config(key.strip(), value.strip())
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


class KnowledgeJob:
    """What one interval does (``process_batch``), around the accumulated store.

    While KD catches up (more records waiting beyond the batch just read) it
    only accumulates, and learns at most once per ``interval``: a backlog of
    many micro-batches then costs reading it, not re-clustering after each
    slice. ``finish`` publishes what a ``--once`` run left unpublished.
    """

    def __init__(self, config: KDConfig, spark: Any, store: AccumulatedStore) -> None:
        self.config = config
        self.spark = spark
        self.store = store
        self.client = RepositoryClient(config, config.rpc_deadline)
        self.metrics = KDMetrics(config, lambda: store.total, lambda: self.failures) if config.metrics else None
        self.failures = 0  # times the streaming query failed (supervise)
        self.last_seconds = 0.0
        self.last_timings: dict[str, float] = {}
        self._published_at = time.monotonic()
        self._unpublished: int | None = None  # records accepted since the last publication
        self.accepted = 0  # records accepted by this run
        self.knowledge: features_pb2.Knowledge | None = None  # the last one this run published

    def close(self) -> None:
        self.client.close()
        if self.metrics is not None:
            self.metrics.close()

    def process_batch(self, frame: Any, batch_id: int) -> None:
        """foreachBatch callback: read, accumulate, learn, publish."""
        started = time.monotonic()
        timings: dict[str, float] = {}
        table = frame.toArrow()
        timings["read"] = time.monotonic() - started
        if table.num_rows == 0:
            return  # an empty range (a query's first batch over an empty repository)
        appended = self.store.append(table, time.time())
        if appended.malformed:
            log.warning(
                "skipped malformed feature records",
                extra={
                    "count": appended.malformed,
                    "total_malformed": self.store.malformed,
                    "examples": "; ".join(appended.examples),
                },
            )
        end_offset = int(pc.max(table.column("offset")).as_py())
        # The store now holds everything up to the batch's last offset, so the
        # consumer offset may move now (Spark's own source commit comes later,
        # and never after the last batch of a --once run).
        self.client.commit(self.config.consumer, end_offset)
        timings["store"] = time.monotonic() - started - timings["read"]
        self._unpublished = (self._unpublished or 0) + appended.accepted
        self.accepted += appended.accepted
        knowledge = self.publish(started, timings) if self._should_publish(end_offset) else None
        self.last_seconds = time.monotonic() - started
        self.last_timings = {k: round(v, 3) for k, v in timings.items()}
        if self.metrics is not None:
            self.metrics.interval.observe(self.last_seconds)
            self.metrics.records.observe(appended.accepted)
        log.info(
            "interval",
            extra={
                "batch": batch_id,
                "new": appended.accepted,
                "malformed": appended.malformed,
                "total": self.store.total,
                "groups": len(knowledge.groups) if knowledge else "later",
                "clusters": len(knowledge.clusters) if knowledge else "later",
                "seconds": round(self.last_seconds, 3),
                **self.last_timings,
            },
        )

    def _should_publish(self, end_offset: int) -> bool:
        """Publish when caught up, or when the last publication is an interval old."""
        if time.monotonic() - self._published_at >= self.config.interval:
            return True
        return int(self.client.offsets(self.config.consumer).latest) <= end_offset

    def finish(self) -> None:
        """Publish knowledge a catch-up left unpublished (end of a --once run)."""
        if self._unpublished is not None:
            self.publish(time.monotonic(), {})

    def publish(self, started: float, timings: dict[str, float]) -> features_pb2.Knowledge:
        """Cluster every group (the largest ``max_groups``), write the preview
        file, send both to the repository. Returns the knowledge published."""
        config = self.config
        mark = time.monotonic()
        groups = self.store.ordered()
        main, chosen = plan(groups, config.image, config.max_groups)
        results = cluster_groups(self.spark, groups, chosen, config)
        timings["cluster"] = time.monotonic() - mark
        mark = time.monotonic()
        png = render(
            results,
            self.store.history(),
            max_points=config.preview_points,
            seed=config.seed,
            max_rows=config.preview_groups,
            title=f"[{len(groups)} groups]" if groups else "",
        )
        config.preview_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(config.preview_file, png, durable=False)  # a viewer never sees half a PNG
        timings["preview"] = time.monotonic() - mark
        mark = time.monotonic()
        knowledge = to_knowledge(
            results,
            main,
            up_to_offset=self.store.max_offset,
            malformed=self.store.malformed,
            new_records=self._unpublished or 0,
            interval_seconds=time.monotonic() - started,
            max_assignments=config.max_assignments,
        )
        self.client.put_knowledge(knowledge.SerializeToString(), png)
        timings["publish"] = time.monotonic() - mark
        self._published_at = time.monotonic()
        self._unpublished = None
        self.knowledge = knowledge
        return knowledge

    def summary(self) -> str:
        """What this run did, in one line (the result of ``hio kd --once``)."""
        read = f"{self.accepted:,} new feature records ({self.store.total:,} stored in all)"
        if self.knowledge is None:
            return f"hio kd: {read}; knowledge unchanged"
        return (
            f"hio kd: {read}; published knowledge of {len(self.knowledge.groups)} groups, "
            f"{len(self.knowledge.clusters)} clusters (see it: hio knowledge)"
        )


def start_query(spark: Any, config: KDConfig, job: KnowledgeJob) -> Any:
    """Start the streaming query (checkpointed) over the repository source."""
    from hio.kd.source import NAME, RepositoryDataSource

    # A driver killed mid-write leaves the hidden temporary Spark writes each checkpoint
    # entry to before renaming it (``.0.<uuid>.tmp`` and its ``.crc``); one in a checkpoint
    # with no batch yet makes every later start fail (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY).
    # Spark never reads them, and no query runs now, so nothing is writing them.
    for leftover in clean_temporaries(config.checkpoint_dir, "**/.*.tmp*"):
        log.info("removed a torn checkpoint write", extra={"file": str(leftover)})
    spark.dataSource.register(RepositoryDataSource)
    options = connection_options(config, config.rpc_deadline) | {
        "consumer": config.consumer,
        "max_records": str(config.max_records_per_interval),
        "partitions": str(config.read_partitions),
        "max_record_bytes": str(config.max_record_bytes),
        "start_after": str(job.store.max_offset),
    }
    trigger = {"availableNow": True} if config.once else {"processingTime": f"{config.interval} seconds"}
    return (
        spark.readStream.format(NAME)
        .options(**options)
        .load()
        .writeStream.queryName("hio_kd")
        .foreachBatch(job.process_batch)
        .option("checkpointLocation", str(config.checkpoint_dir))
        .trigger(**trigger)
        .start()
    )


class SparkSessionKeeper:
    """The Spark session KD runs on. One KD built itself (``owned``) is built
    again when its driver JVM died (killed, out of memory): KD then carries on
    from its checkpoint and store instead of ending, since nothing (not even
    ``hio up``) would restart it. A session handed in (tests, notebooks) is
    never replaced or stopped. When the session KD starts with does not come up
    (its JVM exited before it answered), ``spark`` stays None and ``not_started``
    says why: :func:`supervise` counts that as a failed round and tries again."""

    def __init__(self, config: KDConfig, spark: Any = None) -> None:
        self.config = config
        self.owned = spark is None
        self.spark = spark
        self.not_started: Exception | None = None
        if spark is None:
            try:
                self.spark = build_session(config)
            except Exception as exc:  # noqa: BLE001 - whatever stopped the JVM, KD carries on and says so
                self.not_started = exc

    def _state(self) -> str:
        """'running'; 'stopped' (the JVM answers, its SparkContext has shut down); 'gone' (no JVM)."""
        if self.spark is None:  # never started
            return "gone"
        try:
            return "stopped" if self.spark.sparkContext._jsc.sc().isStopped() else "running"
        except Exception:  # noqa: BLE001 - Py4J cannot reach a dead JVM
            return "gone"

    def renew_if_dead(self) -> bool:
        """A new session if this one is dead (and KD owns it); whether it was renewed."""
        if not self.owned:
            return False
        state = self._state()
        if state == "running":
            return False
        log.error("the Spark session is dead; starting a new one", extra={"driver": state})
        _forget_dead_session(jvm_gone=state == "gone")
        self.spark = build_session(self.config)
        return True

    def stop(self) -> None:
        if self.owned and self._state() == "running":
            self.spark.stop()


def _forget_dead_session(jvm_gone: bool) -> None:
    """Drop PySpark's handles on a dead session, so the next one is built anew: on
    the same JVM if it still answers, else on a new JVM (a new gateway)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    SparkContext._active_spark_context = None
    if jvm_gone:
        SparkContext._gateway = None
        SparkContext._jvm = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None


@dataclasses.dataclass
class Readiness:
    """What KD's health reports as its readiness: why it cannot do its job just now, ''
    while its query runs."""

    not_ready: str = "starting Spark"


def _run_query_once(
    spark: Any, config: KDConfig, job: KnowledgeJob, stop: threading.Event, readiness: Readiness
) -> Exception | None:
    """Start the query and wait for it: None when it ended or ``stop`` was set, else
    why it failed (a query error, or the driver JVM unreachable). A query still running
    then is stopped; one on a dead JVM is gone anyway."""
    try:
        query = start_query(spark, config, job)
    except Exception as exc:  # noqa: BLE001 - a JVM that died, a checkpoint it cannot read
        return exc
    readiness.not_ready = ""
    try:
        while not stop.is_set():
            if query.awaitTermination(0.5):
                break
        return None
    except Exception as exc:  # noqa: BLE001 - the query's error, or Py4J's: the driver JVM died under the query
        return exc
    finally:
        try:
            if query.isActive:
                query.stop()
        except Exception as exc:  # noqa: BLE001 - Py4J errors when the driver JVM died
            log.debug("could not stop the query", extra={"error": str(exc)[:200]})


def supervise(
    session: SparkSessionKeeper,
    config: KDConfig,
    job: KnowledgeJob,
    stop: threading.Event,
    readiness: Readiness | None = None,
) -> int:
    """Run the query until stopped (or, with ``once``, until caught up). A failed
    query (the repository down for longer than ``rpc_deadline``, a Python
    worker that did not start, a driver JVM that died) is restarted from its
    checkpoint after ``restart_delay``, on a new Spark session if the old one
    is dead (a new session that does not start is a failure too, tried again
    the same way); a ``--once`` run gives up after ``max_failures`` in a row. Without
    ``once`` a query that ends by itself is a failure too: KD runs until told
    to stop."""
    readiness = readiness or Readiness()
    failures = 0
    not_started = session.not_started  # why the last new session did not start
    while not stop.is_set():
        error = not_started or _run_query_once(session.spark, config, job, stop, readiness)
        if error is None and (config.once or stop.is_set()):
            job.finish()
            return 0
        failures += 1
        job.failures += 1
        reason = "the query ended by itself" if error is None else _first_line(error)
        what = "a new Spark session did not start" if not_started else "its query failed"
        log.error("%s; trying again", what, extra={"failures": failures, "error": reason})
        readiness.not_ready = f"{what} ({reason}); trying again in {config.restart_delay:g} s"
        if config.once and failures >= config.max_failures:
            return 1
        stop.wait(config.restart_delay)
        not_started = None if stop.is_set() else _renew(session, job)
    return 0


def _first_line(exc: BaseException) -> str:
    """An error in one line for the log and the readiness (its type when it has no words)."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _renew(session: SparkSessionKeeper, job: KnowledgeJob) -> Exception | None:
    """A new session for ``job`` if the old one is dead; why a new one did not start (its
    driver JVM exited before it answered: memory, a port, a machine under load), else None.
    A session that did not start is the next round's failure: no query runs on a dead one."""
    try:
        if session.renew_if_dead():
            job.spark = session.spark
    except Exception as exc:  # noqa: BLE001 - whatever stopped the JVM, KD carries on and says so
        return exc
    return None


def run(config: KDConfig, stop: threading.Event | None = None, spark: Any = None) -> int:
    """``hio kd``: open the store, start Spark, run until SIGTERM/SIGINT or ``stop``.

    With ``spark`` given (tests, notebooks) that session is used and left
    running, and no signal handlers are installed.
    """
    stop = stop or threading.Event()
    for name, folder in (
        ("parquet_path", config.parquet_dir),
        ("checkpoint_path", config.checkpoint_dir),
        ("preview_path", config.preview_file.parent),
    ):
        make_folder(name if getattr(config, name) else "data_dir", folder)
    readiness = Readiness()
    server, port, health = create_server(config, config.listen, max_workers=2)
    server.start()
    health.start(lambda: readiness.not_ready)
    try:
        store = AccumulatedStore(config.parquet_dir).open()
        session = SparkSessionKeeper(config, spark)
    except BaseException:
        server.stop(0)
        raise
    if session.owned:
        stop_on_signals(stop)
    job = KnowledgeJob(config, session.spark, store)
    http = None
    try:
        http = serve_http(config, config.http_listen, job.metrics.registry if job.metrics else None, name="kd")
        log.log(
            NOTICE,
            "KD started",
            extra={
                "spark": config.spark_master,
                "repository": config.repository_address,
                "stored": store.total,
                "once": config.once,
                "listen": f"{config.listen.rpartition(':')[0]}:{port}",
                "http": http.address if http else "off",
            },
        )
        code = supervise(session, config, job, stop, readiness)
        if config.once and code == 0:
            print(job.summary(), flush=True)
        return code
    finally:
        if http is not None:
            http.close()
        health.stop()
        server.stop(0)
        job.close()
        session.stop()
