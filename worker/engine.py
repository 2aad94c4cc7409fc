"""One processing engine: a persistent micro-batch around a user's pipeline
(docs/architecture.md, "The data path", steps 3-5).

Tuples reach it on a gateway's ``Deliver`` stream or by ``PullTuple`` from the
master's queue. One is processed at a time; at most one more is being received
meanwhile, also across streams (:class:`_Prefetcher` hands a stream's channel
back early). The same module runs as a local process and inside a container
(``hio engine``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import math
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

import zstandard

from hio.config import ConfigError
from hio.metrics import PROCESS_BUCKETS, bucket_counts, histogram
from hio.proto import engine_pb2, engine_pb2_grpc, master_pb2
from hio.settings import FEATURE_RECORD_DECOMPRESSED_BYTES, message_limit, record_limit
from hio.transport.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    HioError,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    grpc_errors,
)
from hio.transport.frames import (
    ChunkFrame,
    FrameReader,
    StopDeadline,
    TupleFrame,
    TupleMeta,
    TupleReceipt,
    idle_bounded,
    packed,
)
from hio.transport.lane import LaneServer, create_server_with_lane
from hio.transport.net import ROLE_SERVICES, run_until_signal
from hio.transport.retry import Backoff
from hio.transport.tickets import load_ticket_key, verify_ticket
from hio.worker.api import PIPELINE_EXIT_CODE, Pipeline, TupleInfo, load_pipeline, pipeline_for_image
from hio.worker.cluster import ClusterLink, PullCall
from hio.worker.config import EngineConfig
from hio.worker.features import build_record
from hio.worker.reporter import Reporter

log = logging.getLogger("hio.worker.engine")
T = TypeVar("T")

LAST_ERROR_KEY = "hio.last_error"
LAST_ERROR_BYTES = 1024
TIMEOUT_EXIT_CODE = 75  # EX_TEMPFAIL: the controller restarts us
ZSTD_LEVEL = 3
ZSTD_SMALL_LEVEL = -1  # records up to ZSTD_SMALL_BYTES: zstd's fast mode, cheaper per small
ZSTD_SMALL_BYTES = 512  # record and a little larger than level 3
HANDOFF_DEADLINE = 10.0  # seconds the watchdog may spend handing a hung tuple back
MIN_EMPTY_PULL = 0.1  # seconds between long-polls the master answers at once
AHEAD_MAX_SECONDS = 1.0  # queue tuples that take longer are not pulled ahead (_worth_pulling_ahead)
STORER_JOIN_SECONDS = 5.0  # how long a stream's end waits for a store still in flight
ANSWER_DELAY = 0.02  # seconds a ready receipt may wait while tuples are still being processed
STORE_LINGER = 0.004  # seconds a small batch of records may wait for more while they arrive fast
STORE_GAP = 0.001  # ... "fast": the next record came within this
STORE_FULL = 64  # ... until this many wait
# An UNAVAILABLE carrying a retry hint is the engine's state (stopping, its repository
# unreachable), not the tuples' fault: the gateway retries them without counting an attempt.
ENGINE_STATE_RETRY = 1.0


def truncate(text: str) -> str:
    """``text`` cut to :data:`LAST_ERROR_BYTES` bytes (UTF-8), for a tuple's hio.last_error."""
    data = text.encode("utf-8")
    return text if len(data) <= LAST_ERROR_BYTES else data[:LAST_ERROR_BYTES].decode("utf-8", errors="ignore")


@dataclasses.dataclass
class _Job:
    """The tuple being processed, as the watchdog sees it."""

    meta: TupleMeta
    data: bytes
    from_queue: bool
    started: float
    taken: bool = False


class Watchdog:
    """Gives a tuple back when ``process()`` runs longer than ``timeout`` seconds.

    A hung user function cannot be interrupted from Python, so ``on_timeout``
    hands the tuple to the master and ends the process; the controller
    restarts the engine. ``timeout`` 0 disables the watchdog.
    """

    def __init__(self, timeout: float, on_timeout: Callable[[_Job], None]) -> None:
        self._timeout = timeout
        self._on_timeout = on_timeout
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._idle = False  # the watchdog waits for a job: the next begin() wakes it
        if timeout > 0:
            threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def begin(self, meta: TupleMeta, data: bytes, from_queue: bool) -> _Job:
        job = _Job(meta=meta, data=data, from_queue=from_queue, started=time.monotonic())
        with self._cond:
            self._job = job
            if self._idle:  # else it wakes at the deadline it waits for and looks again
                self._idle = False
                self._cond.notify()
        return job

    def end(self, job: _Job) -> None:
        """Mark ``job`` finished; if the watchdog already took it, wait for the exit."""
        with self._cond:
            taken = job.taken
            self._job = None
        if taken:
            threading.Event().wait()  # the watchdog is handing it back and will end the process

    def _run(self) -> None:
        while True:
            self._on_timeout(self._overdue())

    def _overdue(self) -> _Job:
        """The job at hand once it has run past the timeout, taken. Waits without polling: an
        idle engine's watchdog sleeps until a job begins, a busy one until the deadline of
        the job it saw (a job begun since has a later one), so it costs no CPU between."""
        with self._cond:
            while True:
                job = self._job
                if job is None or job.taken:
                    self._idle = job is None
                    self._cond.wait()
                    continue
                left = job.started + self._timeout - time.monotonic()
                if left <= 0:
                    job.taken = True
                    return job
                self._cond.wait(left)


class _Prefetcher:
    """Receives the next tuple of a stream while the caller processes the current one, and
    hands the stream's channel back before the stream ends.

    Publishes into the stream's event queue: ``("tuple", (meta, data))``, then
    ``("end", None)`` or ``("error", exc)`` (DATA_LOSS, INVALID_ARGUMENT,
    cancellation) after the tuples before it. Receives at most one tuple the
    caller has not taken (:meth:`started`), so memory stays at two tuples;
    tuples packed in a message already received are published at once (they
    are in memory anyway, and a thread hand-off per small tuple costs more
    than the tuple).

    ``hand_over`` runs once the stream's input has ended and its last tuple has
    started processing (docs/architecture.md, "The data path", 3): nothing more
    of this stream needs the slot, so the next stream is received while that
    tuple is processed and stored, one tuple ahead, never more. A channel held
    until the last receipt would idle while the release, the next route and the
    next stream's first bytes travel: for a cheap tuple, most of its cost.
    """

    def __init__(
        self, reader: FrameReader, publish: Callable[[tuple[str, Any]], None], hand_over: Callable[[], None]
    ) -> None:
        self._reader = reader
        self._publish = publish
        self._hand_over = hand_over
        self._cond = threading.Condition()
        self._untaken = 0
        self._closed = False
        self._received = 0
        self._started = 0
        self._ended = False
        self._handed_over = False
        threading.Thread(target=self._run, name="receiver", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._untaken == 0 or self._reader.buffered)
                if self._closed:
                    return
                self._untaken += 1
            try:
                item = self._reader.next_tuple_bytes()
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer in order
                if not self._closed:
                    self._publish(("error", exc))
                return
            with self._cond:
                if self._closed:  # the stream ended meanwhile (gRPC ends a handler's input cleanly)
                    return
                if item is None:
                    self._ended = True
                    self._hand_over_if_due()
                else:
                    self._received += 1
            self._publish(("end", None) if item is None else ("tuple", item))
            if item is None:
                return

    def started(self) -> None:
        """The caller took the tuple it was given and it holds the processing slot now:
        receive the next one."""
        with self._cond:
            self._untaken -= 1
            self._started += 1
            if self._untaken == 0:  # the receiver waits for nothing else from us; waking it
                self._cond.notify()  # for every packed tuple would cost a futile thread switch each
            self._hand_over_if_due()

    def close(self) -> bool:
        """The stream is over: receive nothing more, no hand-over from now on. True if it had handed over."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            handed_over, self._handed_over = self._handed_over, True
            return handed_over

    def _hand_over_if_due(self) -> None:
        """Hand over (lock held, so :meth:`close` sees it complete) once due."""
        if self._handed_over or not self._ended or self._started < self._received:
            return
        self._handed_over = True
        self._hand_over()


@dataclasses.dataclass(eq=False)
class _Slot:
    """One processed tuple (of a Deliver stream, or pulled), until its record is stored and its receipt final."""

    index: int
    meta: TupleMeta
    blob: bytes = b""
    cpu: float = 0.0
    receipt: TupleReceipt | None = None  # set once final (STORED after its batch is stored)
    from_queue: bool = False

    def answer(self, state: TupleReceipt.State, **fields: Any) -> _Slot:
        """Make the receipt final with ``state``."""
        self.receipt = TupleReceipt(index=self.index, tuple_id=self.meta.tuple_id, state=state, **fields)
        return self


StoreMany = Callable[[Sequence[tuple[int, bytes]]], list[bool]]
OnStored = Callable[[list[_Slot], list[bool]], None]
OnRefused = Callable[[_Slot, str], None]
Pulled = tuple[list[tuple[TupleMeta, bytes]], bool]  # a pull's tuples, and whether it came full (_pull)


def take_batch(waiting: collections.deque[_Slot], max_records: int, max_bytes: int) -> list[_Slot]:
    """The next records for one store request, taken from ``waiting``: the first whatever its
    size, then up to ``max_records`` in all and ``max_bytes`` of records."""
    batch = [waiting.popleft()]
    size = len(batch[0].blob)
    while waiting and len(batch) < max_records and size + len(waiting[0].blob) <= max_bytes:
        size += len(waiting[0].blob)
        batch.append(waiting.popleft())
    return batch


def store_batch(store_many: StoreMany, batch: list[_Slot], on_stored: OnStored, on_refused: OnRefused) -> None:
    """One store request for ``batch``; ``on_stored`` once the repository has stored it. A batch
    the repository refuses is stored record by record, so only the bad record fails
    (``on_refused`` with the repository's words). Any other failure (the repository
    unreachable) raises."""
    try:
        duplicates = store_many([(slot.meta.tuple_id, slot.blob) for slot in batch])
    except (InvalidArgument, DataLoss) as exc:
        if len(batch) == 1:
            on_refused(batch[0], exc.message)
        else:  # find the refused record; the others are stored
            for slot in batch:
                store_batch(store_many, [slot], on_stored, on_refused)
        return
    on_stored(batch, duplicates)


class _BatchStorer:
    """Stores one Deliver stream's feature records on its own thread, in batches, in order.

    Why: a store returns after the repository's fsync, so storing tuple by
    tuple puts a round trip and an fsync between every two tuples. Here the
    stream keeps processing while the records processed meanwhile ride on the
    next store request (at most ``max_records`` of them, ``max_bytes`` in all;
    :func:`store_batch`, so a refused record fails alone and the stream goes
    on). Any other failure (the repository unreachable) stops the storer;
    :attr:`error` holds it and nothing after it is stored.
    """

    def __init__(
        self,
        store_many: StoreMany,
        on_stored: OnStored,
        wake: Callable[[], None],
        *,
        max_records: int,
        max_bytes: int,
        max_pending: int,
        on_refused: OnRefused,
    ) -> None:
        self._store_many = store_many
        self._on_stored = on_stored
        self._on_refused = on_refused
        self._wake = wake
        self._max_records = max(1, max_records)
        self._max_bytes = max_bytes
        self._max_pending = max(1, max_pending)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Slot] = collections.deque()
        self._in_flight = 0
        self._closed = False
        self._last_submit = 0.0
        self._submit_gap = math.inf  # seconds between the last two records submitted
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="feature-storer", daemon=True)
        self._thread.start()

    def submit(self, slot: _Slot) -> None:
        """Queue a processed slot; blocks while ``max_pending`` records wait. Raises the storer's error."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self.error is not None or self._closed or len(self._waiting) + self._in_flight < self._max_pending
                )
            )
            if self.error is not None:
                raise self.error
            self._waiting.append(slot)
            now = time.monotonic()
            self._submit_gap, self._last_submit = now - self._last_submit, now
            if len(self._waiting) == 1:  # the storer thread waits only for an empty queue
                self._cond.notify_all()

    def close(self, timeout: float) -> None:
        """Drop what is not sent yet; wait up to ``timeout`` s for a batch in flight."""
        with self._cond:
            self._closed = True
            self._waiting.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

    def _linger(self) -> None:
        """While records arrive fast (small tuples), let a small batch wait a few ms for more (lock held).

        Why: at thousands of small tuples a second, a store request per few records
        costs more gRPC work on both ends than storing them. A record that came more
        than :data:`STORE_GAP` after the one before it (costly or large tuples, the
        first of a stream) does not wait: nothing says another follows soon.
        """
        if self._submit_gap > STORE_GAP:
            return
        deadline = time.monotonic() + STORE_LINGER
        while not self._closed and len(self._waiting) < min(STORE_FULL, self._max_records):
            now = time.monotonic()
            if now >= deadline or now - self._last_submit > STORE_GAP:
                return
            self._cond.wait(min(STORE_GAP, deadline - now))

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._waiting))
                self._linger()
                if self._closed:
                    return
                batch = take_batch(self._waiting, self._max_records, self._max_bytes)
                self._in_flight = len(batch)
            error: BaseException | None = None
            try:
                store_batch(self._store_many, batch, self._on_stored, self._on_refused)
            except BaseException as exc:  # noqa: BLE001 - handed to the stream, which ends with it
                error = exc
                if isinstance(exc, (Unavailable, DeadlineExceeded)):  # the repository's state, not the tuples'
                    error = Unavailable(f"repository unreachable: {exc.message}", retry_after=ENGINE_STATE_RETRY)
                elif isinstance(exc, FailedPrecondition) and exc.retry_after is not None:
                    # a refusal with a hint is the repository's state too (its disk failed to
                    # sync, until it restarts): the senders hold the tuples uncharged that long
                    error = Unavailable(f"repository refuses records: {exc.message}", retry_after=exc.retry_after)
            with self._cond:
                self.error = error
                self._in_flight = 0
                self._cond.notify_all()
            self._wake()
            if error is not None:
                return


class Engine:
    """The data path of one channel. Thread-safe; not tied to gRPC.

    At any time at most one Deliver stream or one pulled tuple holds the
    channel's claim (may take its next tuple), and one tuple holds the
    processing slot. A stream that handed the claim over may still be
    processing its last tuple and storing its features meanwhile.
    """

    def __init__(
        self,
        config: EngineConfig,
        pipeline: Pipeline,
        cluster: ClusterLink,
        reporter: Reporter,
        *,
        exit_process: Callable[[int], None] = os._exit,
    ) -> None:
        self._config = config
        self._pipeline = pipeline
        self._cluster = cluster
        self._reporter = reporter
        self._exit = exit_process
        self._channel = config.channel_id
        self._cond = threading.Condition()
        self._active: str | None = None  # "deliver" | "queue" | None: who may take the next tuple
        self._releases_pending = 0  # releases queued at the reporter, not yet sent
        self._tails = 0  # streams handed over whose last tuple is not settled yet
        self._processing_slot = threading.Lock()  # the one tuple processed at a time
        self.processing = False
        self._stop_deadline = StopDeadline()  # stopping began; when Deliver streams still open are cut off
        self._pull_call: PullCall | None = None
        self._compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self._small_compressor = zstandard.ZstdCompressor(level=ZSTD_SMALL_LEVEL)
        self._ticket_key = load_ticket_key(config.ticket_key_file)
        self.idle_seconds = config.stream_idle_seconds
        self.lane: LaneServer | None = None  # the payload lane, when it serves one (create_engine_server)
        self._max_record = record_limit(config)
        self._watchdog = Watchdog(config.tuple_timeout, self._on_timeout)
        self._process_seconds = (  # what its worker's metrics show (GetEngineStats)
            histogram("hio_engine_process_seconds", "process() seconds", PROCESS_BUCKETS) if config.metrics else None
        )
        self._queue_tuple_seconds: float | None = None  # moving average of a queue tuple's processing time
        self._puller = threading.Thread(target=self._pull_loop, name="puller", daemon=True)
        # Two threads kept to run beside the processing of pulled tuples (:meth:`_beside`): starting
        # one waits until it runs, a time slice on a loaded machine.
        self._background = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="beside-pull")

    def stats(self) -> engine_pb2.GetEngineStatsResponse:
        """What this engine measured since it started (empty with ``metrics`` off)."""
        if self._process_seconds is None:
            return engine_pb2.GetEngineStatsResponse()
        counts = bucket_counts(self._process_seconds)
        return engine_pb2.GetEngineStatsResponse(
            process_bucket_bounds=counts.bounds,
            process_bucket_counts=[int(c) for c in counts.counts],
            process_seconds_sum=counts.total,
        )

    def start(self) -> None:
        self._puller.start()

    @property
    def _stopping(self) -> bool:
        """Stopping began (:meth:`stop`): new work is refused."""
        return self._stop_deadline.begun

    def stop(self, grace: float) -> None:
        """Refuse new work, let the current tuple finish (up to ``grace`` s), flush reports. A
        tuple still arriving may finish within half of ``grace``; then its stream ends with
        UNAVAILABLE, saying to send the rest elsewhere (:meth:`deliver_cut`)."""
        with self._cond:
            self._stop_deadline.begin(grace / 2)
            call = self._pull_call
            self._cond.notify_all()
        if call is not None:
            call.cancel()
        with self._cond:
            if not self._cond.wait_for(lambda: self._active is None and self._tails == 0, timeout=grace):
                log.warning("stopping with a tuple still in progress", extra={"channel": self._channel})
        self._reporter.stop(timeout=min(2.0, grace))
        self._puller.join(1.0)
        self._background.shutdown(wait=False)

    def deliver_cut(self) -> Unavailable | None:
        """The error a Deliver stream still open ends with once the stop's finish time is over."""
        return self._stopping_error("the rest ") if self._stop_deadline.due() else None

    def _stopping_error(self, what: str = "") -> Unavailable:
        """UNAVAILABLE with a hint: the sender retries ``what`` on another channel, uncharged."""
        return Unavailable(f"channel {self._channel} is stopping; send {what}elsewhere", retry_after=ENGINE_STATE_RETRY)

    def _claim(self) -> None:
        with self._cond:
            if self._stopping:
                raise self._stopping_error()
            if self._active is not None:
                raise ResourceExhausted(f"channel {self._channel} busy", retry_after=0.05)
            self._active = "deliver"
        self._reporter.set_busy(True)

    def _unclaim(self, *, pull_done: bool = False) -> None:
        """Free the channel and report the release; the puller waits until every release is sent.
        ``pull_done``: the release ends a pull (what it did not report goes back to the queue)."""
        self._reporter.set_busy(False)
        with self._cond:
            self._active = None
            self._releases_pending += 1
            self._cond.notify_all()
        self._reporter.release(self._released, pull_done=pull_done)

    def _hand_over(self) -> None:
        """Free the channel for the next stream while this one's last tuple is processed and stored."""
        with self._cond:
            self._tails += 1
        self._unclaim()

    def _released(self, pull_queue: bool) -> None:
        with self._cond:
            self._releases_pending -= 1
            self._cond.notify_all()
        if pull_queue:
            log.debug("master has queued work", extra={"channel": self._channel})

    def _reader(self, frames: Iterable[TupleFrame | ChunkFrame], max_chunk_bytes: int | None) -> FrameReader:
        """A reader of a stream of tuples for this engine (a ChunkFrame reads like a TupleFrame
        there); ``max_chunk_bytes``: the largest frame payload, by default a gRPC message's."""
        return FrameReader(
            cast("Iterable[TupleFrame]", frames),
            max_tuple_bytes=self._config.max_tuple_bytes,
            max_chunk_bytes=max_chunk_bytes or message_limit(self._config),
            need_id=True,
        )

    def deliver(
        self, frames: Iterable[TupleFrame | ChunkFrame], *, max_chunk_bytes: int | None = None
    ) -> Iterator[TupleReceipt]:
        """Serve one Deliver stream: a receipt per tuple, in order, a STORED one once its record is
        stored (:class:`_BatchStorer`, :class:`_Prefetcher`). Raises ResourceExhausted when the
        channel is busy, FailedPrecondition for a tuple of another image, DataLoss/InvalidArgument
        for a damaged stream (after the receipts of the tuples before it). ``max_chunk_bytes``:
        the largest frame payload (the payload lane sends a tuple as one frame)."""
        self._claim()
        events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        reader = self._reader(frames, max_chunk_bytes)
        prefetch = _Prefetcher(reader, events.put, self._hand_over)
        storer = _BatchStorer(
            self._cluster.store_many,
            self._stored,
            lambda: events.put(("wake", None)),
            max_records=self._config.store_batch_records,
            max_bytes=self._max_record,
            max_pending=self._config.store_pending_records,
            on_refused=self._refused,
        )
        try:
            yield from self._serve(prefetch, storer, events, reader)
        finally:
            handed_over = prefetch.close()
            storer.close(STORER_JOIN_SECONDS)
            if handed_over:  # its last tuple is settled
                with self._cond:
                    self._tails -= 1
                    self._cond.notify_all()
            else:
                self._unclaim()

    def _serve(
        self,
        prefetch: _Prefetcher,
        storer: _BatchStorer,
        events: queue.SimpleQueue[tuple[str, Any]],
        reader: FrameReader,
    ) -> Iterator[TupleReceipt]:
        """The stream's loop: take events (a tuple, the end, an error, a stored batch), answer in order.

        An error of the stream or of a tuple stops taking tuples; the receipts
        of the tuples before it are still sent, then the error ends the stream.
        A storage failure ends it at once: unanswered tuples are redelivered.

        Receipts are sent when no tuple is waiting, or once the oldest has
        waited :data:`ANSWER_DELAY`: sending a gRPC response blocks this
        thread until it is written, which, once per small tuple, costs more than
        processing it.
        """
        slots: collections.deque[_Slot] = collections.deque()
        failure: BaseException | None = None
        ended = False
        index = 0
        answers: list[TupleReceipt] = []
        since = 0.0
        while True:
            while slots and (receipt := slots[0].receipt) is not None:
                if not answers:
                    since = time.monotonic()
                slots.popleft()
                answers.append(receipt)
            finishing = storer.error is not None or (ended and not slots)
            if answers and (finishing or events.empty() or time.monotonic() - since >= ANSWER_DELAY):
                if reader.packed:  # the sender packs: one message for all receipts ready now
                    yield packed(answers)
                else:
                    yield from answers
                answers = []
            if storer.error is not None:
                raise storer.error
            if ended and not slots:
                if failure is not None:
                    raise failure
                return
            kind, value = events.get()
            if kind == "tuple" and not ended:
                try:
                    slots.append(self._take_tuple(index, value[0], value[1], storer, prefetch.started))  # (meta, data)
                except BaseException as exc:  # noqa: BLE001 - sent after the earlier receipts
                    ended, failure = True, exc
                value = None  # the payload must not outlive its processing (memory: two tuples a channel)
                index += 1
            elif kind == "end":
                ended = True
            elif kind == "error" and not ended:
                ended, failure = True, value

    def _take_tuple(
        self, index: int, meta: TupleMeta, data: bytes, storer: _BatchStorer, started: Callable[[], None]
    ) -> _Slot:
        """Check and process one tuple of a stream; its record goes to ``storer``."""
        if self._stopping:
            raise self._stopping_error("the rest ")
        self._check_image(meta)
        slot = _Slot(index, meta)
        result = self._compute(meta, data, from_queue=False, started=started)
        if isinstance(result, str):
            try:
                dead = self._hand_back(meta, data, result)
            except HioError as exc:
                # The master's queue did not take it back (unreachable, or its disk failed to sync): the
                # tuple fails to its sender, which counts the attempt and sends it again, and the stream
                # goes on, so the tuples after it are not charged an attempt.
                message = truncate(f"{result}; the master's queue did not take it back: {exc.message}")
                return self._fail(
                    slot, message, "failed tuple not taken back by the master; its sender retries it", exc.message
                )
            self._report_failed(meta, result, from_queue=False)
            slot.answer(
                TupleReceipt.ENQUEUED,
                message=result,
                dead_lettered=dead,
                queued=TupleReceipt.DEAD_LETTER if dead else TupleReceipt.RETRYING,
            )
        else:
            slot.blob, slot.cpu = result
            storer.submit(slot)
        return slot

    def _stored(self, slots: list[_Slot], duplicates: list[bool]) -> None:
        """A batch is in the repository: report each tuple and make its receipt STORED."""
        self._reporter.outcomes(
            [self._outcome(slot.meta, ok=True, from_queue=slot.from_queue, seconds=slot.cpu) for slot in slots]
        )
        debug = log.isEnabledFor(logging.DEBUG)  # else no log record is built per tuple
        for slot, duplicate in zip(slots, duplicates, strict=True):
            if debug:
                log.debug(
                    "tuple stored",
                    extra={
                        "channel": self._channel,
                        "tuple_id": slot.meta.tuple_id,
                        "bytes": len(slot.blob),
                        "duplicate": duplicate,
                        "cpu_s": round(slot.cpu, 4),
                    },
                )
            if not slot.from_queue:  # a pulled tuple's answer is its report
                slot.answer(TupleReceipt.STORED)

    def _refused(self, slot: _Slot, message: str) -> None:
        """The repository refused this tuple's record: the tuple fails (its sender, or the master
        for a queued one, counts an attempt and, if it keeps failing, it ends in the dead letters
        with this reason)."""
        error = truncate(f"cannot store features: {message}")
        self._fail(slot, error, "features refused by the repository", error)

    def _check_image(self, meta: TupleMeta) -> None:
        """Refuse a tuple of another image, or one the master did not route (ticket)."""
        if meta.image != self._config.image:
            raise FailedPrecondition(
                f"tuple {meta.tuple_id} is for image {meta.image!r} but channel "
                f"{self._channel} runs {self._config.image!r}"
            )
        if self._ticket_key and not verify_ticket(self._ticket_key, meta.tuple_id, meta.image, meta.ticket):
            raise PermissionDenied(
                f"tuple {meta.tuple_id}: its ticket does not match; "
                "only tuples routed by this cluster's master are accepted"
            )

    def _fail(self, slot: _Slot, message: str, what: str, reason: str) -> _Slot:
        """The tuple fails to its sender with ``message`` (``what`` and ``reason`` for the log)."""
        log.warning(what, extra={"channel": self._channel, "tuple_id": slot.meta.tuple_id, "error": reason})
        self._report_failed(slot.meta, message, from_queue=slot.from_queue)
        return slot.answer(TupleReceipt.FAILED, message=message)

    def _hand_back(self, meta: TupleMeta, data: bytes, error: str, deadline: float | None = None) -> bool:
        """Give a failed direct tuple to the master's queue with attempt+1 and the error;
        whether the master kept it as a dead letter (its attempts used up) instead."""
        again = TupleMeta()
        again.CopyFrom(meta)
        again.attempt = max(meta.attempt, 1) + 1
        again.attributes[LAST_ERROR_KEY] = truncate(error)
        receipt = self._cluster.enqueue(again, data, deadline)
        log.info(
            "tuple failed; handed back to the master",
            extra={
                "channel": self._channel,
                "tuple_id": meta.tuple_id,
                "attempt": again.attempt,
                "error": error,
                "dead_lettered": receipt.dead_lettered,
            },
        )
        return receipt.dead_lettered

    def _compute(
        self, meta: TupleMeta, data: bytes, *, from_queue: bool, started: Callable[[], None] | None = None
    ) -> tuple[bytes, float] | str:
        """Run the pipeline on one tuple in the processing slot: (compressed record, CPU seconds), or the error.

        ``started`` runs once the slot is ours. When the channel was handed
        over meanwhile and nothing claimed it, the master learns the slot is free.
        """
        with self._processing_slot:
            self.processing = True
            if started is not None:
                started()
            try:
                return self._run_pipeline(meta, data, from_queue=from_queue)
            finally:
                self.processing = False
                with self._cond:
                    handed_over = self._active is None
                if handed_over:
                    self._reporter.processing_ended()

    def _run_pipeline(self, meta: TupleMeta, data: bytes, *, from_queue: bool) -> tuple[bytes, float] | str:
        job = self._watchdog.begin(meta, data, from_queue)
        cpu_start = time.thread_time()
        started = time.perf_counter()
        try:
            result = self._pipeline.process(data, TupleInfo.from_meta(meta))
            cpu = time.thread_time() - cpu_start
            record = build_record(
                result,
                meta,
                kd_features=self._pipeline.kd_features,
                engine=self._channel,
                processed_unix=time.time(),
                processing_seconds=cpu,
            )
        except BaseException as exc:  # noqa: BLE001 - user code may raise anything (CancelledError, a Timeout)
            error = truncate(f"{type(exc).__name__}: {exc}")
            log.info("pipeline failed", extra={"channel": self._channel, "tuple_id": meta.tuple_id, "error": error})
            return error
        finally:
            self._watchdog.end(job)
            if self._process_seconds is not None:
                self._process_seconds.observe(time.perf_counter() - started)
        serialized = record.SerializeToString()
        if len(serialized) > FEATURE_RECORD_DECOMPRESSED_BYTES:
            return truncate(
                f"FeatureError: features of {len(serialized)} bytes (before compression) are over "
                f"the repository's limit of {FEATURE_RECORD_DECOMPRESSED_BYTES}"
            )
        compressor = self._small_compressor if len(serialized) <= ZSTD_SMALL_BYTES else self._compressor
        blob = compressor.compress(serialized)
        if len(blob) > self._max_record:
            return truncate(
                f"FeatureError: compressed features of {len(blob)} bytes are over the limit of {self._max_record}"
            )
        return blob, cpu

    def _report_failed(self, meta: TupleMeta, message: str, *, from_queue: bool) -> None:
        self._reporter.outcomes([self._outcome(meta, ok=False, from_queue=from_queue, message=message)])

    @staticmethod
    def _outcome(
        meta: TupleMeta, *, ok: bool, from_queue: bool, message: str = "", seconds: float = 0.0
    ) -> master_pb2.TupleOutcome:
        return master_pb2.TupleOutcome(
            tuple_id=meta.tuple_id,
            ok=ok,
            message=message,
            from_queue=from_queue,
            size=meta.size,
            processing_seconds=seconds,
            accepted_unix=meta.accepted_unix,
            stored_unix=time.time(),
        )

    def _on_timeout(self, job: _Job) -> None:
        """Hand the hung tuple back (synchronously, bounded), then end the process."""
        message = f"timeout after {self._config.tuple_timeout:g} s"
        log.error(
            "tuple timed out; handing it back and restarting",
            extra={"channel": self._channel, "tuple_id": job.meta.tuple_id, "timeout_s": self._config.tuple_timeout},
        )
        try:
            if not job.from_queue:
                self._hand_back(job.meta, job.data, message, deadline=HANDOFF_DEADLINE)
            outcome = self._outcome(job.meta, ok=False, from_queue=job.from_queue, message=message)
            self._cluster.report(
                master_pb2.ReportTuplesRequest(channel_id=self._channel, outcomes=[outcome]), timeout=HANDOFF_DEADLINE
            )
        except HioError as exc:
            log.error(
                "could not hand the timed-out tuple back; its sender will redeliver it",
                extra={"channel": self._channel, "tuple_id": job.meta.tuple_id, "reason": exc.message},
            )
        finally:
            self._reporter.stop(timeout=1.0)  # outcomes of earlier tuples still on their way
            logging.shutdown()
            self._exit(TIMEOUT_EXIT_CODE)

    def _wait_idle(self) -> bool:
        """Block until the channel is idle and its last release was sent; False when stopping."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or (self._active is None and not self._releases_pending))
            return not self._stopping

    def _pull_loop(self) -> None:
        backoff = Backoff(base=0.2, cap=2.0)
        while self._wait_idle():
            started = time.monotonic()
            try:
                got = self._pull_once()
                backoff.reset()
                if got or time.monotonic() - started >= MIN_EMPTY_PULL:
                    continue
                delay = MIN_EMPTY_PULL  # the master answered "nothing" at once: do not spin
            except HioError as exc:
                delay = backoff.delay(exc.retry_after)
                log.info(
                    "pulling from the queue failed; retrying",
                    extra={"channel": self._channel, "reason": exc.message, "retry_in_s": round(delay, 2)},
                )
            except BaseException:  # the puller must outlive any one tuple
                log.exception("pulling from the queue failed unexpectedly", extra={"channel": self._channel})
                delay = backoff.delay()
            with self._cond:
                self._cond.wait_for(lambda: self._stopping, timeout=delay)

    def _pull_once(self) -> bool:
        """One long-poll; process the tuples it brings, then the pulls fetched meanwhile.

        While the last tuple of a pull is processed the next pull is fetched
        (``pull_ahead``; docs/architecture.md, "The data path", 4) if this one
        came full (one that came short drained the queue: the next waits as a
        long-poll, so tuples come in batches rather than one by one as they
        arrive) and :meth:`_worth_pulling_ahead`; meanwhile the last pull's
        features are stored (:meth:`_beside`). Whatever is held and not
        reported when this ends goes back to the queue with the release, not
        charged; when the repository could not store, Unavailable with a hint
        then holds the puller back a while. False when the long-poll brought
        nothing.
        """
        got = self._pull(self._config.pull_wait, claim=True)
        if got is None:
            return False
        pulled, full = got
        storing: concurrent.futures.Future[bool] | None = None
        stored = True
        try:
            while pulled:
                done, complete, ahead = self._process_pulled(pulled, ahead=full and self._worth_pulling_ahead())
                if storing is not None and not storing.result():
                    complete = False  # the repository cannot store: these go back unreported
                else:
                    storing = self._beside(functools.partial(self._store_pulled, done), False)
                pulled, full = (ahead.result() if ahead is not None else None) or ([], False)
                if not complete or self._stopping:
                    break
        finally:
            if storing is not None:
                stored = storing.result()
            self._unclaim(pull_done=True)
        if not stored:  # the puller waits before it pulls (and processes) them again
            raise Unavailable("the repository cannot store features", retry_after=ENGINE_STATE_RETRY)
        return True

    def _pull(self, wait: float, *, claim: bool) -> Pulled | None:
        """Pull from the queue (waiting up to ``wait`` s for tuples) and read the pull whole: its
        tuples, and whether it came full (as many as asked, or another like the last would not
        have fitted in the bytes: then more are likely waiting). None when nothing came or the
        engine is stopping.

        ``claim``: a long-poll; the engine's stop cancels it, and once tuples come
        it waits for a Deliver stream that raced it to end and takes the channel.
        Otherwise a pull ahead, for a channel already claimed: never cancelled (it
        waits for nothing, and a pull cut off while its tuples are sent would charge
        them, as the master cannot tell a broken stream from an engine that died on
        them); read whole, they go back uncharged with the release.
        """
        if self._stopping:
            return None
        max_tuples, max_bytes = self._pull_size()
        call = self._cluster.pull(self._channel, wait, max_tuples=max_tuples, max_bytes=max_bytes)
        if claim:
            with self._cond:
                if self._stopping:
                    call.cancel()
                    return None
                self._pull_call = call
        try:
            frames = call.frames()
            first = next(frames, None)
            if first is None:
                return None
            if claim and not self._claim_for_queue():
                call.cancel()
                return None
            try:
                pulled = self._read_pulled(itertools.chain([first], frames), first.meta, call.max_chunk_bytes)
            except BaseException:
                if claim:
                    self._unclaim(pull_done=True)
                raise
        finally:
            if claim:  # a pull ahead never registered itself
                with self._cond:
                    self._pull_call = None
        size = sum(len(data) for _, data in pulled)
        return pulled, bool(pulled) and (len(pulled) >= max_tuples or size + len(pulled[-1][1]) > max_bytes)

    def _beside(self, call: Callable[[], T], failed: T) -> concurrent.futures.Future[T]:
        """Run ``call`` beside the processing of pulled tuples: fetching the next pull (pulling
        only once idle would leave the slot idle for a release, a pull and the transfer), and
        storing the last pull's features (the answer waits for the repository's fsync, time the
        slot would otherwise spend idle). A failure is logged and gives ``failed``."""

        def run() -> T:
            try:
                return call()
            except HioError as exc:  # the caller goes on as after the failure it stands for
                log.debug("background call failed", extra={"reason": exc.message})
            except BaseException:  # must not stop the puller
                log.exception("background call failed unexpectedly")
            return failed

        try:
            return self._background.submit(run)
        except RuntimeError:  # shut down: the engine is stopping
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            future.set_result(failed)
            return future

    def _worth_pulling_ahead(self) -> bool:
        """Pull ahead only for tuples known to take at most ``AHEAD_MAX_SECONDS`` (why:
        docs/architecture.md, "The data path", 4)."""
        seconds = self._queue_tuple_seconds
        return self._config.pull_ahead and seconds is not None and seconds <= AHEAD_MAX_SECONDS

    def _pull_size(self) -> tuple[int, int]:
        """How many queued tuples (and bytes) to ask for: about ``pull_batch_seconds`` of work,
        one at a time until a tuple's cost is known (docs/architecture.md, "The data path", 4)."""
        seconds = self._queue_tuple_seconds
        budget = self._config.pull_batch_seconds
        if seconds is None or budget <= 0:
            return 1, 0
        count = min(budget / max(seconds, 1e-5), float(self._config.pull_batch_tuples))
        return max(1, int(count)), self._config.pull_batch_bytes

    def _claim_for_queue(self) -> bool:
        """Wait for a Deliver stream that raced us to end, then take the channel."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or self._active is None)
            if self._stopping:
                return False
            self._active = "queue"
        self._reporter.set_busy(True)
        return True

    def _process_pulled(
        self, pulled: list[tuple[TupleMeta, bytes]], *, ahead: bool
    ) -> tuple[list[_Slot], bool, concurrent.futures.Future[Pulled | None] | None]:
        """Process the pulled tuples in order; their records (for :meth:`_store_pulled`), True
        when every one was processed, and the next pull when ``ahead`` (fetched beside the
        last tuple's processing). A tuple that fails is reported at once. Stops early when
        stopping, or once the pull has taken three times ``pull_batch_seconds``; what is not
        processed goes back with the release (docs/architecture.md, "The data path", 4).
        """
        started = time.monotonic()
        limit = 3 * self._config.pull_batch_seconds
        done: list[_Slot] = []
        fetching: concurrent.futures.Future[Pulled | None] | None = None
        processed = 0
        for meta, data in pulled:
            if self._stopping or (processed and time.monotonic() - started > limit):
                break
            processed += 1
            if ahead and processed == len(pulled):
                fetching = self._beside(functools.partial(self._pull, 0.0, claim=False), None)
            result = (
                self._compute(meta, data, from_queue=True)
                if meta.image == self._config.image
                else f"channel {self._channel} runs {self._config.image!r}, not {meta.image!r}"
            )
            if isinstance(result, str):
                self._report_failed(meta, result, from_queue=True)
            else:
                done.append(_Slot(len(done), meta, *result, from_queue=True))
        if processed:
            seconds = (time.monotonic() - started) / processed
            previous = self._queue_tuple_seconds
            self._queue_tuple_seconds = seconds if previous is None else 0.7 * previous + 0.3 * seconds
        return done, processed == len(pulled), fetching

    def _read_pulled(
        self, frames: Iterable[TupleFrame | ChunkFrame], first_meta: TupleMeta, max_chunk_bytes: int
    ) -> list[tuple[TupleMeta, bytes]]:
        reader = self._reader(frames, max_chunk_bytes)
        pulled: list[tuple[TupleMeta, bytes]] = []
        try:
            while (item := reader.next_tuple_bytes()) is not None:
                pulled.append(item)
        except HioError as exc:
            damaged = reader.reading or (first_meta if not pulled else None)
            if damaged is not None:  # charged: the master requeues it, or dead-letters it when exhausted
                self._report_failed(damaged, f"damaged queue tuple: {exc.message}", from_queue=True)
            else:
                log.warning(
                    "damaged pull; what follows goes back to the queue",
                    extra={"channel": self._channel, "after_tuple_id": pulled[-1][0].tuple_id, "reason": exc.message},
                )
        return pulled

    def _store_pulled(self, done: list[_Slot]) -> bool:
        """Store the records in batches of the repository call's bounds (:func:`store_batch`),
        reporting them; False when the repository could not be reached (past
        ``rpc_deadline``): the rest, not reported, goes back with the release, not charged."""
        waiting = collections.deque(done)
        while waiting:
            batch = take_batch(waiting, self._config.store_batch_records, self._max_record)
            try:
                store_batch(self._cluster.store_many, batch, self._stored, self._refused)
            except HioError as exc:
                log.warning(
                    "cannot store features; the pulled tuples go back to the queue",
                    extra={"channel": self._channel, "tuples": len(batch) + len(waiting), "reason": exc.message},
                )
                return False
        return True


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Thin gRPC face of :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @grpc_errors
    def Deliver(self, request_iterator: Iterable[TupleFrame], context: Any) -> Iterator[TupleReceipt]:
        frames = idle_bounded(request_iterator, self._engine.idle_seconds, cut=self._engine.deliver_cut)
        yield from self._engine.deliver(frames)

    @grpc_errors
    def GetEngineStats(
        self, request: engine_pb2.GetEngineStatsRequest, context: Any
    ) -> engine_pb2.GetEngineStatsResponse:
        return self._engine.stats()


POLICY = {"Deliver": {"gateway", "worker"}, "GetEngineStats": {"worker", "viewer"}}


def resolve_pipeline(config: EngineConfig) -> str:
    """The pipeline spec: the setting, else $HIO_PIPELINE (container images), else the built-in."""
    return config.pipeline or os.environ.get("HIO_PIPELINE", "") or pipeline_for_image(config.image)


def create_engine_server(
    config: EngineConfig, *, exit_process: Callable[[int], None] = os._exit, pipeline: Pipeline | None = None
) -> tuple[Any, int, Any, Engine]:
    """Load the pipeline (unless given) and build (server not started, port, health, engine started).

    Health is SERVING from the start: the pipeline is loaded before the
    server exists.
    """
    if pipeline is None:
        pipeline = load_pipeline(resolve_pipeline(config))
    cluster = ClusterLink(config, rpc_deadline=config.rpc_deadline, lanes=config.lanes)
    reporter = Reporter(
        config.channel_id,
        cluster.report,
        keepalive=config.reservation_seconds / 3,
        processing=lambda: engine.processing,
    )
    engine = Engine(config, pipeline, cluster, reporter, exit_process=exit_process)
    reporter.start()

    server, port, health, engine.lane = create_server_with_lane(
        config,
        config.listen,
        lane_listen=config.lane_listen,  # the worker chose the port: one that cannot be had is an error
        lane=lambda table: LaneServer(
            config,
            service="Engine",
            uploads={"Deliver": lambda frames: engine.deliver(frames, max_chunk_bytes=config.max_tuple_bytes)},
            table=table,
            policy=POLICY,
        ),
        max_workers=8,
        policy=POLICY,
        service=ROLE_SERVICES["engine"],
        register=[lambda s: engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), s)],
    )
    health.start()
    return server, port, health, engine


def _pipeline_failed(why: str) -> int:
    """Say why on the last line (its worker shows that line); the exit code that says it."""
    print(f"hio engine: cannot load the pipeline: {why}", file=sys.stderr, flush=True)
    return PIPELINE_EXIT_CODE


def run_engine(config: EngineConfig) -> int:
    """`hio engine`: serve one channel until SIGTERM (its worker's death sends one); exit 0 after a clean stop.

    A pipeline that cannot be loaded exits with :data:`PIPELINE_EXIT_CODE` and says why on
    its last line: the worker shows that line as the channel's state."""
    try:
        pipeline = load_pipeline(resolve_pipeline(config))
    except ConfigError as exc:  # no such module or function
        return _pipeline_failed(str(exc))
    except Exception as exc:  # noqa: BLE001 - the user's own code (a SyntaxError, a setup() that raises)
        traceback.print_exc(file=sys.stderr)  # where it failed, in the engine's log
        return _pipeline_failed(f"{type(exc).__name__}: {exc}")
    server, port, health, engine = create_engine_server(config, pipeline=pipeline)
    server.start()
    engine.start()
    log.info(
        "engine serving",
        extra={"channel": config.channel_id, "image": config.image, "port": port, "pipeline": pipeline.spec},
    )

    def stop() -> None:
        health.stop()
        engine.stop(config.grace_seconds)  # new lane calls are refused (UNAVAILABLE) meanwhile
        if engine.lane is not None:
            engine.lane.stop()

    return run_until_signal(server, grace=1.0, on_stop=[stop])
