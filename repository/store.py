"""The feature repository's domain object: features, consumer offsets, knowledge.

Layout under the repository folder (``data_dir/repository/``)::

    features/   append-only segments (see hio.repository.segments)
    consumers/  one committed offset per consumer name
    knowledge/  knowledge.pb and preview.png

A record is stored only if its bytes arrived intact (CRC-32), it is a single zstd frame
that decompresses within the bound, and it holds a ``FeatureRecord`` for the tuple id it
is uploaded under. Damaged bytes are ``DATA_LOSS`` (the sender should resend); anything
else is the sender's bug, ``INVALID_ARGUMENT``.

A consumer's offset file is replaced atomically on every commit, so a restart resumes
each consumer where it last committed. A commit may move an offset backwards: that is how
a consumer deliberately re-reads (after changing its algorithm, say). It may never point
past the latest stored record.

The knowledge and its preview are each replaced atomically, and both are cached in memory
under one lock, so callers always see a matching pair. On disk the old preview goes first,
then the knowledge is written, then its preview: a crash in between leaves knowledge without
a preview, never a preview of other knowledge. A put without a preview removes the previous
one: a stale picture of other clusters would mislead.

No gRPC here: errors are ``hio.transport.errors`` classes the servicer maps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Self

import zstandard
from google.protobuf.message import DecodeError

from hio.proto import features_pb2
from hio.repository.config import FSYNC_INTERVAL_MS
from hio.repository.featurelog import Appended, FeatureLog, read_offset_file
from hio.settings import FEATURE_RECORD_DECOMPRESSED_BYTES, RECORD_HEADROOM, MiB, message_limit, record_limit
from hio.storage.files import DiskFailure, atomic_write, clean_temporaries, fsync_dir
from hio.transport.errors import DataLoss, FailedPrecondition, InvalidArgument
from hio.transport.frames import crc32

if TYPE_CHECKING:
    from hio.repository.config import RepositoryConfig

log = logging.getLogger("hio.repository")

MAX_TUPLE_ID = 2**64 - 1
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CONSUMER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_OFFSET_SUFFIX = ".offset"
_KNOWLEDGE = "knowledge.pb"
_PREVIEW = "preview.png"

_local = threading.local()  # a decompressor per thread: creating one costs more than a small record


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Every bound of the store, explicit."""

    segment_bytes: int = 64 * MiB
    fsync: str = "batch"
    fsync_interval_ms: int = FSYNC_INTERVAL_MS
    max_record_bytes: int = 16 * MiB - RECORD_HEADROOM
    max_decompressed_bytes: int = FEATURE_RECORD_DECOMPRESSED_BYTES
    max_consumers: int = 1024
    max_knowledge_bytes: int = 16 * MiB
    max_read_bytes: int = 16 * MiB - RECORD_HEADROOM  # the largest record one ReadFeatures message carries


class FeatureStore(FeatureLog):
    """Idempotent feature store with named consumers and knowledge. Thread safe.

    Open it with a folder; it rebuilds its index from disk. Close it when done. Reads,
    waits, offsets and stats are the :class:`FeatureLog`'s; :meth:`put` checks records first.
    """

    def __init__(self, root: str | Path, options: StoreOptions | None = None) -> None:
        self.root = Path(root)
        self.options = options or StoreOptions()
        disk = self.disk = DiskFailure(disk="the repository's disk", owner="repository")  # every fsync is final
        super().__init__(
            self.root / "features",
            disk,
            segment_bytes=self.options.segment_bytes,
            fsync=self.options.fsync,
            fsync_interval=self.options.fsync_interval_ms / 1000.0,
        )
        try:
            self._check_readable()
            self._consumers = ConsumerOffsets(self.root / "consumers", disk, max_consumers=self.options.max_consumers)
            self._consumers.clamp(self.latest())
            self._knowledge = KnowledgeFiles(self.root / "knowledge", disk, max_bytes=self.options.max_knowledge_bytes)
        except BaseException:
            self.close()  # release the folder lock
            raise

    def _check_readable(self) -> None:
        """Every stored record must fit one read message: one stored with a larger chunk_bytes
        than this start's would fail every read past it, and stall each consumer there."""
        largest = self.largest_payload()
        if largest > self.options.max_read_bytes:
            raise FailedPrecondition(
                f"{self.root / 'features'} holds a record of {largest} bytes, more than one gRPC message "
                f"carries with these settings ({self.options.max_read_bytes}); start the repository with "
                "the chunk_bytes it stored that record with (a message holds chunk_bytes + 4 MiB, "
                "at least 16 MiB)"
            )

    @classmethod
    def from_config(cls, config: RepositoryConfig) -> FeatureStore:
        """The store under ``config.data_dir/repository`` with the config's bounds."""
        from hio.config import state_dir

        bounds = {f.name: getattr(config, f.name) for f in dataclasses.fields(StoreOptions) if hasattr(config, f.name)}
        limits = {"max_knowledge_bytes": message_limit(config), "max_read_bytes": record_limit(config)}
        options = StoreOptions(**{**bounds, **limits})
        return cls(state_dir(config.data_dir, "repository"), options)

    def put(self, records: Iterable[tuple[int, bytes, int]]) -> list[Appended]:
        """Store (tuple_id, record_zstd, crc32) records; all are checked before any is stored.

        A record whose id is stored already keeps its offset and is reported
        ``duplicate``; nothing is written for it. Raises DataLoss for a
        checksum mismatch and InvalidArgument for a record that is not a
        bounded zstd FeatureRecord of its id; then nothing of the batch is stored.
        """
        batch = [(tuple_id, bytes(data), crc) for tuple_id, data, crc in records]
        for tuple_id, data, crc in batch:
            verify_upload(tuple_id, data, crc, self.options)
        return self._append([(tuple_id, data) for tuple_id, data, _ in batch])

    def consumers(self) -> dict[str, int]:
        """Every named consumer's committed offset."""
        return self._consumers.all()

    def committed(self, name: str) -> int:
        """Committed offset of consumer ``name`` (0 when unknown or the name is empty)."""
        return self._consumers.committed(name)

    def commit(self, name: str, offset: int) -> None:
        """Persist consumer ``name``'s offset (0..latest); moving backwards re-reads."""
        self._consumers.commit(name, offset, self.latest())

    def put_knowledge(self, knowledge: bytes, preview_png: bytes | None = None) -> features_pb2.Knowledge:
        """Replace the knowledge (must parse as Knowledge) and the preview (PNG or None)."""
        return self._knowledge.put(knowledge, preview_png)

    def get_knowledge_and_preview(self) -> tuple[bytes | None, bytes | None]:
        """The serialized Knowledge and the preview PNG last put (each None when there is none),
        guaranteed to belong together."""
        return self._knowledge.get()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_consumer_name(name: str) -> None:
    """Refuse names that are not 1..128 of [A-Za-z0-9_.-] (they become file names)."""
    if not _CONSUMER_NAME.match(name) or name in (".", ".."):
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
        for path in self._folder.glob(f"*{_OFFSET_SUFFIX}"):
            offset = read_offset_file(path, "consumer offset file")
            if offset is not None:  # None: removed since the listing
                offsets[path.name.removesuffix(_OFFSET_SUFFIX)] = offset
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
                atomic_write(self._folder / f"{name}{_OFFSET_SUFFIX}", f"{latest}\n".encode(), disk=self._disk)
                self._offsets[name] = latest
                log.warning(
                    "consumer offset past the latest stored record; moved back to it "
                    "(records it had read were lost: see the log above)",
                    extra={"consumer": name, "committed": offset, "latest": latest},
                )

    def committed(self, name: str) -> int:
        if not name:
            return 0
        check_consumer_name(name)
        with self._lock:
            return self._offsets.get(name, 0)

    def all(self) -> dict[str, int]:
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
            if self._offsets.get(name) == offset and (self._folder / f"{name}{_OFFSET_SUFFIX}").exists():
                return
            atomic_write(self._folder / f"{name}{_OFFSET_SUFFIX}", f"{offset}\n".encode(), disk=self._disk)
            previous = self._offsets.get(name, 0)
            self._offsets[name] = offset
        if offset < previous:
            log.info("consumer rewound", extra={"consumer": name, "from": previous, "to": offset})


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
        self._check_loaded()

    def _check_loaded(self) -> None:
        """The files as put checks them: they are written atomically, so a file that fails is
        damage from outside, and serving it would hand every reader a decode error."""
        problem = ""
        if self._knowledge is not None:
            try:
                features_pb2.Knowledge.FromString(self._knowledge)
            except DecodeError:
                problem = f"{self._folder / _KNOWLEDGE} is not a serialized hio.proto.Knowledge"
        if self._preview is not None and not self._preview.startswith(PNG_SIGNATURE):
            problem = f"{self._folder / _PREVIEW} is not a PNG image"
        if problem:
            raise FailedPrecondition(
                f"{problem}; remove the knowledge folder's files (KD writes them again at its next interval)"
            )

    def put(self, knowledge: bytes, preview_png: bytes | None) -> features_pb2.Knowledge:
        if not knowledge:
            raise InvalidArgument("knowledge is empty: send a serialized hio.proto.Knowledge")
        try:
            parsed = features_pb2.Knowledge.FromString(knowledge)
        except DecodeError:
            raise InvalidArgument("knowledge is not a serialized hio.proto.Knowledge") from None
        if preview_png is not None and not preview_png.startswith(PNG_SIGNATURE):
            raise InvalidArgument("preview_png is not a PNG image (wrong signature)")
        for what, data in (("knowledge", knowledge), ("preview_png", preview_png or b"")):
            if len(data) > self._max:
                raise InvalidArgument(f"{what} of {len(data)} bytes is over the limit of {self._max}")
        with self._lock:
            self._disk.check()  # before either file changes: the two stay a pair
            with contextlib.suppress(FileNotFoundError):  # the deletion too must survive a crash
                (self._folder / _PREVIEW).unlink()
                fsync_dir(self._folder, self._disk)
            atomic_write(self._folder / _KNOWLEDGE, knowledge, disk=self._disk)
            if preview_png is not None:
                atomic_write(self._folder / _PREVIEW, preview_png, disk=self._disk)
            self._knowledge, self._preview = knowledge, preview_png
        return parsed

    def get(self) -> tuple[bytes | None, bytes | None]:
        with self._lock:
            return self._knowledge, self._preview


def _read_optional(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def verify_upload(tuple_id: int, record_zstd: bytes, crc: int, limits: StoreOptions) -> features_pb2.FeatureRecord:
    """The decoded record within ``limits``' record bounds, or an error naming the tuple and what is wrong."""
    what = f"tuple {tuple_id}"
    if not 0 < tuple_id <= MAX_TUPLE_ID:
        raise InvalidArgument(f"tuple id {tuple_id} is not a valid id (1..2^64-1)")
    if not record_zstd:
        raise InvalidArgument(f"{what}: record_zstd is empty")
    if len(record_zstd) > limits.max_record_bytes:
        raise InvalidArgument(
            f"{what}: compressed record of {len(record_zstd)} bytes is over the limit of {limits.max_record_bytes}"
        )
    actual = crc32(record_zstd)
    if actual != crc:
        raise DataLoss(f"{what}: record checksum mismatch (CRC-32 {actual:08x}, expected {crc:08x}); resend it")
    record = features_pb2.FeatureRecord()
    try:
        record.ParseFromString(_decompress(what, record_zstd, limits.max_decompressed_bytes))
    except DecodeError:
        raise InvalidArgument(f"{what}: record_zstd does not hold a serialized FeatureRecord") from None
    if record.tuple_id != tuple_id:
        raise InvalidArgument(
            f"{what}: the FeatureRecord inside names tuple {record.tuple_id}, "
            f"not the id {tuple_id} it was uploaded under"
        )
    return record


def _decompress(what: str, data: bytes, limit: int) -> bytes:
    """One zstd frame, at most ``limit`` bytes once decompressed, nothing after it."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        raise InvalidArgument(f"{what}: record_zstd is not zstd-compressed data") from None
    if declared > limit:  # -1 = not declared; then max_output_size below bounds it
        raise InvalidArgument(f"{what}: record decompresses to {declared} bytes, over the limit of {limit}")
    try:
        return _decompressor().decompress(data, max_output_size=limit, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise InvalidArgument(
            f"{what}: record_zstd does not decompress ({exc}); "
            f"it must be one zstd frame of at most {limit} bytes decompressed"
        ) from None
