"""Telling the master what an engine did, without ever making the data path wait.

Outcomes are batched and sent by one background thread, in order: a queued
tuple's outcome (which settles its lease) within ``flush_interval`` seconds,
at once when a release is asked for (a stream's input ended, a queued tuple
is done) or a released channel's last tuple is done. A direct tuple's
outcome only feeds the master's figures (its receipt went to the gateway),
so it waits for the channel's next report, at most ``direct_interval``
seconds: at moderate rates a stream of one tuple then costs one report (its
release), not two. Every report says whether a tuple is being processed. While
the channel is busy the thread sends an empty report every ``keepalive``
seconds so the master keeps the channel's reservation and leases. Reports that fail with a retryable error
are sent again (the master treats them idempotently).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable

from hio.proto import master_pb2
from hio.transport import errors
from hio.transport.retry import Backoff

log = logging.getLogger("hio.worker")

Send = Callable[[master_pb2.ReportTuplesRequest], master_pb2.ReportTuplesResponse]
RETRYABLE = (errors.Unavailable, errors.ResourceExhausted, errors.DeadlineExceeded)
MAX_BATCH = 1000  # outcomes per request, well under the master's bound
MAX_PENDING = 10_000  # outcomes kept while the master is unreachable


@dataclasses.dataclass
class _Release:
    """A release marker: everything before it goes in the request that releases."""

    callback: Callable[[bool], None] | None
    pull_done: bool = False


_Item = master_pb2.TupleOutcome | _Release


class Reporter:
    """Batches outcomes and releases for one channel; thread-safe, never blocks callers.

    ``send`` performs one ReportTuples call and raises ``hio.transport.errors``
    classes on failure. Release callbacks receive the master's ``pull_queue``
    answer (False when the report could not be delivered).
    """

    def __init__(
        self,
        channel_id: str,
        send: Send,
        *,
        keepalive: float,
        flush_interval: float = 0.05,
        direct_interval: float = 1.0,
        processing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._channel_id = channel_id
        self._send = send
        self._processing = processing
        self._keepalive = self._configured_keepalive = keepalive
        self._flush_interval = flush_interval
        self._direct_interval = max(flush_interval, direct_interval)
        self._queue_outcomes = 0  # outcomes pending that settle a lease: these go within flush_interval
        self._releases = 0  # releases pending: they go at once
        self._cond = threading.Condition()
        self._items: collections.deque[_Item] = collections.deque()
        self._busy = False
        self._state_due = False
        self._stopping = False
        self._stop_deadline = float("inf")
        self._exited = False
        self._last_sent = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"reporter-{channel_id}", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def outcomes(self, outcomes: Iterable[master_pb2.TupleOutcome]) -> None:
        """Queue tuples' outcomes (when each goes: the module docstring).

        The thread is woken only when these make a report due sooner than it
        planned: the first item, or the first queued tuple's outcome. Waking it
        for every small direct tuple would cost a thread switch each.
        """
        with self._cond:
            wake = not self._items
            for outcome in outcomes:
                self._items.append(outcome)
                if outcome.from_queue:
                    wake = wake or not self._queue_outcomes
                    self._queue_outcomes += 1
            self._drop_excess()
            if wake or len(self._items) >= MAX_BATCH:
                self._cond.notify()

    def release(self, callback: Callable[[bool], None] | None = None, *, pull_done: bool = False) -> None:
        """Queue a release of the channel; ``callback(pull_queue)`` runs once it was sent.
        ``pull_done``: it ends a pull; what was pulled and not reported goes back to the queue.

        A release that comes after the reporter stopped (work that outlived the
        engine's grace) is sent by the caller, within what is left of the stop's
        time (at least one try): otherwise the master would hold what the
        channel pulled until its lease ran out.
        """
        release = _Release(callback, pull_done)
        with self._cond:
            if not self._exited:
                self._items.append(release)
                self._releases += 1
                self._cond.notify()
                return
        self._send_batch([], [release])

    def processing_ended(self) -> None:
        """A released channel finished its last tuple: tell the master at once (routing prefers it now)."""
        with self._cond:
            self._state_due = True
            self._cond.notify()

    def set_busy(self, busy: bool) -> None:
        """While busy, empty keep-alive reports hold the channel's reservation."""
        with self._cond:
            self._busy = busy
            self._cond.notify()

    def stop(self, timeout: float) -> None:
        """Send what is pending (for at most ``timeout`` seconds), then stop the thread."""
        with self._cond:
            self._stopping = True
            self._stop_deadline = time.monotonic() + timeout
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout + 1.0)

    def _drop_excess(self) -> None:
        """Bound memory while the master is unreachable: forget the oldest outcomes."""
        excess = len(self._items) - MAX_PENDING
        if excess <= 0:
            return
        kept: collections.deque[_Item] = collections.deque()
        for item in self._items:
            if excess > 0 and isinstance(item, master_pb2.TupleOutcome):
                excess -= 1
                self._queue_outcomes -= item.from_queue
                continue
            kept.append(item)
        self._items = kept
        log.warning(
            "master unreachable: dropped the oldest tuple outcomes",
            extra={"channel": self._channel_id, "pending": len(self._items)},
        )

    def _next_batch(self) -> tuple[list[master_pb2.TupleOutcome], list[_Release]] | None:
        """Wait for something to send (nothing: a keep-alive); (outcomes, releases) or None to stop."""
        with self._cond:
            while True:
                now = time.monotonic()
                has_release = self._releases > 0
                interval = self._flush_interval if self._queue_outcomes else self._direct_interval
                batch_due = bool(self._items) and (
                    has_release or self._stopping or len(self._items) >= MAX_BATCH or now - self._last_sent >= interval
                )
                keepalive_due = (self._busy and now - self._last_sent >= self._keepalive) or self._state_due
                if batch_due or keepalive_due:
                    return self._take()
                if self._stopping and not self._items:
                    self._exited = True  # under the lock: a later release is sent by its caller
                    return None
                waits = [self._keepalive - (now - self._last_sent)] if self._busy else [self._keepalive]
                if self._items:
                    waits.append(interval - (now - self._last_sent))
                self._cond.wait(max(0.005, min(waits)))

    def _take(self) -> tuple[list[master_pb2.TupleOutcome], list[_Release]]:
        self._state_due = False
        outcomes: list[master_pb2.TupleOutcome] = []
        releases: list[_Release] = []
        while self._items and len(outcomes) < MAX_BATCH:
            item = self._items.popleft()
            if isinstance(item, _Release):
                releases.append(item)
                self._releases -= 1
                break  # a release ends a request: later outcomes belong to the next use
            outcomes.append(item)
            self._queue_outcomes -= item.from_queue
        return outcomes, releases

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            self._send_batch(*batch)

    def _send_batch(self, outcomes: list[master_pb2.TupleOutcome], releases: list[_Release]) -> None:
        """One report of these outcomes and releases; each release's callback gets the answer."""
        request = master_pb2.ReportTuplesRequest(
            channel_id=self._channel_id,
            outcomes=outcomes,
            release=bool(releases),
            processing=self._processing(),
            pull_done=any(r.pull_done for r in releases),
        )
        pull_queue = self._deliver(request)
        for release in releases:
            if release.callback is not None:
                release.callback(pull_queue)

    def _deliver(self, request: master_pb2.ReportTuplesRequest) -> bool:
        """Send one request, retrying while the master is unavailable; its pull_queue."""
        backoff = Backoff(base=0.05, cap=2.0)
        while True:
            try:
                reply = self._send(request)
                holds = [t for t in (reply.reservation_seconds, reply.lease_seconds) if t > 0]
                with self._cond:
                    self._last_sent = time.monotonic()
                    if holds:  # keep alive at least every third of the master's shorter hold time
                        self._keepalive = min(self._configured_keepalive, min(holds) / 3)
                return bool(reply.pull_queue)
            except RETRYABLE as exc:
                with self._cond:
                    give_up = self._stopping and time.monotonic() >= self._stop_deadline
                if give_up:
                    log.warning(
                        "report not delivered before stopping",
                        extra={"channel": self._channel_id, "reason": exc.message},
                    )
                    return False
                log.info("report failed; retrying", extra={"channel": self._channel_id, "reason": exc.message})
                time.sleep(min(backoff.delay(exc.retry_after), max(0.0, self._stop_deadline - time.monotonic())))
            except Exception as exc:  # noqa: BLE001 - refused (or broken): drop it, keep reporting
                log.warning(
                    "master refused a report; dropped",
                    extra={
                        "channel": self._channel_id,
                        "outcomes": len(request.outcomes),
                        "reason": exc.message if isinstance(exc, errors.HioError) else repr(exc),
                    },
                )
                with self._cond:
                    self._last_sent = time.monotonic()
                return False
