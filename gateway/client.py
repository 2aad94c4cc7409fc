"""The gateway client library: what instrument software and scripts call.

    from hio.gateway import Gateway

    with Gateway(master_address="master:7000") as gw:
        tuple_id = gw.send(image_bytes, image="hio/microscopy", name="plate1.tif")
        ids = gw.send_many(["a.tif", "b.tif"])            # paths or bytes, concurrent

Every tuple is first written to the on-disk spool (``submit`` returns once it
is there: safe from a crash of any process; fsynced within about 100 ms, or
before ``submit`` returns with ``spool_fsync="always"``), then delivered in the
background; it leaves the spool only once the master says ENQUEUED, an engine
says STORED, or it is refused for good (its future raises DeliveryError). A
tuple still in the spool when the process stops is delivered at the next start.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Self

from hio import config as cfg
from hio.config import state_dir
from hio.gateway.config import GatewayConfig, infer_image
from hio.gateway.dispatch import Completion, DeliveryState, Dispatcher, Outcome
from hio.gateway.spool import MoveOnDone, Spool, SpoolEntry, SpoolFull, safe_name
from hio.proto.tuple_pb2 import TupleMeta
from hio.storage.files import atomic_write
from hio.transport.frames import check_meta

log = logging.getLogger("hio.gateway")

__all__ = ["DeliveryError", "DeliveryTimeout", "Gateway", "GatewayStatus", "SpoolFull", "TupleFuture"]

DEFAULT_TIMEOUT = 300.0


class DeliveryError(Exception):
    """A tuple was not delivered: dead-lettered after ``max_attempts`` failed deliveries,
    refused, or the gateway closed first. ``reason`` says why; ``tuple_id`` is 0 if never
    routed. (A tuple whose *processing* fails was delivered: the engine hands it to the
    master's queue, its future resolves with outcome "enqueued", and the master retries
    it and may dead-letter it later: ``hio dead-letters``.)"""

    def __init__(self, message: str, *, tuple_id: int = 0, reason: str = "", name: str = "") -> None:
        super().__init__(message)
        self.tuple_id = tuple_id
        self.reason = reason or message
        self.name = name


class DeliveryTimeout(DeliveryError, TimeoutError):
    """``send`` gave up waiting; the tuple stays spooled and delivery goes on."""


class TupleFuture(concurrent.futures.Future[int]):
    """Future of one tuple: resolves to its id once STORED or ENQUEUED.

    ``outcome`` ("stored", "enqueued", ...) and ``tuple_id`` are set before it
    resolves; ``detail`` says why an enqueued tuple went to the master's queue
    when an engine's processing of it failed ("processing failed: ..."; the
    queue tries it again), else it is ''. ``name``, ``size``, ``image``,
    ``created_unix`` and ``crc32`` (of the payload) describe the tuple.
    """

    def __init__(self, name: str, size: int, image: str = "", created_unix: float = 0.0, crc32: int = 0) -> None:
        super().__init__()
        self.name = name
        self.size = size
        self.image = image
        self.created_unix = created_unix
        self.crc32 = crc32
        self.outcome = ""
        self.tuple_id = 0
        self.detail = ""
        self.seq = 0  # the spool's sequence number, set when tracked


@dataclasses.dataclass(kw_only=True)
class GatewayStatus(DeliveryState):
    """A snapshot of the gateway's counters (since this Gateway started) and of what keeps
    tuples from delivery."""

    spooled_tuples: int
    spooled_bytes: int
    spool_bytes_limit: int
    #: the spool's failed fsync that stops new tuples until the gateway is restarted, else ''
    spool_failure: str = ""
    #: seconds since the oldest spooled tuple was accepted (0 when none is spooled)
    oldest_spooled_seconds: float = 0.0
    #: where this gateway reaches the master
    master_address: str = ""

    def warnings(self) -> list[str]:
        """What keeps spooled tuples from delivery, in words (empty when nothing does)."""
        out = []
        if self.spool_failure:
            out.append(self.spool_failure)
        if self.master_queue_refusal:
            out.append(
                f"the master's queue takes no tuples (they wait in the spool, or go to a free "
                f"channel): {self.master_queue_refusal}"
            )
        if self.master_refusal:
            out.append(f"the master refuses this gateway (tuples wait in the spool): {self.master_refusal}")
        if self.master_unreachable_seconds:
            where = f" at {self.master_address}" if self.master_address else ""
            why = f" ({self.master_error})" if self.master_error else ""
            out.append(
                f"the master{where} has been unreachable for {self.master_unreachable_seconds:.0f}s{why}; "
                "tuples wait in the spool"
            )
        for image, (seconds, words) in sorted(self.unserved_images.items()):
            out.append(f"no engine serves image '{image}' (for {seconds:.0f}s; tuples wait in the spool): {words}")
        return out


class Gateway:
    """Client library of the gateway. Thread-safe; a context manager.

    ``Gateway(config=None, **overrides)``: ``config`` is a :class:`GatewayConfig`
    (default: built from ``$HIO_CONFIG``, ``HIO_*`` environment and defaults);
    keyword ``overrides`` replace single settings (``master_address=...``).
    Opening the gateway locks its spool folder and resumes any tuples left
    there by an earlier run. ``spool_name`` picks the spool subfolder (default:
    the source name), so several gateways can share a ``data_dir``.
    """

    def __init__(self, config: GatewayConfig | None = None, *, spool_name: str | None = None, **overrides: Any) -> None:
        if config is None:
            config = cfg.build(GatewayConfig, "gateway", overrides=overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
            config.validate()
        self.config = config
        self._source = config.resolved_source()
        root = state_dir(config.data_dir, "gateway") / "spool" / safe_name(spool_name or self._source)
        self.spool = Spool(root, config.spool_bytes, fsync=config.spool_fsync, memory_bytes=config.spool_memory_bytes)
        self._lock = threading.Lock()
        self._futures: dict[int, TupleFuture] = {}
        self._closed = False
        self._unforgotten: list[SpoolEntry] = []  # delivered, but their DONE record could not be written
        self._unmoved_file = self.spool.root / UNMOVED_FILE
        # delivered originals whose move failed; kept on disk, so a restart does not send them again
        self._unmoved: dict[str, tuple[MoveOnDone, Outcome]] = _load_unmoved(self._unmoved_file)
        self._dispatcher = Dispatcher(
            config,
            persist=self.spool.update_many,
            open_payload=self.spool.open_payload,
            payload_damage=self.spool.payload_damage,
            on_complete=self._finish,
        )
        #: futures of the tuples an earlier run left spooled; they are delivered like new ones
        self.resumed_futures: list[TupleFuture] = [self._track(entry) for entry in self.spool.entries()]
        self._dispatcher.start()

    def submit(
        self,
        data: bytes,
        *,
        image: str | None = None,
        name: str = "",
        attributes: Mapping[str, str] | None = None,
        created_unix: float | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> TupleFuture:
        """Spool ``data`` as one tuple and return a future of its id.

        Returns once the tuple is written to the spool (fsynced before that with
        ``spool_fsync="always"``, else within about 100 ms), without waiting
        for delivery. Blocks when the spool is full: then it waits up to
        ``timeout`` s (None = as long as needed) and raises :class:`SpoolFull`;
        and, with "batch", while 256 MiB appended wait for a disk slower than
        the submissions. Raises ``FailedPrecondition`` once a spool fsync has failed
        (until the gateway is restarted; see :attr:`GatewayStatus.spool_failure`).
        Raises ``InvalidArgument`` for a tuple over ``max_tuple_bytes`` or
        ``spool_bytes``, or without an image; :class:`DeliveryError` once the
        gateway is closed. Thread-safe. The future resolves to the tuple id, or
        raises :class:`DeliveryError`.
        """
        self._check_open()
        meta = self._meta(image or self.config.image, name, len(data), attributes, created_unix)
        entry = self.spool.put_bytes(bytes(data), meta, timeout=timeout)
        return self._track(entry)

    def submit_file(
        self,
        path: str | os.PathLike[str],
        *,
        image: str | None = None,
        name: str | None = None,
        attributes: Mapping[str, str] | None = None,
        created_unix: float | None = None,
        move_to: str | os.PathLike[str] | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> TupleFuture:
        """Spool a file as one tuple (hard link or copy; never modified) and return a future.

        ``image`` defaults to the configured one, else the file extension's.
        ``name`` defaults to the file name, ``created_unix`` to its mtime.
        ``move_to``: move the original there once delivered. Blocking and
        errors as :meth:`submit`; ``ConfigError`` when no image can be inferred.
        """
        self._check_open()
        path = Path(path)
        stat = path.stat()
        image = infer_image(path, image or self.config.image)
        meta = self._meta(
            image,
            path.name if name is None else name,
            stat.st_size,
            attributes,
            stat.st_mtime if created_unix is None else created_unix,
        )
        move = MoveOnDone(str(path.resolve()), str(Path(move_to).resolve())) if move_to else None
        entry = self.spool.put_file(path, meta, move=move, timeout=timeout)
        return self._track(entry)

    def send(
        self,
        data: bytes,
        *,
        image: str | None = None,
        name: str = "",
        attributes: Mapping[str, str] | None = None,
        created_unix: float | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> int:
        """:meth:`submit` one tuple and block until it is STORED or ENQUEUED; return its id.

        Retries as the delivery policy says (re-routing, ``max_attempts``).
        Raises :class:`DeliveryError` when it was dead-lettered or refused,
        :class:`SpoolFull` when no spool room came within ``timeout``, and
        :class:`DeliveryTimeout` after ``timeout`` s (the tuple stays spooled
        and is still delivered). A tuple whose processing failed returns its
        id (the master's queue retries it). Thread-safe.
        """
        start = time.monotonic()
        future = self.submit(
            data, image=image, name=name, attributes=attributes, created_unix=created_unix, timeout=timeout
        )
        return self.result(future, _left(start, timeout))

    def send_file(self, path: str | os.PathLike[str], *, timeout: float | None = DEFAULT_TIMEOUT, **kwargs: Any) -> int:
        """:meth:`submit_file` and wait like :meth:`send`; returns the tuple id."""
        start = time.monotonic()
        future = self.submit_file(path, timeout=timeout, **kwargs)
        return self.result(future, _left(start, timeout))

    def send_many(
        self,
        items: Iterable[bytes | str | os.PathLike[str]],
        *,
        image: str | None = None,
        attributes: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> list[int]:
        """Send many tuples (bytes, or paths of files) concurrently; their ids in order.

        All are spooled first, then delivered over ``streams`` parallel streams
        in batches. Blocks until every one is STORED or ENQUEUED; raises the
        first :class:`DeliveryError` (others still complete). ``timeout`` bounds
        the whole call.
        """
        start = time.monotonic()
        futures = [
            self.submit(item, image=image, attributes=attributes, timeout=timeout)
            if isinstance(item, (bytes, bytearray, memoryview))
            else self.submit_file(item, image=image, attributes=attributes, timeout=timeout)
            for item in items
        ]
        return [self.result(f, _left(start, timeout)) for f in futures]

    def result(self, future: TupleFuture, timeout: float | None = None) -> int:
        """Wait for a future from ``submit``; its id, or DeliveryError/DeliveryTimeout.

        Gives up early, with :class:`DeliveryTimeout`, when no engine has served the
        tuple's image for ``image_wait_seconds`` (a misspelt image, or no worker for it
        yet): the tuple stays spooled and is delivered once an engine serves it."""
        start = time.monotonic()
        while True:
            left = _left(start, timeout)
            try:
                return int(future.result(0.25 if left is None else min(left, 0.25)))
            except concurrent.futures.TimeoutError:
                delivery = self._dispatcher.snapshot()
                unserved = delivery.unserved_images.get(future.image)
                if unserved is not None and unserved[0] > self.config.image_wait_seconds:
                    why = f"no engine serves image '{future.image}' after {unserved[0]:.0f}s (master: {unserved[1]})"
                    fate = "not delivered (it stays spooled, and goes once an engine serves its image)"
                    break
                if left is not None and left <= 0.25:
                    down = delivery.master_unreachable_seconds
                    why = self._dispatcher.last_error(future.seq) or (
                        f"master {self.config.master_address} unreachable for {down:.0f}s"
                        if down
                        else "still waiting for a channel or the queue"
                    )
                    fate = f"not delivered within {timeout:.0f}s (it stays spooled)"
                    break
        raise DeliveryTimeout(f"tuple '{future.name}' {fate}: {why}", name=future.name, reason=why)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every spooled tuple is delivered (or failed); False on timeout."""
        with self._lock:
            pending = list(self._futures.values())
        return not concurrent.futures.wait(pending, timeout=timeout).not_done

    def close(self, timeout: float | None = None, *, drain: bool = True) -> None:
        """Stop delivering; blocks at most about ``timeout`` s (default ``grace_seconds``).

        With ``drain`` (the default) it first waits for spooled tuples to be
        delivered; without, it only lets in-flight streams finish. Tuples not
        delivered by then stay in the spool for the next start, and their
        futures raise DeliveryError. Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        grace = self.config.grace_seconds if timeout is None else timeout
        start = time.monotonic()
        if drain:
            self.flush(grace)
        self._dispatcher.stop(_left(start, grace) or 0.0)
        with self._lock:
            pending = list(self._futures.values())
            self._futures.clear()
        for future in pending:
            if not future.done():
                _closed_first(future)
        self.spool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status(self) -> GatewayStatus:
        """Counters and spool usage. Non-blocking, thread-safe."""
        oldest = self.spool.oldest()
        return GatewayStatus(
            spooled_tuples=len(self.spool),
            spooled_bytes=self.spool.used_bytes,
            spool_bytes_limit=self.spool.limit,
            spool_failure=self.spool.disk_failure,
            oldest_spooled_seconds=max(0.0, time.time() - oldest.meta.accepted_unix) if oldest else 0.0,
            master_address=self.config.master_address,
            **dataclasses.asdict(self._dispatcher.snapshot()),  # the counters, what keeps tuples waiting
        )

    def _meta(
        self, image: str, name: str, size: int, attributes: Mapping[str, str] | None, created_unix: float | None
    ) -> TupleMeta:
        now = time.time()
        meta = TupleMeta(
            source=self._source,
            image=image or "",
            size=size,
            name=name,
            created_unix=now if created_unix is None else float(created_unix),
            attempt=1,
            accepted_unix=now,
            attributes=dict(attributes or {}),
        )
        check_meta(meta, self.config.max_tuple_bytes, need_id=False)
        return meta

    def _check_open(self) -> None:
        """Refuse a submit to a closed gateway by name. No lock: a close() racing the
        submit is settled by :meth:`_track`, under it."""
        if self._closed:
            raise DeliveryError("the gateway is closed; submit tuples before close() (or open a new Gateway)")

    def _track(self, entry: SpoolEntry) -> TupleFuture:
        """A future for the entry, and the entry to delivery; both under one look at
        ``_closed``, so a close() in between cannot leave a future nobody resolves."""
        meta = entry.meta
        future = TupleFuture(meta.name, entry.size, meta.image, meta.created_unix, meta.crc32)
        future.seq = entry.seq
        with self._lock:
            closed = self._closed
            if not closed:
                self._futures[entry.seq] = future
        if closed:
            _closed_first(future)
        else:
            self._dispatcher.add(entry)
        return future

    def unmoved_sources(self) -> set[str]:
        """Delivered originals still in their folder because moving them failed (the
        watcher must not take them again)."""
        with self._lock:
            return set(self._unmoved)

    def retry_moves(self) -> None:
        """Try again to move delivered originals whose move failed."""
        with self._lock:
            todo = list(self._unmoved.values())
        moved = [move for move, outcome in todo if _move(move, outcome, quiet=True)]
        if moved:
            with self._lock:
                for move in moved:
                    self._unmoved.pop(move.source, None)
            self._save_unmoved()

    def _finish(self, done: list[Completion]) -> None:
        """Delivery hook: move the originals, drop the spool entries (one append), resolve the futures."""
        try:
            unmoved = [
                (entry.move, outcome)
                for entry, outcome, _ in done
                if entry.move is not None and not _move(entry.move, outcome)
            ]
            if unmoved:
                with self._lock:
                    self._unmoved.update((move.source, (move, outcome)) for move, outcome in unmoved)
                self._save_unmoved()  # before the spool forgets them: a restart must know them
            self._forget([entry for entry, _, _ in done])
        finally:  # delivered is delivered: callers learn it even if forgetting it failed (it is sent again)
            with self._lock:
                futures = [self._futures.pop(entry.seq, None) for entry, _, _ in done]
            for future, (entry, outcome, detail) in zip(futures, done, strict=True):
                if future is not None and not future.done():
                    _resolve(future, entry, outcome, detail)

    def _save_unmoved(self) -> None:
        """Write the unmoved originals (with each file's identity) atomically beside the spool."""
        with self._lock:
            records = [
                {**dataclasses.asdict(move), "outcome": outcome.value, "identity": _identity(move.source)}
                for move, outcome in self._unmoved.values()
            ]
        try:
            atomic_write(self._unmoved_file, json.dumps(records).encode())
        except OSError as exc:
            log.error(
                "cannot record the delivered files that could not be moved; after a restart they would be sent again",
                extra={"path": str(self._unmoved_file), "error": str(exc)},
            )

    def _forget(self, entries: list[SpoolEntry]) -> None:
        """Drop delivered entries from the spool; those a failed append could not drop
        are tried again with the next ones (until then they hold their room, and a
        restart would send them again, under the same ids)."""
        with self._lock:
            entries, self._unforgotten = self._unforgotten + entries, []
        try:
            self.spool.remove_many(entries)
        except OSError as exc:
            with self._lock:
                self._unforgotten = entries + self._unforgotten
            log.error(
                "cannot record delivered tuples in the spool; trying again with the next ones",
                extra={"tuples": len(entries), "error": str(exc)},
            )


UNMOVED_FILE = "unmoved.json"


def _identity(path: str) -> list[int] | None:
    """What tells this file from a new one written under its name later (None: it is gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _load_unmoved(path: Path) -> dict[str, tuple[MoveOnDone, Outcome]]:
    """The delivered originals an earlier run could not move, those still there and unchanged
    (a file since moved by hand, or replaced by a new one of the same name, is forgotten)."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.error(
            "cannot read the delivered files that could not be moved; they may be sent again",
            extra={"path": str(path), "error": str(exc)},
        )
        return {}
    kept: dict[str, tuple[MoveOnDone, Outcome]] = {}
    for record in records:
        try:
            move, outcome = MoveOnDone(record["source"], record["target"]), Outcome(record["outcome"])
        except (KeyError, TypeError, ValueError):
            continue
        if record.get("identity") is not None and _identity(move.source) == record["identity"]:
            kept[move.source] = (move, outcome)
    return kept


def _closed_first(future: TupleFuture) -> None:
    message = f"tuple '{future.name}': gateway closed before delivery; it stays spooled and is sent at the next start"
    future.set_exception(DeliveryError(message, name=future.name))


def _resolve(future: TupleFuture, entry: SpoolEntry, outcome: Outcome, detail: str) -> None:
    name, tuple_id = entry.meta.name, int(entry.meta.tuple_id)
    future.outcome, future.tuple_id, future.detail = outcome.value, tuple_id, detail
    if outcome in (Outcome.STORED, Outcome.ENQUEUED):
        future.set_result(tuple_id)
        return
    label = f"tuple '{name}' (id {tuple_id})" if name else f"tuple {tuple_id}"
    future.set_exception(
        DeliveryError(f"{label} {outcome.value}: {detail}", tuple_id=tuple_id, reason=detail, name=name)
    )


def _move(move: MoveOnDone, outcome: Outcome, *, quiet: bool = False) -> bool:
    """Move a delivered original to its done folder (rejected ones under .rejected/);
    False when it is still where it was."""
    target = Path(move.target)
    if outcome is Outcome.REJECTED:
        target = target.parent / ".rejected" / target.name
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(move.source, target)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not os.path.lexists(move.source):
            log.info("original already moved", extra={"path": move.source})
            return True
        (log.debug if quiet else log.error)(
            "cannot move delivered file; it stays and is not sent again",
            extra={"path": move.source, "target": str(target), "error": str(exc)},
        )
        return False
    return True


def _left(start: float, timeout: float | None) -> float | None:
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
