"""Reporter batching, ordering, keep-alive and retry, without a network.

``send`` here is the one function the reporter calls; a recording function
shows what the master would receive and can answer like it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from hio.proto import master_pb2
from hio.transport.errors import InvalidArgument, Unavailable
from hio.worker.reporter import MAX_BATCH, Reporter
from tests.harness import wait_for


class Recorder:
    def __init__(self, fail_first: int = 0, pull_queue: bool = False) -> None:
        self.requests: list[master_pb2.ReportTuplesRequest] = []
        self.fail_first = fail_first
        self.pull_queue = pull_queue
        self.lock = threading.Lock()

    def __call__(self, request: master_pb2.ReportTuplesRequest) -> master_pb2.ReportTuplesResponse:
        with self.lock:
            if self.fail_first > 0:
                self.fail_first -= 1
                raise Unavailable("master: UNAVAILABLE: connection refused")
            self.requests.append(request)
        return master_pb2.ReportTuplesResponse(pull_queue=self.pull_queue)


def _outcome(tuple_id: int, *, from_queue: bool = False) -> master_pb2.TupleOutcome:
    return master_pb2.TupleOutcome(tuple_id=tuple_id, ok=True, size=1, from_queue=from_queue)


@contextlib.contextmanager
def _running(send: Recorder, **intervals: Any) -> Iterator[Reporter]:
    """A started reporter (queued outcomes within 50 ms, direct ones after 30 s unless
    ``intervals`` say otherwise), stopped at the end."""
    settings = {"keepalive": 60.0, "flush_interval": 0.05, "direct_interval": 30.0, **intervals}
    reporter = Reporter("w/0", send, **settings).start()
    try:
        yield reporter
    finally:
        reporter.stop(timeout=2)


def test_outcomes_are_batched_and_a_release_closes_a_request() -> None:
    send = Recorder(pull_queue=True)
    reporter = Reporter("w/0", send, keepalive=60.0, flush_interval=0.2).start()
    answers: list[bool] = []
    for i in range(1, 4):
        reporter.outcomes([_outcome(i)])
    reporter.release(answers.append)
    reporter.outcomes([_outcome(4)])
    wait_for(lambda: answers, timeout=5, what="the release callback")
    reporter.stop(timeout=2)
    assert answers == [True]
    ids = [[o.tuple_id for o in r.outcomes] for r in send.requests]
    assert ids[0] == [1, 2, 3] and send.requests[0].release and send.requests[0].channel_id == "w/0"
    assert ids[1:] == [[4]] and not send.requests[1].release  # flushed on stop


def test_unavailable_master_is_retried_in_order() -> None:
    send = Recorder(fail_first=3)
    reporter = Reporter("w/0", send, keepalive=60.0, flush_interval=0.01).start()
    reporter.outcomes([_outcome(1)])
    done = threading.Event()
    reporter.release(lambda _pull: done.set())
    assert done.wait(10)
    reporter.stop(timeout=1)
    assert [o.tuple_id for r in send.requests for o in r.outcomes] == [1]
    assert any(r.release for r in send.requests)


def test_refused_report_is_dropped_and_the_release_still_answers() -> None:
    def refuse(request: master_pb2.ReportTuplesRequest) -> master_pb2.ReportTuplesResponse:
        raise InvalidArgument("master: INVALID_ARGUMENT: unknown channel")

    reporter = Reporter("w/0", refuse, keepalive=60.0).start()
    answers: list[bool] = []
    reporter.release(answers.append)
    wait_for(lambda: answers, timeout=5, what="the release callback")
    reporter.stop(timeout=1)
    assert answers == [False]


def test_busy_channel_sends_keepalives_and_idle_one_does_not() -> None:
    send = Recorder()
    reporter = Reporter("w/0", send, keepalive=0.1).start()
    time.sleep(0.35)
    assert send.requests == []
    reporter.set_busy(True)
    time.sleep(1.0)
    reporter.set_busy(False)
    reporter.stop(timeout=1)
    empties = [r for r in send.requests if not r.outcomes and not r.release]
    assert 3 <= len(empties) <= 12, f"about one a keepalive (0.1 s) over 1 s busy: {len(empties)}"


def test_reports_say_whether_a_tuple_is_in_progress_and_its_end_is_sent_at_once() -> None:
    send = Recorder()
    processing = [True]
    reporter = Reporter("w/0", send, keepalive=60.0, flush_interval=60.0, processing=lambda: processing[0]).start()
    answers: list[bool] = []
    reporter.release(answers.append)  # handed over while the last tuple is processed
    wait_for(lambda: answers, timeout=5, what="the release")
    processing[0] = False
    reporter.processing_ended()
    wait_for(lambda: len(send.requests) == 2, timeout=5, what="the report that processing ended")
    reporter.stop(timeout=1)
    assert [(r.release, r.processing) for r in send.requests] == [(True, True), (False, False)]


def test_a_direct_outcome_waits_for_the_next_release_and_a_queued_one_goes_within_the_flush_interval() -> None:
    send = Recorder()
    with _running(send) as reporter:
        reporter.release()
        wait_for(lambda: len(send.requests) == 1, timeout=5, what="the first release")
        reporter.outcomes([_outcome(1)])  # a direct tuple: only the master's figures need it
        time.sleep(0.5)
        assert len(send.requests) == 1, "a direct outcome alone does not cost a report"
        reporter.release()
        wait_for(lambda: len(send.requests) == 2, timeout=5, what="the next release")
        assert [o.tuple_id for o in send.requests[1].outcomes] == [1] and send.requests[1].release
        reporter.outcomes([_outcome(2, from_queue=True)])
        wait_for(lambda: len(send.requests) == 3, timeout=5, what="the queued tuple's outcome")
        assert [o.tuple_id for o in send.requests[2].outcomes] == [2] and not send.requests[2].release


def test_a_direct_outcome_is_sent_after_direct_interval_when_nothing_else_goes() -> None:
    send = Recorder()
    with _running(send, direct_interval=0.3) as reporter:
        reporter.outcomes([_outcome(1)])
        wait_for(lambda: send.requests, timeout=5, what="the lone direct outcome")
        assert [o.tuple_id for o in send.requests[0].outcomes] == [1]


def test_a_release_after_the_reporter_stopped_is_sent_at_once() -> None:
    """Work that outlives the engine's grace still gives its pull back: the master would
    otherwise hold the pulled tuples until their lease ran out."""
    sent: list[master_pb2.ReportTuplesRequest] = []

    def send(request: master_pb2.ReportTuplesRequest) -> master_pb2.ReportTuplesResponse:
        sent.append(request)
        return master_pb2.ReportTuplesResponse(pull_queue=True)

    reporter = Reporter("w/0", send, keepalive=60.0).start()
    reporter.stop(timeout=1.0)
    answers: list[bool] = []
    reporter.release(answers.append, pull_done=True)
    assert answers == [True], "sent by the caller, at once"
    assert [(r.release, r.pull_done, r.channel_id) for r in sent] == [(True, True, "w/0")]


def test_a_late_release_the_master_does_not_take_is_logged_not_raised() -> None:
    def refuse(request: master_pb2.ReportTuplesRequest) -> master_pb2.ReportTuplesResponse:
        raise Unavailable("master down")

    reporter = Reporter("w/0", refuse, keepalive=60.0).start()
    reporter.stop(timeout=0.5)
    answers: list[bool] = []
    reporter.release(answers.append)
    assert answers == [False]


def test_a_queued_outcome_behind_direct_ones_still_goes_within_the_flush_interval() -> None:
    """Direct outcomes do not wake the reporter (they wait for the next report); a queued tuple's
    outcome that joins them does, since its lease waits on it."""
    send = Recorder()
    with _running(send) as reporter:
        reporter.outcomes([_outcome(1), _outcome(2)])
        time.sleep(0.3)
        assert not send.requests
        reporter.outcomes([_outcome(3, from_queue=True)])
        wait_for(lambda: send.requests, timeout=5, what="the queued tuple's outcome")
        assert [o.tuple_id for o in send.requests[0].outcomes] == [1, 2, 3]


def test_a_full_request_of_direct_outcomes_goes_without_waiting_for_the_interval() -> None:
    send = Recorder()
    with _running(send) as reporter:
        reporter.outcomes([_outcome(i) for i in range(1, MAX_BATCH + 6)])
        wait_for(lambda: send.requests, timeout=5, what="a full request")
        assert [o.tuple_id for o in send.requests[0].outcomes] == list(range(1, MAX_BATCH + 1))
    assert [o.tuple_id for r in send.requests for o in r.outcomes] == list(range(1, MAX_BATCH + 6))
