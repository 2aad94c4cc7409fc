"""The fsync policy the master's durable stores share (the backlog's segment log and
journal, the dead letters), and the file helpers they use."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from hio.storage.files import UNSYNCED_BYTES, SyncBudget, fsync_dir, write_all
from hio.storage.segmentlog import POLICIES, SegmentLog

__all__ = ["Durability", "fsync_dir", "write_all"]

BATCH_INTERVAL = 0.1  # seconds: 'batch' fsyncs what waits at most this often


class Durability:
    """The master's fsync policy: 'always', 'batch' or 'never' (see
    :mod:`hio.storage.segmentlog`), its :class:`SyncBudget` (the bound on what waits for
    an fsync, and the final refusal after a failed one), and the 'batch' rounds:
    :meth:`flush_due`, called by the master's maintenance thread, runs one over the
    segment logs that :meth:`attach` named, at most every ``interval`` seconds."""

    def __init__(self, policy: str, interval: float = BATCH_INTERVAL, unsynced_bytes: int = UNSYNCED_BYTES) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown fsync policy {policy!r}")
        self.policy = policy
        self.budget = SyncBudget(unsynced_bytes, disk="the backlog's disk", owner="master")
        self._interval = interval
        self._logs: list[SegmentLog] = []
        self._round = threading.Lock()  # one round at a time
        self._last = time.monotonic()

    @property
    def syncs(self) -> bool:
        """True unless the policy is 'never'."""
        return self.policy != "never"

    @property
    def unsynced_bytes(self) -> int:
        """Bytes admitted or written and not yet fsynced ('batch')."""
        return self.budget.unsynced

    def attach(self, log: SegmentLog) -> None:
        """Run ``log``'s 'batch' rounds from :meth:`flush_due`."""
        self._logs.append(log)

    def sync_folder(self, path: Path, *, refuse: bool = True) -> None:
        """fsync ``path`` after a file in it was made or removed (unless 'never'); a failure
        is final, as for a file. ``refuse``: raise the refusal that names it (the caller has
        not committed to anything yet); else only record it (a rename already happened, and
        what the caller keeps in memory must follow the files)."""
        if not self.syncs:
            return
        with contextlib.suppress(OSError):  # not refusing: recorded by the budget, and the caller goes on
            self.budget.sync_folder(path, refuse=refuse)

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

    def flush_due(self, now: float | None = None, *, force: bool = False) -> None:
        """'batch': one round over the attached logs if ``interval`` has passed (or ``force``)."""
        if self.policy != "batch":
            return
        now = time.monotonic() if now is None else now
        with self._round:
            if not force and now - self._last < self._interval:
                return
            self._last = now
            for log in self._logs:
                log.flush_round()
