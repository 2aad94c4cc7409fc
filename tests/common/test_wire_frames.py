"""Large chunks encoded by hand and read in place: the same wire bytes as protobuf's, and the
same meaning for every frame a sender may produce (in this codebase or any other)."""

from __future__ import annotations

import os
import random

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from hio.transport.frames import (
    ENCODED_MIN_BYTES,
    ChunkFrame,
    FrameReader,
    TupleFrame,
    TupleMeta,
    crc32,
    encode_frame,
    frames_for_bytes,
    frames_for_stream,
    parse_frame,
    serialize_frame,
    tuple_frames,
)

BIG = ENCODED_MIN_BYTES + 17

metas = st.one_of(
    st.none(),
    st.just(TupleMeta()),
    st.builds(
        TupleMeta,
        tuple_id=st.integers(0, 2**64 - 1),
        image=st.text(max_size=20),
        size=st.integers(0, 2**40),
        crc32=st.integers(0, 2**32 - 1),
        attempt=st.integers(0, 9),
        attributes=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    ),
)
sizes = st.sampled_from([0, 1, 127, 128, 16383, 16384, ENCODED_MIN_BYTES - 1, ENCODED_MIN_BYTES, BIG, 2_100_000])


def same_frame(got: TupleFrame | ChunkFrame, want: TupleFrame) -> None:
    assert bytes(got.data) == want.data and got.last == want.last and list(got.packed) == list(want.packed)
    assert got.HasField("meta") == want.HasField("meta") and got.meta == want.meta


@settings(max_examples=60, deadline=None)
@given(meta=metas, size=sizes, last=st.booleans())
def test_encoded_frame_is_byte_for_byte_protobufs_and_reads_back_the_same(meta, size, last) -> None:
    data = os.urandom(size)
    want = TupleFrame(meta=meta, data=data, last=last)
    wire = encode_frame(meta, data, last)
    assert TupleFrame.FromString(wire) == want
    if meta is None or len(meta.attributes) < 2:  # protobuf leaves the order of map entries open
        assert wire == want.SerializeToString()
    got = parse_frame(wire)
    same_frame(got, want)
    # large plain chunks are read in place; everything else is protobuf's own message
    assert isinstance(got, ChunkFrame) == (len(wire) >= ENCODED_MIN_BYTES and size > 0)


def test_a_large_chunk_is_a_view_of_the_received_message_not_a_copy() -> None:
    wire = encode_frame(TupleMeta(tuple_id=3), os.urandom(BIG), True)
    got = parse_frame(wire)
    assert isinstance(got.data, memoryview) and got.data.obj is wire


def frame_with(*fields: bytes) -> bytes:
    return b"".join(fields)


DATA = random.Random(9).randbytes(BIG)  # the same bytes in every test process
DATA_FIELD = encode_frame(None, DATA, False)
OTHER_DATA_FIELD = encode_frame(None, DATA[::-1], False)
LAST = b"\x18\x01"
META = encode_frame(TupleMeta(tuple_id=9, image="x"), b"", False)


@pytest.mark.parametrize(
    "wire",
    [
        frame_with(LAST, DATA_FIELD, META),  # fields in another order
        frame_with(DATA_FIELD, OTHER_DATA_FIELD, LAST),  # data twice: the last one wins
        frame_with(META, META, DATA_FIELD),  # meta twice: merged
        frame_with(DATA_FIELD, b"\x28\x05", LAST),  # an unknown varint field (a newer sender)
        frame_with(DATA_FIELD, b"\x32\x03abc"),  # an unknown length-delimited field
        frame_with(
            META,
            DATA_FIELD,
            b"\x22"
            + bytes([len(p := TupleFrame(meta=TupleMeta(tuple_id=10), data=b"a", last=True).SerializeToString())])
            + p,
            LAST,
        ),
        frame_with(DATA_FIELD, b"\x18\x00"),  # last written as false
        LAST * 40_000,  # many small fields: protobuf's parser reads them
        frame_with(META, DATA_FIELD, LAST * 40_000),
    ],
    ids=[
        "fields in another order",
        "data twice",
        "meta twice",
        "unknown varint field",
        "unknown length-delimited field",
        "nested frame as unknown field",
        "last false",
        "many small fields",
        "meta, data, many small fields",
    ],
)
def test_frames_that_protobuf_reads_are_read_with_the_same_meaning(wire: bytes) -> None:
    same_frame(parse_frame(wire), TupleFrame.FromString(wire))


@pytest.mark.parametrize(
    "wire",
    [
        DATA_FIELD[:-1000],  # cut inside the payload
        b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01" + DATA,  # a length varint that never ends
        b"\x0a\x05\xff\xff\xff\xff\xff" + DATA_FIELD,  # meta that is not a message
        b"\x0f" + DATA,  # a field with wire type 7
    ],
    ids=["cut payload", "endless varint", "meta not a message", "wire type 7"],
)
def test_damaged_frames_are_refused_as_protobuf_refuses_them(wire: bytes) -> None:
    with pytest.raises(DecodeError):
        TupleFrame.FromString(wire)
    with pytest.raises(DecodeError):
        parse_frame(wire)


def test_encoded_streams_read_back_verified_and_the_pipeline_gets_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    payloads = [os.urandom(n) for n in (10, BIG, 3 * BIG + 5, 2_000_000)]
    metas_ = [
        TupleMeta(tuple_id=i + 1, image="hio/synthetic", size=len(p), crc32=crc32(p)) for i, p in enumerate(payloads)
    ]
    path = tmp_path / "t.bin"
    path.write_bytes(payloads[2])
    sent = [
        *frames_for_bytes(metas_[0], payloads[0], BIG, encode=True),
        *frames_for_bytes(metas_[1], payloads[1], BIG, encode=True),
        *frames_for_stream(metas_[2], path.open("rb"), BIG, encode=True),
        *tuple_frames([(metas_[3], payloads[3])], 1 << 20, 1 << 20, encode=True),
    ]
    assert any(isinstance(f, bytes) for f in sent) and any(isinstance(f, TupleFrame) for f in sent)
    received = [parse_frame(serialize_frame(f)) for f in sent]
    reader = FrameReader(received, max_tuple_bytes=1 << 30, max_chunk_bytes=1 << 21)
    got = []
    while (item := reader.next_tuple_bytes()) is not None:
        got.append(item)
    assert [d for _, d in got] == payloads and all(type(d) is bytes for _, d in got)
    assert [m.tuple_id for m, _ in got] == [1, 2, 3, 4]
