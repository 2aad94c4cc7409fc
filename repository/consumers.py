"""Committed read offsets of named consumers (knowledge discovery jobs).

One small file per consumer under ``consumers/``, replaced atomically on
every commit, so a restart resumes each consumer where it last committed.
A commit may move an offset backwards: that is how a consumer deliberately
re-reads (after changing its algorithm, say). It may never point past the
latest stored record.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

from hio.storage.files import DiskFailure, atomic_write, clean_temporaries
from hio.transport.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("hio.repository")

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_SUFFIX = ".offset"


def check_consumer_name(name: str) -> None:
    """Refuse names that are not 1..128 of [A-Za-z0-9_.-] (they become file names)."""
    if not _NAME.match(name) or name in (".", ".."):
        raise InvalidArgument(
            f"consumer name {name[:140]!r} is invalid: use 1..128 characters of letters, digits, '_', '.', '-'"
        )


class ConsumerOffsets:
    """name -> committed offset, persisted. Thread safe."""

    def __init__(self, folder: Path, disk: DiskFailure, *, max_consumers: int) -> None:
        self._folder = folder
        self._disk = disk
        self._max = max_consumers
        self._lock = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)
        clean_temporaries(folder)
        self._offsets = self._load()

    def _load(self) -> dict[str, int]:
        offsets: dict[str, int] = {}
        for path in self._folder.glob(f"*{_SUFFIX}"):
            name = path.name.removesuffix(_SUFFIX)
            try:
                offsets[name] = int(path.read_text().strip())
            except (OSError, ValueError) as exc:
                # Written atomically, so this is outside damage; do not guess an offset.
                raise FailedPrecondition(
                    f"consumer offset file {path} is unreadable ({exc}); fix or remove it"
                ) from None
        return offsets

    def clamp(self, latest: int) -> None:
        """Bring offsets past ``latest`` back to it (persisted), with a warning.

        Records a consumer read can be lost after it committed (a power loss with
        ``fsync = "never"``, a torn tail cut off); the next records then get those
        offsets again, and a consumer left past them would skip them for good.
        """
        with self._lock:
            ahead = {name: offset for name, offset in self._offsets.items() if offset > latest}
            for name, offset in ahead.items():
                atomic_write(self._folder / f"{name}{_SUFFIX}", f"{latest}\n".encode(), disk=self._disk)
                self._offsets[name] = latest
                log.warning(
                    "consumer offset past the latest stored record; moved back to it "
                    "(records it had read were lost: see the log above)",
                    extra={"consumer": name, "committed": offset, "latest": latest},
                )

    def committed(self, name: str) -> int:
        """The consumer's committed offset; 0 for an unknown or empty name."""
        if not name:
            return 0
        check_consumer_name(name)
        with self._lock:
            return self._offsets.get(name, 0)

    def all(self) -> dict[str, int]:
        """name -> committed offset, of every consumer."""
        with self._lock:
            return dict(self._offsets)

    def commit(self, name: str, offset: int, latest: int) -> None:
        """Persist ``offset`` for ``name``; refuse offsets past ``latest``."""
        check_consumer_name(name)
        if offset < 0 or offset > latest:
            raise InvalidArgument(
                f"consumer {name}: cannot commit offset {offset}; the latest stored offset is {latest}"
            )
        with self._lock:
            if name not in self._offsets and len(self._offsets) >= self._max:
                raise FailedPrecondition(
                    f"consumer {name}: already {self._max} consumers (max_consumers); reuse a name"
                )
            if self._offsets.get(name) == offset and (self._folder / f"{name}{_SUFFIX}").exists():
                return
            atomic_write(self._folder / f"{name}{_SUFFIX}", f"{offset}\n".encode(), disk=self._disk)
            previous = self._offsets.get(name, 0)
            self._offsets[name] = offset
        if offset < previous:
            log.info("consumer rewound", extra={"consumer": name, "from": previous, "to": offset})
