"""The feature repository's domain object: features, consumer offsets, knowledge.

Layout under the repository folder (``data_dir/repository/``)::

    features/   append-only segments (see hio.repository.segments)
    consumers/  one committed offset per consumer name
    knowledge/  knowledge.pb and preview.png

No gRPC here: errors are ``hio.transport.errors`` classes the servicer maps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Self

from hio.repository.consumers import ConsumerOffsets
from hio.repository.featurelog import Appended, FeatureLog
from hio.repository.knowledge import KnowledgeFiles
from hio.repository.records import RecordLimits, verify_upload
from hio.settings import FEATURE_RECORD_DECOMPRESSED_BYTES, MiB
from hio.storage.files import DiskFailure

if TYPE_CHECKING:
    from hio.proto import features_pb2
    from hio.repository.config import RepositoryConfig


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Every bound of the store, explicit."""

    segment_bytes: int = 64 * MiB
    fsync: str = "batch"
    fsync_interval_ms: int = 0
    max_record_bytes: int = 16 * MiB - 64 * 1024
    max_decompressed_bytes: int = FEATURE_RECORD_DECOMPRESSED_BYTES
    max_consumers: int = 1024
    max_knowledge_bytes: int = 16 * MiB


class FeatureStore:
    """Idempotent feature store with named consumers and knowledge. Thread safe.

    Open it with a folder; it rebuilds its index from disk. Close it when done.
    """

    def __init__(self, root: str | Path, options: StoreOptions | None = None) -> None:
        self.root = Path(root)
        self.options = options or StoreOptions()
        self._limits = RecordLimits(self.options.max_record_bytes, self.options.max_decompressed_bytes)
        disk = self.disk = DiskFailure(disk="the repository's disk", owner="repository")  # every fsync is final
        self._features = FeatureLog(
            self.root / "features",
            disk,
            segment_bytes=self.options.segment_bytes,
            fsync=self.options.fsync,
            fsync_interval=self.options.fsync_interval_ms / 1000.0,
        )
        try:
            self._consumers = ConsumerOffsets(self.root / "consumers", disk, max_consumers=self.options.max_consumers)
            self._consumers.clamp(self._features.latest)
            self._knowledge = KnowledgeFiles(self.root / "knowledge", disk, max_bytes=self.options.max_knowledge_bytes)
        except BaseException:
            self._features.close()  # release the folder lock
            raise

    @property
    def disk_failure(self) -> str:
        """'' while no fsync failed; else the failed fsync that stopped new records until the
        repository is restarted (:class:`DiskFailure`)."""
        return self.disk.failure

    @classmethod
    def from_config(cls, config: RepositoryConfig) -> FeatureStore:
        """The store under ``config.data_dir/repository`` with the config's bounds."""
        from hio.config import state_dir
        from hio.transport.net import message_limit

        bounds = {f.name: getattr(config, f.name) for f in dataclasses.fields(StoreOptions) if hasattr(config, f.name)}
        options = StoreOptions(**{**bounds, "max_knowledge_bytes": message_limit(config)})  # a knowledge: one message
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
            verify_upload(tuple_id, data, crc, self._limits)
        return self._features.append([(tuple_id, data) for tuple_id, data, _ in batch])

    def latest(self) -> int:
        """Highest offset stored (0 = nothing yet); offsets are dense, so also how many records."""
        return self._features.latest

    def wait_beyond(self, offset: int, seconds: float) -> int:
        """:meth:`latest` once it passes ``offset``, or after ``seconds``; Unavailable at close."""
        return self._features.wait_beyond(offset, seconds)

    def offset_of(self, tuple_id: int) -> int:
        """Offset of a stored tuple id, 0 if not stored."""
        return self._features.offset_of(tuple_id)

    def read(self, after: int = 0, until: int = 0, max_records: int = 0) -> Iterator[tuple[int, int, bytes]]:
        """(offset, tuple_id, record_zstd) with ``after < offset <= until`` (until 0 = latest),
        at most ``max_records`` (0 = all), in offset order, read lazily from disk."""
        return self._features.read(after, until, max_records)

    def durable_unix(self, offsets: list[int]) -> list[float]:
        """When each stored offset became durable (Unix seconds); 0.0 where not known
        (:meth:`FeatureLog.durable_unix`)."""
        return self._features.durable_unix(offsets)

    def stats(self) -> dict[str, int]:
        """records, segments, bytes on disk; records readable, appended by this process and
        put as duplicates (:meth:`FeatureLog.stats`)."""
        return self._features.stats()

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

    def close(self) -> None:
        """Flush and close; further writes are refused."""
        self._features.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
