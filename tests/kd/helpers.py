"""Building feature records and a real repository for KD tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import zstandard

from hio.kd.records import Row
from hio.proto import features_pb2, repository_pb2, repository_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.frames import crc32
from hio.transport.net import create_channel

CENTRES = np.array([[0.0, 0.0, 0.0], [10.0, 10.0, 0.0], [0.0, 10.0, 10.0]])


def record(
    tuple_id: int,
    values: dict[str, float],
    *,
    image: str = "hio/synthetic",
    kd: Sequence[str] = (),
    text: dict[str, str] | None = None,
) -> features_pb2.FeatureRecord:
    rec = features_pb2.FeatureRecord(tuple_id=tuple_id, processed_unix=time.time(), kd_features=list(kd))
    rec.meta.tuple_id = tuple_id
    rec.meta.image = image
    for name, value in values.items():
        rec.features[name].number = value
    for name, value in (text or {}).items():
        rec.features[name].text = value
    return rec


def blob(rec: features_pb2.FeatureRecord) -> bytes:
    return zstandard.ZstdCompressor().compress(rec.SerializeToString())


def blobs_records(
    first_id: int, count: int, seed: int = 0, image: str = "hio/synthetic"
) -> tuple[list[features_pb2.FeatureRecord], np.ndarray]:
    """``count`` records from three well-separated blobs; (records, true blob of each)."""
    rng = np.random.default_rng(seed + first_id)
    truth = np.arange(count) % len(CENTRES)
    points = CENTRES[truth] + rng.normal(scale=0.5, size=(count, CENTRES.shape[1]))
    records = [
        record(first_id + i, {"a": p[0], "b": p[1], "c": p[2]}, image=image, kd=("a", "b", "c"), text={"label": "x"})
        for i, p in enumerate(points.tolist())
    ]
    return records, truth


def simulation_records(first_id: int, count: int) -> tuple[list[features_pb2.FeatureRecord], list[int]]:
    """``count`` records of another image with another feature set: three 2-D blobs."""
    rng = np.random.default_rng(first_id)
    centres = np.array([[100.0, 0.0], [0.0, 50.0], [-100.0, -50.0]])
    truth = [i % 3 for i in range(count)]
    points = centres[truth] + rng.normal(scale=2.0, size=(count, 2))
    return [
        record(first_id + i, {"energy": p[0], "pressure": p[1]}, image="hio/simulation", kd=("energy", "pressure"))
        for i, p in enumerate(points.tolist())
    ], truth


class Repo:
    """A client of a real repository for test set-up."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = create_channel(address, ClusterSettings())
        self.stub = repository_pb2_grpc.RepositoryStub(self.channel)

    def put(self, records: Sequence[features_pb2.FeatureRecord], batch: int = 500) -> None:
        for start in range(0, len(records), batch):
            uploads = []
            for rec in records[start : start + batch]:
                data = blob(rec)
                uploads.append(
                    repository_pb2.FeaturesUpload(tuple_id=rec.tuple_id, record_zstd=data, crc32=crc32(data))
                )
            self.stub.PutFeatures(repository_pb2.PutFeaturesRequest(records=uploads), timeout=30)

    def knowledge(self) -> features_pb2.Knowledge | None:
        reply = self.stub.GetKnowledge(repository_pb2.GetKnowledgeRequest(), timeout=10)
        return features_pb2.Knowledge.FromString(reply.knowledge) if reply.knowledge else None

    def preview(self) -> bytes:
        return self.stub.GetPreview(repository_pb2.GetPreviewRequest(), timeout=10).png

    def offsets(self, consumer: str = "kd") -> repository_pb2.GetOffsetsResponse:
        return self.stub.GetOffsets(repository_pb2.GetOffsetsRequest(consumer=consumer), timeout=10)

    def close(self) -> None:
        self.channel.close()


@contextlib.contextmanager
def repository(data_dir: Path) -> Iterator[Repo]:
    """A real repository server (in-process, port 0) over ``data_dir``."""
    from hio.repository import RepositoryConfig, create_repository_server

    config = RepositoryConfig(listen="127.0.0.1:0", http_listen="", data_dir=str(data_dir), fsync="never")
    server, port, store = create_repository_server(config)
    server.start()
    repo = Repo(f"127.0.0.1:{port}")
    try:
        yield repo
    finally:
        repo.close()
        server.stop(0).wait(5)
        store.close()


def to_table(rows: Iterable[Row]) -> Any:  # a pyarrow.Table (pyarrow ships no types)
    """Rows as an Arrow table shaped like what Spark hands to ``foreachBatch``."""
    schema = pa.schema(
        [
            ("offset", pa.int64()),
            ("tuple_id", pa.int64()),
            ("image", pa.string()),
            ("processed_unix", pa.float64()),
            ("names", pa.list_(pa.string())),
            ("values", pa.list_(pa.float64())),
            ("error", pa.string()),
        ]
    )
    out: dict[str, list[Any]] = {name: [] for name in schema.names}
    for row in rows:
        for name, value in zip(schema.names, row.as_tuple(), strict=True):
            out[name].append(value)
    return pa.table(out, schema=schema)
