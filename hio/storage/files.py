"""File helpers for durable state, shared by every role that keeps some.

A file is replaced by writing a temporary sibling, fsyncing it, renaming it
over the old one and fsyncing the folder: a reader (or a restart after a
crash) sees either the old content or the new, never a mix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from hio.transport.errors import FailedPrecondition

log = logging.getLogger("hio.files")


def fsync_dir(path: Path, disk: DiskFailure | None = None) -> None:
    """Make a rename, a new file or a deletion in ``path`` durable. A failure is not raised:
    the change happened, and what the caller keeps must follow the files; with ``disk`` it
    is final all the same (:class:`DiskFailure`)."""
    with contextlib.suppress(OSError):
        if disk is not None:
            disk.sync_folder(path)
        else:
            _fsync_folder(path)


def _fsync_folder(path: Path) -> None:
    """fsync a folder; raises what fails, but for a folder it cannot open or a filesystem
    that does not fsync folders (the rename happened all the same)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_FOLDER_FSYNC:
            raise
    finally:
        os.close(fd)


_NO_FOLDER_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES)


def atomic_write(
    path: Path,
    data: bytes | Callable[[BinaryIO], object],
    *,
    disk: DiskFailure | None = None,
    durable: bool = True,
    mode: int = 0o666,
) -> None:
    """Replace ``path`` with ``data`` (or what ``data(file)`` writes) atomically; fsync both
    file and folder when ``durable``. With ``disk``, the role's final-on-failure rule holds:
    refused once an fsync failed; a failed fsync of the file refuses this write too.
    ``mode``: the new file's permissions (less the umask)."""
    if disk is not None:
        disk.check()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data)
            fh.flush()
            if durable and disk is not None:
                disk.sync(fh.fileno(), refuse=True)
            elif durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent, disk)


def clean_temporaries(folder: Path, pattern: str = "*.tmp") -> list[Path]:
    """Remove temporaries a crash left behind in ``folder`` (those ``pattern`` matches,
    a glob that may reach into subfolders); returns them."""
    removed = [leftover for leftover in folder.glob(pattern) if leftover.is_file()]
    for leftover in removed:
        leftover.unlink(missing_ok=True)
    return removed


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte (os.write may write fewer than asked)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def copy_exact(source: BinaryIO, write: Callable[[bytes], object], size: int, what: str) -> None:
    """Copy exactly ``size`` bytes from ``source`` to ``write``, a MiB at a time; OSError if it ends early."""
    remaining = size
    while remaining:
        chunk = source.read(min(1024 * 1024, remaining))
        if not chunk:
            raise OSError(f"{what}: payload ends {remaining} bytes early")
        write(chunk)
        remaining -= len(chunk)


def lock_folder(folder: Path, in_use: Exception, name: str = "LOCK") -> int:
    """Take an exclusive lock on ``folder`` (its file ``name``, holding our pid): two writers
    must never share durable state. Returns the descriptor that holds the lock (close it to
    release); raises ``in_use`` (the refusal worded for the role) when another process holds it."""
    fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise in_use from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


FAILED_DISK_RETRY_SECONDS = 30.0  # the retry hint a refusal after a failed fsync carries


class DiskFailure:
    """The final-on-failure rule of a role's durable files, shared by its stores.

    A failed fsync is final (:meth:`fail`, :attr:`failure`, :meth:`check`): after it Linux
    marks the unwritten pages clean, so a later fsync reports success for bytes that never
    reached the disk (PostgreSQL's "fsyncgate"). The role then takes no new tuples until it
    is restarted (as PostgreSQL, etcd and Kafka stop using such a disk), instead of
    receipting tuples onto a disk that has lost bytes; what it took before is still
    delivered. A folder's fsync counts as a file's.
    """

    def __init__(self, *, disk: str, owner: str) -> None:
        self.name = disk  # "the spool's disk": how a refusal names it
        self._owner = owner  # "gateway": the role to restart after a failed fsync
        self._lock = threading.Lock()
        self.failure = ""  # the first failed fsync, for good: what failed, when, and what follows
        self.observe: Callable[[float], None] | None = None  # given each fsync's seconds (metrics)

    def check(self) -> None:
        """Raise FailedPrecondition once an fsync has failed (before a tuple costs any I/O):
        gRPC's code for "do not retry until the system's state is fixed" (here: a restart),
        where UNAVAILABLE would have clients retry at once; it carries a retry hint all the
        same, for senders that wait for the restart (the gateway keeps such tuples spooled)."""
        if self.failure:
            raise FailedPrecondition(
                f"{self.failure}; nothing of this tuple was written", retry_after=FAILED_DISK_RETRY_SECONDS
            )

    def sync(self, fd: int, *, refuse: bool = False) -> None:
        """``os.fsync(fd)`` for the role. A failure is final (:meth:`fail`) and raised: as
        the OSError, or with ``refuse`` (the caller's tuple waits on it) as the refusal
        that names it, FailedPrecondition."""
        self._timed(lambda: os.fsync(fd), refuse)

    def sync_folder(self, path: Path, *, refuse: bool = False) -> None:
        """fsync a folder for the role, its failure handled as in :meth:`sync`."""
        self._timed(lambda: _fsync_folder(path), refuse)

    def _timed(self, fsync: Callable[[], None], refuse: bool) -> None:
        started = time.perf_counter()
        try:
            fsync()
        except OSError as exc:
            self.fail(exc.strerror or str(exc))
            if refuse:
                self.check()
            raise
        if self.observe is not None:
            self.observe(time.perf_counter() - started)

    def fail(self, error: str) -> None:
        """An fsync of the role's files failed: no new tuple until restart (see the class)."""
        with self._lock:
            if self.failure:
                return
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            self.failure = (
                f"{self.name} failed to sync at {when} ({error}), so it takes no new tuples "
                f"until the {self._owner} is restarted: after a failed fsync, a later one can "
                "report success for bytes that never reached the disk. Tuples taken before "
                f"are still delivered; check the disk, then restart the {self._owner}"
            )
        log.error("fsync failed: no new tuples until restart", extra={"disk": self.name, "error": error})
