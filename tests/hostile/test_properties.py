"""Property-based hostile input: random and malformed messages to every RPC.

Hypothesis generates tuple streams (random metadata, sizes, CRCs, chunk
splits, a missing last frame, extra frames, metadata in the wrong place),
random requests for every unary RPC, and raw bytes that are not protobuf at
all. The properties, checked after every example against servers that keep
running for the whole module:

* no call ends ``INTERNAL`` or ``UNKNOWN`` (a crash inside our code);
* every server still answers its health check ``SERVING``;
* stored state stays consistent: every queued tuple pulled back verifies its
  size and CRC-32 and was receipted; every repository record decompresses into
  a ``FeatureRecord`` carrying the id it is stored under, offsets stay dense,
  and only receipted tuples are stored; the gateway spool holds only intact,
  receipted payloads and no leaked reservation.
"""

from __future__ import annotations

import hashlib
import itertools
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hio.proto import features_pb2, master_pb2, repository_pb2
from hio.transport.frames import TupleFrame, TupleMeta, TupleReceipt
from hio.transport.tickets import make_ticket
from tests.harness import spooled_payload
from tests.hostile.cluster import (
    CHUNK,
    ENGINE_IMAGE,
    GATEWAY_IMAGE,
    QUEUE_IMAGE,
    TICKET_KEY,
    HostileCluster,
    serving,
    upload,
)

Code = grpc.StatusCode


def examples(count: int) -> settings:
    """Our settings: no per-example deadline (real RPCs), no example database in the checkout."""
    return settings(
        max_examples=count,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# The gateway's dispatcher draws retry jitter from the global `random` module on its own threads;
# hypothesis notices the global state moving during a draw and warns, wrongly blaming our strategies.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies:hypothesis.errors.HypothesisDeprecationWarning"
)
POOL = 64  # routed ids per image, drawn by the strategies


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileCluster]:
    c = HostileCluster(tmp_path_factory.mktemp("properties"))
    c.pools = {image: list(c.route(POOL, image).tuple_ids) for image in (QUEUE_IMAGE, ENGINE_IMAGE)}  # type: ignore[attr-defined]
    yield c
    c.close()


def no_crash(error: grpc.RpcError | None) -> None:
    """The property every call shares: refusals are deliberate statuses, never INTERNAL/UNKNOWN."""
    if error is not None:
        assert error.code() not in (Code.INTERNAL, Code.UNKNOWN), f"{error.code()}: {error.details()}"


def collect(call: Iterable[Any]) -> tuple[list[Any], grpc.RpcError | None]:
    """Responses of a streaming call up to its end or its error."""
    out: list[Any] = []
    try:
        out.extend(call)
    except grpc.RpcError as exc:
        return out, exc
    return out, None


def unary(fn: Callable[[], Any]) -> tuple[Any, grpc.RpcError | None]:
    try:
        return fn(), None
    except grpc.RpcError as exc:
        return None, exc


def all_serving(cluster: HostileCluster) -> None:
    for server in cluster.servers.values():
        assert serving(server.address), f"{server.name} stopped serving"


# ---------------------------------------------------------------------------------------------
# Strategies

small_text = st.text(max_size=12)
attribute_keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz._", min_size=1, max_size=10).filter(
    lambda k: k not in ("cost_ms", "features", "mode")
)  # knobs that make the synthetic pipeline slow
MUTATIONS = ["none"] * 6 + [
    "crc",
    "size",
    "drop_last",
    "extra_frame",
    "no_meta",
    "meta_again",
    "flip_byte",
    "all_last",
    "empty_first",
    "huge_size",
]


@st.composite
def tuple_frames(
    draw: st.DrawFn, ids: st.SearchStrategy[int], images: st.SearchStrategy[str], ticket: bool
) -> list[TupleFrame]:
    """The frames of one tuple, mostly well-formed, sometimes broken in one way."""
    size = draw(st.integers(0, 3 * CHUNK))
    payload = hashlib.shake_128(draw(st.binary(min_size=1, max_size=8))).digest(size)
    meta = TupleMeta(
        tuple_id=draw(ids),
        image=draw(images),
        size=size,
        crc32=zlib.crc32(payload),
        source=draw(small_text),
        name=draw(small_text),
        attempt=draw(st.integers(0, 5)),
        created_unix=draw(st.floats(allow_nan=True, allow_infinity=True)),
        attributes=draw(st.dictionaries(attribute_keys, small_text, max_size=4)),
    )
    if ticket:
        meta.ticket = draw(
            st.one_of(st.just(make_ticket(TICKET_KEY, meta.tuple_id, meta.image)), st.binary(max_size=20))
        )
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=4)))
    bounds = [0, *cuts, size]
    chunks = [payload[a:b] for a, b in itertools.pairwise(bounds)] or [b""]
    frames = [TupleFrame(data=c) for c in chunks]
    frames[0].meta.CopyFrom(meta)
    frames[-1].last = True
    return _mutate(draw, draw(st.sampled_from(MUTATIONS)), frames)


def _mutate(draw: st.DrawFn, how: str, frames: list[TupleFrame]) -> list[TupleFrame]:
    head = frames[0].meta
    if how == "crc":
        head.crc32 = draw(st.integers(0, 2**32 - 1))
    elif how == "size":
        head.size = draw(st.integers(0, 4 * CHUNK))
    elif how == "huge_size":
        head.size = draw(st.integers(2**32, 2**64 - 1))
    elif how == "drop_last":
        frames.pop()
    elif how == "extra_frame":
        frames.insert(
            draw(st.integers(0, len(frames))), TupleFrame(data=draw(st.binary(max_size=64)), last=draw(st.booleans()))
        )
    elif how == "no_meta":
        frames[0].ClearField("meta")
    elif how == "meta_again" and len(frames) > 1:
        frames[draw(st.integers(1, len(frames) - 1))].meta.CopyFrom(head)
    elif how == "flip_byte" and any(f.data for f in frames):
        frame = next(f for f in frames if f.data)
        data = bytearray(frame.data)
        data[draw(st.integers(0, len(data) - 1))] ^= 0x5A
        frame.data = bytes(data)
    elif how == "all_last":
        for frame in frames:
            frame.last = True
    elif how == "empty_first":
        frames.insert(0, TupleFrame())
    return frames


def streams(
    ids: st.SearchStrategy[int], images: st.SearchStrategy[str], ticket: bool = False
) -> st.SearchStrategy[list[TupleFrame]]:
    """One to three tuples back to back."""
    return st.lists(tuple_frames(ids, images, ticket), min_size=1, max_size=3).map(
        lambda tuples: [f for frames in tuples for f in frames]
    )


def pool_ids(cluster: HostileCluster, image: str) -> st.SearchStrategy[int]:
    pool = cluster.pools[image]  # type: ignore[attr-defined]
    return st.one_of(st.sampled_from(pool), st.sampled_from(pool), st.just(0), st.integers(0, 2**64 - 1))


# ---------------------------------------------------------------------------------------------
# Tuple streams


@examples(50)
@given(data=st.data())
def test_enqueue_random_streams(cluster: HostileCluster, data: st.DataObject) -> None:
    images = st.sampled_from([QUEUE_IMAGE, QUEUE_IMAGE, QUEUE_IMAGE, "", "no/such", "x" * 300])
    frames = data.draw(streams(pool_ids(cluster, QUEUE_IMAGE), images))
    receipts, error = collect(cluster.master.Enqueue(iter(frames), timeout=15))
    no_crash(error)
    drained = cluster.drain_queue()  # verifies every payload's size and CRC-32
    receipted = {r.tuple_id for r in receipts if r.state == TupleReceipt.ENQUEUED}
    queued = {r.tuple_id for r in receipts if r.state == TupleReceipt.ENQUEUED and not r.message}
    assert set(drained) <= receipted, "a tuple was queued without a receipt"
    assert queued <= set(drained), "a receipted tuple is not in the queue"
    all_serving(cluster)


@examples(40)
@given(data=st.data())
def test_deliver_random_streams(cluster: HostileCluster, data: st.DataObject) -> None:
    images = st.sampled_from([ENGINE_IMAGE, ENGINE_IMAGE, ENGINE_IMAGE, "", "no/such"])
    frames = data.draw(streams(pool_ids(cluster, ENGINE_IMAGE), images, ticket=True))
    before = set(cluster.stored())
    receipts, error = collect(cluster.engine.Deliver(iter(frames), timeout=15))
    no_crash(error)
    stored = cluster.stored()  # every record decodes, names its id, offsets dense
    said_stored = {r.tuple_id for r in receipts if r.state == TupleReceipt.STORED}
    assert said_stored <= set(stored), "STORED receipt for a tuple the repository does not hold"
    assert set(stored) - before <= said_stored, "features stored for a tuple that was not receipted"
    for tuple_id in said_stored:
        assert stored[tuple_id].meta.tuple_id == tuple_id
    all_serving(cluster)


@examples(40)
@given(data=st.data())
def test_submit_random_streams(cluster: HostileCluster, data: st.DataObject) -> None:
    images = st.sampled_from([GATEWAY_IMAGE, GATEWAY_IMAGE, "", "zz/none", "x" * 300])
    ids = st.one_of(st.just(0), st.just(0), st.integers(0, 2**64 - 1))
    frames = data.draw(streams(ids, images))
    for frame in frames:  # never ask to wait for the outcome: it may never come
        if frame.HasField("meta") and "hio.wait" in frame.meta.attributes:
            frame.meta.attributes["hio.wait"] = data.draw(st.sampled_from(["", "accepted", "bogus"]))
    gateway = cluster.gateway
    receipts, error = collect(cluster.ingest.Submit(iter(frames), timeout=15))
    no_crash(error)
    assert all(r.state == TupleReceipt.ACCEPTED for r in receipts)
    assert gateway.spool.reserved_bytes == 0, "a refused tuple left its spool reservation behind"
    for entry in gateway.spool.entries():
        try:
            payload = spooled_payload(gateway.spool, entry)
        except FileNotFoundError:  # delivered meanwhile
            continue
        assert len(payload) == entry.meta.size and zlib.crc32(payload) == entry.meta.crc32
    all_serving(cluster)


# ---------------------------------------------------------------------------------------------
# Unary and server-streaming requests


def _floats() -> st.SearchStrategy[float]:
    return st.floats(allow_nan=True, allow_infinity=True)


def _waits() -> st.SearchStrategy[float]:
    """Pull waits that never block the test long: invalid ones, or at most 0.2 s."""
    return st.one_of(_floats().filter(lambda w: not 0 <= w <= 30), st.floats(0, 0.2))


def _channel_info() -> st.SearchStrategy[master_pb2.ChannelInfo]:
    return st.builds(
        master_pb2.ChannelInfo,
        channel_id=small_text,
        image=st.sampled_from(["", "rand/img", QUEUE_IMAGE, "y" * 300]),
        address=small_text,
        state=st.integers(0, 4),
        detail=small_text,
    )


def _outcome() -> st.SearchStrategy[master_pb2.TupleOutcome]:
    return st.builds(
        master_pb2.TupleOutcome,
        tuple_id=st.integers(2**40, 2**64 - 1),
        ok=st.booleans(),
        message=small_text,
        from_queue=st.booleans(),
        size=st.integers(0, 2**64 - 1),
        processing_seconds=_floats(),
        accepted_unix=_floats(),
    )


MASTER_REQUESTS = st.one_of(
    st.builds(
        master_pb2.RouteTuplesRequest,
        source=small_text,
        image=st.sampled_from(["", "no/such", QUEUE_IMAGE, ENGINE_IMAGE, "z" * 300]),
        items=st.lists(
            st.builds(master_pb2.RouteItem, size=st.integers(0, 2**64 - 1), tuple_id=st.integers(0, 2**64 - 1)),
            max_size=5,
        ),
        force_queue=st.just(True),
    ).map(lambda r: ("RouteTuples", r)),
    st.builds(
        master_pb2.ReportTuplesRequest,
        channel_id=small_text,
        outcomes=st.lists(_outcome(), max_size=4),
        release=st.booleans(),
    ).map(lambda r: ("ReportTuples", r)),
    st.builds(
        master_pb2.RegisterWorkerRequest,
        worker_id=small_text,
        host=small_text,
        cpus=st.integers(0, 2**32 - 1),
        channels=st.lists(_channel_info(), max_size=3),
    ).map(lambda r: ("RegisterWorker", r)),
    st.builds(master_pb2.HeartbeatRequest, worker_id=small_text, channels=st.lists(_channel_info(), max_size=3)).map(
        lambda r: ("Heartbeat", r)
    ),
    st.builds(master_pb2.PullTupleRequest, channel_id=small_text, wait_seconds=_waits()).map(
        lambda r: ("PullTuple", r)
    ),
    st.builds(master_pb2.RetryDeadLetterRequest, tuple_id=st.integers(2**40, 2**64 - 1)).map(
        lambda r: ("RetryDeadLetter", r)
    ),
    st.just(("GetStatus", master_pb2.GetStatusRequest())),
    st.just(("ListDeadLetters", master_pb2.ListDeadLettersRequest())),
)


@examples(150)
@given(request=MASTER_REQUESTS)
def test_master_random_requests(cluster: HostileCluster, request: tuple[str, Any]) -> None:
    method, message = request
    call = getattr(cluster.master, method)
    if method == "PullTuple":
        _, error = collect(call(message, timeout=5))
    else:
        _, error = unary(lambda: call(message, timeout=5))
    no_crash(error)
    status = cluster.master.GetStatus(master_pb2.GetStatusRequest(), timeout=5)
    assert all(q.leased <= q.length for q in status.queues)
    assert cluster.drain_queue() == {}  # nothing appeared in the backlog
    all_serving(cluster)


def _uploads(cluster_ids: st.SearchStrategy[int]) -> st.SearchStrategy[repository_pb2.FeaturesUpload]:
    random_upload = st.builds(
        repository_pb2.FeaturesUpload,
        tuple_id=st.integers(0, 2**64 - 1),
        record_zstd=st.binary(max_size=300),
        crc32=st.integers(0, 2**32 - 1),
    )
    good = cluster_ids.map(upload)
    return st.one_of(random_upload, good, good.map(_damaged))


def _damaged(u: repository_pb2.FeaturesUpload) -> repository_pb2.FeaturesUpload:
    data = bytearray(u.record_zstd)
    data[len(data) // 2] ^= 0xFF
    return repository_pb2.FeaturesUpload(tuple_id=u.tuple_id, record_zstd=bytes(data), crc32=zlib.crc32(data))


def _knowledge() -> st.SearchStrategy[bytes]:
    real = st.builds(
        features_pb2.Knowledge,
        tuple_count=st.integers(0, 2**64 - 1),
        algorithm=small_text,
        feature_names=st.lists(small_text, max_size=3),
    ).map(lambda k: k.SerializeToString())
    return st.one_of(st.binary(max_size=200), real)


REPOSITORY_REQUESTS = st.one_of(
    st.builds(
        repository_pb2.PutFeaturesRequest, records=st.lists(_uploads(st.integers(10**12, 10**12 + 10_000)), max_size=4)
    ).map(lambda r: ("PutFeatures", r)),
    st.builds(
        repository_pb2.ReadFeaturesRequest,
        after=st.integers(0, 2**64 - 1),
        until=st.integers(0, 2**64 - 1),
        max_records=st.integers(0, 2**32 - 1),
    ).map(lambda r: ("ReadFeatures", r)),
    st.builds(
        repository_pb2.CommitOffsetRequest,
        consumer=st.one_of(small_text, st.just("kd"), st.just("../x")),
        offset=st.integers(0, 2**64 - 1),
    ).map(lambda r: ("CommitOffset", r)),
    st.builds(
        repository_pb2.GetOffsetsRequest, consumer=st.one_of(small_text, st.text(min_size=200, max_size=300))
    ).map(lambda r: ("GetOffsets", r)),
    st.builds(
        repository_pb2.PutKnowledgeRequest,
        knowledge=_knowledge(),
        preview_png=st.one_of(
            st.just(b""), st.binary(max_size=50), st.binary(max_size=50).map(lambda b: b"\x89PNG\r\n\x1a\n" + b)
        ),
    ).map(lambda r: ("PutKnowledge", r)),
    st.just(("GetKnowledge", repository_pb2.GetKnowledgeRequest())),
    st.just(("GetPreview", repository_pb2.GetPreviewRequest())),
)


@examples(150)
@given(request=REPOSITORY_REQUESTS)
def test_repository_random_requests(cluster: HostileCluster, request: tuple[str, Any]) -> None:
    method, message = request
    before = cluster.stored()
    call = getattr(cluster.repository, method)
    if method == "ReadFeatures":
        batches, error = collect(call(message, timeout=10))
        offsets = [r.offset for b in batches for r in b.records]
        assert offsets == sorted(offsets) and all(message.after < o for o in offsets)
        if message.until:
            assert all(o <= message.until for o in offsets)
        if message.max_records:
            assert len(offsets) <= message.max_records
    else:
        _, error = unary(lambda: call(message, timeout=10))
    no_crash(error)
    after = cluster.stored()  # every record decodes to a FeatureRecord of its id
    for tuple_id, record in before.items():
        assert after[tuple_id] == record, "a stored record changed"
    if method == "PutFeatures" and error is None:
        assert {u.tuple_id for u in message.records} <= set(after)
    elif set(after) != set(before):
        raise AssertionError(f"{method} changed the stored records")
    knowledge = cluster.repository.GetKnowledge(repository_pb2.GetKnowledgeRequest(), timeout=5).knowledge
    if knowledge:
        features_pb2.Knowledge.FromString(knowledge)
    all_serving(cluster)


# ---------------------------------------------------------------------------------------------
# Raw bytes that need not be protobuf at all

METHODS = [
    ("master", "/hio.proto.Master/RouteTuples", "unary"),
    ("master", "/hio.proto.Master/ReportTuples", "unary"),
    ("master", "/hio.proto.Master/RegisterWorker", "unary"),
    ("master", "/hio.proto.Master/Heartbeat", "unary"),
    ("master", "/hio.proto.Master/PullTuple", "server_stream"),
    ("master", "/hio.proto.Master/Enqueue", "bidi"),
    ("master", "/hio.proto.Master/RetryDeadLetter", "unary"),
    ("master", "/hio.proto.Master/GetScaling", "unary"),
    ("master", "/hio.proto.Master/SetScaling", "unary"),
    ("engine", "/hio.proto.Engine/Deliver", "bidi"),
    ("engine", "/hio.proto.Engine/GetEngineStats", "unary"),
    ("gateway", "/hio.proto.Ingest/Submit", "bidi"),
    ("gateway", "/hio.proto.Ingest/GetGatewayStatus", "unary"),
    ("repository", "/hio.proto.Repository/PutFeatures", "unary"),
    ("repository", "/hio.proto.Repository/StoreFeatures", "bidi"),
    ("repository", "/hio.proto.Repository/ReadFeatures", "server_stream"),
    ("repository", "/hio.proto.Repository/CommitOffset", "unary"),
    ("repository", "/hio.proto.Repository/PutKnowledge", "unary"),
]


def _address(cluster: HostileCluster, server: str) -> str:
    return {
        "master": cluster.master_address,
        "engine": cluster.engine_address,
        "gateway": cluster.gateway_address,
        "repository": cluster.repository_address,
    }[server]


def raw_call(
    cluster: HostileCluster, server: str, method: str, kind: str, payloads: list[bytes]
) -> grpc.RpcError | None:
    """Send ``payloads`` as serialized requests (no serializer: bytes go out as they are)."""
    channel = cluster.channel(_address(cluster, server), "admin")
    if kind == "unary":
        return unary(lambda: channel.unary_unary(method)(payloads[0], timeout=5))[1]
    if kind == "server_stream":
        return collect(channel.unary_stream(method)(payloads[0], timeout=5))[1]
    return collect(channel.stream_stream(method)(iter(payloads), timeout=5))[1]


@examples(120)
@given(target=st.sampled_from(METHODS), payloads=st.lists(st.binary(max_size=200), min_size=1, max_size=3))
def test_raw_bytes_to_every_method(
    cluster: HostileCluster, target: tuple[str, str, str], payloads: list[bytes]
) -> None:
    server, method, kind = target
    if method.endswith("/PullTuple"):  # a parseable request could long-poll; keep it short
        payloads = [p for p in payloads if not p] or [b""]
    error = raw_call(cluster, server, method, kind, payloads)
    no_crash(error)  # unparseable bytes are INVALID_ARGUMENT (hio.transport.net parses inside the handler)
    cluster.stored()
    assert cluster.drain_queue() == {}
    all_serving(cluster)


@pytest.mark.parametrize(
    "server,method,kind",
    [
        m
        for m in METHODS
        if m[1].rsplit("/", 1)[1] in ("RouteTuples", "Enqueue", "PutFeatures", "StoreFeatures", "Submit", "Deliver")
    ],
)
def test_unparseable_request_is_invalid_argument(cluster: HostileCluster, server: str, method: str, kind: str) -> None:
    error = raw_call(cluster, server, method, kind, [b"\xff\xff\xff\xff"])  # a truncated varint field
    assert error is not None and error.code() == Code.INVALID_ARGUMENT, (error.code(), error.details())
    all_serving(cluster)
