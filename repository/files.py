"""Small file helpers for crash-safe replacement.

A file is replaced by writing a temporary sibling, fsyncing it, renaming it
over the old one and fsyncing the folder: a reader (or a restart after a
crash) sees either the old content or the new, never a mix.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


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
