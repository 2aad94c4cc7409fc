"""The one error table: domain errors carry a gRPC status and a public message.

Domain classes raise :class:`HioError` subclasses and never import grpc;
servicers wrap their methods with :func:`grpc_errors`, which turns them into a
status. Anything unexpected becomes ``INTERNAL`` with a reference the log
carries, without leaking internals to the caller.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any, cast

import grpc

log = logging.getLogger("hio.errors")


class HioError(Exception):
    """A refusal with a gRPC status code and a message safe to show callers."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:  # a class of its own code, not a kind of one (gateway.spool.SpoolFull)
            BY_CODE.setdefault(cls.code, cls)


BY_CODE: dict[grpc.StatusCode, type[HioError]] = {}  # the class of each code (a failed call's error, as ours)


class InvalidArgument(HioError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(HioError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(HioError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(HioError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(HioError):
    """A bound is reached; the caller should slow down and retry after a while."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLoss(HioError):
    """Bytes arrived damaged (checksum or size mismatch); the sender should resend."""

    code = grpc.StatusCode.DATA_LOSS


class Unavailable(HioError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(HioError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(HioError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Aborted(HioError):
    code = grpc.StatusCode.ABORTED


class Unimplemented(HioError):
    code = grpc.StatusCode.UNIMPLEMENTED


class DeadlineExceeded(HioError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(HioError):
    """The caller went away (or gave up) before ending its request."""

    code = grpc.StatusCode.CANCELLED


RETRY_AFTER_KEY = "hio-retry-after"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, float | None]:
    """(code, message, retry hint) a caller is told for ``exc``: a HioError's own; anything
    else (a bug, a disk error) is INTERNAL, its details logged under a reference it names.
    Call it from the ``except`` block (the log carries the traceback)."""
    if isinstance(exc, HioError):
        return exc.code, exc.message, exc.retry_after
    if isinstance(exc, OSError) and exc.errno in DISK_FULL:
        # The server's disk, not the request: a sender waits and retries (uncharged), as for
        # any full queue, instead of charging its tuples an attempt for an "internal error".
        log.error("disk full", extra={"error": str(exc)})
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"the server's disk is full ({exc}); retry later", 5.0
    ref = uuid.uuid4().hex[:12]
    log.error("internal error ref=%s", ref, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (ref {ref}); see the server log", None


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    """End the call with ``exc``'s status; gRPC's own signal that it was aborted passes on
    (abort raises a bare ``Exception()``; the context's state says it aborted)."""
    if getattr(getattr(context, "_state", None), "aborted", False) or isinstance(exc, grpc.RpcError):
        raise exc
    code, message, retry = status_of(exc)
    if retry is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{retry:.3f}"),))
    context.abort(code, message)


def grpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a servicer method (unary or streaming) so errors become statuses."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - the one place that maps errors (_abort passes gRPC's abort on)
                _abort(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    def unary_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - the one place that maps errors (_abort passes gRPC's abort on)
            _abort(context, exc)

    return unary_wrapper


def retry_after(error: grpc.RpcError) -> float | None:
    """The server's retry hint carried by a RESOURCE_EXHAUSTED status, if any."""
    try:
        # (key, value) pairs: grpc's namedtuples or the lane's tuples (the stubs say objects)
        metadata = cast("Iterable[tuple[str, str | bytes]]", error.trailing_metadata() or ())
        return next((float(value) for key, value in metadata if key == RETRY_AFTER_KEY), None)
    except Exception:  # noqa: BLE001 - not every RpcError carries metadata
        return None
