"""An engine's stores, through its own ClusterLink: requests on one kept StoreFeatures
stream, the records of many tuples in one request. Real servers over loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hio.repository import RepositoryConfig
from hio.settings import ClusterSettings
from hio.transport.errors import InvalidArgument, PermissionDenied, Unauthenticated
from hio.worker.cluster import ClusterLink
from tests.harness import HioProcess, free_port
from tests.repository.records import decode, upload
from tests.repository.test_service import Running, config_for


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[Running]:
    running = Running(config_for(tmp_path))
    yield running
    running.close()


def engine_link(repo: Running, **settings: object) -> ClusterLink:
    """The link an engine stores through (no master needed to store)."""
    values: dict[str, object] = {"repository_address": repo.address, "master_address": "127.0.0.1:1"}
    values.update(settings)
    return ClusterLink(ClusterSettings(**values), rpc_deadline=10.0)  # type: ignore[arg-type] - settings' keywords, as objects


def records(*ids: int) -> list[tuple[int, bytes]]:
    return [(tuple_id, data) for tuple_id, data, _crc in (upload(i) for i in ids)]


def stored(repo: Running) -> dict[int, bytes]:
    """What the store holds, by tuple id (read from the store itself: the tokens test allows no reader)."""
    return {tuple_id: data for _offset, tuple_id, data in repo.store.read(0)}


def test_an_engines_stores_are_kept_and_a_record_stored_again_is_a_duplicate(repo: Running) -> None:
    link = engine_link(repo)
    try:
        for n in range(1, 7):
            assert link.store_many(records(n)) == [False]
        assert link.store_many(records(3, 7)) == [True, False]
    finally:
        link.close()
    held = stored(repo)
    assert sorted(held) == [1, 2, 3, 4, 5, 6, 7]
    assert all(decode(data).tuple_id == tuple_id for tuple_id, data in held.items())


def test_a_refused_record_refuses_its_batch_with_the_domain_error_and_the_next_store_goes_on(
    repo: Running,
) -> None:
    """A refusal ends the engine's StoreFeatures stream with the refused batch's status; the
    next store opens another stream and is stored."""
    ((_id, other),) = records(9)
    link = engine_link(repo)
    try:
        link.store_many(records(3))
        with pytest.raises(InvalidArgument, match="names tuple 9, not the id 2 it was uploaded under"):
            link.store_many([*records(1), (2, other)])
        assert link.store_many(records(4)) == [False]
    finally:
        link.close()
    assert sorted(stored(repo)) == [3, 4], "the repository checks every record before storing any"


def test_stores_are_authorized_by_token_and_role(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("wk-secret worker w1\ngw-secret gateway g1\n")
    repo = Running(config_for(tmp_path, tokens_file=str(tokens)))
    try:
        for token, refusal in (("gw-secret", PermissionDenied), ("nobody", Unauthenticated)):
            link = engine_link(repo, token=token)
            try:
                with pytest.raises(refusal):
                    link.store_many(records(3))
            finally:
                link.close()
        link = engine_link(repo, token="wk-secret")
        try:
            link.store_many(records(1))
            link.store_many(records(2))
        finally:
            link.close()
        assert sorted(stored(repo)) == [1, 2]
    finally:
        repo.close()


def test_stores_go_on_after_the_repository_restarts(tmp_path: Path) -> None:
    """The kept channel reconnects to a restarted repository; what the first one stored is kept."""
    address = f"127.0.0.1:{free_port()}"
    args = ["--listen", address, "--http-listen", "", "--data-dir", str(tmp_path / "repo")]
    link = ClusterLink(ClusterSettings(repository_address=address, master_address="127.0.0.1:1"), rpc_deadline=30.0)
    try:
        with HioProcess("repository", args, tmp_path, name="repository-1") as first:
            first.wait_started(address)
            link.store_many(records(1))
            link.store_many(records(2))
        with HioProcess("repository", args, tmp_path, name="repository-2") as second:
            second.wait_started(address)
            for n in range(3, 6):
                assert link.store_many(records(n)) == [False]
            assert link.store_many(records(2)) == [True]
    finally:
        link.close()


def test_the_repository_has_no_lane_settings() -> None:
    """Features go over gRPC only: no lane, so no lane port (listen's last port leaves none free)."""
    with pytest.raises(TypeError):
        RepositoryConfig(lane_listen="127.0.0.1:7101")  # type: ignore[call-arg] - the refusal under test
    RepositoryConfig(listen="127.0.0.1:65535", http_listen="").validate()
