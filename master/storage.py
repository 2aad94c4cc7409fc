"""The fsync policy the master's durable stores share (the backlog's segment log and
journal, the dead letters)."""

from __future__ import annotations

import threading
import time

from hio.config import FSYNC_POLICIES
from hio.storage.files import DiskFailure
from hio.storage.segmentlog import UNSYNCED_BYTES, SegmentLog

BATCH_INTERVAL = 0.1  # seconds: 'batch' fsyncs what waits at most this often


class Durability:
    """The master's fsync policy: 'always', 'batch' or 'never' (see
    :mod:`hio.storage.segmentlog`), its :class:`DiskFailure` (the final refusal after a
    failed fsync), the bound on what waits for an fsync, and the 'batch' rounds:
    :meth:`flush_due`, called by the master's maintenance thread, runs one over the
    segment logs that :meth:`attach` named, at most every ``interval`` seconds."""

    def __init__(self, policy: str, interval: float = BATCH_INTERVAL, unsynced_bytes: int = UNSYNCED_BYTES) -> None:
        if policy not in FSYNC_POLICIES:
            raise ValueError(f"unknown fsync policy {policy!r}")
        self.policy = policy
        self.disk = DiskFailure(disk="the backlog's disk", owner="master")
        self.unsynced_limit = unsynced_bytes
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
        return sum(log.unsynced for log in self._logs)

    def attach(self, log: SegmentLog) -> None:
        """Run ``log``'s 'batch' rounds from :meth:`flush_due`."""
        self._logs.append(log)

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
