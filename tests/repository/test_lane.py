"""PutFeatures on the repository's lane: the call an engine makes per tuple when tuples come
one at a time, on a kept connection instead of a gRPC call each (about 2 ms of CPU at the
two ends). Real servers over loopback; the engine's side is its own ClusterLink."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from hio.common.config import ConfigError
from hio.common.errors import DataLoss, PermissionDenied
from hio.common.lane import LaneCalls, LaneError, LaneSkips
from hio.common.settings import ClusterSettings
from hio.proto import repository_pb2 as pb
from hio.repository import RepositoryConfig, create_repository_server
from hio.worker.cluster import ClusterLink
from tests.harness import HioProcess, free_port, wait_for
from tests.repository.records import decode, upload
from tests.repository.test_service import Running, config_for


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[Running]:
    running = Running(config_for(tmp_path))
    yield running
    running.close()


def engine_link(repo: Running, **settings: object) -> ClusterLink:
    """The link an engine stores through (no master needed for PutFeatures)."""
    values: dict[str, object] = {"repository_address": repo.address, "master_address": "127.0.0.1:1"}
    values.update(settings)
    lanes = bool(values.pop("lanes", True))
    return ClusterLink(ClusterSettings(**values), rpc_deadline=10.0, lanes=lanes)  # type: ignore[arg-type]


def records(*ids: int) -> list[tuple[int, bytes]]:
    return [(tuple_id, data) for tuple_id, data, _crc in (upload(i) for i in ids)]


def stored(repo: Running) -> dict[int, bytes]:
    """What the store holds, by tuple id (read from the store itself: the tokens test allows no reader)."""
    return {tuple_id: data for _offset, tuple_id, data in repo.store.read(0)}


def test_an_engines_stores_go_over_the_lane_on_one_kept_connection(repo: Running) -> None:
    """The first store goes over gRPC (its answer names the lane); the next ones share one
    connection; a record stored again is a duplicate, as over gRPC."""
    lane = repo.store.lane
    assert lane is not None and lane.port
    link = engine_link(repo)
    try:
        for n in range(1, 7):
            assert link.store_many(records(n)) == [False]
        assert link.store_many(records(3, 7)) == [True, False]
    finally:
        link.close()
    assert lane.methods["PutFeatures"] == 6 and lane.sessions == 1
    held = stored(repo)
    assert sorted(held) == [1, 2, 3, 4, 5, 6, 7]
    assert all(decode(data).tuple_id == tuple_id for tuple_id, data in held.items())


def test_the_grpc_answer_names_the_lane_and_none_when_lanes_are_off(tmp_path: Path) -> None:
    on = Running(config_for(tmp_path / "on"))
    off = Running(config_for(tmp_path / "off", lanes=False))
    try:
        answer = on.stub().PutFeatures(pb.PutFeaturesRequest(records=[pb.FeaturesUpload(
            tuple_id=t, record_zstd=d, crc32=c) for t, d, c in [upload(1)]]), timeout=10)
        assert on.store.lane is not None and answer.calls_lane_port == on.store.lane.port
        answer = off.stub().PutFeatures(pb.PutFeaturesRequest(records=[pb.FeaturesUpload(
            tuple_id=t, record_zstd=d, crc32=c) for t, d, c in [upload(1)]]), timeout=10)
        assert off.store.lane is None and answer.calls_lane_port == 0
    finally:
        on.close()
        off.close()
    tls = RepositoryConfig(listen="127.0.0.1:7100", tls_cert="host.crt", tls_key="host.key")
    assert tls.lane_address() == "127.0.0.1:7101", "a repository that speaks TLS offers its lane, over TLS too"
    assert RepositoryConfig(listen="0.0.0.0:7100").lane_address() == "0.0.0.0:7101"


def test_an_engine_told_not_to_use_lanes_stores_over_grpc(repo: Running) -> None:
    link = engine_link(repo, lanes=False)
    try:
        for n in range(1, 4):
            link.store_many(records(n))
    finally:
        link.close()
    assert repo.store.lane is not None and repo.store.lane.methods["PutFeatures"] == 0
    assert sorted(stored(repo)) == [1, 2, 3]


def test_a_record_refused_on_the_lane_is_refused_as_over_grpc_and_nothing_is_stored(repo: Running) -> None:
    link = engine_link(repo)
    try:
        link.store_many(records(1))                        # learns the lane
        tuple_id, data, crc = upload(2)
        bad = pb.PutFeaturesRequest(records=[pb.FeaturesUpload(tuple_id=tuple_id, record_zstd=data, crc32=crc ^ 1)])
        with pytest.raises(grpc.RpcError) as over_grpc:
            repo.stub().PutFeatures(bad, timeout=10)
        calls = LaneCalls(f"127.0.0.1:{repo.store.lane.port}", LaneSkips(logging.getLogger("test"), "skipped"))
        try:
            with pytest.raises(LaneError) as on_lane:
                calls.request("PutFeatures", bad, pb.PutFeaturesResponse, timeout=10)
            assert calls.request("PutFeatures", pb.PutFeaturesRequest(records=[pb.FeaturesUpload(
                tuple_id=tuple_id, record_zstd=data, crc32=crc)]), pb.PutFeaturesResponse,
                timeout=10) is not None, "an error answers that call only; the session goes on"
            with pytest.raises(LaneError) as garbage:
                calls.call("PutFeatures", b"\xff\xff\xff", timeout=10)
        finally:
            calls.close()
        # and through the engine's own link: the same error class it gets from gRPC
        with pytest.raises(DataLoss, match="checksum mismatch"):
            link._retry(lambda: link._put_features(bad), "repository")
    finally:
        link.close()
    assert on_lane.value.code() == over_grpc.value.code() == grpc.StatusCode.DATA_LOSS
    assert on_lane.value.details() == over_grpc.value.details()
    assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PutFeaturesRequest" in garbage.value.details()
    assert sorted(stored(repo)) == [1, 2]


def test_puts_on_the_lane_are_authorized_as_over_grpc(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("wk-secret worker w1\ngw-secret gateway g1\n")
    repo = Running(config_for(tmp_path, tokens_file=str(tokens)))
    try:
        port = repo.store.lane.port  # type: ignore[union-attr]
        request = pb.PutFeaturesRequest(records=[pb.FeaturesUpload(tuple_id=t, record_zstd=d, crc32=c)
                                                 for t, d, c in [upload(1)]])
        def calls_with(token: str) -> LaneCalls:
            return LaneCalls(f"127.0.0.1:{port}", LaneSkips(logging.getLogger("test"), "skipped"), token=token)

        for token, code in (("gw-secret", grpc.StatusCode.PERMISSION_DENIED),
                            ("nobody", grpc.StatusCode.UNAUTHENTICATED)):
            calls = calls_with(token)
            try:
                with pytest.raises(LaneError) as refused:
                    calls.request("PutFeatures", request, pb.PutFeaturesResponse, timeout=10)
                assert refused.value.code() == code
            finally:
                calls.close()
        calls = calls_with("wk-secret")
        try:
            with pytest.raises(LaneError) as other:
                calls.request("ReadFeatures", pb.ReadFeaturesRequest(), pb.PutFeaturesResponse, timeout=10)
            assert other.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PutFeatures only" in other.value.details()
        finally:
            calls.close()
        assert stored(repo) == {}
        link = engine_link(repo, token="wk-secret")
        try:
            link.store_many(records(1))
            link.store_many(records(2))
        finally:
            link.close()
        gateway = engine_link(repo, token="gw-secret")
        try:
            with pytest.raises(PermissionDenied):
                gateway.store_many(records(3))
        finally:
            gateway.close()
        assert repo.store.lane.methods["PutFeatures"] == 1   # type: ignore[union-attr]
        assert sorted(stored(repo)) == [1, 2]
    finally:
        repo.close()


def test_stores_go_on_over_grpc_when_the_lane_stops_and_back_on_a_lane_when_it_returns(tmp_path: Path) -> None:
    """A kept connection the repository closed (it stopped, or restarted) is noticed before it
    is used; the store goes over gRPC meanwhile, and onto the new lane once an answer names it."""
    address = f"127.0.0.1:{free_port()}"
    args = ["--listen", address, "--http-listen", "", "--data-dir", str(tmp_path / "repo")]
    settings = ClusterSettings(repository_address=address, master_address="127.0.0.1:1")
    link = ClusterLink(settings, rpc_deadline=30.0)
    try:
        with HioProcess("repository", args, tmp_path, name="repository-1") as first:
            first.wait_healthy(address)
            link.store_many(records(1))
            link.store_many(records(2))
            lane = link.repository_lane
            assert lane is not None and lane.address == f"127.0.0.1:{int(address.rsplit(':', 1)[1]) + 1}"
            assert lane.kept == 1, "the second store went over a kept lane connection"
        with HioProcess("repository", args, tmp_path, name="repository-2") as second:
            second.wait_healthy(address)
            assert link.store_many(records(3)) == [False]   # the kept connection is found closed
            for n in range(4, 6):
                assert link.store_many(records(n)) == [False]
            assert link.store_many(records(2)) == [True], "what the first one stored is kept"
            lane = link.repository_lane
            assert lane is not None and lane.kept == 1, "back on the lane, on one new kept connection"
    finally:
        link.close()


def test_a_lane_port_that_is_taken_is_named_or_given_way(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen for the payload lane on 127.0.0.1:{busy}.*lane_listen"):
            create_repository_server(config_for(tmp_path / "a", lane_listen=f"127.0.0.1:{busy}"))
        if busy > 1:   # listen on the port below: the derived lane port (+1) is the taken one
            caplog.set_level(logging.WARNING)
            config = config_for(tmp_path / "b", listen=f"127.0.0.1:{busy - 1}")
            try:
                server, _port, store = create_repository_server(config)
            except ConfigError:
                pytest.skip(f"port {busy - 1} is in use here too")
            try:
                assert store.lane is not None and store.lane.port not in (0, busy)
                assert any(r.getMessage() == "payload lane port taken; using any free port" for r in caplog.records)
            finally:
                server.stop(0)
                store.close()
    with pytest.raises(ConfigError, match="set lane_listen"):
        RepositoryConfig(listen="127.0.0.1:65535").validate()
    with pytest.raises(ConfigError, match="127.0.0.1:7180 takes http_listen's port: it is listen's port"):
        RepositoryConfig(listen="127.0.0.1:7179").validate()          # the default http_listen is 7180
    with pytest.raises(ConfigError, match="takes listen's port: choose another lane_listen"):
        RepositoryConfig(listen="127.0.0.1:7100", lane_listen="0.0.0.0:7100").validate()
    RepositoryConfig(listen="127.0.0.1:0", http_listen="127.0.0.1:0").validate()   # any free ports: no clash


def test_the_lane_stops_with_the_store_ending_the_sessions_still_open(repo: Running) -> None:
    lane = repo.store.lane
    assert lane is not None
    port = lane.port
    link = engine_link(repo)
    try:
        link.store_many(records(1))
        link.store_many(records(2))
        assert lane.open_calls == 1 and link.repository_lane is not None and link.repository_lane.kept == 1
        repo.server.stop(0).wait()
        repo.store.close()
        assert lane.open_calls == 0, "the engine's kept session was ended by the store's close"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        link.close()
    repo.server, repo.port, repo.store = create_repository_server(repo.config)   # for the fixture's close
    repo.server.start()
