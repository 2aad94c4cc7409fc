"""The repository as a Spark Structured Streaming source (Python Data Source API).

Offsets are the repository's offsets (``{"offset": N}``: everything up to N
has been planned). Each micro-batch covers ``start < offset <= end``; the range
is cut into ``read_partitions`` contiguous slices that executors read in
parallel, each through its own gRPC channel. ``latestOffset`` honours a
``ReadMaxRows`` limit (``max_records_per_interval``): repository offsets are
dense (1, 2, 3, ...), so a range of N offsets is N records. ``commit`` moves
the consumer's offset in the repository once Spark has finished a batch:
informational for operators, and the starting point of a query that has lost
its checkpoint (with the store's own high-water mark, ``start_after``).

Spark pickles the reader to its Python workers, so it holds only plain options.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from hio.kd.client import RepositoryClient
from hio.kd.records import SPARK_SCHEMA, decode

NAME = "hio_repository"
log = logging.getLogger("hio.kd")


@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """One slice of a micro-batch: repository offsets ``after < offset <= until``."""

    after: int
    until: int


def split_range(after: int, until: int, parts: int, min_size: int = 500) -> list[OffsetRange]:
    """Cut (after, until] into at most ``parts`` contiguous slices of at least ``min_size``."""
    total = until - after
    if total <= 0:
        return []
    parts = max(1, min(parts, total // min_size))
    bounds = [after + total * index // parts for index in range(parts + 1)]
    return [OffsetRange(start, end) for start, end in itertools.pairwise(bounds)]


class RepositoryDataSource(DataSource):
    """``spark.readStream.format("hio_repository")``; options: see ``client.connection_options``
    plus ``consumer``, ``max_records``, ``partitions``, ``max_record_bytes``, ``start_after``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SPARK_SCHEMA

    def streamReader(self, schema: StructType) -> RepositoryStreamReader:
        return RepositoryStreamReader(dict(self.options))


class RepositoryStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans and reads micro-batches of repository records."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.consumer = options.get("consumer", "kd")
        self.max_records = int(options.get("max_records", "50000"))
        self.partition_count = int(options.get("partitions", "2"))
        self.max_record_bytes = int(options.get("max_record_bytes", str(16 * 1024 * 1024)))
        self.start_after = int(options.get("start_after", "0"))
        self.target: int | None = None

    def _client(self) -> RepositoryClient:
        return RepositoryClient.from_options(self.options)

    def initialOffset(self) -> dict[str, int]:
        """Where a query without a checkpoint starts: after what the consumer
        committed, or after what the store already holds, whichever is later."""
        with self._client() as client:
            committed = client.offsets(self.consumer).committed
        return {"offset": max(int(committed), self.start_after)}

    def _latest(self) -> int:
        with self._client() as client:
            return int(client.offsets(self.consumer).latest)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self._latest()

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_records)

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        begin = int(start["offset"])
        latest = self.target if self.target is not None else self._latest()
        if latest < begin:
            log.warning(
                "repository offsets went backwards; waiting for new records",
                extra={"latest": latest, "kd_offset": begin},
            )
            return {"offset": begin}
        if isinstance(limit, ReadMaxRows):
            latest = min(latest, begin + limit.max_rows)
        elif not isinstance(limit, ReadAllAvailable):
            latest = min(latest, begin + self.max_records)
        return {"offset": latest}

    def reportLatestOffset(self) -> dict[str, int]:
        return {"offset": self._latest()}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        return split_range(int(start["offset"]), int(end["offset"]), self.partition_count)

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, OffsetRange)
        with self._client() as client:
            for record in client.read(partition.after, partition.until):
                yield decode(record.offset, record.tuple_id, record.record_zstd, self.max_record_bytes).as_tuple()

    def commit(self, end: dict[str, int]) -> None:
        with self._client() as client:
            client.commit(self.consumer, int(end["offset"]))
