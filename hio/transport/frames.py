"""Tuples on the wire: cutting them into frames and reading them back, verified.

gRPC senders cut tuples with :func:`tuple_frames` (one: :func:`frames_for_bytes`,
:func:`frames_for_file`; the lane's senders with ``lane.lane_frames``); receivers read them
with :class:`FrameReader`, which checks the metadata, bounds each chunk and the tuple, and
verifies the size and CRC-32 as bytes arrive,
so a damaged tuple is refused (``DATA_LOSS``) before anyone acts on it. Small tuples may
travel packed, several in one message (:func:`pack_small`); the reader spreads them out
again. Large chunks are encoded by hand and read in place (:func:`encode_frame`,
:func:`parse_frame`): the same wire bytes, without the copies Python protobuf makes of a payload.
"""

from __future__ import annotations

import collections
import math
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, TypeVar, cast

from hio.proto import tuple_pb2
from hio.transport.errors import DataLoss, DeadlineExceeded, InvalidArgument

TupleMeta = tuple_pb2.TupleMeta
TupleFrame = tuple_pb2.TupleFrame
TupleReceipt = tuple_pb2.TupleReceipt
Packable = TypeVar("Packable", TupleFrame, TupleReceipt)

# A frame as senders hand it to gRPC: a message, or a large chunk already in
# its wire form (:func:`encode_frame`); :func:`serialize_frame` sends both.
WireFrame = TupleFrame | bytes

# Chunks of at least this many bytes travel encoded by hand and are read
# without copying (:func:`parse_frame`). Below it, protobuf's own code is as fast.
ENCODED_MIN_BYTES = 64 * 1024


try:  # the same CRC-32 as zlib's, with SIMD: an order of magnitude less CPU per byte
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - a platform without isal wheels
    _crc32 = zlib.crc32


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32 (zlib polynomial) as an unsigned 32-bit integer; ``value`` continues an earlier one.

    Every payload is checked at least twice on its way (sender and
    receiver, spool and backlog), so this is on the data path of every byte.
    """
    return _crc32(data, value) & 0xFFFFFFFF


def crc32_of_file(source: str | os.PathLike[str] | BinaryIO, size: int = -1) -> tuple[int, int]:
    """(CRC-32, bytes read) of a file by name, or of the next ``size`` bytes of an open one
    (up to its end if ``size`` is negative, or where it ends first)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as fh:
            return crc32_of_file(fh, size)
    value, read, block = 0, 0, 4 * 1024 * 1024
    while read != size and (chunk := source.read(block if size < 0 else min(block, size - read))):
        value = _crc32(chunk, value)
        read += len(chunk)
    return value & 0xFFFFFFFF, read


def frames_for_bytes(meta: TupleMeta, data: bytes, chunk_bytes: int, *, encode: bool = False) -> Iterator[WireFrame]:
    """Frames of one in-memory tuple: meta with the first chunk, `last` on the final one.

    With ``encode``, chunks of :data:`ENCODED_MIN_BYTES` or more come already
    encoded (:func:`encode_frame`); the call must then send with
    :func:`serialize_frame`.
    """
    size = len(data)
    if size <= chunk_bytes:
        yield _frame(meta, data, True, encode)
        return
    view = memoryview(data)
    for start in range(0, size, chunk_bytes):
        end = min(start + chunk_bytes, size)
        yield _frame(meta if start == 0 else None, view[start:end], end == size, encode)


def frames_for_stream(meta: TupleMeta, fh: BinaryIO, chunk_bytes: int, *, encode: bool = False) -> Iterator[WireFrame]:
    """Frames of one tuple read from an open binary file of exactly ``meta.size`` bytes
    (``encode`` as for :func:`frames_for_bytes`)."""
    remaining = meta.size
    first = True
    while True:
        chunk = fh.read(min(chunk_bytes, remaining)) if remaining else b""
        remaining -= len(chunk)
        last = remaining == 0 or not chunk
        yield _frame(meta if first else None, chunk, last, encode)
        first = False
        if last:
            return


def frames_for_file(
    meta: TupleMeta, path: str | os.PathLike[str], chunk_bytes: int, *, encode: bool = False
) -> Iterator[WireFrame]:
    """Frames of one tuple stored in a file; the file is read chunk by chunk."""
    with open(path, "rb") as fh:
        yield from frames_for_stream(meta, fh, chunk_bytes, encode=encode)


def _frame(meta: TupleMeta | None, data: bytes | memoryview, last: bool, encode: bool) -> WireFrame:
    if encode and len(data) >= ENCODED_MIN_BYTES:
        return encode_frame(meta, data, last)
    return TupleFrame(meta=meta, data=bytes(data) if isinstance(data, memoryview) else data, last=last)


# -- large chunks on the wire without copies -----------------------------------------
#
# At 1-10 MB per tuple, protobuf's copies of a payload (into the message, to serialize it,
# twice out of it at the receiver) would be most of the gateway's CPU. The bytes are a
# ``TupleFrame``'s: any gRPC peer, in any language, sends and reads them as such.

_META_KEY, _DATA_KEY, _LAST_KEY = 0x0A, 0x12, 0x18  # (field << 3) | wire type
_PLAIN_FIELDS = 4  # meta, data, last, and one repeat (a sender may write meta in two parts)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_frame(meta: TupleMeta | None, data: bytes | memoryview, last: bool) -> bytes:
    """``TupleFrame(meta=meta, data=data, last=last).SerializeToString()``, byte for byte,
    with the payload copied once (into the result) instead of twice."""
    parts: list[bytes | memoryview] = []
    if meta is not None:
        head = meta.SerializeToString()
        parts += [b"\x0a", _varint(len(head)), head]
    if len(data):
        parts += [b"\x12", _varint(len(data)), data]
    if last:
        parts.append(b"\x18\x01")
    return b"".join(parts)


def serialize_frame(frame: WireFrame) -> bytes:
    """gRPC request/response serializer for frame streams: messages and encoded chunks."""
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


class ChunkFrame:
    """A received frame whose payload was left where it arrived: ``data`` is a memoryview of
    the received message (or the bytes a lane read it into). Reads like a ``TupleFrame``
    (``meta``, ``data``, ``last``, ``packed``, ``HasField``) for :class:`FrameReader`; never
    carries packed tuples."""

    __slots__ = ("_head", "data")
    packed: tuple[TupleFrame, ...] = ()

    def __init__(self, head: TupleFrame, data: bytes | memoryview) -> None:
        self._head = head
        self.data = data

    @property
    def meta(self) -> TupleMeta:
        return self._head.meta

    @property
    def last(self) -> bool:
        return self._head.last

    def HasField(self, name: str) -> bool:  # the protobuf name
        return self._head.HasField(name)


def parse_frame(raw: bytes) -> TupleFrame | ChunkFrame:
    """gRPC deserializer for frame streams: a large chunk stays in ``raw`` (no copy);
    anything else, or anything unusual (unknown or repeated fields, packed tuples,
    damage), is parsed by protobuf, which raises on what it cannot read."""
    if len(raw) >= ENCODED_MIN_BYTES and (span := _data_span(raw)) is not None:
        key_at, start, end = span
        return ChunkFrame(TupleFrame.FromString(raw[:key_at] + raw[end:]), memoryview(raw)[start:end])
    return TupleFrame.FromString(raw)


def _data_span(raw: bytes) -> tuple[int, int, int] | None:
    """(key offset, start, end) of the one ``data`` field in a plain frame, else None.

    A plain frame has at most three fields (meta, data, last); a message of
    many small fields goes to protobuf's parser, which reads it far faster
    than this loop would.
    """
    pos, size, span = 0, len(raw), None
    for _ in range(_PLAIN_FIELDS + 1):
        if pos >= size:
            return span
        key_at = pos
        key, pos = _read_varint(raw, pos)
        if key == _LAST_KEY:
            _, pos = _read_varint(raw, pos)
        elif key in (_META_KEY, _DATA_KEY):
            length, pos = _read_varint(raw, pos)
            if pos + length > size:
                return None
            if key == _DATA_KEY:
                if span is not None:
                    return None
                span = (key_at, pos, pos + length)
            pos += length
        else:  # packed tuples, unknown fields, damage: protobuf's parser decides
            return None
        if pos < 0:
            return None
    return None  # more fields than a plain frame has


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    """(value, next position); position -1 when the varint is cut off or too long."""
    value, shift = 0, 0
    while pos < len(raw) and shift < 64:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return 0, -1


SYSTEM_ATTRIBUTES = 4  # keys the system may add to a tuple's attributes (hio.last_error)
SYSTEM_ATTRIBUTE_BYTES = 4 * 1024  # ... and their bytes (hio.last_error is cut to 1 KiB)


def check_meta(meta: TupleMeta, max_tuple_bytes: int, *, need_id: bool) -> None:
    """Refuse metadata that is missing, inconsistent or over the bounds (runs for every tuple)."""

    def what() -> str:
        return f"tuple {meta.tuple_id}" if meta.tuple_id else f"tuple '{meta.name[:64] or '?'}'"

    if need_id and meta.tuple_id == 0:
        raise InvalidArgument(f"{what()}: no tuple id (ask the master for a route first)")
    if not meta.image:
        raise InvalidArgument(f"{what()}: metadata names no image")
    for field, text, bound in (("image", meta.image, 256), ("source", meta.source, 256), ("name", meta.name, 1024)):
        if len(text) > bound:
            raise InvalidArgument(f"{what()}: its {field} of {len(text)} characters is over the limit of {bound}")
    if meta.size > max_tuple_bytes:
        raise InvalidArgument(f"{what()}: {meta.size} bytes is over the limit of {max_tuple_bytes}")
    attributes = meta.attributes
    # A tuple enters the system (no id yet) within the user's bound; past that point the system
    # may add its own few keys (hio.last_error), so a tuple at the bound can still be handed back.
    count, size = (256, 64 * 1024) if not need_id else (256 + SYSTEM_ATTRIBUTES, 64 * 1024 + SYSTEM_ATTRIBUTE_BYTES)
    if attributes and (len(attributes) > count or sum(len(k) + len(v) for k, v in attributes.items()) > size):
        raise InvalidArgument(f"{what()}: too many or too large attributes (at most 256, 64 KiB)")


def pack_small(
    tuples: Iterable[tuple[TupleMeta, bytes | BinaryIO]], chunk_bytes: int, pack_bytes: int
) -> Iterator[TupleFrame | tuple[TupleMeta, bytes | BinaryIO]]:
    """The tuples in order: small ones gathered into packed messages (``TupleFrame``, each up
    to ``pack_bytes`` of serialized frames; a small spooled file is read and closed here),
    every other one as given, ``(meta, payload)``. Shared by the gRPC and the lane framing.

    Small: at most a quarter of a packed message, and within a chunk (a packed tuple is
    one frame, and the receiver bounds a frame's data by its chunk limit).
    """
    largest = min(pack_bytes // 4, chunk_bytes)
    gathered: list[TupleFrame] = []
    size = 0
    for meta, payload in tuples:
        if meta.size > largest:
            if gathered:
                yield packed(gathered)
                gathered, size = [], 0
            yield meta, payload
            continue
        data = payload
        if not isinstance(data, bytes):
            with data:
                data = data.read(meta.size)
        frame = TupleFrame(meta=meta, data=data, last=True)
        frame_size = frame.ByteSize() + 8
        if gathered and size + frame_size > pack_bytes:
            yield packed(gathered)
            gathered, size = [], 0
        gathered.append(frame)
        size += frame_size
    if gathered:
        yield packed(gathered)


def tuple_frames(
    tuples: Iterable[tuple[TupleMeta, bytes | BinaryIO]], chunk_bytes: int, pack_bytes: int, *, encode: bool = False
) -> Iterator[WireFrame]:
    """The frames of several tuples in order, each given by its metadata and its payload:
    bytes, or an open file positioned at it (closed here). Small ones travel packed
    (:func:`pack_small`); ``tuples`` is consumed lazily, one file open at a time.
    ``encode`` as for :func:`frames_for_bytes`."""
    for item in pack_small(tuples, chunk_bytes, pack_bytes):
        if isinstance(item, TupleFrame):
            yield item
            continue
        meta, payload = item
        if isinstance(payload, bytes):
            yield from frames_for_bytes(meta, payload, chunk_bytes, encode=encode)
        else:
            with payload:
                yield from frames_for_stream(meta, payload, chunk_bytes, encode=encode)


def unpacked_receipts(receipt: TupleReceipt) -> list[TupleReceipt]:
    """A receipt message's receipts in order (itself, then those packed on it)."""
    return [receipt, *receipt.packed]


def packed(messages: list[Packable]) -> Packable:
    """One message carrying ``messages`` (frames or receipts) in order: the first, the rest packed on it."""
    first = messages[0]
    first.packed.extend(messages[1:])
    return first


class FrameReader:
    """Reads tuples one after the other from a stream of frames, verifying each.

    Packed tuples (``TupleFrame.packed``) are read as if each had come as a
    frame of its own. Not thread-safe: one reader per stream. ``index``
    counts tuples read so far.
    """

    def __init__(
        self, frames: Iterable[TupleFrame], *, max_tuple_bytes: int, max_chunk_bytes: int, need_id: bool = True
    ) -> None:
        self._frames = iter(frames)
        self._unpacked: collections.deque[TupleFrame] = collections.deque()  # packed tuples not read yet
        self._max_tuple = max_tuple_bytes
        self._max_chunk = max_chunk_bytes
        self._need_id = need_id
        self.index = 0
        self.reading: TupleMeta | None = None  # the tuple being read; left set when reading it failed
        self.packed = False  # the sender packs small tuples: it understands packed receipts

    @property
    def buffered(self) -> bool:
        """The next tuple's first frame is already in memory (packed with an earlier one)."""
        return bool(self._unpacked)

    def _next_frame(self) -> TupleFrame:
        """The next frame, a packed tuple as a frame of its own (the packing rules checked);
        StopIteration at the stream's end."""
        if self._unpacked:
            return self._unpacked.popleft()
        frame = next(self._frames)
        if not frame.packed:
            return frame
        if not frame.last:
            raise InvalidArgument("a frame carrying packed tuples must end its own tuple (set last)")
        for n, inner in enumerate(frame.packed):
            if not inner.HasField("meta") or not inner.last or inner.packed:
                raise InvalidArgument(
                    f"packed tuple {n}: must be one whole tuple in one frame (metadata, last set, nothing packed in it)"
                )
        self.packed = True
        self._unpacked.extend(frame.packed)
        # without meta: the last frame of a tuple of several frames
        return TupleFrame(meta=frame.meta if frame.HasField("meta") else None, data=frame.data, last=True)

    def next_tuple(
        self, sink: Callable[[bytes | memoryview], None], begin: Callable[[TupleMeta], None] | None = None
    ) -> TupleMeta | None:
        """Read the next tuple, passing its chunks to ``sink``; None at the stream's end.
        ``begin`` sees its checked metadata before any chunk (it may refuse the tuple by raising).

        A chunk is bytes, or a memoryview of the received message for large
        ones (:func:`parse_frame`); a sink that keeps it must copy or join it.

        Raises DataLoss for a truncated or corrupt tuple, InvalidArgument for
        bad metadata or an oversized chunk. The sink sees only verified-size
        data; the checksum is known only at the end, so sinks that persist must
        not publish before this returns.
        """
        try:
            frame = self._next_frame()
        except StopIteration:
            return None
        if not frame.HasField("meta"):
            raise InvalidArgument(f"frame {self.index}: the first frame of a tuple must carry its metadata")
        meta = TupleMeta()
        meta.CopyFrom(frame.meta)
        check_meta(meta, self._max_tuple, need_id=self._need_id)
        self.reading = meta
        if begin is not None:
            begin(meta)
        received, value = 0, 0
        while True:
            data = frame.data
            if len(data) > self._max_chunk:
                raise InvalidArgument(
                    f"{self._label(meta)}: chunk of {len(data)} bytes is over the limit of {self._max_chunk}"
                )
            received += len(data)
            if received > meta.size:
                raise DataLoss(f"{self._label(meta)}: more bytes than the {meta.size} its metadata declares")
            if data:
                value = _crc32(data, value)
                sink(data)
            if frame.last:
                break
            try:
                frame = self._next_frame()
            except StopIteration:
                raise DataLoss(f"{self._label(meta)}: stream ended after {received} of {meta.size} bytes") from None
            if frame.HasField("meta"):
                raise InvalidArgument(f"{self._label(meta)}: a new tuple began before this one's last frame")
        if received != meta.size:
            raise DataLoss(f"{self._label(meta)}: got {received} bytes, metadata declares {meta.size}")
        if (value & 0xFFFFFFFF) != meta.crc32:
            raise DataLoss(
                f"{self._label(meta)}: checksum mismatch (CRC-32 {value & 0xFFFFFFFF:08x}, expected {meta.crc32:08x})"
            )
        self.index += 1
        self.reading = None
        return meta

    def _label(self, meta: TupleMeta) -> str:
        return f"tuple {meta.tuple_id or meta.name or self.index}"

    def next_tuple_bytes(self) -> tuple[TupleMeta, bytes] | None:
        """Read the next tuple into memory; None at the stream's end."""
        chunks: list[bytes | memoryview] = []
        meta = self.next_tuple(chunks.append)
        if meta is None:
            return None
        if len(chunks) == 1 and isinstance(chunks[0], bytes):
            return meta, chunks[0]
        return meta, b"".join(chunks)  # one copy, also out of the received messages


class StopDeadline:
    """When a stopping server ends the streams it still serves. From :meth:`begin` on, the
    server takes no new tuple; a tuple a stream is sending may finish within ``finish_seconds``,
    then :meth:`due` says to cut the stream off, by its own servicer (an ``idle_bounded`` cut),
    so the sender reads why it ended, not gRPC's 'Cancelling all calls' at the server's stop."""

    def __init__(self) -> None:
        self._at = math.inf  # monotonic

    def begin(self, finish_seconds: float) -> None:
        self._at = min(self._at, time.monotonic() + max(0.0, finish_seconds))

    @property
    def begun(self) -> bool:
        return self._at < math.inf

    def due(self) -> bool:
        return time.monotonic() >= self._at


_ENDED = object()  # what the reader of an idle-bounded stream hands over when its input ends
CUT_POLL = 0.2  # seconds: how often a waiting idle_bounded asks its cut


def idle_bounded(
    frames: Iterable[TupleFrame], seconds: float, cut: Callable[[], BaseException | None] | None = None
) -> Iterator[TupleFrame]:
    """The frames of a stream, ended with DeadlineExceeded (naming ``seconds``) when its
    sender sends nothing for ``seconds``; ``seconds`` <= 0: no bound. ``cut``, asked before
    each frame and every :data:`CUT_POLL` seconds of waiting, ends the stream with the error
    it returns (a server that stops says why, in the middle of a tuple too).

    A thread of the stream's own reads ``frames``, one frame ahead of the caller, and
    the caller's thread waits for it with the bound, so the error is raised where the
    servicer can answer with it: a gRPC handler's thread blocked in its request
    iterator could only cancel the call (the client would read CANCELLED). Only time
    spent waiting for the sender counts, not time the caller spends on a frame. Once
    the caller's status is sent, gRPC ends the request iterator and the reader with it.
    """
    if seconds <= 0 and cut is None:
        yield from frames
        return
    handoff: queue.SimpleQueue[object] = queue.SimpleQueue()
    room = threading.Semaphore(1)  # the reader reads a frame only once the caller took the one before
    done = threading.Event()

    def read() -> None:
        iterator = iter(frames)
        while True:
            room.acquire()
            if done.is_set():
                return
            try:
                item: object = next(iterator)
            except StopIteration:
                item = _ENDED
            except BaseException as exc:  # noqa: BLE001 - the caller raises it, in order
                item = exc
            handoff.put(item)
            if item is _ENDED or isinstance(item, BaseException):
                return

    def next_item() -> object:
        waited_until = time.monotonic() + seconds if seconds > 0 else math.inf
        while True:
            if cut is not None and (error := cut()) is not None:
                raise error
            try:
                return handoff.get(timeout=min(CUT_POLL if cut else seconds, max(waited_until - time.monotonic(), 0)))
            except queue.Empty:
                if time.monotonic() >= waited_until:
                    raise DeadlineExceeded(
                        f"no frame for {seconds:g} s (stream_idle_seconds): the sender stalled; the stream is ended"
                    ) from None

    threading.Thread(target=read, name="stream-reader", daemon=True).start()
    try:
        while True:
            item = next_item()
            if item is _ENDED:
                return
            if isinstance(item, BaseException):
                raise item
            room.release()
            yield cast(TupleFrame, item)
    finally:
        done.set()
        room.release()  # a reader waiting for room sees it is done
