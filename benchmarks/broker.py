"""A durable message broker beside Spark in `hio bench`: RabbitMQ, as Debian packages it.

:class:`RabbitBroker` runs a broker of its own for the benchmark: on loopback, on free
ports (AMQP, Erlang distribution and the Erlang port mapper, all three its own), with its
data, logs and Erlang cookie in one folder, and no plugins. It is stopped, and the folder
removed, whatever happened (:meth:`RabbitBroker.stop`; every process it started is its
child, killed by its own id).

:class:`RabbitSystem` is the design the paper's Kafka row stands for, with acknowledged,
persistent delivery: a durable queue; each message published persistent with publisher
confirms (``send`` returns once the broker has written it to disk); two consumer processes
(two processing slots) with manual acknowledgements, each running the same pipeline as
this system's engines (:func:`hio.worker.pipelines.synthetic.process`), appending the
features of what it has taken to a feature log of its own, fsyncing it, and only then
acknowledging (at least once: a crash between the fsync and the ack processes a message
again).

What any broker's row shares is here too: :class:`ConsumerSystem` (the consumer processes,
their results and the prefetch per message size), :func:`store_batch` (store, then ack),
:func:`apt_install`; :mod:`benchmarks.jetstream` builds on them.
"""

from __future__ import annotations

import abc
import contextlib
import glob
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.systems import SLOTS, FeatureFile, FinishLog, LoggedSystem, features_line, parse_header
from hio.process.procs import free_port

log = logging.getLogger("hio.bench")

QUEUE = "hio-bench"
SERVER_GLOB = "/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin/rabbitmq-server"
EPMD = "/usr/bin/epmd"
PREFETCH_BYTES = 32 * 10**6  # unacknowledged bytes a consumer may hold at most
MAX_PREFETCH = 256  # ... and messages


def apt_install(package: str) -> None:
    """Install Debian's ``package`` for the benchmark, as root with apt-get; nothing elsewhere.
    Whether it worked, the caller checks (and names the package in its error)."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    log.warning("installing Debian's %s for the benchmark", package)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", package],
        env=env,
        capture_output=True,
        timeout=900,
    )


def server_script() -> Path:
    """The broker's start script, installed with apt-get as root when it is missing."""
    found = sorted(glob.glob(SERVER_GLOB))
    if not found:
        apt_install("rabbitmq-server")
        found = sorted(glob.glob(SERVER_GLOB))
    if not found or not Path(EPMD).exists():
        raise RuntimeError(
            "RabbitMQ is not installed (Debian's rabbitmq-server): as root, "
            "apt-get install rabbitmq-server (hio bench does when run as root)"
        )
    return Path(found[-1])


class RabbitBroker:
    """One RabbitMQ node of the benchmark's own under ``root`` (see the module doc)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = 0
        self._epmd: subprocess.Popen[bytes] | None = None
        self._server: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> None:
        """Start the node; return once it takes AMQP connections. Stops what it started on failure."""
        script = server_script()
        try:
            self._start(script, timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, script: Path, timeout: float) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        (self.root / "logs").mkdir(parents=True)
        (self.root / "enabled_plugins").write_text("[].\n")
        (self.root / "rabbitmq.conf").write_text("log.console = false\nlog.file.level = warning\n")
        (self.root / "rabbitmq-env.conf").write_text("")
        self.port = free_port()
        epmd_port = free_port()
        env = {
            **os.environ,
            "HOME": str(self.root),  # the Erlang cookie goes here
            "ERL_EPMD_PORT": str(epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODENAME": f"hio-bench-{os.getpid()}-{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.root / "logs"),
            "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.root / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.root / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": str(self.root / "plugins-expand"),
            "RABBITMQ_PID_FILE": str(self.root / "rabbitmq.pid"),
        }
        with open(self.root / "logs" / "epmd.log", "wb") as out:
            self._epmd = subprocess.Popen(
                [EPMD, "-port", str(epmd_port), "-address", "127.0.0.1"], stdout=out, stderr=out, env=env
            )
        with open(self.root / "logs" / "server.log", "wb") as out:
            # A session of its own: the script's shell and the Erlang VM are stopped as one group.
            self._server = subprocess.Popen(
                [str(script)], stdout=out, stderr=out, env=env, cwd=self.root, start_new_session=True
            )
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        import pika

        deadline = time.monotonic() + timeout
        quiet = logging.getLogger("pika")  # each refused try is expected here, not an error to log
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            self._poll_ready(pika, deadline, timeout)
        finally:
            quiet.setLevel(level)

    def _poll_ready(self, pika: Any, deadline: float, timeout: float) -> None:
        while True:
            if self._server is not None and self._server.poll() is not None:
                raise RuntimeError(f"RabbitMQ exited at start ({self._server.returncode}): {self._log_tail()}")
            try:
                pika.BlockingConnection(self.parameters()).close()
                return
            except pika.exceptions.AMQPConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"RabbitMQ did not start within {timeout:.0f} s: {self._log_tail()}") from None
                time.sleep(0.5)

    def _log_tail(self) -> str:
        try:
            return (self.root / "logs" / "server.log").read_text(errors="replace")[-1500:]
        except OSError:
            return "(no log)"

    def parameters(self) -> Any:
        """Connection parameters of this node (guest may connect over loopback only)."""
        import pika

        return pika.ConnectionParameters(
            host="127.0.0.1", port=self.port, heartbeat=0, blocked_connection_timeout=600, connection_attempts=1
        )

    def stop(self) -> None:
        """Stop the node and its port mapper (SIGTERM, then SIGKILL), remove its folder. Idempotent."""
        if self._server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._server.pid, signal.SIGTERM)
            try:
                self._server.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._server.pid, signal.SIGKILL)
                self._server.wait(10)
            self._server = None
        if self._epmd is not None:
            self._epmd.terminate()
            try:
                self._epmd.wait(10)
            except subprocess.TimeoutExpired:
                self._epmd.kill()
                self._epmd.wait(10)
            self._epmd = None
        shutil.rmtree(self.root, ignore_errors=True)


# -- the consumer process ------------------------------------------------------------


def prefetch_for(size: int) -> int:
    """Messages of ``size`` bytes a consumer may hold unacknowledged: :data:`PREFETCH_BYTES`
    of them, between 1 and :data:`MAX_PREFETCH`."""
    return max(1, min(MAX_PREFETCH, PREFETCH_BYTES // max(size, 1)))


def store_batch(store: FeatureFile, lines: list[bytes]) -> list[tuple[str, int, float, float]]:
    """Append a batch's features lines to ``store`` and fsync it, before the batch is
    acknowledged; the messages it finished, ``(tag, seq, sent, done)``, to report once acked."""
    done = store.append(lines)
    heads = [parse_header(line) for line in lines]
    return [(*head, done) for head in heads if head is not None]


def consume(parameters: Any, features: str, prefetch: int, results: Any, stop: Any) -> None:
    """One consumer process: take, process (the engines' pipeline), store, ack (see the module doc).

    Messages already delivered to this consumer are processed before their features are
    stored and acknowledged together (a batch); ``results`` gets ``(tag, seq, sent, done)``
    per message once stored, or ``("error", text)``.
    """
    import pika

    store = FeatureFile(Path(features))
    connection = pika.BlockingConnection(parameters)
    channel = connection.channel()
    channel.basic_qos(prefetch_count=prefetch)
    batch: list[tuple[int, bytes]] = []  # (delivery tag, features line)
    try:
        for method, properties, body in channel.consume(QUEUE, inactivity_timeout=0.05):
            if stop.is_set():
                break
            if method is not None:
                cost_ms = float((properties.headers or {}).get("cost_ms", "0"))
                batch.append((method.delivery_tag, features_line(body, cost_ms / 1000)))
                if len(batch) < prefetch and channel.get_waiting_message_count() > 0:
                    continue
            if batch:
                finished = store_batch(store, [line for _, line in batch])
                channel.basic_ack(delivery_tag=batch[-1][0], multiple=True)
                results.put(finished)
                batch = []
    except Exception as exc:  # noqa: BLE001 - reported to the benchmark, which records it as the step's error
        results.put(("error", f"consumer: {exc}"))
    finally:
        with contextlib.suppress(Exception):
            connection.close()
        store.close()


# -- the systems -----------------------------------------------------------------------


class ConsumerSystem(LoggedSystem):
    """A broker's row: :data:`SLOTS` consumer processes (spawned) that report what they
    stored to one results queue, drained into the :class:`FinishLog` by a thread. A
    subclass says how its consumers start (:meth:`_consumer`), and may prepare the broker
    for them first (:meth:`_prepare_consumers`); consumers are new at each point, with a
    prefetch that suits its message size (:func:`prefetch_for`)."""

    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir
        self._context = multiprocessing.get_context("spawn")
        self._results: Any = None
        self._stop: Any = None
        self._consumers: list[Any] = []
        self._drainer: threading.Thread | None = None
        self._finishes = FinishLog()
        self._prefetch = 1
        self._cost_s = 0.0

    @abc.abstractmethod
    def _consumer(self, n: int, prefetch: int) -> tuple[Any, tuple[Any, ...]]:
        """Consumer ``n``'s target and its arguments before ``(results, stop)``."""

    def _prepare_consumers(self) -> None:
        """Called with no consumer running, before new ones start."""

    def _start_results(self) -> None:
        self._results = self._context.Queue()
        self._stop = self._context.Event()
        self._drainer = threading.Thread(target=self._drain, name=f"{self.name}-results", daemon=True)
        self._drainer.start()

    def _stop_results(self) -> None:
        if self._results is not None:
            self._results.put(None)  # ends the drainer
            if self._drainer is not None:
                self._drainer.join(10)
            self._results = None

    def begin_point(self, size: int, cost_s: float) -> None:
        """Consumers whose prefetch suits this size (unacknowledged messages held at most)."""
        self._prefetch = prefetch_for(size)
        self._cost_s = cost_s
        self._start_consumers()
        self._finishes.clear()

    def _start_consumers(self) -> None:
        self._stop_consumers()
        self._prepare_consumers()
        self._stop = self._context.Event()
        self._consumers = []
        for n in range(SLOTS):
            target, args = self._consumer(n, self._prefetch)
            self._consumers.append(
                self._context.Process(
                    target=target,
                    args=(*args, self._results, self._stop),
                    name=f"{self.name}-consumer-{n}",
                    daemon=True,
                )
            )
        for process in self._consumers:
            process.start()

    def end_point(self) -> None:
        self._stop_consumers()

    def _stop_consumers(self) -> None:
        if self._stop is not None:
            self._stop.set()
        for process in self._consumers:
            process.join(15)
            if process.is_alive():
                process.kill()
                process.join(5)
        self._consumers = []

    def _drain(self) -> None:
        while True:
            try:
                item = self._results.get(timeout=1.0)
            except queue.Empty:
                continue
            except (OSError, ValueError, EOFError):
                return
            if item is None:
                return
            if isinstance(item, tuple) and item[0] == "error":
                self._finishes.error(str(item[1]))
            else:
                self._finishes.add(item)

    def errors(self) -> list[str]:
        found = super().errors()
        dead = [p.name for p in self._consumers if not p.is_alive()]
        return found + [f"{name} exited" for name in dead]


class RabbitSystem(ConsumerSystem):
    """RabbitMQ: durable queue, persistent messages, publisher confirms, two consumers with manual acks."""

    name = "rabbitmq"
    sender_threads = 4

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.broker = RabbitBroker(data_dir / "broker")
        self._idle_channels: queue.SimpleQueue[Any] = queue.SimpleQueue()  # publishing channels not in use
        self._connections: list[Any] = []
        self._lock = threading.Lock()  # the publishers' connections

    def start(self) -> None:
        import pika

        self.root.mkdir(parents=True, exist_ok=True)
        self.broker.start()
        with contextlib.closing(pika.BlockingConnection(self.broker.parameters())) as connection:
            connection.channel().queue_declare(QUEUE, durable=True)
        self._start_results()

    def _consumer(self, n: int, prefetch: int) -> tuple[Any, tuple[Any, ...]]:
        return consume, (self.broker.parameters(), str(self.root / f"features-{n}.log"), prefetch)

    def stop(self) -> None:
        self._stop_consumers()
        for connection in self._connections:
            with contextlib.suppress(Exception):
                connection.close()
        self._connections = []
        self._idle_channels = queue.SimpleQueue()
        self._stop_results()
        self.broker.stop()

    def reset(self) -> None:
        """Drop the backlog: stop the consumers (what they hold unacknowledged goes back to the
        queue), purge the queue, start new consumers; nothing of the old step finishes later."""
        import pika

        self._stop_consumers()
        with contextlib.closing(pika.BlockingConnection(self.broker.parameters())) as connection:
            connection.channel().queue_purge(QUEUE)
        self._start_consumers()

    def _channel(self) -> Any:
        """A publishing channel with confirms that no other sender uses meanwhile (pika is not
        thread-safe); kept for the next send, so that steps after the first pay no handshake."""
        import pika

        try:
            return self._idle_channels.get_nowait()
        except queue.Empty:
            pass
        connection = pika.BlockingConnection(self.broker.parameters())
        with self._lock:
            self._connections.append(connection)
        channel = connection.channel()
        channel.confirm_delivery()
        return channel

    def send(self, tag: str, seq: int, payload: bytes, cost_s: float) -> None:
        """Publish persistent; returns once the broker confirmed it (written to disk)."""
        import pika

        channel = self._channel()
        channel.basic_publish(
            exchange="",
            routing_key=QUEUE,
            body=payload,
            properties=pika.BasicProperties(delivery_mode=2, headers={"cost_ms": f"{cost_s * 1000:g}"}),
            mandatory=True,
        )
        self._idle_channels.put(channel)  # a channel whose publish failed is not used again
