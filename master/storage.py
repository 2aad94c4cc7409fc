"""Small file-system helpers shared by the master's durable stores: the fsync
policy, complete writes, durable renames."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

from hio.common.files import UNSYNCED_BYTES, SyncBudget, fsync_dir, write_all

log = logging.getLogger("hio.master")

__all__ = ["Durability", "Pending", "fsync_dir", "write_all"]

BATCH_INTERVAL = 0.1  # seconds: 'batch' fsyncs dirty files at most this often


class Durability:
    """The fsync policy of the backlog: 'always', 'batch' or 'never'.

    'always' fsyncs before the caller goes on (a receipt or an ack is then on
    disk). 'batch' remembers what each descriptor wrote and has not synced,
    and :meth:`flush_due` (called by the master's maintenance thread) fsyncs it
    at most every ``interval`` seconds: a process crash loses nothing, a power
    loss the last ~100 ms of receipts. Two things keep that promise when
    tuples come faster than the disk writes (before them, fsync rounds fell
    behind without bound, and every byte went to the disk): a writer is
    admitted (:meth:`admit`) only while its tuple keeps what waits for an
    fsync within ``unsynced_bytes`` (a :class:`SyncBudget`, as the gateway's
    spool keeps); and a file that gets no more writes is
    handed over with :meth:`retire` (synced and closed by the next round, not
    by the receiving thread), so one deleted before its round comes is closed
    by :meth:`discard` unwritten. 'never' leaves it to the OS.

    :meth:`written`, :meth:`retire`, :meth:`discard` and :meth:`release` never
    touch the disk, so the backlog may call them under its lock;
    :meth:`close_retired` and :meth:`flush_due` do, and are called without it.
    """

    def __init__(self, policy: str, interval: float = BATCH_INTERVAL,
                 unsynced_bytes: int = UNSYNCED_BYTES) -> None:
        if policy not in ("always", "batch", "never"):
            raise ValueError(f"unknown fsync policy {policy!r}")
        self.policy = policy
        self.budget = SyncBudget(unsynced_bytes, disk="the backlog's disk", owner="master")
        self._interval = interval
        self._files: dict[int, Pending] = {}     # descriptors with writes to sync, or retired ones to close
        self._lock = threading.Lock()            # _files and their Pending
        self._round = threading.Lock()           # one flush round at a time: its error stands for it
        self._last = time.monotonic()
        self._closed = False

    @property
    def syncs(self) -> bool:
        """True unless the policy is 'never' (sealing and compaction fsync then)."""
        return self.policy != "never"

    @property
    def unsynced_bytes(self) -> int:
        """Bytes admitted or written and not yet fsynced ('batch')."""
        return self.budget.unsynced

    def admit(self, nbytes: int) -> None:
        """'batch': :meth:`SyncBudget.admit`. The caller reports the bytes with
        ``written(fd, nbytes)`` or gives them back with :meth:`release`."""
        if self.policy == "batch":
            self.budget.admit(nbytes)
        else:
            self.budget.check()       # after a failed fsync, as with 'batch'

    def sync_folder(self, path: Path, *, refuse: bool = True) -> None:
        """fsync ``path`` after a file in it was made or removed (unless 'never'); a failure
        is final, as for a file. ``refuse``: raise the refusal that names it (the caller has
        not committed to anything yet); else only record it (a rename already happened, and
        what the caller keeps in memory must follow the files)."""
        if not self.syncs:
            return
        try:
            self.budget.sync_folder(path, refuse=refuse)
        except OSError:   # not refusing: recorded by the budget, and the caller goes on
            pass

    def replace(self, tmp: Path, final: Path, data: bytes) -> None:
        """Write ``data`` to ``tmp`` (synced unless 'never'), then rename it over ``final``
        (the folder synced after; its failure recorded, not raised: the file is replaced)."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            write_all(fd, data)
            if self.syncs:
                self.budget.sync(fd, refuse=True)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        self.sync_folder(final.parent, refuse=False)

    def release(self, nbytes: int) -> None:
        """Admitted bytes that were not written after all."""
        if self.policy == "batch":
            self.budget.settle(nbytes)

    def written(self, fd: int, nbytes: int = 0) -> None:
        """``fd`` has new bytes: fsync now ('always') or soon ('batch'). ``nbytes``: those
        the writer was admitted for (:meth:`admit`), settled by the fsync that covers them;
        the journal's few bytes a write are not counted."""
        if self.policy == "always":
            self.budget.sync(fd, refuse=True)
        elif self.policy == "batch":
            with self._lock:
                pending = self._files.setdefault(fd, Pending())
                pending.writes += 1
                pending.unsynced += nbytes

    def retire(self, fd: int) -> "Pending":
        """Take over ``fd``, which gets no more writes: it is synced if it must be, then closed.

        Returns the handle to :meth:`discard` it with if its file is deleted first.
        """
        with self._lock:
            pending = self._files.setdefault(fd, Pending())
            pending.retired = True
            return pending

    def discard(self, pending: "Pending") -> None:
        """The retired file is deleted or replaced: close it without syncing (its bytes need no disk)."""
        with self._lock:
            if pending.closed:
                return
            unsynced, pending.unsynced = pending.unsynced, 0
            pending.dropped = True
        self.budget.settle(unsynced)

    def close_retired(self) -> None:
        """Close the retired descriptors that wait for no fsync (disk I/O: call without locks).

        After :meth:`close`, or with 'always', the retired ones are synced and
        closed here too. A failing fsync is logged and the descriptor kept for
        the next round (the caller's own operation has succeeded by then).
        """
        with self._lock:
            sync_now = self._closed or self.policy == "always"
            ready = [(fd, p, (p.writes, p.unsynced)) for fd, p in self._files.items()
                     if p.retired and not p.syncing and (p.dropped or not p.dirty or sync_now)]
            for _, pending, _ in ready:
                pending.syncing = True
        errors = [error for fd, pending, covered in ready if (error := self._sync(fd, pending, covered, sync_now))]
        if errors:
            self.budget.round_done(errors[0])
            log.warning("backlog fsync failed", extra={"error": errors[0], "files": len(errors)})

    def flush_due(self, now: float | None = None, *, force: bool = False) -> None:
        """Fsync what waits for it if ``interval`` has passed (or ``force``); close the retired.

        The fsyncs run outside the internal lock: writers never wait for the
        disk except in :meth:`admit`.
        """
        now = time.monotonic() if now is None else now
        with self._round:
            with self._lock:
                if not self._files or (not force and now - self._last < self._interval):
                    return
                self._last = now
                candidates = [(fd, p) for fd, p in self._files.items() if p.dirty or p.retired]
            errors: list[str] = []
            for fd, pending in candidates:
                with self._lock:   # one descriptor at a time, each with what was written before its fsync
                    if pending.syncing or pending.closed or self._files.get(fd) is not pending:
                        continue
                    pending.syncing = True
                    covered = (pending.writes, pending.unsynced)
                if error := self._sync(fd, pending, covered, covered[0] != pending.synced):
                    errors.append(error)
            self.budget.round_done(errors[0] if errors else "")
        if errors:
            log.warning("backlog fsync failed", extra={"error": errors[0], "files": len(errors)})

    def _sync(self, fd: int, pending: "Pending", covered: tuple[int, int], needed: bool) -> str:
        """Fsync ``fd`` (marked syncing) if ``needed`` and its file is kept; count the (writes,
        bytes) it ``covered`` and close it if retired. Returns why the fsync failed, or ''."""
        error = ""
        if needed and not pending.dropped:
            try:
                self.budget.sync(fd)
            except OSError as exc:
                error = exc.strerror or str(exc)
        synced = 0
        with self._lock:
            pending.syncing = False
            if not error and not pending.dropped:
                pending.synced = covered[0]
                pending.unsynced -= covered[1]
                synced = covered[1]
            close = pending.dropped or (pending.retired and not pending.dirty)
            if close or not (pending.dirty or pending.retired):
                if self._files.get(fd) is pending:
                    del self._files[fd]
            pending.closed = close
        self.budget.settle(synced)
        if close:
            os.close(fd)
        return error

    def close(self) -> None:
        """Sync what waits and close the retired; later retires are synced by :meth:`close_retired`."""
        with self._lock:
            self._closed = True
        self.budget.close()
        self.flush_due(force=True)
        self.close_retired()


@dataclasses.dataclass(eq=False)
class Pending:
    """What one 'batch' descriptor waits for (the handle :meth:`Durability.retire` returns)."""

    writes: int = 0          # writes reported
    synced: int = 0          # ... of which an fsync covers
    unsynced: int = 0        # bytes written since its last fsync
    retired: bool = False    # no more writes: close it once synced
    dropped: bool = False    # its file is deleted: close it, no fsync
    syncing: bool = False    # a round is working on it right now (its descriptor stays open)
    closed: bool = False     # closed: the descriptor's number may belong to another file now

    @property
    def dirty(self) -> bool:
        return self.writes != self.synced
