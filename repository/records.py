"""Checking what engines upload before anything is stored.

A record is stored only if its bytes arrived intact (CRC-32), it is a single
zstd frame that decompresses within the bound, and it holds a
``FeatureRecord`` for the tuple id it is uploaded under. Damaged bytes are
``DATA_LOSS`` (the sender should resend); anything else is the sender's bug,
``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import dataclasses
import threading

import zstandard
from google.protobuf.message import DecodeError

from hio.proto import features_pb2
from hio.transport.errors import DataLoss, InvalidArgument
from hio.transport.frames import crc32

MAX_TUPLE_ID = 2**64 - 1

_local = threading.local()  # a decompressor per thread: creating one costs more than a small record


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


@dataclasses.dataclass(frozen=True)
class RecordLimits:
    """Bounds on one uploaded record."""

    max_record_bytes: int  # compressed
    max_decompressed_bytes: int


def verify_upload(tuple_id: int, record_zstd: bytes, crc: int, limits: RecordLimits) -> features_pb2.FeatureRecord:
    """The decoded record, or an error naming the tuple and what is wrong."""
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
