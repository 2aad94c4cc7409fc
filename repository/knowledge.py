"""What knowledge discovery last learned, and its preview image.

Two files under ``knowledge/``, each replaced atomically. The preview is
written first, then the knowledge, and both are cached in memory under one
lock, so callers always see a matching pair. A put without a preview removes
the previous one: a stale picture of other clusters would mislead.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from google.protobuf.message import DecodeError

from hio.proto import features_pb2
from hio.storage.files import DiskFailure, atomic_write, clean_temporaries, fsync_dir
from hio.transport.errors import InvalidArgument

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_KNOWLEDGE = "knowledge.pb"
_PREVIEW = "preview.png"


def parse_knowledge(data: bytes) -> features_pb2.Knowledge:
    """The Knowledge message in ``data``, or InvalidArgument."""
    if not data:
        raise InvalidArgument("knowledge is empty: send a serialized hio.proto.Knowledge")
    knowledge = features_pb2.Knowledge()
    try:
        knowledge.ParseFromString(data)
    except DecodeError:
        raise InvalidArgument("knowledge is not a serialized hio.proto.Knowledge") from None
    return knowledge


class KnowledgeFiles:
    """The latest knowledge bytes and preview PNG, on disk and cached. Thread safe."""

    def __init__(self, folder: Path, disk: DiskFailure, *, max_bytes: int) -> None:
        self._folder = folder
        self._disk = disk
        self._max = max_bytes
        self._lock = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)
        clean_temporaries(folder)
        self._knowledge = _read_optional(folder / _KNOWLEDGE)
        self._preview = _read_optional(folder / _PREVIEW)

    def put(self, knowledge: bytes, preview_png: bytes | None) -> features_pb2.Knowledge:
        """Replace the knowledge (validated) and the preview (PNG, or None to drop it)."""
        parsed = parse_knowledge(knowledge)
        if preview_png is not None and not preview_png.startswith(PNG_SIGNATURE):
            raise InvalidArgument("preview_png is not a PNG image (wrong signature)")
        for what, data in (("knowledge", knowledge), ("preview_png", preview_png or b"")):
            if len(data) > self._max:
                raise InvalidArgument(f"{what} of {len(data)} bytes is over the limit of {self._max}")
        with self._lock:
            self._disk.check()  # before either file changes: the two stay a pair
            if preview_png is None:
                with contextlib.suppress(FileNotFoundError):  # the deletion too must survive a crash
                    (self._folder / _PREVIEW).unlink()
                    fsync_dir(self._folder, self._disk)
            else:
                atomic_write(self._folder / _PREVIEW, preview_png, disk=self._disk)
            atomic_write(self._folder / _KNOWLEDGE, knowledge, disk=self._disk)
            self._knowledge, self._preview = knowledge, preview_png
        return parsed

    def get(self) -> tuple[bytes | None, bytes | None]:
        """(knowledge, preview), each None when there is none."""
        with self._lock:
            return self._knowledge, self._preview


def _read_optional(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
