"""One request, one answer, over a bidirectional gRPC stream kept open between calls.

Why: on two cores, grpcio's sync server spends about twice the CPU on a unary call
that it spends on a message of an open stream (docs/benchmarks/scale-analysis.md),
and an engine stores features many times a second. :class:`KeptStream` gives such a
caller a unary call's contract on a stream: :meth:`KeptStream.call` sends one request
and returns its answer, or raises the ``grpc.RpcError`` that ended the stream (the
server's status: the next call opens a new stream, so ``call_with_retry`` retries a
call the way it retries a unary one). Two rules keep the stream honest:

- an answer that does not come within ``timeout`` seconds cancels the stream and the
  call raises DEADLINE_EXCEEDED, as a unary call's deadline would;
- a stream no call used for ``idle_seconds`` is closed, so a quiet caller holds none
  of the server's threads (a sync server gives each open stream one).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import grpc

Request = TypeVar("Request")
Answer = TypeVar("Answer")

_END = object()  # ends a stream's request iterator


class StreamEnded(grpc.RpcError):
    """A kept stream that ended without a status of its own (the server closed it
    between calls, or it timed out): the code and details of a unary call's failure."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Open:
    """One open stream: its request queue and its answers."""

    def __init__(self, open_stream: Callable[[Iterator[Any]], Any]) -> None:
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.call = open_stream(iter(self.requests.get, _END))
        self.timed_out = False

    def end(self) -> None:
        self.requests.put(_END)


class KeptStream(Generic[Request, Answer]):
    """A stream-stream method used as a unary one, one call at a time (thread-safe).

    ``method``: the stub's stream-stream callable (``stub.StoreFeatures``); ``name``
    names it in errors.
    """

    def __init__(
        self,
        method: Callable[[Iterator[Request]], Any],
        *,
        name: str,
        timeout: float,
        idle_seconds: float,
    ) -> None:
        self._method = method
        self._name = name
        self._timeout = timeout
        self._idle = idle_seconds
        self._calls = threading.Lock()  # one call at a time: answers come in order
        self._cond = threading.Condition()  # guards what the watcher reads
        self._open: _Open | None = None
        self._due = math.inf  # when the call in flight must have its answer (monotonic)
        self._last = 0.0  # when the last call ended
        self._closed = False
        self._tick = max(0.01, min(1.0, timeout / 4, idle_seconds / 4))  # how often the watcher looks
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-stream", daemon=True)
        self._watcher.start()

    def call(self, request: Request) -> Answer:
        """Send ``request`` on the open stream (opening one if none is) and return its answer."""
        with self._calls:
            with self._cond:
                if self._closed:
                    raise StreamEnded(grpc.StatusCode.CANCELLED, f"{self._name}: the stream is closed")
                stream = self._open
                if stream is None:
                    stream = self._open = _Open(self._method)
                    self._cond.notify_all()  # the watcher sleeps while no stream is open
                self._due = time.monotonic() + self._timeout
            try:
                stream.requests.put(request)
                answer: Answer = next(stream.call)
            except StopIteration:
                self._drop(stream)
                raise StreamEnded(grpc.StatusCode.UNAVAILABLE, f"{self._name}: the server ended the stream") from None
            except grpc.RpcError:
                self._drop(stream)
                if stream.timed_out:
                    raise StreamEnded(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"{self._name}: no answer within {self._timeout:g} s"
                    ) from None
                raise
            finally:
                with self._cond:
                    self._due, self._last = math.inf, time.monotonic()
            return answer

    def close(self) -> None:
        """End the open stream (a call in flight fails) and stop the watcher."""
        with self._cond:
            self._closed = True
            stream, self._open = self._open, None
            self._cond.notify_all()
        if stream is not None:
            stream.end()
            stream.call.cancel()
        self._watcher.join(timeout=5.0)

    def _drop(self, stream: _Open) -> None:
        with self._cond:
            if self._open is stream:
                self._open = None
        stream.end()
        stream.call.cancel()

    def _watch(self) -> None:
        """Cancel a stream whose answer is overdue; end one that stayed idle. It looks every
        tick while a stream is open, so a call costs it nothing (late by at most a tick)."""
        with self._cond:
            while not self._closed:
                stream = self._open
                if stream is None:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                if now >= self._due:
                    stream.timed_out = True
                    self._open, self._due = None, math.inf
                    stream.call.cancel()  # the waiting call raises DEADLINE_EXCEEDED
                elif self._due == math.inf and now - self._last >= self._idle:
                    self._open = None
                    stream.end()  # the server's loop ends; nothing is in flight
                self._cond.wait(self._tick)
