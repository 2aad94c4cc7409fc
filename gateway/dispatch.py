"""Delivery of spooled tuples: route at the master, stream to a channel or the queue.

``streams`` worker threads each take a batch of consecutive spooled tuples of
one image (at most ``batch_tuples`` and ``batch_bytes``; a bigger tuple goes
alone), ask ``Master.RouteTuples`` for one route, persist the ids, and stream
the batch over one ``Engine.Deliver`` (or ``Master.Enqueue``) call, reading
receipts as they arrive. Routes are gRPC calls on one kept channel to the master;
payloads travel on each peer's :class:`~hio.transport.payload.PayloadChannel` (its
payload lane on kept connections, or gRPC chunks while its lane fails). Payloads
the spool keeps in memory (bytes submitted through the library, within its
``memory_bytes`` bound) are streamed from there; the others are read from the
spool chunk by chunk, so memory stays bounded.

Retry policy (the master owns the rest):

* engine ``RESOURCE_EXHAUSTED`` (channel busy): route again at once, no attempt counted;
* engine not reachable at all (connection refused: killed, restarting, not yet
  expired at the master): route again after about a second, no attempt counted
  (it is not the tuple's fault; the master's reservation keeps the next route off
  that channel until the master expires it);
* engine ``UNAVAILABLE`` with a retry hint (it is stopping, or its repository is
  unreachable): route again after the hint, no attempt counted;
* a full disk anywhere (``RESOURCE_EXHAUSTED``): back off by the hint, no attempt counted;
* broken stream, other ``UNAVAILABLE``, ``DATA_LOSS``, a ``FAILED`` receipt: route
  again with the same id and ``attempt + 1`` after a short jittered backoff;
  but on ``DATA_LOSS`` a tuple whose spooled copy no longer matches its CRC-32 (a
  file rewritten in place) is rejected: sending it again cannot help;
* master ``INVALID_ARGUMENT`` for a lone tuple that carries an id: the id is not
  the master's (its state was reset): route it again as a new tuple;
* master queue full, or refusing tuples with a hint (``FAILED_PRECONDITION``: its disk failed
  to sync, until it restarts): back off
  by the server's hint (logged once), no attempt counted;
* master unreachable: back off and retry, forever (callers decide when to give up);
* ``attempt > max_attempts``: the tuple goes to the master queue anyway, which
  dead-letters it; the caller learns it as :attr:`Outcome.DEAD_LETTERED`.
"""

from __future__ import annotations

import collections
import enum
import heapq
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import BinaryIO

import grpc

from hio.config import lane_beside
from hio.gateway.config import GatewayConfig
from hio.gateway.spool import SpoolEntry
from hio.proto import master_pb2, master_pb2_grpc
from hio.proto.tuple_pb2 import TupleReceipt
from hio.transport.errors import retry_after
from hio.transport.frames import TupleMeta, unpacked_receipts
from hio.transport.lane import LaneError
from hio.transport.net import NEVER_CONNECTED, create_channel, rpc_error_text, rpc_status
from hio.transport.payload import PayloadPeers, Upload

log = logging.getLogger("hio.gateway")

LAST_ERROR_ATTRIBUTE = "hio.last_error"
QUEUE_REFUSAL_SHOWN_SECONDS = 60.0  # how long the status shows the master's queue refusing (then all may go direct)
_QUEUE_REFUSED = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE})
_MASTER_DOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
UNREACHABLE_LOG_SECONDS = 60.0  # an unreachable engine is logged at most once in this long


class Outcome(enum.Enum):
    """How a tuple left the spool."""

    STORED = "stored"  # features in the repository
    ENQUEUED = "enqueued"  # durably in the master's backlog queue
    DEAD_LETTERED = "dead-lettered"  # failed max_attempts times; the master keeps it
    REJECTED = "rejected"  # refused for good (bad tuple); dropped from the spool


Completion = tuple[SpoolEntry, Outcome, str]  # a tuple that left delivery: how, and why (if it failed)


@dataclass(eq=False)
class _Pending:
    """A spooled tuple waiting for (or in) delivery."""

    seq: int
    entry: SpoolEntry
    failure: str = ""  # the last counted failure (dead-letter reason)
    solo: bool = False  # route alone (its batch was refused)
    taken: bool = False  # a delivery thread holds it (not queued, not settled)


@dataclass
class DispatchStats:
    """Counters since start (monotonic, never reset)."""

    sent_direct: int = 0
    sent_queue: int = 0
    bytes_sent_direct: int = 0  # payload of the sent_direct tuples: to engines, never through the master
    bytes_sent_queue: int = 0  # payload of the sent_queue tuples: into the master's queue
    stored: int = 0
    enqueued: int = 0
    failed: int = 0
    retries: int = 0


@dataclass
class DeliveryState(DispatchStats):
    """The counters and what keeps tuples from delivery; :class:`~hio.gateway.client.GatewayStatus`
    adds the spool's figures."""

    #: seconds the master has been failing every call (0 when reachable)
    master_unreachable_seconds: float = 0.0
    #: while the master is unreachable, how its last call failed
    master_error: str = ""
    #: images the master knows no engine for: image -> (seconds refused so far, the master's message)
    unserved_images: dict[str, tuple[float, str]] = field(default_factory=dict)
    #: the master's words while it refuses this gateway (missing or wrong token, certificate), else ''
    master_refusal: str = ""
    #: the master's words while its queue takes no tuples (its disk failed to sync), else ''
    master_queue_refusal: str = ""
    #: tuples streamed by route ("direct", "queue"); each try of a tuple counts
    attempts: dict[str, int] = field(default_factory=dict)
    #: failed calls by peer ("master", "engine") and gRPC status code name
    refusals: dict[tuple[str, str], int] = field(default_factory=dict)


class Dispatcher:
    """Delivers spooled tuples with ``config.streams`` threads. Thread-safe.

    ``add`` hands it an entry; ``on_complete([(entry, outcome, detail), ...])``
    is called (from a worker thread) once tuples are STORED, ENQUEUED,
    dead-lettered or rejected, all those one receipt message settled at once
    (so the spool forgets them in one append); the hook removes them from the spool.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        persist: Callable[[list[SpoolEntry]], None],
        open_payload: Callable[[SpoolEntry], BinaryIO],
        payload_damage: Callable[[SpoolEntry], str],
        on_complete: Callable[[list[Completion]], None],
    ) -> None:
        self._config = config
        self._persist = persist  # ids and attempts into the spool (one append): any redelivery keeps them
        self._open_payload = open_payload
        self._payload_damage = payload_damage
        self._on_complete = on_complete
        self._source = config.resolved_source()
        self._cond = threading.Condition()
        self._ready: list[tuple[int, _Pending]] = []  # heap by seq (ints compare in C)
        self._delayed: list[tuple[float, int, _Pending]] = []  # heap by time
        self._errors: dict[int, str] = {}  # seq -> last error, for callers
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._calls: set[Upload] = set()
        self._channels: dict[str, grpc.Channel] = {}
        self._route_call = master_pb2_grpc.MasterStub(self._channel(config.master_address)).RouteTuples
        self._payload = PayloadPeers(
            config, lanes=config.lanes, channel=self._channel, pack_bytes=config.pack_bytes, logger=log
        )
        self._unreachable_logged: dict[str, float] = {}  # engine address -> when last logged
        self._master_down_since: float | None = None
        self._master_error = ""  # while the master is unreachable: how its last call failed
        self._queue_full_logged = False
        self._queue_refusal = (0.0, "")  # (when, the master's words): its queue refused
        self._unserved: dict[str, tuple[float, str]] = {}  # image -> (since, the master's words)
        self._refusal = ""  # the master's words while it refuses us (auth)
        self._counter = itertools.count()
        self.stats = DispatchStats()
        self._attempts: collections.Counter[str] = collections.Counter()  # route -> tuples streamed (each try)
        self._refusals: collections.Counter[tuple[str, str]] = collections.Counter()  # (peer, code) -> failed calls

    # -- public ----------------------------------------------------------------

    def start(self) -> None:
        for n in range(self._config.streams):
            thread = threading.Thread(target=self._run, name=f"hio-gateway-stream-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def add(self, entry: SpoolEntry) -> None:
        """Queue a spooled tuple for delivery (in spool order). Non-blocking."""
        with self._cond:
            heapq.heappush(self._ready, (entry.seq, _Pending(entry.seq, entry)))
            self._cond.notify()

    def last_error(self, seq: int) -> str:
        """Why the tuple's last delivery attempt failed ('' if none did)."""
        with self._cond:
            return self._errors.get(seq, "")

    def snapshot(self) -> DeliveryState:
        """The counters and what keeps tuples from delivery, in one look under the lock."""
        now = time.monotonic()
        with self._cond:
            down = self._master_down_since
            when, words = self._queue_refusal
            return DeliveryState(
                **asdict(self.stats),
                master_unreachable_seconds=0.0 if down is None else now - down,
                master_error=self._master_error,
                unserved_images={image: (now - since, said) for image, (since, said) in self._unserved.items()},
                master_refusal=self._refusal,
                master_queue_refusal=words if now - when < QUEUE_REFUSAL_SHOWN_SECONDS else "",
                attempts=dict(self._attempts),
                refusals=dict(self._refusals),
            )

    def waiting(self) -> int:
        with self._cond:
            return len(self._ready) + len(self._delayed)

    def stop(self, grace: float) -> None:
        """Take no new batch; let in-flight streams finish for ``grace`` s, then cancel them."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + grace
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        self._close_channels()  # ends the unary calls too (a route to a master that does not answer)
        for thread in self._threads:
            thread.join(5.0)
        self._payload.close()
        self._close_channels()  # any a thread opened meanwhile

    def _close_channels(self) -> None:
        with self._cond:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()

    # -- batching ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._deliver(batch)
            except Exception as exc:  # a worker must never die; the tuple stays spooled
                log.exception("delivery failed unexpectedly")
                with self._cond:  # those settled or already back in the queue are not sent again
                    left = [p for p in batch if p.taken]
                if left:
                    self._retry(left, f"gateway error: {exc}", count_attempt=False, delay=1.0)

    def _next_batch(self) -> list[_Pending] | None:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    pending = heapq.heappop(self._delayed)[2]
                    heapq.heappush(self._ready, (pending.seq, pending))
                if self._ready:
                    return self._take_batch()
                wait = self._delayed[0][0] - now if self._delayed else None
                self._cond.wait(wait)

    def _take_batch(self) -> list[_Pending]:
        """Consecutive ready tuples of the head's image within the batch bounds.

        A stream takes at most its fair share of what is ready (ready / streams,
        at least one): a batch goes to one channel, so when few tuples wait
        (costly processing, moderate rates) they spread over the channels
        instead of queueing behind one engine while another idles; when many
        wait (small tuples, high rates) batches stay large.
        """
        share = max(1, -(-(len(self._ready)) // self._config.streams))
        limit = min(self._config.batch_tuples, share)
        head = heapq.heappop(self._ready)[1]
        head.taken = True
        batch, total = [head], head.entry.size
        if head.solo or self._is_dead(head):
            return batch
        image = head.entry.meta.image
        while self._ready and len(batch) < limit:
            nxt = self._ready[0][1]
            if (
                nxt.entry.meta.image != image
                or nxt.solo
                or self._is_dead(nxt)
                or total + nxt.entry.size > self._config.batch_bytes
            ):
                break
            batch.append(heapq.heappop(self._ready)[1])
            nxt.taken = True
            total += nxt.entry.size
        return batch

    def _is_dead(self, pending: _Pending, charged: int = 0) -> bool:
        """Whether the tuple's attempts, with ``charged`` more, are past ``max_attempts``."""
        return max(pending.entry.meta.attempt, 1) + charged > self._config.max_attempts

    # -- one batch -----------------------------------------------------------

    def _deliver(self, batch: list[_Pending]) -> None:
        dead = self._is_dead(batch[0])
        try:
            route = self._route(batch, force_queue=dead or self._config.force_queue)
        except grpc.RpcError as exc:
            self._route_failed(batch, exc)
            return
        self._master_state()
        self._refusal = ""
        if self._unserved:
            self._image_state(batch[0].entry.meta.image)
        direct = route.HasField("channel") and not dead
        for pending, tuple_id, ticket in zip(batch, route.tuple_ids, route.tickets, strict=True):
            meta = pending.entry.meta
            meta.tuple_id, meta.ticket = tuple_id, ticket
            if pending.failure and not direct:  # the reason the master gives if it keeps a dead letter
                meta.attributes[LAST_ERROR_ATTRIBUTE] = pending.failure[:1000]
        self._persist([p.entry for p in batch])
        if direct:
            self._stream(batch, route.channel.address, direct=True, lane=route.channel.lane_address)
        else:  # the master's payload lane: its port on the host we reach the master at
            port = route.queue.lane_port if route.HasField("queue") else 0
            lane = lane_beside(self._config.master_address, port) if port else ""
            self._stream(batch, self._config.master_address, direct=False, lane=lane)

    def _route(self, batch: list[_Pending], *, force_queue: bool) -> master_pb2.RouteTuplesResponse:
        request = master_pb2.RouteTuplesRequest(
            source=self._source,
            image=batch[0].entry.meta.image,
            force_queue=force_queue,
            wait_seconds=0.0 if force_queue else self._config.route_wait_seconds,
            items=[master_pb2.RouteItem(size=p.entry.size, tuple_id=p.entry.meta.tuple_id) for p in batch],
        )
        timeout = self._config.route_timeout_seconds + request.wait_seconds
        response = self._route_call(request, timeout=timeout)
        if len(response.tuple_ids) != len(batch) or len(response.tickets) != len(batch):
            # an answer the contract does not allow, failed like a call (LaneError reads as one)
            raise LaneError(
                grpc.StatusCode.INTERNAL, f"master answered {len(response.tuple_ids)} ids for {len(batch)} tuples"
            )
        return response

    def _stream(self, batch: list[_Pending], address: str, *, direct: bool, lane: str = "") -> None:
        """One Deliver/Enqueue stream for the batch on the peer's payload channel (its lane
        ``lane`` or gRPC, as :class:`PayloadPeers` chooses); settle each tuple by its receipt."""
        sent: list[_Pending] = []
        skipped: set[int] = set()
        abandoned = threading.Event()  # set once this stream is settled: a late lane sender stops
        call, reading = self._payload.upload(
            address,
            lane,
            "Deliver" if direct else "Enqueue",
            self._payloads(batch, sent, skipped, abandoned),
            timeout=self._config.stream_timeout_seconds,
        )
        with self._cond:
            self._calls.add(call)
            self._attempts["direct" if direct else "queue"] += len(batch)
        settled: set[int] = set()
        try:
            for message in call:
                done: list[tuple[_Pending, Outcome, str]] = []
                for receipt in unpacked_receipts(message):
                    self._settle(receipt, sent, settled, done, direct=direct)
                if done:
                    self._complete_many(done, direct=direct)
        except grpc.RpcError as exc:
            abandoned.set()
            if reading.failure:
                self._read_failed(_unsettled(batch, sent, settled, skipped), sent[-1], reading.failure)
                return
            if getattr(exc, "transport", False) and not settled:
                # The peer's lane broke before it answered anything (closed, garbage, or a kept
                # connection the server had closed): not the tuples' fault. The same route (its
                # reservation is ours) is streamed again at once, uncharged, on the peer's channel
                # now (gRPC when the lane was found broken, else a new lane connection).
                if unsent := [p for p in batch if p.seq not in skipped]:
                    self._stream(unsent, address, direct=direct, lane=lane)
                return
            self._stream_failed(_unsettled(batch, sent, settled, skipped), exc, address, direct=direct)
            return
        finally:
            abandoned.set()
            with self._cond:
                self._calls.discard(call)
        if not direct:
            self._queue_full_logged = False
            self._queue_refusal = (0.0, "")
        left = _unsettled(batch, sent, settled, skipped)
        if left:
            self._retry(left, f"{address}: stream ended without a receipt", count_attempt=True)

    def _payloads(
        self, batch: list[_Pending], sent: list[_Pending], skipped: set[int], abandoned: threading.Event
    ) -> Iterator[tuple[TupleMeta, bytes | BinaryIO]]:
        """Each tuple's metadata and payload (kept in memory, else its spooled file), in order;
        a tuple whose spooled payload is gone is rejected and skipped. Stops once ``abandoned``
        is set (its stream was settled without it: the tuples left are retried elsewhere)."""
        for pending in batch:
            if abandoned.is_set():
                return
            entry = pending.entry
            try:
                payload = entry.payload if entry.payload is not None else self._open_payload(entry)
            except FileNotFoundError:
                skipped.add(pending.seq)
                self._reject(pending, f"spooled payload {entry.data_path} is missing")
                continue
            except OSError:
                sent.append(pending)  # last in ``sent``: the tuple _read_failed blames
                raise
            sent.append(pending)
            yield entry.meta, payload

    def _settle(
        self,
        receipt: TupleReceipt,
        sent: list[_Pending],
        settled: set[int],
        done: list[tuple[_Pending, Outcome, str]],
        *,
        direct: bool,
    ) -> None:
        """Act on one receipt: a tuple it completes goes to ``done``, a failed one is retried.

        An engine answers ENQUEUED only for a tuple whose processing failed and that it
        handed to the master's queue: its words go with the outcome, so the sender can
        say the tuple is not stored yet, and why."""
        if receipt.index >= len(sent) or receipt.index in settled:
            log.warning("receipt for an unknown tuple ignored", extra={"index": receipt.index})
            return
        pending = sent[receipt.index]
        if receipt.tuple_id and receipt.tuple_id != pending.entry.meta.tuple_id:
            # A receiver that numbers tuples otherwise (e.g. one without packing, which skips
            # packed tuples): never settle a tuple on another's receipt; it is delivered again.
            log.warning(
                "receipt names another tuple; ignored",
                extra={
                    "index": receipt.index,
                    "receipt_tuple_id": receipt.tuple_id,
                    "tuple_id": pending.entry.meta.tuple_id,
                },
            )
            return
        state = receipt.state
        if state == TupleReceipt.STORED:
            settled.add(receipt.index)
            done.append((pending, Outcome.STORED, ""))
        elif state == TupleReceipt.ENQUEUED:
            settled.add(receipt.index)
            # The receiver says when the master kept the tuple as a dead letter (the master's
            # max_attempts decides, which may be lower than ours); one that does not say so
            # (an older release) is judged by our own count.
            handed_back = direct and bool(receipt.message)  # charged one attempt: its last one dead-letters it
            dead = receipt.dead_lettered or self._is_dead(pending, charged=int(handed_back))
            if handed_back:
                detail = f"processing failed: {receipt.message}"
            else:
                detail = (pending.failure or receipt.message) if dead else ""
            done.append((pending, Outcome.DEAD_LETTERED if dead else Outcome.ENQUEUED, detail))
        elif state == TupleReceipt.FAILED:
            settled.add(receipt.index)
            self._retry([pending], f"processing failed: {receipt.message}", count_attempt=True)

    # -- outcomes ----------------------------------------------------------------

    def _reject(self, pending: _Pending, detail: str) -> None:
        self._complete_many([(pending, Outcome.REJECTED, detail)])

    def _complete_many(self, done: list[tuple[_Pending, Outcome, str]], *, direct: bool = False) -> None:
        sizes = [p.entry.size for p, outcome, _ in done if outcome in (Outcome.STORED, Outcome.ENQUEUED)]
        stored = sum(outcome is Outcome.STORED for _, outcome, _ in done)
        with self._cond:
            for pending, _, _ in done:
                pending.taken = False
                self._errors.pop(pending.seq, None)
            stats = self.stats
            if direct:
                stats.sent_direct += len(sizes)
                stats.bytes_sent_direct += sum(sizes)
            else:
                stats.sent_queue += len(sizes)
                stats.bytes_sent_queue += sum(sizes)
            stats.stored += stored
            stats.enqueued += len(sizes) - stored
            stats.failed += len(done) - len(sizes)
        for pending, outcome, detail in done:
            if outcome is Outcome.DEAD_LETTERED:
                meta = pending.entry.meta
                extra = {"tuple_id": meta.tuple_id, "tuple_name": meta.name, "error": detail}
                log.warning("tuple dead-lettered at the master", extra=extra)
        try:
            self._on_complete([(pending.entry, outcome, detail) for pending, outcome, detail in done])
        except Exception:  # the hook's failure must not stop delivery of others
            log.exception("completion hook failed", extra={"seqs": [pending.seq for pending, _, _ in done]})

    def _retry(
        self, batch: list[_Pending], error: str, *, count_attempt: bool, delay: float | None = None, solo: bool = False
    ) -> None:
        """Put tuples back for another route after a delay; count the attempt if asked."""
        if count_attempt:
            with self._cond:
                for pending in batch:
                    pending.entry.meta.attempt = max(pending.entry.meta.attempt, 1) + 1
                    pending.failure = error
                    self.stats.retries += 1
            try:
                self._persist([p.entry for p in batch])
            except OSError as exc:  # the count lives on in memory; it is only lost if the gateway stops
                log.error("cannot record the attempt in the spool", extra={"error": str(exc)})
        now = time.monotonic()
        with self._cond:
            for pending in batch:
                pending.taken = False
                pending.solo = pending.solo or solo
                self._errors[pending.seq] = error
                wait = delay if delay is not None else _jitter(pending.entry.meta.attempt)
                heapq.heappush(self._delayed, (now + wait, next(self._counter), pending))
            self._cond.notify_all()
        log.info(
            "tuples back for redelivery", extra={"tuples": len(batch), "error": error, "attempt_counted": count_attempt}
        )

    def _route_failed(self, batch: list[_Pending], exc: grpc.RpcError) -> None:
        code, details, why, error = self._failed_call(exc, "master", self._config.master_address)
        if code in _MASTER_DOWN:
            self._master_down(batch, why, error)
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._retry(batch, error, count_attempt=False, delay=_hinted(exc))
        elif code == grpc.StatusCode.NOT_FOUND:
            self._image_state(batch[0].entry.meta.image, unserved=details)
            self._retry(batch, error, count_attempt=False, delay=random.uniform(2.0, 4.0))
        elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            # A token or certificate problem does not mend itself, but an operator may mend it:
            # the tuples wait in the spool (uncounted); callers can see why (master_refusal).
            if not self._refusal:
                log.error("the master refuses this gateway; tuples wait in the spool", extra={"error": error})
            self._refusal = error
            self._retry(batch, error, count_attempt=False, delay=random.uniform(2.0, 4.0))
        elif code == grpc.StatusCode.INVALID_ARGUMENT and len(batch) > 1:
            self._retry(batch, error, count_attempt=False, delay=0.0, solo=True)
        elif code == grpc.StatusCode.INVALID_ARGUMENT and batch[0].entry.meta.tuple_id:
            self._forget_id(batch[0], details)
        elif code == grpc.StatusCode.INVALID_ARGUMENT:
            self._reject(batch[0], error)
        else:
            log.warning("routing failed", extra={"error": error})
            self._retry(batch, error, count_attempt=False, delay=random.uniform(1.0, 3.0))

    def _failed_call(self, exc: grpc.RpcError, peer: str, address: str) -> tuple[grpc.StatusCode | None, str, str, str]:
        """(code, details, 'CODE: details', the error naming the peer) of a failed call, counted
        among the refusals."""
        code, details = rpc_status(exc)
        with self._cond:
            self._refusals[peer, code.name if code is not None else "UNKNOWN"] += 1
        why = rpc_error_text(exc, self._config)
        return code, details, why, f"{peer} {address}: {why}"

    def _master_down(self, batch: list[_Pending], why: str, error: str) -> None:
        """The master is unreachable: the tuples wait, uncounted, longer the longer that lasts."""
        down = self._master_state(unreachable=why)
        self._retry(batch, error, count_attempt=False, delay=random.uniform(0.5, 1.0) * min(5.0, 0.2 + down / 2))

    def _forget_id(self, pending: _Pending, details: str) -> None:
        """The master refused a tuple that carries an id: most likely the id is not its own (its
        state was reset, or this spool was pointed at another cluster). That is no fault of the
        tuple, so it is routed again as a new tuple rather than dropped; refused again without
        an id, it is rejected for what it is."""
        meta = pending.entry.meta
        log.warning(
            "the master refused the tuple's id; routing it again as a new tuple",
            extra={"tuple_id": meta.tuple_id, "tuple": meta.name, "error": details},
        )
        meta.tuple_id, meta.ticket = 0, b""
        self._persist([pending.entry])
        self._retry([pending], details, count_attempt=False, delay=0.0, solo=True)

    def _stream_failed(self, left: list[_Pending], exc: grpc.RpcError, address: str, *, direct: bool) -> None:
        code, details, why, error = self._failed_call(exc, "engine" if direct else "master", address)
        if not left:
            return
        if code == grpc.StatusCode.CANCELLED and self._stopping:
            return  # stopping: the tuples stay spooled for the next start
        if direct and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._retry(left, error, count_attempt=False, delay=random.uniform(0.0, 0.05))
        elif direct and code == grpc.StatusCode.UNAVAILABLE and retry_after(exc) is not None:
            # The engine says it is its own state (stopping, its repository unreachable; the
            # engine's words may quote a connection failure of its own): not the tuples' fault,
            # so no attempt is counted; routed again after the hint.
            self._engine_unreachable(address, error, what="engine cannot take tuples just now")
            self._retry(left, error, count_attempt=False, delay=_hinted(exc))
        elif direct and code == grpc.StatusCode.UNAVAILABLE and NEVER_CONNECTED in details:
            # Nothing reached the engine, so nothing can have hurt it: a killed worker's
            # channels stay in routing until the master expires them (seconds), and
            # charging each refused route would dead-letter healthy tuples.
            self._engine_unreachable(address, error)
            self._retry(left, error, count_attempt=False, delay=random.uniform(0.5, 1.5))
        elif not direct and (
            code == grpc.StatusCode.RESOURCE_EXHAUSTED or (code in _QUEUE_REFUSED and retry_after(exc) is not None)
        ):
            # The master answers but its queue takes nothing now: full, or (with a hint) its
            # disk failed to sync, for good until it restarts (FAILED_PRECONDITION) or for a
            # round (UNAVAILABLE). The tuples wait here, uncounted, and are routed again after
            # the hint (a channel may be free by then).
            if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._queue_refusal = (time.monotonic(), details)
            if not self._queue_full_logged:
                self._queue_full_logged = True
                log.warning(
                    "queue full, slowing down"
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    else "the master's queue takes no tuples, slowing down",
                    extra={"master": address, "error": details},
                )
            self._retry(left, error, count_attempt=False, delay=_hinted(exc))
        elif not direct and code in _MASTER_DOWN:
            self._master_down(left, why, error)
        elif code == grpc.StatusCode.DATA_LOSS:
            self._check_spooled(left, error)
        else:
            self._retry(left, error, count_attempt=True)

    def _read_failed(self, left: list[_Pending], culprit: _Pending, failure: str) -> None:
        """A spooled payload could not be read while streaming it: a payload gone or changed
        is rejected by name; an unreadable one (a disk error) is tried again, counted, with
        the reason; the tuples beside it were not at fault and go again uncounted."""
        entry = culprit.entry
        error = f"cannot read the spooled payload {entry.data_path} of '{entry.meta.name}': {failure}"
        log.error(
            "cannot read a spooled payload",
            extra={"tuple": entry.meta.name, "path": str(entry.data_path), "error": failure},
        )
        others = [p for p in left if p is not culprit]
        if others:
            self._retry(others, error, count_attempt=False, delay=0.0)
        if culprit in left:
            self._check_spooled([culprit], error)

    def _check_spooled(self, left: list[_Pending], error: str) -> None:
        """The receiver found a payload damaged: if it is our spooled copy, sending it again
        cannot help, so it is rejected by name; the others are retried as after any failure."""
        retry: list[_Pending] = []
        for pending in left:
            why = self._payload_damage(pending.entry)
            if why:
                log.error(
                    "spooled payload damaged; tuple rejected",
                    extra={"tuple": pending.entry.meta.name, "path": str(pending.entry.data_path), "error": why},
                )
                self._reject(pending, why)
            else:
                retry.append(pending)
        if retry:
            self._retry(retry, error, count_attempt=True)

    def _engine_unreachable(
        self, address: str, error: str, what: str = "engine unreachable; routing its tuples again"
    ) -> None:
        """Say that an engine refuses connections (or tuples), at most once a minute per engine."""
        now = time.monotonic()
        with self._cond:
            last = self._unreachable_logged.get(address)
            if last is not None and now - last < UNREACHABLE_LOG_SECONDS:
                return
            self._unreachable_logged[address] = now
        log.warning(what, extra={"engine": address, "error": error})

    # -- master health -------------------------------------------------------------

    def _master_state(self, unreachable: str = "") -> float:
        """The master answered (``unreachable`` ''), or its call failed as an unreachable master's
        do (``unreachable``: 'CODE: details'); each change between the two is logged once. The
        seconds it has been unreachable (0 when it answered)."""
        with self._cond:
            was_down = self._master_down_since is not None
            now = time.monotonic()
            self._master_down_since = (self._master_down_since or now) if unreachable else None
            self._master_error = unreachable
            down = 0.0 if self._master_down_since is None else now - self._master_down_since
        if unreachable and not was_down and not self._stopping:  # a call the stop ended is no news
            log.warning(
                "master unreachable; retrying", extra={"master": self._config.master_address, "error": unreachable}
            )
        elif was_down and not unreachable:
            log.warning("master reachable again", extra={"master": self._config.master_address})
        return down

    def _image_state(self, image: str, unserved: str | None = None) -> None:
        """The master routed ``image`` (``unserved`` None), or knows no channel for it (``unserved``:
        its words, the first kept while that lasts); each change between the two is logged once."""
        with self._cond:
            was_unserved = image in self._unserved
            if unserved is None:
                self._unserved.pop(image, None)
            elif not was_unserved:
                self._unserved[image] = (time.monotonic(), unserved)
        if unserved is not None and not was_unserved:
            log.warning(
                "no channel serves this image; tuples wait in the spool", extra={"image": image, "error": unserved}
            )
        elif was_unserved and unserved is None:
            log.warning("a channel serves this image now", extra={"image": image})

    def _channel(self, address: str) -> grpc.Channel:
        with self._cond:
            if address not in self._channels:
                self._channels[address] = create_channel(address, self._config)
            return self._channels[address]


def _unsettled(batch: list[_Pending], sent: list[_Pending], settled: set[int], skipped: set[int]) -> list[_Pending]:
    """Tuples of the batch without a final receipt: sent but unanswered, or never sent."""
    sent_seqs = {p.seq for p in sent}
    left = [p for i, p in enumerate(sent) if i not in settled]
    return left + [p for p in batch if p.seq not in sent_seqs and p.seq not in skipped]


def _hinted(exc: grpc.RpcError) -> float:
    hint = retry_after(exc)
    return max(hint or 0.0, random.uniform(0.2, 1.0))


def _jitter(attempt: int) -> float:
    """Short jittered backoff that grows with the attempt: ~0.1 s, 0.2 s, 0.4 s ... up to 5 s."""
    return random.uniform(0.5, 1.0) * min(5.0, 0.1 * 2 ** max(0, attempt - 2))
