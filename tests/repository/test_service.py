"""The repository's gRPC service and HTTP view, in-process over loopback."""

from __future__ import annotations

import errno
import json
import os
import random
import time
import urllib.error
import urllib.request
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from hio.proto import features_pb2, repository_pb2_grpc
from hio.proto import repository_pb2 as pb
from hio.repository import RepositoryConfig, create_repository_server
from hio.repository.http import STYLE, pages
from hio.repository.store import FeatureStore
from hio.settings import ClusterSettings
from hio.transport.frames import crc32
from hio.transport.http import script_hash, serve_http
from hio.transport.net import create_channel
from tests.harness import FsyncDisk, health_of, wait_for
from tests.repository.records import compress, decode, knowledge, png_bytes, upload


def config_for(tmp_path: Path, **overrides: object) -> RepositoryConfig:
    values: dict[str, object] = {
        "listen": "127.0.0.1:0",
        "http_listen": "",
        "data_dir": str(tmp_path / "data"),
        "segment_bytes": 64 * 1024,
    }
    values.update(overrides)
    config = RepositoryConfig(**values)  # type: ignore[arg-type] - the config's keywords, as objects
    config.validate()
    return config


class Running:
    def __init__(self, config: RepositoryConfig) -> None:
        self.config = config
        self.server, self.port, self.store = create_repository_server(config)
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"
        self._channels: list[grpc.Channel] = []

    def stub(self, token: str | None = None) -> repository_pb2_grpc.RepositoryStub:
        channel = create_channel(self.address, self.config, token=token)
        self._channels.append(channel)
        return repository_pb2_grpc.RepositoryStub(channel)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self.server.stop(0).wait()
        self.store.close()


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[Running]:
    running = Running(config_for(tmp_path, read_batch_records=7))
    yield running
    running.close()


def put_request(*ids: int) -> pb.PutFeaturesRequest:
    return pb.PutFeaturesRequest(
        records=[pb.FeaturesUpload(tuple_id=t, record_zstd=d, crc32=c) for t, d, c in (upload(i) for i in ids)]
    )


def test_put_read_commit(repo: Running) -> None:
    stub = repo.stub()
    before = time.time()
    reply = stub.PutFeatures(put_request(*range(1, 21)), timeout=10)
    answered = time.time()
    assert list(reply.offsets) == list(range(1, 21)) and not any(reply.duplicate)
    again = stub.PutFeatures(put_request(3, 21), timeout=10)
    assert list(again.offsets) == [3, 21] and list(again.duplicate) == [True, False]

    batches = list(stub.ReadFeatures(pb.ReadFeaturesRequest(after=0), timeout=10))
    assert [len(b.records) for b in batches] == [7, 7, 7]
    records = [r for b in batches for r in b.records]
    assert [r.offset for r in records] == list(range(1, 22))
    assert all(decode(r.record_zstd).tuple_id == r.tuple_id for r in records)
    assert all(before <= r.durable_unix <= answered for r in records[:20])  # durable before the put answered
    window = [
        r.offset for b in stub.ReadFeatures(pb.ReadFeaturesRequest(after=5, until=9, max_records=3)) for r in b.records
    ]
    assert window == [6, 7, 8]

    stub.CommitOffset(pb.CommitOffsetRequest(consumer="kd", offset=9), timeout=10)
    offsets = stub.GetOffsets(pb.GetOffsetsRequest(consumer="kd"), timeout=10)
    assert (offsets.latest, offsets.committed, offsets.records) == (21, 9, 21)
    assert stub.GetOffsets(pb.GetOffsetsRequest(), timeout=10).committed == 0


def test_read_batches_are_bounded_in_bytes(tmp_path: Path) -> None:
    running = Running(config_for(tmp_path, read_batch_bytes=64 * 1024, read_batch_records=1000))
    try:
        stub = running.stub()
        big = []
        for tid in range(1, 6):  # random doubles, ~40 KiB: one per 64 KiB message
            record = features_pb2.FeatureRecord(tuple_id=tid)
            record.features["noise"].array.values.extend(random.random() for _ in range(5000))
            data = compress(record.SerializeToString())
            big.append(pb.FeaturesUpload(tuple_id=tid, record_zstd=data, crc32=crc32(data)))
        stub.PutFeatures(pb.PutFeaturesRequest(records=big), timeout=10)
        sizes = [len(b.records) for b in stub.ReadFeatures(pb.ReadFeaturesRequest(), timeout=10)]
        assert sum(sizes) == 5 and max(sizes) == 1
    finally:
        running.close()


def test_largest_record_round_trips(repo: Running) -> None:
    """A record just under max_record_bytes fits one PutFeatures and one ReadFeatures message."""
    record = features_pb2.FeatureRecord(tuple_id=1)
    doubles = (repo.config.max_record_bytes - 128 * 1024) // 8
    record.features["noise"].array.values.extend(array("d", os.urandom(doubles * 8)))
    data = compress(record.SerializeToString())
    assert repo.config.max_record_bytes - 256 * 1024 < len(data) <= repo.config.max_record_bytes
    stub = repo.stub()
    stub.PutFeatures(
        pb.PutFeaturesRequest(records=[pb.FeaturesUpload(tuple_id=1, record_zstd=data, crc32=crc32(data))]), timeout=30
    )
    [batch] = list(stub.ReadFeatures(pb.ReadFeaturesRequest(), timeout=30))
    assert batch.records[0].record_zstd == data


@pytest.mark.parametrize(
    "mutate, code, text",
    [
        (lambda u: u.__setattr__("crc32", u.crc32 ^ 0xFF), grpc.StatusCode.DATA_LOSS, "checksum"),
        (
            lambda u: (u.__setattr__("record_zstd", b"garbage!"), u.__setattr__("crc32", crc32(b"garbage!"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not zstd",
        ),
        (lambda u: u.__setattr__("tuple_id", 99), grpc.StatusCode.INVALID_ARGUMENT, "names tuple 2"),
    ],
)
def test_bad_uploads_map_to_statuses(
    repo: Running, mutate: Callable[[pb.FeaturesUpload], object], code: grpc.StatusCode, text: str
) -> None:
    request = put_request(1, 2)
    mutate(request.records[1])
    with pytest.raises(grpc.RpcError) as info:
        repo.stub().PutFeatures(request, timeout=10)
    assert info.value.code() == code and text in info.value.details()
    assert repo.store.latest() == 0


def test_argument_errors(repo: Running) -> None:
    stub = repo.stub()
    cases = [
        (lambda: stub.PutFeatures(pb.PutFeaturesRequest(), timeout=10), "no records"),
        (lambda: stub.CommitOffset(pb.CommitOffsetRequest(consumer="kd", offset=5), timeout=10), "latest"),
        (lambda: stub.CommitOffset(pb.CommitOffsetRequest(consumer="no/slash", offset=0), timeout=10), "name"),
        (lambda: list(stub.ReadFeatures(pb.ReadFeaturesRequest(after=5, until=1), timeout=10)), "until"),
        (lambda: stub.PutKnowledge(pb.PutKnowledgeRequest(knowledge=b"\xff\xff"), timeout=10), "Knowledge"),
        (lambda: stub.GetOffsets(pb.GetOffsetsRequest(wait_seconds=-1), timeout=10), "wait_seconds"),
        (lambda: stub.GetOffsets(pb.GetOffsetsRequest(wait_seconds=61), timeout=10), "wait_seconds"),
        (lambda: stub.GetOffsets(pb.GetOffsetsRequest(wait_seconds=float("nan")), timeout=10), "wait_seconds"),
    ]
    for call, text in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, text
        assert text in info.value.details()


def test_get_offsets_waits_for_a_record_beyond_the_one_named(repo: Running) -> None:
    """A follower's long poll: answered when a put makes a record beyond ``wait_after``
    readable (its fsync done), at once when one is already, else after ``wait_seconds``."""
    stub = repo.stub()
    stub.PutFeatures(put_request(1), timeout=10)
    started = time.monotonic()
    assert stub.GetOffsets(pb.GetOffsetsRequest(wait_after=0, wait_seconds=30), timeout=40).records == 1
    assert time.monotonic() - started < 5, "a record is there already: no wait"
    started = time.monotonic()
    assert stub.GetOffsets(pb.GetOffsetsRequest(wait_after=1, wait_seconds=0.3), timeout=10).records == 1
    assert time.monotonic() - started >= 0.3, "nothing new: the whole wait"

    waiting = stub.GetOffsets.future(pb.GetOffsetsRequest(wait_after=1, wait_seconds=30), timeout=40)
    time.sleep(0.3)
    assert not waiting.done(), "nothing beyond offset 1 yet"
    put_at = time.monotonic()
    stub.PutFeatures(put_request(2, 3), timeout=10)
    assert waiting.result(timeout=10).records == 3
    assert time.monotonic() - put_at < 5, "answered by the put, not by its wait_seconds"


def test_get_offsets_waiters_are_bounded(tmp_path: Path) -> None:
    """Beyond a quarter of the server's threads, a waiting GetOffsets answers at once: the
    threads PutFeatures needs are never all held by followers."""
    running = Running(config_for(tmp_path, max_workers=8))  # two may wait
    try:
        stub = running.stub()
        request = pb.GetOffsetsRequest(wait_after=0, wait_seconds=30)
        held = [stub.GetOffsets.future(request, timeout=40) for _ in range(2)]
        time.sleep(0.3)
        started = time.monotonic()
        assert stub.GetOffsets(request, timeout=10).records == 0
        assert time.monotonic() - started < 5, "two wait already: the third answers at once"
        stub.PutFeatures(put_request(1), timeout=10)
        assert [f.result(timeout=10).records for f in held] == [1, 1]
    finally:
        running.close()


def test_knowledge_and_preview(repo: Running) -> None:
    stub = repo.stub()
    with pytest.raises(grpc.RpcError) as info:
        stub.GetPreview(pb.GetPreviewRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    empty = stub.GetKnowledge(pb.GetKnowledgeRequest(), timeout=10)
    assert empty.knowledge == b"" and not empty.has_preview

    k = knowledge().SerializeToString()
    stub.PutKnowledge(pb.PutKnowledgeRequest(knowledge=k, preview_png=png_bytes()), timeout=10)
    got = stub.GetKnowledge(pb.GetKnowledgeRequest(), timeout=10)
    assert got.knowledge == k and got.has_preview
    assert stub.GetPreview(pb.GetPreviewRequest(), timeout=10).png == png_bytes()
    with pytest.raises(grpc.RpcError) as info:
        stub.PutKnowledge(pb.PutKnowledgeRequest(knowledge=k, preview_png=b"not a png"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PNG" in info.value.details()


def test_roles_limit_methods(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("wtok worker w1\nktok kd kd1\nvtok viewer v1\n")
    running = Running(config_for(tmp_path, tokens_file=str(tokens)))
    try:
        worker, kd, viewer = running.stub("wtok"), running.stub("ktok"), running.stub("vtok")
        worker.PutFeatures(put_request(1), timeout=10)
        assert kd.GetOffsets(pb.GetOffsetsRequest(), timeout=10).latest == 1
        viewer.GetKnowledge(pb.GetKnowledgeRequest(), timeout=10)
        refusals = [
            (
                lambda: list(worker.ReadFeatures(pb.ReadFeaturesRequest(), timeout=10)),
                grpc.StatusCode.PERMISSION_DENIED,
            ),
            (lambda: kd.PutFeatures(put_request(2), timeout=10), grpc.StatusCode.PERMISSION_DENIED),
            (
                lambda: viewer.CommitOffset(pb.CommitOffsetRequest(consumer="x"), timeout=10),
                grpc.StatusCode.PERMISSION_DENIED,
            ),
            (lambda: running.stub("").GetOffsets(pb.GetOffsetsRequest(), timeout=10), grpc.StatusCode.UNAUTHENTICATED),
        ]
        for call, code in refusals:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == code
        assert running.store.latest() == 1
    finally:
        running.close()


# --------------------------------------------------------------------- HTTP


def fetch(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


@pytest.fixture
def http(tmp_path: Path) -> Iterator[tuple[FeatureStore, str]]:
    store = FeatureStore(tmp_path / "repo")
    server = serve_http(ClusterSettings(), "127.0.0.1:0", None, name="repository", pages=pages(store))
    assert server is not None
    yield store, f"http://{server.address}"
    server.close()
    store.close()


def test_http_before_any_knowledge(http: tuple[FeatureStore, str]) -> None:
    _store, base = http
    assert fetch(base + "/healthz")[0] == 200
    assert fetch(base + "/preview.png")[0] == 404
    status, _, body = fetch(base + "/knowledge.json")
    assert status == 404 and b"no knowledge" in body
    status, ctype, body = fetch(base + "/")
    assert status == 200 and ctype.startswith("text/html")
    assert b"No preview yet" in body and b'http-equiv="refresh" content="10"' in body
    assert fetch(base + "/nope")[0] == 404


def test_http_shows_knowledge(http: tuple[FeatureStore, str]) -> None:
    store, base = http
    store.put([upload(i) for i in range(1, 4)])
    store.put_knowledge(knowledge(tuple_count=30, clusters=3, assignments=5).SerializeToString(), png_bytes())
    status, ctype, body = fetch(base + "/preview.png")
    assert (status, ctype, body) == (200, "image/png", png_bytes())
    page = fetch(base + "/")[2].decode()
    assert '<img src="/preview.png"' in page
    with urllib.request.urlopen(base + "/", timeout=10) as reply:  # the page's policy: its one inline style, no more
        policy = reply.headers["Content-Security-Policy"]
    assert f"<style>{STYLE}</style>" in page and " style=" not in page and "<script" not in page
    assert f"script-src 'none'; style-src {script_hash(STYLE)}; img-src 'self';" in policy
    assert "<th>records stored</th><td>3</td>" in page and "<th>tuples clustered</th><td>30</td>" in page
    assert page.count("<tr><td>") == 3  # one row per cluster
    doc = json.loads(fetch(base + "/knowledge.json")[2])
    assert doc["tuple_count"] == 30 and len(doc["clusters"]) == 3 and doc["assignments"] == []
    full = json.loads(fetch(base + "/knowledge.json?assignments=1")[2])
    assert len(full["assignments"]) == 5


def test_a_repository_whose_fsync_failed_is_alive_but_not_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readiness ("" and hio.proto.Repository) turns NOT_SERVING once the repository cannot
    write (a failed fsync is final until restart); liveness stays SERVING."""
    disk = FsyncDisk(monkeypatch)
    repo = Running(config_for(tmp_path, fsync="always"))
    try:
        assert [health_of(repo.address, name) for name in ("", "hio.proto.Repository", "liveness")] == ["SERVING"] * 3
        disk.error = OSError(errno.EIO, "Input/output error")
        with pytest.raises(grpc.RpcError) as refused:
            repo.stub().PutFeatures(put_request(1), timeout=10)
        assert refused.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL)
        wait_for(lambda: health_of(repo.address) == "NOT_SERVING", timeout=5, what="the repository not ready")
        assert health_of(repo.address, "hio.proto.Repository") == "NOT_SERVING"
        assert health_of(repo.address, "liveness") == "SERVING"
    finally:
        repo.close()
