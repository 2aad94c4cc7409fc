"""Small file-system helpers shared by the master's durable stores: the fsync
policy, complete writes, durable renames."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from hio.common.files import fsync_dir, write_all

__all__ = ["Durability", "fsync_dir", "replace_durably", "write_all"]

BATCH_INTERVAL = 0.1  # seconds: 'batch' fsyncs dirty files at most this often


def replace_durably(tmp: Path, final: Path, data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` to ``tmp``, then atomically rename it to ``final``."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    if sync:
        fsync_dir(final.parent)


class Durability:
    """The fsync policy of the backlog: 'always', 'batch' or 'never'.

    'always' fsyncs before the caller goes on (a receipt or an ack is then on
    disk). 'batch' remembers dirty descriptors and :meth:`flush_due` (called
    by the master's maintenance thread) fsyncs them at most every
    ``interval`` seconds: a power loss may lose the last ~100 ms of receipts,
    a process crash loses nothing. 'never' leaves it to the OS.
    """

    def __init__(self, policy: str, interval: float = BATCH_INTERVAL) -> None:
        if policy not in ("always", "batch", "never"):
            raise ValueError(f"unknown fsync policy {policy!r}")
        self.policy = policy
        self._interval = interval
        self._dirty: set[int] = set()
        self._lock = threading.Lock()
        self._last = time.monotonic()

    @property
    def syncs(self) -> bool:
        """True unless the policy is 'never' (sealing and compaction fsync then)."""
        return self.policy != "never"

    def written(self, fd: int) -> None:
        """``fd`` has new bytes: fsync now ('always') or soon ('batch')."""
        if self.policy == "always":
            os.fsync(fd)
        elif self.policy == "batch":
            with self._lock:
                self._dirty.add(fd)

    def forget(self, fd: int) -> None:
        """``fd`` is about to be closed: stop tracking it (its owner fsyncs it if it must)."""
        with self._lock:
            self._dirty.discard(fd)

    def flush_due(self, now: float | None = None, *, force: bool = False) -> None:
        """Fsync the dirty descriptors if ``interval`` has passed (or ``force``).

        The fsyncs run outside the internal lock so that :meth:`written` and
        :meth:`forget` never wait for the disk.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._dirty or (not force and now - self._last < self._interval):
                return
            fds = list(self._dirty)
            self._dirty.clear()
            self._last = now
        for fd in fds:
            try:
                os.fsync(fd)
            except OSError:  # closed meanwhile by its owner, who synced it if it had to
                pass
