"""File helpers for durable state, shared by every role that keeps some.

A file is replaced by writing a temporary sibling, fsyncing it, renaming it
over the old one and fsyncing the folder: a reader (or a restart after a
crash) sees either the old content or the new, never a mix.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NoReturn

from hio.transport.errors import FailedPrecondition, Unavailable

log = logging.getLogger("hio.files")


def fsync_dir(path: Path, *, strict: bool = False) -> None:
    """Make a rename or a new file in ``path`` durable (no-op where unsupported).

    ``strict``: raise an fsync that fails for another reason than the filesystem not
    supporting it (the stores that stop after a failed fsync: the spool, the backlog);
    else it is ignored, as it always was for the other roles' files."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on folders; the rename still happened
        if strict and exc.errno not in _NO_FOLDER_FSYNC:
            raise  # the disk failed to sync: the caller must not count on the rename
    finally:
        os.close(fd)


_NO_FOLDER_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES)


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically; fsync both file and folder when ``durable``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def remove_durably(path: Path) -> None:
    """Delete ``path`` if present and make the deletion durable."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_dir(path.parent)


def clean_temporaries(folder: Path) -> None:
    """Remove temporaries a crash left behind in ``folder``."""
    for leftover in folder.glob(".*.tmp"):
        leftover.unlink(missing_ok=True)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte (os.write may write fewer than asked)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def copy_exact(
    source: BinaryIO, write: Callable[[bytes], object], size: int, what: str, block: int = 1024 * 1024
) -> None:
    """Copy exactly ``size`` bytes from ``source`` to ``write``; OSError if it ends early."""
    remaining = size
    while remaining:
        chunk = source.read(min(block, remaining))
        if not chunk:
            raise OSError(f"{what}: payload ends {remaining} bytes early")
        write(chunk)
        remaining -= len(chunk)


def lock_folder(folder: Path, name: str = "LOCK") -> int | None:
    """Take an exclusive lock on ``folder`` (its file ``name``, holding our pid).

    Returns the descriptor that holds the lock (close it to release), or None
    when another process holds it: two writers must never share durable
    state. The caller words the refusal for its role.
    """
    fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


UNSYNCED_BYTES = 256 * 1024 * 1024  # 'batch' fsync: what may wait for the disk (about a second of it)
FAILED_DISK_RETRY_SECONDS = 30.0  # the retry hint a refusal after a failed fsync carries


class SyncBudget:
    """Bytes a durable store has taken and its disk has not yet synced ('batch' fsync),
    kept within ``limit``: every durable store keeps one, for its segment log.

    Why: a store that fsyncs in background rounds answers before the disk has the
    bytes. A disk slower than the tuples lets the rounds fall behind without bound,
    and a power loss would take seconds of receipts, not one round's. A writer is therefore admitted only
    while its tuple keeps the total within ``limit`` (one larger than ``limit`` waits
    until nothing does); counting before the write makes it a bound for concurrent
    writers too.

    A failed fsync is final (:meth:`fail`, :attr:`failure`, :meth:`check`): after it Linux marks the
    unwritten pages clean, so a later fsync reports success for bytes that never
    reached the disk (PostgreSQL's "fsyncgate"). The store then takes no new tuples
    until its role is restarted (as PostgreSQL, etcd and Kafka stop using such a disk),
    instead of receipting tuples onto a disk that has lost bytes; what it took before is
    still delivered. A round that fails for another reason (no descriptor left to open
    a file with) is only named to the writers waiting for it (:meth:`round_done`).
    """

    def __init__(self, limit: int = UNSYNCED_BYTES, *, disk: str, owner: str) -> None:
        if limit <= 0:
            raise ValueError(f"unsynced_bytes must be positive, got {limit}")
        self.limit = int(limit)
        self._disk = disk  # "the spool's disk": how a refusal names it
        self._owner = owner  # "gateway": the role to restart after a failed fsync
        self._unsynced = 0
        self._cond = threading.Condition(threading.Lock())
        self._rounds = 0  # flush rounds finished
        self._error = ""  # why the latest round failed ('' after a success)
        self._failure = ""  # the first failed fsync, for good ('' if none failed)
        self._closed = False

    @property
    def unsynced(self) -> int:
        return self._unsynced

    @property
    def failure(self) -> str:
        """'' while no fsync failed; else what failed, when, and what follows."""
        return self._failure

    def check(self) -> None:
        """Raise FailedPrecondition once an fsync has failed (before a tuple costs any I/O):
        gRPC's code for "do not retry until the system's state is fixed" (here: a restart),
        where UNAVAILABLE would have clients retry at once; it carries a retry hint all the
        same, for senders that wait for the restart (the gateway keeps such tuples spooled)."""
        if self._failure:
            raise FailedPrecondition(
                f"{self._failure}; nothing of this tuple was written", retry_after=FAILED_DISK_RETRY_SECONDS
            )

    def admit(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit, then count them (the caller writes them, or
        gives them back with :meth:`settle`). Raises FailedPrecondition, nothing counted, once
        an fsync has failed, or Unavailable when a round fails while it waits. Call it holding none of
        the store's locks."""
        with self._cond:
            start = self._rounds
            while True:
                self.check()
                if self._closed or not self._unsynced or self._unsynced + nbytes <= self.limit:
                    break
                if self._error and self._rounds > start:
                    raise Unavailable(
                        f"{self._disk} does not sync ({self._error}); "
                        f"{self._unsynced} bytes wait for it; nothing was written",
                        retry_after=1.0,
                    )
                self._cond.wait()  # every change it waits for notifies (settle, round_done, fail, close)
            self._unsynced += nbytes

    def add(self, nbytes: int) -> None:
        """Count bytes written without admission (a store's small bookkeeping records)."""
        if nbytes:
            with self._cond:
                self._unsynced += nbytes

    def settle(self, nbytes: int) -> None:
        """``nbytes`` no longer wait: synced, deleted before their sync, or not written after all."""
        if nbytes:
            with self._cond:
                self._unsynced -= nbytes
                self._cond.notify_all()

    def round_done(self, error: str = "") -> None:
        """A flush round finished; ``error`` says why it failed ('' if it did not)."""
        with self._cond:
            self._rounds += 1
            self._error = error
            self._cond.notify_all()

    def sync(self, fd: int, *, refuse: bool = False) -> None:
        """``os.fsync(fd)`` for the store. A failure is final (:meth:`fail`) and raised: as
        the OSError, or with ``refuse`` (the caller's tuple waits on it) as the refusal
        that names it, FailedPrecondition."""
        try:
            os.fsync(fd)
        except OSError as exc:
            self._failed(exc, refuse)

    def sync_folder(self, path: Path, *, refuse: bool = False) -> None:
        """:func:`fsync_dir` (strict) for the store, its failure handled as in :meth:`sync`."""
        try:
            fsync_dir(path, strict=True)
        except OSError as exc:
            self._failed(exc, refuse)

    def _failed(self, exc: OSError, refuse: bool) -> NoReturn:
        self.fail(exc.strerror or str(exc))
        if refuse:
            self.check()
        raise exc

    def fail(self, error: str) -> None:
        """An fsync of the store's files failed: no new tuple until restart (see the class)."""
        with self._cond:
            if not self._failure:
                when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
                self._failure = (
                    f"{self._disk} failed to sync at {when} ({error}), so it takes no new tuples "
                    f"until the {self._owner} is restarted: after a failed fsync, a later one can "
                    "report success for bytes that never reached the disk. Tuples taken before "
                    f"are still delivered; check the disk, then restart the {self._owner}"
                )
                log.error("fsync failed: no new tuples until restart", extra={"disk": self._disk, "error": error})
            self._cond.notify_all()

    def close(self) -> None:
        """The store is closing (it syncs what is left): waiting writers go on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
