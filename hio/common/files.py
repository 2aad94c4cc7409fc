"""File helpers for durable state, shared by every role that keeps some.

A file is replaced by writing a temporary sibling, fsyncing it, renaming it
over the old one and fsyncing the folder: a reader (or a restart after a
crash) sees either the old content or the new, never a mix.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import BinaryIO, Callable


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on folders; the rename still happened
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush ``path``'s bytes to the disk (for files written without fsync earlier)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def copy_exact(source: "BinaryIO", write: "Callable[[bytes], object]", size: int, what: str,
               block: int = 1024 * 1024) -> None:
    """Copy exactly ``size`` bytes from ``source`` to ``write``; OSError if it ends early."""
    remaining = size
    while remaining:
        chunk = source.read(min(block, remaining))
        if not chunk:
            raise OSError(f"{what}: payload ends {remaining} bytes early")
        write(chunk)
        remaining -= len(chunk)


def lock_folder(folder: Path) -> int | None:
    """Take an exclusive lock on ``folder`` (its LOCK file, holding our pid).

    Returns the descriptor that holds the lock (close it to release), or None
    when another process holds it: two writers must never share durable
    state. The caller words the refusal for its role.
    """
    fd = os.open(folder / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
