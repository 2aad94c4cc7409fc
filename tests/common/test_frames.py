import itertools
import os
import threading
import time
from collections.abc import Iterator

import pytest

from hio.transport.errors import DataLoss, InvalidArgument
from hio.transport.frames import FrameReader, TupleFrame, TupleMeta, crc32, frames_for_bytes, frames_for_file


def meta_for(data: bytes, tuple_id: int = 7, **kw) -> TupleMeta:
    return TupleMeta(tuple_id=tuple_id, image="hio/synthetic", size=len(data), crc32=crc32(data), **kw)


def reader(frames, **kw) -> FrameReader:
    return FrameReader(
        frames, max_tuple_bytes=kw.pop("max_tuple", 1 << 30), max_chunk_bytes=kw.pop("max_chunk", 1 << 20), **kw
    )


def test_many_tuples_of_many_chunks_round_trip(tmp_path) -> None:
    payloads = [os.urandom(n) for n in (0, 1, 1000, 3 * 65536 + 5)]
    frames = [f for i, p in enumerate(payloads) for f in frames_for_bytes(meta_for(p, i + 1), p, 65536)]
    assert sum(1 for f in frames if f.HasField("meta")) == len(payloads)
    r = reader(frames)
    got = []
    while (item := r.next_tuple_bytes()) is not None:
        got.append(item)
    assert [d for _, d in got] == payloads and [m.tuple_id for m, _ in got] == [1, 2, 3, 4]


def test_file_frames_stream_from_disk(tmp_path) -> None:
    data = os.urandom(300_000)
    path = tmp_path / "t.bin"
    path.write_bytes(data)
    frames = list(frames_for_file(meta_for(data), path, 100_000))
    assert len(frames) == 3 and frames[-1].last and not frames[0].last
    assert reader(frames).next_tuple_bytes()[1] == data


def test_corrupt_chunk_is_data_loss_naming_the_tuple() -> None:
    data = os.urandom(5000)
    frames = list(frames_for_bytes(meta_for(data, 42), data, 1000))
    frames[2] = TupleFrame(data=bytes(1000))
    with pytest.raises(DataLoss, match="tuple 42: checksum mismatch"):
        reader(frames).next_tuple_bytes()


def test_truncated_stream_and_size_lies_are_data_loss() -> None:
    data = os.urandom(5000)
    frames = list(frames_for_bytes(meta_for(data, 9), data, 1000))
    with pytest.raises(DataLoss, match="stream ended after 3000 of 5000"):
        reader(frames[:3]).next_tuple_bytes()
    lying = meta_for(data, 9)
    lying.size = 10
    with pytest.raises(DataLoss, match="more bytes"):
        reader(frames_for_bytes(lying, data, 1000)).next_tuple_bytes()


@pytest.mark.parametrize(
    "meta,message",
    [
        (TupleMeta(tuple_id=0, image="x", size=1), "no tuple id"),
        (TupleMeta(tuple_id=1, image="", size=1), "names no image"),
        (TupleMeta(tuple_id=1, image="x", size=1 << 40), "over the limit"),
        (TupleMeta(tuple_id=1, image="x" * 257, size=1), "its image of 257 characters is over the limit of 256"),
        (TupleMeta(tuple_id=1, image="x", source="s" * 300, size=1), "its source of 300 characters"),
        (
            TupleMeta(tuple_id=1, image="x", name="n" * 1025, size=1),
            "its name of 1025 characters is over the limit of 1024",
        ),
    ],
)
def test_bad_metadata_is_invalid_argument(meta, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        reader([TupleFrame(meta=meta, data=b"x", last=True)]).next_tuple_bytes()


def test_oversized_chunk_and_missing_meta_are_refused() -> None:
    data = os.urandom(4096)
    with pytest.raises(InvalidArgument, match="chunk of 4096 bytes"):
        reader(frames_for_bytes(meta_for(data), data, 1 << 20), max_chunk=1024).next_tuple_bytes()
    with pytest.raises(InvalidArgument, match="must carry its metadata"):
        reader([TupleFrame(data=b"abc", last=True)]).next_tuple_bytes()


def _packed(payloads: list[bytes], pack_bytes: int = 1 << 20) -> list[TupleFrame]:
    from hio.transport.frames import pack_small

    out = list(pack_small([(meta_for(p, i + 1), p) for i, p in enumerate(payloads)], 1 << 20, pack_bytes))
    assert all(isinstance(message, TupleFrame) for message in out), "every tuple is packed"
    return out  # type: ignore[return-value]  # TupleFrames only, as asserted


def test_packed_small_tuples_read_as_if_each_came_alone() -> None:
    payloads = [os.urandom(n) for n in (0, 1, 100, 5000)] * 50
    messages = _packed(payloads, pack_bytes=64 * 1024)
    assert 1 < len(messages) < 20  # many tuples per message, split at the bound
    assert all(m.ByteSize() <= 64 * 1024 for m in messages)
    r = reader(messages)
    got = []
    while (item := r.next_tuple_bytes()) is not None:
        got.append(item)
    assert [d for _, d in got] == payloads and [m.tuple_id for m, _ in got] == list(range(1, 201))
    assert r.packed and r.index == 200


def test_tuples_packed_on_the_last_frame_of_a_tuple_of_several_frames_follow_it() -> None:
    """tuple.proto: packed tuples may ride on any frame that ends its own tuple."""
    big, small = os.urandom(10), [b"b" * 3, b"c" * 4]
    first = TupleFrame(meta=meta_for(big, 1), data=big[:5])
    last = TupleFrame(data=big[5:], last=True)
    for n, p in enumerate(small, 2):
        last.packed.add(meta=meta_for(p, n), data=p, last=True)
    r = reader([first, last])
    got = [r.next_tuple_bytes() for _ in range(3)]
    assert [(m.tuple_id, d) for m, d in got] == [(1, big), (2, small[0]), (3, small[1])]
    assert r.next_tuple_bytes() is None
    with pytest.raises(InvalidArgument, match="must carry its metadata"):  # a first frame without meta
        reader([last]).next_tuple_bytes()


def test_packed_tuple_that_is_damaged_is_refused_by_id() -> None:
    payloads = [b"a" * 10, b"b" * 10, b"c" * 10]
    (message,) = _packed(payloads)
    message.packed[1].data = b"x" * 10
    r = reader([message])
    assert r.next_tuple_bytes()[1] == b"a" * 10 and r.next_tuple_bytes()[1] == b"b" * 10
    with pytest.raises(DataLoss, match="tuple 3: checksum mismatch"):
        r.next_tuple_bytes()


@pytest.mark.parametrize("breakage", ["outer not last", "inner without meta", "inner not last", "nested"])
def test_packing_rules_are_enforced(breakage: str) -> None:
    (message,) = _packed([b"a", b"b", b"c"])
    if breakage == "outer not last":
        message.last = False
    elif breakage == "inner without meta":
        message.packed[0].ClearField("meta")
    elif breakage == "inner not last":
        message.packed[1].last = False
    else:
        message.packed[0].packed.add(meta=meta_for(b"d", 9), data=b"d", last=True)
    with pytest.raises(InvalidArgument, match="pack"):
        reader([message]).next_tuple_bytes()


def test_only_tuples_within_a_chunk_and_a_quarter_message_are_packed() -> None:
    from hio.transport.frames import pack_small

    def packs(size: int, chunk_bytes: int) -> bool:
        data = bytes(size)
        (item,) = pack_small([(meta_for(data), data)], chunk_bytes, 1 << 20)
        return isinstance(item, TupleFrame)

    assert packs(256 * 1024, 1 << 20)
    assert not packs(256 * 1024 + 1, 1 << 20)
    assert not packs(64 * 1024 + 1, 64 * 1024)  # the receiver's chunk limit


def test_reader_names_the_tuple_it_failed_to_read() -> None:
    good, bad = b"fine", b"damaged"
    metas = [
        TupleMeta(tuple_id=1, image="i", size=len(good), crc32=crc32(good)),
        TupleMeta(tuple_id=2, image="i", size=len(bad), crc32=crc32(bad) ^ 1),
    ]
    frames = [TupleFrame(meta=metas[0], data=good, last=True), TupleFrame(meta=metas[1], data=bad, last=True)]
    reader = FrameReader(iter(frames), max_tuple_bytes=100, max_chunk_bytes=100)
    assert reader.next_tuple_bytes() == (metas[0], good) and reader.reading is None
    with pytest.raises(DataLoss, match="checksum"):
        reader.next_tuple_bytes()
    assert reader.reading is not None and reader.reading.tuple_id == 2


def test_tuple_frames_pack_small_tuples_and_chunk_large_ones_from_bytes_or_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hio.transport.frames import tuple_frames

    payloads = [b"a" * 10, b"b" * 3000, b"c" * 20, b"d" * 30]
    metas = [TupleMeta(tuple_id=n + 1, image="i", size=len(p), crc32=crc32(p)) for n, p in enumerate(payloads)]
    files = []
    for n in (1, 3):  # the large tuple and the last small one come from files
        path = tmp_path / f"t{n}"
        path.write_bytes(b"xx" + payloads[n])
        fh = open(path, "rb")  # noqa: SIM115 - handed over: the framing must close it (asserted below)
        fh.seek(2)
        files.append(fh)
    sources = [payloads[0], files[0], payloads[2], files[1]]
    messages = list(tuple_frames(zip(metas, sources, strict=True), chunk_bytes=1024, pack_bytes=4096))
    assert [len(m.packed) for m in messages] == [0, 0, 0, 0, 1], "small, then 3 chunks, then two packed together"
    assert all(fh.closed for fh in files)
    reader = FrameReader(iter(messages), max_tuple_bytes=10_000, max_chunk_bytes=1024)
    got = []
    while (item := reader.next_tuple_bytes()) is not None:
        got.append(item)
    assert got == list(zip(metas, payloads, strict=True))


def test_an_idle_bound_counts_only_the_time_spent_waiting_for_the_sender() -> None:
    from hio.transport.errors import DeadlineExceeded
    from hio.transport.frames import idle_bounded

    sent: list[int] = []
    release = threading.Event()

    def sender() -> Iterator[TupleFrame]:
        for n in range(3):
            sent.append(n)
            yield TupleFrame(data=bytes([n]))
        release.wait(10)  # then stalls

    frames = idle_bounded(sender(), 0.5)
    first = next(frames)
    time.sleep(1.0)  # the receiver is busy for twice the bound: not the sender's idle time
    assert sent == [0, 1]  # read one frame ahead of the receiver, no more
    assert [first.data, *(f.data for f in itertools.islice(frames, 2))] == [b"\0", b"\1", b"\2"]
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"no frame for 0\.5 s \(stream_idle_seconds\): the sender stalled"):
        next(frames)
    assert 0.4 < time.monotonic() - started < 3
    release.set()


def test_a_cut_ends_an_idle_bounded_stream_mid_way_with_its_error() -> None:
    """A server that stops says why, to a sender stalled in the middle of a tuple (no idle bound
    at all) and to one still sending, rather than leaving gRPC to cancel the call."""
    from hio.transport.errors import Unavailable
    from hio.transport.frames import idle_bounded

    release = threading.Event()
    cut_now = threading.Event()

    def stalled() -> Iterator[TupleFrame]:
        yield TupleFrame(data=b"a")
        release.wait(10)
        yield TupleFrame(data=b"never taken")

    def cut() -> Unavailable | None:
        return Unavailable("stopping") if cut_now.is_set() else None

    frames = idle_bounded(stalled(), 0, cut=cut)
    assert next(frames).data == b"a"
    threading.Timer(0.3, cut_now.set).start()
    started = time.monotonic()
    with pytest.raises(Unavailable, match="stopping"):
        next(frames)
    assert time.monotonic() - started < 2
    release.set()

    endless = idle_bounded(itertools.repeat(TupleFrame(data=b"b")), 5, cut=cut)
    with pytest.raises(Unavailable, match="stopping"):
        next(endless)  # cut before the first frame is handed over
