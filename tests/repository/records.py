"""Building feature records the way engines do, for repository tests."""

from __future__ import annotations

import struct
import threading
import zlib

import zstandard

from hio.proto import features_pb2
from hio.transport.frames import crc32


def feature_record(tuple_id: int, value: float = 1.0, *, image: str = "hio/synthetic") -> features_pb2.FeatureRecord:
    record = features_pb2.FeatureRecord(tuple_id=tuple_id, engine="w1/0", processed_unix=1_700_000_000.0)
    record.meta.tuple_id = tuple_id
    record.meta.image = image
    record.features["mean_intensity"].number = value
    record.features["label"].text = f"t{tuple_id}"
    record.kd_features.append("mean_intensity")
    return record


_local = threading.local()  # zstd compressors are not thread safe; creating one per record is slow


def compress(message_bytes: bytes) -> bytes:
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(level=3)
    return _local.compressor.compress(message_bytes)


def upload(tuple_id: int, value: float = 1.0) -> tuple[int, bytes, int]:
    """(tuple_id, record_zstd, crc32) as PutFeatures carries it."""
    data = compress(feature_record(tuple_id, value).SerializeToString())
    return tuple_id, data, crc32(data)


def decode(record_zstd: bytes) -> features_pb2.FeatureRecord:
    record = features_pb2.FeatureRecord()
    record.ParseFromString(zstandard.ZstdDecompressor().decompress(record_zstd))
    return record


def knowledge(tuple_count: int = 10, clusters: int = 3, assignments: int = 4) -> features_pb2.Knowledge:
    k = features_pb2.Knowledge(
        computed_unix=1_700_000_000.0,
        tuple_count=tuple_count,
        up_to_offset=tuple_count,
        feature_names=["mean_intensity"],
        feature_mean=[0.5],
        feature_std=[0.1],
        algorithm="bisecting-kmeans",
    )
    for i in range(clusters):
        k.clusters.add(id=i, centre=[float(i)], count=tuple_count // clusters)
    for i in range(assignments):
        k.assignments.add(tuple_id=i + 1, cluster=i % clusters)
    return k


def png_bytes() -> bytes:
    """A real 1x1 PNG built with zlib, no image library needed."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00\x80")) + chunk(b"IEND", b"")
    )
