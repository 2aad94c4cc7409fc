"""A second durable broker beside Spark in `hio bench`: NATS JetStream, as Debian packages it.

:class:`NatsBroker` runs a server of its own for the benchmark (``nats-server -js``): on
loopback, on a free port, with its configuration, JetStream store and log in one folder;
``max_payload`` of :data:`MAX_PAYLOAD` (a 10 MB message and its headers) and JetStream
limits of :data:`MAX_FILE_STORE` on disk (multi-GB bursts). It is stopped, and the folder
removed, whatever happened (:meth:`NatsBroker.stop`; the server is its child, killed by
its own id).

:class:`NatsSystem` is the same design as :class:`benchmarks.broker.RabbitSystem` on
JetStream: a stream with file storage (work-queue retention: an acknowledged message
leaves it); each message published with ``send`` returning once JetStream acknowledged it
(a PubAck); two consumer processes (two processing slots) on one durable pull consumer
with explicit acks, each running the same pipeline as this system's engines
(:func:`hio.worker.pipelines.synthetic.process`), appending the features of a fetched
batch to a feature log of its own, fsyncing it, and only then acknowledging each message
(at least once). A consumer fetches at most the prefetch of RabbitMQ's consumers
(:func:`benchmarks.broker.prefetch_for`) at a time, and the consumer holds at most that
per consumer unacknowledged (``max_ack_pending``).

nats-py is asyncio: the producer's client lives on one event loop in a thread of its own
(:class:`LoopThread`), which the sender threads hand their publishes to; each consumer
process runs its own loop (:func:`asyncio.run`).

What a PubAck means on nats-server 2.9 (Debian's 2.9.10): the file store has written the
message to the OS (a ``write``, no fsync) before it answers; it fsyncs its files every two
minutes, a fixed interval (``sync_interval``, and ``always``, came with 2.10; 2.9 rejects
the field). A crash of the server loses nothing acknowledged; a crash of the machine may
lose up to two minutes of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.broker import ConsumerSystem, apt_install, store_batch
from benchmarks.systems import SLOTS, FeatureFile, features_line
from hio.process.procs import free_port

log = logging.getLogger("hio.bench")

STREAM = "HIO_BENCH"
SUBJECT = "hio.bench"
DURABLE = "hio-bench"
SERVER = "nats-server"
MAX_PAYLOAD = 16 * 2**20  # a 10 MB message, its headers and the protocol's, with room
MAX_MESSAGE = MAX_PAYLOAD - 2**16  # the largest message sent: what is left beside its NATS headers
MAX_PENDING = 256 * 2**20  # bytes the server buffers for a client before calling it slow
MAX_FILE_STORE = 64 * 2**30  # JetStream's disk limit (a burst of a few GB is held at once)
PUBLISH_TIMEOUT = 120.0  # seconds a publish waits for its PubAck (a 10 MB message on a loaded machine)
FETCH_WAIT = 0.25  # seconds a consumer's fetch waits for a first message (then it looks at ``stop``)

T = TypeVar("T")


def server_binary() -> str:
    """The server's executable, installed with apt-get as root when it is missing."""

    def which() -> str | None:
        return shutil.which(SERVER) or shutil.which(SERVER, path="/usr/sbin:/usr/bin")

    if (found := which()) is None:
        apt_install("nats-server")
        found = which()
    if found is None:
        raise RuntimeError(
            "NATS is not installed (Debian's nats-server): as root, apt-get install nats-server "
            "(hio bench does when run as root)"
        )
    return found


class NatsBroker:
    """One nats-server with JetStream of the benchmark's own under ``root`` (see the module doc)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = 0
        self._server: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Start the server; return once it says it is ready. Stops what it started on failure."""
        binary = server_binary()
        try:
            self._start(binary, timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, binary: str, timeout: float) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        (self.root / "logs").mkdir(parents=True)
        (self.root / "store").mkdir()
        self.port = free_port()
        config = self.root / "nats-server.conf"
        config.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            f'server_name: "hio-bench-{os.getpid()}-{self.port}"\n'
            f"max_payload: {MAX_PAYLOAD}\n"
            f"max_pending: {MAX_PENDING}\n"
            'write_deadline: "60s"\n'
            "jetstream {\n"
            f'  store_dir: "{self.root / "store"}"\n'
            f"  max_file_store: {MAX_FILE_STORE}\n"
            f"  max_memory_store: {64 * 2**20}\n"
            "}\n"
        )
        with open(self.root / "logs" / "server.log", "wb") as out:
            # A session of its own: Ctrl-C at the benchmark's terminal reaches it through stop() only.
            self._server = subprocess.Popen(
                [binary, "-c", str(config), "-js"], stdout=out, stderr=out, cwd=self.root, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while "Server is ready" not in self._log():
            if self._server.poll() is not None:
                raise RuntimeError(f"nats-server exited at start ({self._server.returncode}): {self._log()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not start within {timeout:.0f} s: {self._log()[-1500:]}")
            time.sleep(0.1)

    def _log(self) -> str:
        try:
            return (self.root / "logs" / "server.log").read_text(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL), remove its folder. Idempotent."""
        if self._server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._server.pid, signal.SIGTERM)
            try:
                self._server.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._server.pid, signal.SIGKILL)
                self._server.wait(10)
            self._server = None
        shutil.rmtree(self.root, ignore_errors=True)


async def connect(url: str) -> Any:
    """A client of the benchmark's server: no reconnects (a lost server is an error to
    report, not to hide), buffers sized for 10 MB messages."""
    import nats

    async def report(exc: Exception) -> None:
        log.debug("nats client: %s", exc)  # the call that fails raises it too

    return await nats.connect(
        url,
        allow_reconnect=False,
        connect_timeout=10,
        pending_size=MAX_PENDING,
        error_cb=report,
    )


class LoopThread:
    """An asyncio event loop running in a thread of its own; other threads run coroutines on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop; its result (or its exception) once it is done."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


# -- the consumer process ------------------------------------------------------------


def consume(url: str, features: str, prefetch: int, results: Any, stop: Any) -> None:
    """One consumer process: fetch, process (the engines' pipeline), store, ack (see the module doc).

    ``results`` gets ``(tag, seq, sent, done)`` per message once stored, or ``("error", text)``.
    """
    try:
        asyncio.run(_consume(url, Path(features), prefetch, results, stop))
    except Exception as exc:  # noqa: BLE001 - reported to the benchmark, which records it as the step's error
        results.put(("error", f"consumer: {type(exc).__name__}: {exc}"))


async def _consume(url: str, features: Path, prefetch: int, results: Any, stop: Any) -> None:
    store = FeatureFile(features)
    client: Any = None
    try:
        client = await connect(url)
        subscription = await client.jetstream().pull_subscribe_bind(
            DURABLE, STREAM, pending_bytes_limit=2 * MAX_PENDING
        )
        while not stop.is_set():
            try:
                messages = await subscription.fetch(prefetch, timeout=FETCH_WAIT)
            except TimeoutError:  # none within FETCH_WAIT (nats-py raises asyncio's or its own subclass)
                continue
            lines = []
            for message in messages:
                if stop.is_set():
                    break
                cost_ms = float((message.headers or {}).get("cost_ms", "0"))
                # In a thread: the loop goes on answering the server's pings meanwhile (a batch
                # may take minutes of CPU); one message at a time, one processing slot.
                lines.append(await asyncio.to_thread(features_line, message.data, cost_ms / 1000))
            if len(lines) < len(messages):  # stopped: none of the batch is stored; redeliver it now
                for message in messages:
                    await message.nak()
                break
            finished = store_batch(store, lines)
            for message in messages:
                await message.ack()
            results.put(finished)
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()  # sends what is buffered (the last acks) first
        store.close()


# -- the system ------------------------------------------------------------------------


class NatsSystem(ConsumerSystem):
    """NATS JetStream: file-stored stream, acknowledged publishes, two consumers with explicit acks."""

    name = "nats"
    sender_threads = 4

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.broker = NatsBroker(data_dir / "broker")
        self._loop: LoopThread | None = None
        self._client: Any = None

    def start(self) -> None:
        import nats.js.api as api

        self.root.mkdir(parents=True, exist_ok=True)
        self.broker.start()
        self._loop = LoopThread("nats-producer")
        self._client = self._run(connect(self.broker.url))
        self._run(
            self._client.jetstream().add_stream(
                api.StreamConfig(
                    name=STREAM,
                    subjects=[SUBJECT],
                    storage=api.StorageType.FILE,
                    retention=api.RetentionPolicy.WORK_QUEUE,
                    max_msgs=-1,
                    max_bytes=-1,
                    max_msg_size=-1,
                    num_replicas=1,
                )
            )
        )
        self._start_results()

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("nats: the system is not started")
        return self._loop.run(coroutine, timeout)

    def begin_point(self, size: int, cost_s: float) -> None:
        if size > MAX_MESSAGE:
            raise ValueError(
                f"nats: a {size}-byte message is above the {MAX_MESSAGE} bytes this system's server "
                f"takes (max_payload {MAX_PAYLOAD}, less room for headers)"
            )
        super().begin_point(size, cost_s)

    def _prepare_consumers(self) -> None:
        """The durable consumer anew, bounded for this point: each consumer process may hold
        the prefetch unacknowledged, for as long as processing it takes (with room)."""
        import nats.js.api as api
        import nats.js.errors

        async def renew() -> None:
            manager = self._client.jetstream()
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await manager.delete_consumer(STREAM, DURABLE)
            await manager.add_consumer(
                STREAM,
                api.ConsumerConfig(
                    durable_name=DURABLE,
                    deliver_policy=api.DeliverPolicy.ALL,
                    ack_policy=api.AckPolicy.EXPLICIT,
                    ack_wait=60.0 + 4 * self._prefetch * self._cost_s,
                    max_ack_pending=SLOTS * self._prefetch,
                    max_deliver=-1,
                    filter_subject=SUBJECT,
                ),
            )

        self._run(renew())

    def _consumer(self, n: int, prefetch: int) -> tuple[Any, tuple[Any, ...]]:
        return consume, (self.broker.url, str(self.root / f"features-{n}.log"), prefetch)

    def stop(self) -> None:
        try:
            self._stop_consumers()
            if self._client is not None:
                with contextlib.suppress(Exception):
                    self._run(self._client.close(), timeout=15)
                self._client = None
            if self._loop is not None:
                self._loop.close()
                self._loop = None
            self._stop_results()
        finally:
            self.broker.stop()

    def reset(self) -> None:
        """Drop the backlog: stop the consumers (what they hold unacknowledged goes back to the
        stream), purge the stream, start new consumers; nothing of the old step finishes later."""
        self._stop_consumers()
        self._run(self._client.jetstream().purge_stream(STREAM))
        self._start_consumers()

    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        """Publish to the stream; returns once JetStream acknowledged it (PubAck: written to the OS)."""
        self._run(
            self._client.jetstream().publish(
                SUBJECT,
                payload,
                timeout=PUBLISH_TIMEOUT,
                stream=STREAM,
                headers={"cost_ms": f"{cost_s * 1000:g}"},
            ),
            timeout=PUBLISH_TIMEOUT + 10,
        )
