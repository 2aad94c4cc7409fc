"""Hostile and broken input against real servers: each refused with a clear status, nothing stored wrongly.

For every item of the "never lose a tuple" issue, on each RPC it applies to
(Master.Enqueue, Engine.Deliver, Ingest.Submit, Repository.PutFeatures, and
every service for tokens), the test checks the exact gRPC status, that the
message names the problem, that the refusal left no trace (backlog lengths,
repository records, gateway spool), and that the server still serves a good
request right after. Servers run in this process on port 0 (see cluster.py).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from hio.proto import (
    engine_pb2,
    engine_pb2_grpc,
    ingest_pb2,
    ingest_pb2_grpc,
    master_pb2,
    master_pb2_grpc,
    repository_pb2,
    repository_pb2_grpc,
)
from hio.settings import ClusterSettings
from hio.transport.frames import TupleFrame, TupleMeta, TupleReceipt
from hio.transport.net import create_channel
from tests.harness import wait_for
from tests.hostile.cluster import (
    CHUNK,
    ENGINE_IMAGE,
    GATEWAY_IMAGE,
    MAX_DECOMPRESSED,
    MAX_RECORD,
    MAX_TUPLE,
    QUEUE_IMAGE,
    TOKENS,
    HostileCluster,
    MiB,
    auth,
    frames,
    meta_for,
    serving,
    stall_after,
    upload,
    wide_channel,
)

Code = grpc.StatusCode

# How long a stalled client may hold what it took, given the idle bound: the tests
# pass this as `stream_idle_seconds` to configs that have the setting, and wait a little longer.
IDLE_BOUND = 3.0  # long enough that a loaded machine sees the stall hold what it took before it lapses
STALL_PATIENCE = 15.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileCluster]:
    c = HostileCluster(tmp_path_factory.mktemp("hostile"))
    yield c
    c.close()


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    """Run ``call`` (which must fail) and return its RpcError."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def assert_refused(call: Callable[[], Any], code: Code, *needles: str) -> grpc.RpcError:
    error = refused(call)
    assert error.code() == code, f"expected {code}, got {error.code()}: {error.details()}"
    for needle in needles:
        assert needle in (error.details() or ""), f"{needle!r} not in {error.details()!r}"
    return error


# ---------------------------------------------------------------------------------------------
# Broken tuple streams, on each of the three RPCs that receive them.
# Each case builds frames from a good (meta, data) and breaks them; `named` is what the message
# must contain (besides the tuple id or name where the code puts it).


def _corrupt(meta: TupleMeta, data: bytes) -> list[TupleFrame]:
    bad = frames(meta, data)
    bad[1] = TupleFrame(data=b"\xff" * len(bad[1].data), last=bad[1].last)  # one damaged chunk
    return bad


def _truncated(meta: TupleMeta, data: bytes) -> list[TupleFrame]:
    return frames(meta, data)[:-1]


def _size_lies(meta: TupleMeta, data: bytes) -> list[TupleFrame]:
    meta.size = len(data) - 1
    return frames(meta, data)


def _interleaved(meta: TupleMeta, data: bytes) -> list[TupleFrame]:
    stream = frames(meta, data)
    stream.insert(1, TupleFrame(meta=meta, data=b"", last=True))
    return stream


def _no_meta(meta: TupleMeta, data: bytes) -> list[TupleFrame]:
    return [TupleFrame(data=data[:10], last=True)]


def _no_image(meta: TupleMeta, data: bytes) -> list[TupleFrame]:
    meta.image = ""
    return frames(meta, data)


def _over_tuple_limit(meta: TupleMeta, data: bytes) -> list[TupleFrame]:
    meta.size = MAX_TUPLE + 1
    return frames(meta, data)


def _attributes_flood(meta: TupleMeta, data: bytes) -> list[TupleFrame]:
    for i in range(300):
        meta.attributes[f"k{i}"] = "v"
    return frames(meta, data)


BROKEN = {
    "corrupt chunk": (_corrupt, Code.DATA_LOSS, "checksum mismatch"),
    "truncated stream": (_truncated, Code.DATA_LOSS, "stream ended after"),
    "size mismatch": (_size_lies, Code.DATA_LOSS, "more bytes than"),
    "new tuple before last frame": (_interleaved, Code.INVALID_ARGUMENT, "began before"),
    "missing metadata": (_no_meta, Code.INVALID_ARGUMENT, "must carry its metadata"),
    "metadata without image": (_no_image, Code.INVALID_ARGUMENT, "names no image"),
    "tuple over the limit": (_over_tuple_limit, Code.INVALID_ARGUMENT, f"over the limit of {MAX_TUPLE}"),
    "too many attributes": (_attributes_flood, Code.INVALID_ARGUMENT, "too many or too large attributes"),
}
PAYLOAD = bytes(range(256)) * 1024  # 256 KiB: four 64 KiB chunks


@pytest.mark.parametrize("case", list(BROKEN))
def test_master_enqueue_refuses_broken_streams_and_stores_nothing(cluster: HostileCluster, case: str) -> None:
    breaker, code, needle = BROKEN[case]
    ids = list(cluster.route(2, QUEUE_IMAGE, len(PAYLOAD)).tuple_ids)
    good = frames(meta_for(ids[0], PAYLOAD, QUEUE_IMAGE), PAYLOAD)
    before = cluster.queue()
    bad = breaker(meta_for(ids[1], PAYLOAD, QUEUE_IMAGE), PAYLOAD)
    error = assert_refused(lambda: cluster.enqueue(good + bad), code, needle)
    if code == Code.DATA_LOSS:
        assert str(ids[1]) in error.details()  # names the damaged tuple
    assert cluster.queue()[0] == before[0] + 1  # the good tuple before it is kept, the bad one is not
    assert cluster.drain_queue() == {ids[0]: PAYLOAD}


@pytest.mark.parametrize("case", list(BROKEN))
def test_engine_deliver_refuses_broken_streams_and_stores_nothing(cluster: HostileCluster, case: str) -> None:
    breaker, code, needle = BROKEN[case]
    good = cluster.routed_tuple(PAYLOAD)
    victim = cluster.routed_tuple(PAYLOAD)
    before = set(cluster.stored())
    stream = frames(good, PAYLOAD) + breaker(victim, PAYLOAD)
    call = cluster.engine.Deliver(iter(stream), timeout=15)
    first = next(call)
    assert (first.tuple_id, first.state) == (good.tuple_id, TupleReceipt.STORED)
    error = assert_refused(lambda: next(call), code, needle)
    if code == Code.DATA_LOSS:
        assert str(victim.tuple_id) in error.details()
    assert set(cluster.stored()) == before | {good.tuple_id}
    again = cluster.routed_tuple(b"after")
    assert cluster.deliver([(again, b"after")])[0].state == TupleReceipt.STORED


@pytest.mark.parametrize("case", list(BROKEN))
def test_gateway_submit_refuses_broken_streams_and_spools_nothing(cluster: HostileCluster, case: str) -> None:
    breaker, code, needle = BROKEN[case]
    before = cluster.gateway_status()
    bad = breaker(meta_for(0, PAYLOAD, GATEWAY_IMAGE, name="victim.npz"), PAYLOAD)
    assert_refused(lambda: cluster.submit(bad), code, needle)
    assert cluster.gateway.spool.reserved_bytes == 0  # the aborted writer gave its room back
    assert all(e.meta.name != "victim.npz" for e in cluster.gateway.spool.entries())
    good = cluster.submit(frames(meta_for(0, b"fine", GATEWAY_IMAGE, name="fine.npz"), b"fine"))
    assert [r.state for r in good] == [TupleReceipt.ACCEPTED]
    assert cluster.gateway.flush(timeout=10)
    assert cluster.gateway_status().sent_queue == before.sent_queue + 1
    assert list(cluster.drain_queue(GATEWAY_IMAGE).values()) == [b"fine"]  # the good one only, intact


def test_chunks_over_the_limit(cluster: HostileCluster) -> None:
    """Master and gateway bound chunks by chunk_bytes; the engine by the gRPC message limit."""
    routed = cluster.route(1, QUEUE_IMAGE).tuple_ids[0]
    big = b"c" * (CHUNK + 1)
    one_frame = [TupleFrame(meta=meta_for(routed, big, QUEUE_IMAGE), data=big, last=True)]
    assert_refused(
        lambda: cluster.enqueue(one_frame),
        Code.INVALID_ARGUMENT,
        f"chunk of {CHUNK + 1} bytes is over the limit of {CHUNK}",
    )
    assert cluster.drain_queue() == {}
    sub = [TupleFrame(meta=meta_for(0, big, GATEWAY_IMAGE), data=big, last=True)]
    assert_refused(lambda: cluster.submit(sub), Code.INVALID_ARGUMENT, "over the limit")
    huge = b"h" * (17 * MiB)  # over the 16 MiB message bound every server applies
    meta = cluster.routed_tuple(b"small")  # the message bound applies before any metadata check
    with wide_channel(cluster.engine_address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        stream = [TupleFrame(meta=meta, data=huge, last=True)]
        assert_refused(
            lambda: list(stub.Deliver(iter(stream), metadata=auth("gateway"), timeout=30)),
            Code.RESOURCE_EXHAUSTED,
            "larger than max",
        )
    assert meta.tuple_id not in cluster.stored()
    ok = cluster.routed_tuple(b"ok")
    assert cluster.deliver([(ok, b"ok")])[0].state == TupleReceipt.STORED


def test_route_refuses_oversized_and_malformed_batches(cluster: HostileCluster) -> None:
    def route(**fields: Any) -> Callable[[], Any]:
        return lambda: cluster.master.RouteTuples(master_pb2.RouteTuplesRequest(**fields), timeout=5)

    last = cluster.master.GetStatus(master_pb2.GetStatusRequest(), timeout=5).last_tuple_id
    assert_refused(
        route(image=QUEUE_IMAGE, items=[master_pb2.RouteItem(size=MAX_TUPLE + 1)]),
        Code.INVALID_ARGUMENT,
        "over max_tuple_bytes",
    )
    assert_refused(route(image=QUEUE_IMAGE), Code.INVALID_ARGUMENT, "1 to")
    assert_refused(route(image="", items=[master_pb2.RouteItem(size=1)]), Code.INVALID_ARGUMENT, "image")
    assert_refused(route(image="no/such", items=[master_pb2.RouteItem(size=1)]), Code.NOT_FOUND, "no/such")
    assert cluster.master.GetStatus(master_pb2.GetStatusRequest(), timeout=5).last_tuple_id == last  # no id spent


def test_unknown_image(cluster: HostileCluster) -> None:
    """Master: NOT_FOUND naming the image. Engine: FAILED_PRECONDITION naming both images.
    Gateway: accepted and kept in the spool (a worker may offer the image later), never enqueued."""
    tuple_id = cluster.route(1, QUEUE_IMAGE).tuple_ids[0]
    assert_refused(
        lambda: cluster.enqueue(frames(meta_for(tuple_id, b"x", "no/such"), b"x")), Code.NOT_FOUND, "no/such"
    )
    assert cluster.queue("no/such") == (0, 0, 0) and cluster.drain_queue() == {}
    meta = cluster.routed_tuple(b"x")
    meta.image = "no/such"
    assert_refused(lambda: cluster.deliver([(meta, b"x")]), Code.FAILED_PRECONDITION, "no/such", ENGINE_IMAGE)
    assert meta.tuple_id not in cluster.stored()
    before = cluster.gateway_status()
    receipts = cluster.submit(frames(meta_for(0, b"lost?", "no/such", name="odd.bin"), b"lost?"))
    assert [r.state for r in receipts] == [TupleReceipt.ACCEPTED]
    time.sleep(0.5)
    status = cluster.gateway_status()
    assert status.spooled_tuples >= 1 and status.sent_queue == before.sent_queue
    assert cluster.queue("no/such") == (0, 0, 0)


def test_missing_or_invalid_ids_and_attributes(cluster: HostileCluster) -> None:
    assert_refused(
        lambda: cluster.enqueue(frames(meta_for(0, b"x", QUEUE_IMAGE), b"x")), Code.INVALID_ARGUMENT, "no tuple id"
    )
    assert_refused(lambda: cluster.deliver([(meta_for(0, b"x"), b"x")]), Code.INVALID_ARGUMENT, "no tuple id")
    assert_refused(
        lambda: cluster.submit(frames(meta_for(7, b"x", GATEWAY_IMAGE), b"x")),
        Code.INVALID_ARGUMENT,
        "tuple_id must be 0",
    )
    wait = meta_for(0, b"x", GATEWAY_IMAGE, attributes={"hio.wait": "forever"})
    assert_refused(lambda: cluster.submit(frames(wait, b"x")), Code.INVALID_ARGUMENT, "hio.wait")
    long_name = meta_for(0, b"x", GATEWAY_IMAGE, name="n" * 2000)
    assert_refused(
        lambda: cluster.submit(frames(long_name, b"x")),
        Code.INVALID_ARGUMENT,
        "name of 2000 characters is over the limit of 1024",
    )
    assert cluster.drain_queue() == {} and cluster.gateway.spool.reserved_bytes == 0


# ---------------------------------------------------------------------------------------------
# Replayed tuple ids.


def test_engine_refuses_a_tuple_whose_ticket_does_not_match(cluster: HostileCluster) -> None:
    first = cluster.routed_tuple(b"one")
    second = cluster.routed_tuple(b"two")
    forged = [
        meta_for(first.tuple_id, b"one"),  # no ticket
        meta_for(first.tuple_id, b"one", ticket=second.ticket),  # another id's ticket
        meta_for(first.tuple_id + 10_000, b"one", ticket=first.ticket),  # replayed for a new id
        meta_for(first.tuple_id, b"one", ticket=bytes(16)),
    ]  # made up
    for meta in forged:
        assert_refused(
            lambda meta=meta: cluster.deliver([(meta, b"one")]),
            Code.PERMISSION_DENIED,
            f"tuple {meta.tuple_id}",
            "ticket does not match",
        )
    stored = cluster.stored()
    assert first.tuple_id not in stored and first.tuple_id + 10_000 not in stored
    assert cluster.deliver([(first, b"one")])[0].state == TupleReceipt.STORED


def test_master_refuses_ids_it_never_issued(cluster: HostileCluster) -> None:
    last = cluster.master.GetStatus(master_pb2.GetStatusRequest(), timeout=5).last_tuple_id
    never = last + 1_000
    assert_refused(
        lambda: cluster.enqueue(frames(meta_for(never, b"x", QUEUE_IMAGE), b"x")),
        Code.INVALID_ARGUMENT,
        str(never),
        "never issued",
    )
    assert_refused(
        lambda: cluster.master.RouteTuples(
            master_pb2.RouteTuplesRequest(image=QUEUE_IMAGE, items=[master_pb2.RouteItem(size=1, tuple_id=never)]),
            timeout=5,
        ),
        Code.INVALID_ARGUMENT,
        str(never),
        "never issued",
    )
    assert cluster.drain_queue() == {}


def test_replayed_ids_are_stored_once(cluster: HostileCluster) -> None:
    meta = cluster.routed_tuple(b"replay")
    for _ in range(3):
        assert cluster.deliver([(meta, b"replay")])[0].state == TupleReceipt.STORED
    records = cluster.stored()
    assert meta.tuple_id in records and records[meta.tuple_id].meta.size == len(b"replay")
    reply = cluster.repository.PutFeatures(
        repository_pb2.PutFeaturesRequest(records=[upload(meta.tuple_id)]), timeout=5
    )
    assert list(reply.duplicate) == [True] and len(cluster.stored()) == len(records)
    queued = cluster.route(1, QUEUE_IMAGE).tuple_ids[0]
    once = frames(meta_for(queued, b"q", QUEUE_IMAGE), b"q")
    receipts = cluster.enqueue(once + once) + cluster.enqueue(once)
    assert [r.state for r in receipts] == [TupleReceipt.ENQUEUED] * 3
    assert "already in the queue" in receipts[1].message
    assert cluster.drain_queue() == {queued: b"q"}


def test_report_from_a_stranger_does_not_drop_a_queued_tuple(cluster: HostileCluster) -> None:
    tuple_id = cluster.route(1, QUEUE_IMAGE).tuple_ids[0]
    assert (
        cluster.enqueue(frames(meta_for(tuple_id, b"keep me", QUEUE_IMAGE), b"keep me"))[0].state
        == TupleReceipt.ENQUEUED
    )
    worker = master_pb2_grpc.MasterStub(cluster.channel(cluster.master_address, "worker"))
    forged = master_pb2.TupleOutcome(tuple_id=tuple_id, ok=True, from_queue=True, size=7)
    worker.ReportTuples(master_pb2.ReportTuplesRequest(channel_id="nobody/0", outcomes=[forged]), timeout=5)
    assert cluster.drain_queue() == {tuple_id: b"keep me"}


# ---------------------------------------------------------------------------------------------
# The repository: corrupt and oversized records.


def test_repository_refuses_corrupt_and_oversized_records(cluster: HostileCluster) -> None:
    import zstandard

    base = cluster.master.GetStatus(master_pb2.GetStatusRequest(), timeout=5).last_tuple_id + 50_000
    good = upload(base)
    bad_crc = upload(base + 1)
    bad_crc.crc32 ^= 1
    not_zstd = repository_pb2.FeaturesUpload(tuple_id=base + 2, record_zstd=b"plain", crc32=0)
    not_zstd.crc32 = zlib.crc32(b"plain")
    wrong_id = upload(base + 3, inner_id=base + 4)
    bomb_data = zstandard.ZstdCompressor().compress(b"\0" * (MAX_DECOMPRESSED + 1))
    bomb = repository_pb2.FeaturesUpload(tuple_id=base + 5, record_zstd=bomb_data, crc32=zlib.crc32(bomb_data))
    oversized_data = os.urandom(MAX_RECORD + 1)
    oversized = repository_pb2.FeaturesUpload(
        tuple_id=base + 6, record_zstd=oversized_data, crc32=zlib.crc32(oversized_data)
    )
    cases = [
        (bad_crc, Code.DATA_LOSS, "checksum mismatch"),
        (not_zstd, Code.INVALID_ARGUMENT, "not zstd"),
        (wrong_id, Code.INVALID_ARGUMENT, "names tuple"),
        (bomb, Code.INVALID_ARGUMENT, "over the limit"),
        (oversized, Code.INVALID_ARGUMENT, f"over the limit of {MAX_RECORD}"),
        (repository_pb2.FeaturesUpload(tuple_id=0), Code.INVALID_ARGUMENT, "not a valid id"),
    ]
    worker = repository_pb2_grpc.RepositoryStub(cluster.channel(cluster.repository_address, "worker"))
    before = cluster.stored()
    for upload_, code, needle in cases:  # each batch also carries a good record: all or nothing
        batch = repository_pb2.PutFeaturesRequest(records=[good, upload_])
        assert_refused(lambda batch=batch: worker.PutFeatures(batch, timeout=5), code, needle)
    assert cluster.stored() == before
    assert_refused(
        lambda: worker.PutFeatures(repository_pb2.PutFeaturesRequest(), timeout=5), Code.INVALID_ARGUMENT, "no records"
    )
    reply = worker.PutFeatures(repository_pb2.PutFeaturesRequest(records=[good]), timeout=5)
    assert list(reply.duplicate) == [False] and base in cluster.stored()


# ---------------------------------------------------------------------------------------------
# Tokens: absent, wrong, wrong role; on every service.


def _calls(cluster: HostileCluster) -> dict[str, tuple[str, Callable[[grpc.Channel], Any], str]]:
    """name -> (server address, call on a channel, a role the policy does not allow or '')."""

    def enqueue(ch: grpc.Channel) -> Any:
        tuple_id = cluster.route(1, QUEUE_IMAGE).tuple_ids[0]
        return list(
            master_pb2_grpc.MasterStub(ch).Enqueue(iter(frames(meta_for(tuple_id, b"t", QUEUE_IMAGE), b"t")), timeout=5)
        )

    def deliver(ch: grpc.Channel) -> Any:
        meta = cluster.routed_tuple(b"t")
        return list(engine_pb2_grpc.EngineStub(ch).Deliver(iter(frames(meta, b"t")), timeout=5))

    return {
        "Master.Enqueue": (cluster.master_address, enqueue, "viewer"),
        "Master.RetryDeadLetter": (
            cluster.master_address,
            lambda ch: master_pb2_grpc.MasterStub(ch).RetryDeadLetter(
                master_pb2.RetryDeadLetterRequest(tuple_id=1), timeout=5
            ),
            "worker",
        ),
        "Master.SetScaling": (
            cluster.master_address,
            lambda ch: master_pb2_grpc.MasterStub(ch).SetScaling(
                master_pb2.SetScalingRequest(max_workers=1000), timeout=5
            ),
            "viewer",
        ),
        "Master.RegisterWorker": (
            cluster.master_address,
            lambda ch: master_pb2_grpc.MasterStub(ch).RegisterWorker(
                master_pb2.RegisterWorkerRequest(worker_id="intruder"), timeout=5
            ),
            "gateway",
        ),
        "Engine.Deliver": (cluster.engine_address, deliver, "kd"),
        "Engine.GetEngineStats": (
            cluster.engine_address,
            lambda ch: engine_pb2_grpc.EngineStub(ch).GetEngineStats(engine_pb2.GetEngineStatsRequest(), timeout=5),
            "gateway",
        ),
        "Repository.PutFeatures": (
            cluster.repository_address,
            lambda ch: repository_pb2_grpc.RepositoryStub(ch).PutFeatures(
                repository_pb2.PutFeaturesRequest(records=[upload(9_000_000)]), timeout=5
            ),
            "gateway",
        ),
        "Repository.StoreFeatures": (
            cluster.repository_address,
            lambda ch: list(
                repository_pb2_grpc.RepositoryStub(ch).StoreFeatures(
                    iter([repository_pb2.PutFeaturesRequest(records=[upload(9_000_001)])]), timeout=5
                )
            ),
            "gateway",
        ),
        "Repository.CommitOffset": (
            cluster.repository_address,
            lambda ch: repository_pb2_grpc.RepositoryStub(ch).CommitOffset(
                repository_pb2.CommitOffsetRequest(consumer="intruder", offset=0), timeout=5
            ),
            "worker",
        ),
        "Ingest.Submit": (
            cluster.gateway_address,
            lambda ch: list(
                ingest_pb2_grpc.IngestStub(ch).Submit(iter(frames(meta_for(0, b"t", GATEWAY_IMAGE), b"t")), timeout=5)
            ),
            "",
        ),
        "Ingest.GetGatewayStatus": (
            cluster.gateway_address,
            lambda ch: ingest_pb2_grpc.IngestStub(ch).GetGatewayStatus(ingest_pb2.GetGatewayStatusRequest(), timeout=5),
            "",
        ),
    }


CALLS = [
    "Master.Enqueue",
    "Master.RetryDeadLetter",
    "Master.SetScaling",
    "Master.RegisterWorker",
    "Engine.Deliver",
    "Engine.GetEngineStats",
    "Repository.PutFeatures",
    "Repository.StoreFeatures",
    "Repository.CommitOffset",
    "Ingest.Submit",
    "Ingest.GetGatewayStatus",
]


def _trace(cluster: HostileCluster) -> tuple[Any, ...]:
    """What a refused call must not change."""
    status = cluster.master.GetStatus(master_pb2.GetStatusRequest(), timeout=5)
    consumers = cluster.repository.GetOffsets(repository_pb2.GetOffsetsRequest(consumer="intruder"), timeout=5)
    return (
        len(cluster.stored()),
        cluster.queue(),
        [w.worker_id for w in status.workers],
        consumers.committed,
        len(cluster.gateway.spool),
        status.dead_letters,
    )


@pytest.mark.parametrize("name", CALLS)
def test_tokens_absent_wrong_or_of_the_wrong_role(cluster: HostileCluster, name: str) -> None:
    address, call, wrong_role = _calls(cluster)[name]
    before = _trace(cluster)
    for token, message in (
        (None, "missing token"),
        ("not-a-token", "invalid token"),
        (TOKENS["admin"] + "x", "invalid token"),
    ):
        with create_channel(address, ClusterSettings(), token=token or "") as channel:
            assert_refused(lambda: call(channel), Code.UNAUTHENTICATED, message)
    if wrong_role:
        assert_refused(
            lambda: call(cluster.channel(address, wrong_role)),
            Code.PERMISSION_DENIED,
            f"role '{wrong_role}' may not call",
        )
    assert _trace(cluster) == before
    assert serving(address)


def test_ingest_api_lets_viewers_read_but_not_submit(cluster: HostileCluster) -> None:
    ingest = ingest_pb2_grpc.IngestStub(cluster.channel(cluster.gateway_address, "viewer"))
    assert ingest.GetGatewayStatus(ingest_pb2.GetGatewayStatusRequest(), timeout=5).spool_bytes_limit > 0
    before = len(cluster.stored())
    data = b"not from an instrument"
    assert_refused(
        lambda: list(ingest.Submit(iter(frames(meta_for(0, data, GATEWAY_IMAGE, name="x"), data)), timeout=5)),
        Code.PERMISSION_DENIED,
        "role 'viewer' may not call",
    )
    assert len(cluster.stored()) == before


# ---------------------------------------------------------------------------------------------
# Garbage bytes on every port.

GARBAGE = {
    "random bytes": os.urandom(4096),
    "HTTP/1.1 request": b"GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n",
    "truncated HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM",
    "preface then junk frames": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(2048),
    "huge frame header": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01",
}


def _throw(address: str, payload: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(payload)
        sock.settimeout(1.0)
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except OSError:  # timeout or reset: either is fine, the server decides
            pass
        return answer


def _good_call(cluster: HostileCluster, server: str) -> None:
    if server == "master":
        cluster.master.GetStatus(master_pb2.GetStatusRequest(), timeout=5)
    elif server == "repository":
        cluster.repository.GetOffsets(repository_pb2.GetOffsetsRequest(), timeout=5)
    elif server == "engine":
        meta = cluster.routed_tuple(b"alive")
        assert cluster.deliver([(meta, b"alive")])[0].state == TupleReceipt.STORED
    else:
        assert cluster.gateway_status().spool_bytes_limit > 0


@pytest.mark.parametrize("server", ["master", "repository", "engine", "gateway"])
def test_garbage_bytes_on_the_port_leave_the_server_serving(cluster: HostileCluster, server: str) -> None:
    address = {
        "master": cluster.master_address,
        "repository": cluster.repository_address,
        "engine": cluster.engine_address,
        "gateway": cluster.gateway_address,
    }[server]
    before = len(cluster.stored())
    threads = [threading.Thread(target=_throw, args=(address, payload)) for payload in GARBAGE.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    host, port = address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)), timeout=5)
    try:  # a connection that never speaks must not block others
        assert serving(address)
        _good_call(cluster, server)
    finally:
        silent.close()
    assert len(cluster.stored()) == before + (server == "engine")


# ---------------------------------------------------------------------------------------------
# A client that stalls mid-stream must not hold a channel, queue room or a spool reservation forever.


def _idle_fields(config_cls: type) -> dict[str, float]:
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {"stream_idle_seconds": IDLE_BOUND} if "stream_idle_seconds" in names else {}


def assert_ended_as_stalled(call: Iterator[TupleReceipt]) -> None:
    """The stalled call ends with DEADLINE_EXCEEDED, its message naming the idle bound
    (docs/architecture.md, "Idle streams"), not with CANCELLED."""
    with pytest.raises(grpc.RpcError) as ended:
        for _receipt in call:  # receipts of what arrived before the stall
            pass
    assert ended.value.code() == Code.DEADLINE_EXCEEDED, ended.value
    assert f"no frame for {IDLE_BOUND:g} s" in ended.value.details()


def test_stalled_deliver_does_not_hold_the_channel(cluster: HostileCluster) -> None:
    from hio.worker.config import EngineConfig

    address = cluster.start_engine("stall/0", **_idle_fields(EngineConfig))
    stub = engine_pb2_grpc.EngineStub(cluster.channel(address, "gateway"))
    meta = cluster.routed_tuple(PAYLOAD)
    release = threading.Event()
    stalled = stub.Deliver(stall_after(frames(meta, PAYLOAD)[:1], release), timeout=60)
    try:
        time.sleep(0.3)
        ok = cluster.routed_tuple(b"next")

        def free() -> bool:
            try:
                receipts = list(stub.Deliver(iter(frames(ok, b"next")), timeout=5))
                return receipts[0].state == TupleReceipt.STORED
            except grpc.RpcError as exc:
                assert exc.code() == Code.RESOURCE_EXHAUSTED and "busy" in exc.details()
                return False

        wait_for(free, timeout=STALL_PATIENCE, interval=0.25, what="the stalled stream to release the channel")
        assert_ended_as_stalled(stalled)
    finally:
        release.set()
        stalled.cancel()
    assert meta.tuple_id not in cluster.stored()


def test_stalled_enqueue_does_not_hold_queue_room(tmp_path: Path) -> None:
    from hio.master import MasterConfig

    small = HostileCluster(tmp_path, queue_bytes=MiB, **_idle_fields(MasterConfig))
    try:
        ids = list(small.route(2, QUEUE_IMAGE, 900 * 1024).tuple_ids)
        data = os.urandom(900 * 1024)
        release = threading.Event()
        stub = master_pb2_grpc.MasterStub(small.channel(small.master_address, "gateway"))
        stalled = stub.Enqueue(stall_after(frames(meta_for(ids[0], data, QUEUE_IMAGE), data)[:1], release), timeout=60)
        try:
            time.sleep(1.0)  # the stalled stream's first frame is in (its room lasts IDLE_BOUND)
            second = frames(meta_for(ids[1], data[: 300 * 1024], QUEUE_IMAGE), data[: 300 * 1024])
            assert_refused(lambda: small.enqueue(second), Code.RESOURCE_EXHAUSTED, "backlog queue full")

            def room() -> bool:
                try:
                    return small.enqueue(second)[0].state == TupleReceipt.ENQUEUED
                except grpc.RpcError as exc:
                    assert exc.code() == Code.RESOURCE_EXHAUSTED
                    return False

            wait_for(room, timeout=STALL_PATIENCE, interval=0.25, what="the stalled Enqueue to give its room back")
            assert_ended_as_stalled(stalled)
        finally:
            release.set()
            stalled.cancel()
        assert set(small.drain_queue()) == {ids[1]}
    finally:
        small.close()


def test_stalled_submit_does_not_hold_spool_room(cluster: HostileCluster) -> None:
    from hio.gateway.config import GatewayConfig

    gateway, address = cluster.start_gateway("stall-gw", spool_bytes=MiB, **_idle_fields(GatewayConfig))
    stub = ingest_pb2_grpc.IngestStub(cluster.channel(address, "gateway"))
    data = os.urandom(900 * 1024)
    release = threading.Event()
    stalled = stub.Submit(
        stall_after(frames(meta_for(0, data, GATEWAY_IMAGE, name="slow.npz"), data)[:1], release), timeout=60
    )
    try:
        wait_for(
            lambda: gateway.spool.reserved_bytes == len(data),
            timeout=IDLE_BOUND,
            interval=0.01,
            what="the stalled Submit holding its spool room",
        )
        wait_for(
            lambda: gateway.spool.reserved_bytes == 0,
            timeout=STALL_PATIENCE,
            interval=0.25,
            what="the stalled Submit to give its spool room back",
        )
        assert_ended_as_stalled(stalled)
    finally:
        release.set()
        stalled.cancel()
    assert len(gateway.spool) == 0
