"""Dead letters: tuples that failed too often, kept on disk for an operator.

Each dead letter is two files under ``data_dir/master/dead/``:
``<tuple_id>.payload`` (the bytes) and ``<tuple_id>.json`` (metadata, reason,
time, and the backlog sequence number it came from). The JSON file is written
last, by atomic rename, so it is the commit point: a payload without its JSON
is a leftover of a crash and is removed at start.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from hio.master.storage import Durability
from hio.storage.files import atomic_write, clean_temporaries, copy_exact, fsync_dir, write_all
from hio.transport.frames import TupleMeta

log = logging.getLogger("hio.master")


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """One dead letter as listed: the tuple's metadata, why, and when."""

    meta: TupleMeta
    reason: str
    failed_unix: float
    seq: int = 0  # the backlog record it came from (0: never was in the backlog)

    @property
    def tuple_id(self) -> int:
        return self.meta.tuple_id

    @property
    def attempts(self) -> int:
        """Processing attempts made; ``meta.attempt`` is the one it would have been next."""
        return max(self.meta.attempt - 1, 1)


class DeadWriter:
    """Streams one tuple's payload into the store; :meth:`commit` publishes it."""

    def __init__(self, store: DeadLetterStore, meta: TupleMeta) -> None:
        self._store = store
        self.meta = meta
        self._tmp = store.root / f"{meta.tuple_id}.payload.{uuid.uuid4().hex[:8]}.part"
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert self._fd is not None, "writer already finished"
        write_all(self._fd, data)

    def commit(self, reason: str, seq: int = 0) -> DeadLetter:
        """Make the dead letter durable and listable."""
        assert self._fd is not None, "writer already finished"
        fd, self._fd = self._fd, None
        try:
            if self._store.durability.syncs:
                self._store.durability.disk.sync(fd, refuse=True)
        finally:
            os.close(fd)
        return self._store._publish(self.meta, self._tmp, reason, seq)

    def abort(self) -> None:
        """Forget the partial payload."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tmp.unlink(missing_ok=True)


class DeadLetterStore:
    """Durable, listable, retryable dead letters; thread-safe."""

    def __init__(self, root: str | os.PathLike[str], durability: Durability) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.durability = durability
        self._lock = threading.Lock()
        self._letters: dict[int, DeadLetter] = {}
        self._load()

    def __len__(self) -> int:
        with self._lock:
            return len(self._letters)

    def add(self, meta: TupleMeta, reason: str, source: BinaryIO | bytes, *, seq: int = 0) -> DeadLetter:
        """Store a tuple whose payload is in memory or in an open file (read ``meta.size`` bytes)."""
        out = DeadWriter(self, meta)
        try:
            if isinstance(source, (bytes, bytearray, memoryview)):
                out.write(source)
            else:
                copy_exact(source, out.write, meta.size, f"tuple {meta.tuple_id}")
            return out.commit(reason, seq)
        except BaseException:
            out.abort()
            raise

    def list(self, limit: int, *, latest: bool = False) -> list[DeadLetter]:
        """At most ``limit`` dead letters, oldest failure first (``latest``: latest first)."""
        with self._lock:
            letters = sorted(self._letters.values(), key=lambda d: (d.failed_unix, d.tuple_id), reverse=latest)
        return letters[:limit]

    def get(self, tuple_id: int) -> DeadLetter | None:
        with self._lock:
            return self._letters.get(tuple_id)

    def origins(self) -> set[tuple[int, int]]:
        """(backlog sequence number, tuple id) of dead letters that came from the backlog. Recovery
        drops these records from the queue (a crash may come between writing the dead letter and
        acknowledging its record) and numbers new records above every sequence number listed here."""
        with self._lock:
            return {(d.seq, d.tuple_id) for d in self._letters.values() if d.seq}

    def open_payload(self, tuple_id: int) -> BinaryIO:
        return open(self._payload(tuple_id), "rb")

    def remove(self, tuple_id: int) -> None:
        """Forget a dead letter (after it went back to the queue)."""
        with self._lock:
            self._letters.pop(tuple_id, None)
            self._meta(tuple_id).unlink(missing_ok=True)
            self._payload(tuple_id).unlink(missing_ok=True)
        if self.durability.syncs:  # a failure is not raised: it is back in the queue already
            fsync_dir(self.root, self.durability.disk)

    def _payload(self, tuple_id: int) -> Path:
        return self.root / f"{tuple_id}.payload"

    def _meta(self, tuple_id: int) -> Path:
        return self.root / f"{tuple_id}.json"

    def _publish(self, meta: TupleMeta, tmp: Path, reason: str, seq: int) -> DeadLetter:
        letter = DeadLetter(meta=copy.deepcopy(meta), reason=reason[:4096], failed_unix=time.time(), seq=seq)
        doc = {
            "meta": base64.b64encode(letter.meta.SerializeToString()).decode(),
            "reason": letter.reason,
            "failed_unix": letter.failed_unix,
            "seq": seq,
        }
        with self._lock:
            os.replace(tmp, self._payload(meta.tuple_id))
            atomic_write(
                self._meta(meta.tuple_id),
                json.dumps(doc).encode(),
                disk=self.durability.disk,
                durable=self.durability.syncs,
            )
            self._letters[meta.tuple_id] = letter
        log.warning(
            "dead letter",
            extra={
                "tuple_id": meta.tuple_id,
                "image": meta.image,
                "attempts": letter.attempts,
                "reason": letter.reason,
            },
        )
        return letter

    def _load(self) -> None:
        clean_temporaries(self.root, "*.part")  # payloads a crash left unpublished
        clean_temporaries(self.root)
        for path in self.root.glob("*.json"):
            try:
                doc = json.loads(path.read_text())
                meta = TupleMeta.FromString(base64.b64decode(doc["meta"]))
                letter = DeadLetter(
                    meta=meta,
                    reason=str(doc["reason"]),
                    failed_unix=float(doc["failed_unix"]),
                    seq=int(doc.get("seq", 0)),
                )
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("unreadable dead letter skipped", extra={"path": str(path), "error": str(exc)})
                continue
            if not self._payload(meta.tuple_id).exists():
                log.error("dead letter without payload skipped", extra={"path": str(path)})
                continue
            self._letters[meta.tuple_id] = letter
        for payload in self.root.glob("*.payload"):
            if not self._meta(int(payload.stem) if payload.stem.isdigit() else -1).exists():
                payload.unlink(missing_ok=True)
