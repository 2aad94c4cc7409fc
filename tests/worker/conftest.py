"""Real roles for the worker's tests: a repository, a master, in-process engines."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import zstandard

from hio.config import build
from hio.proto import engine_pb2_grpc, features_pb2, master_pb2, master_pb2_grpc, repository_pb2, repository_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.frames import TupleMeta, crc32, frames_for_bytes
from hio.transport.net import create_channel
from hio.worker.config import EngineConfig
from hio.worker.engine import create_engine_server

SETTINGS = ClusterSettings(chunk_bytes=1024)
TEST_IMAGE = "test/echo"
TEST_PIPELINE = "tests.worker.pipe_test:process"
REPO_ROOT = str(Path(__file__).resolve().parents[2])


class Repo:
    """A real repository server in this process, and a reader of what it stores."""

    def __init__(self, data_dir: Path, settings: ClusterSettings = SETTINGS, **overrides: Any) -> None:
        from hio.repository import RepositoryConfig, create_repository_server

        config = build(
            RepositoryConfig,
            "repository",
            overrides={"listen": "127.0.0.1:0", "http_listen": "", "data_dir": str(data_dir), **overrides},
        )
        self.server, port, self.store = create_repository_server(config)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self._channel = create_channel(self.address, settings)  # settings: this test's, as a client
        self.stub = repository_pb2_grpc.RepositoryStub(self._channel)

    def records(self) -> dict[int, features_pb2.FeatureRecord]:
        out = {}
        for batch in self.stub.ReadFeatures(repository_pb2.ReadFeaturesRequest(after=0), timeout=10):
            for stored in batch.records:
                raw = zstandard.ZstdDecompressor().decompress(stored.record_zstd)
                out[stored.tuple_id] = features_pb2.FeatureRecord.FromString(raw)
        return out

    def close(self) -> None:
        self._channel.close()
        self.server.stop(0).wait(5)
        self.store.close()


class Master:
    """A real master server in this process, with a stub to drive it."""

    def __init__(self, data_dir: Path, settings: ClusterSettings = SETTINGS, **overrides: Any) -> None:
        module = importlib.import_module("hio.master")
        config = build(
            module.MasterConfig, "master", overrides={"listen": "127.0.0.1:0", "data_dir": str(data_dir), **overrides}
        )
        self.server, port, self.domain = module.create_master_server(config)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self._channel = create_channel(self.address, settings)
        self.stub = master_pb2_grpc.MasterStub(self._channel)

    def status(self) -> master_pb2.GetStatusResponse:
        return self.stub.GetStatus(master_pb2.GetStatusRequest(), timeout=5)

    def channels(self) -> dict[str, master_pb2.ChannelInfo]:
        return {c.channel_id: c for w in self.status().workers for c in w.channels}

    def close(self) -> None:
        self._channel.close()
        self.server.stop(0).wait(5)
        close = getattr(self.domain, "close", None)
        if callable(close):
            close()


def master_available() -> bool:
    try:
        module = importlib.import_module("hio.master")
        return hasattr(module, "create_master_server") and hasattr(module, "MasterConfig")
    except ImportError:
        return False


needs_master = pytest.mark.skipif(not master_available(), reason="hio.master.create_master_server not built yet")


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[Repo]:
    r = Repo(tmp_path / "repo")
    yield r
    r.close()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    if not master_available():
        pytest.skip("hio.master.create_master_server not built yet")
    m = Master(tmp_path / "master")
    yield m
    m.close()


class RunningEngine:
    """An engine served in this process on port 0."""

    def __init__(self, config: EngineConfig) -> None:
        self.exits: list[int] = []
        self.server, port, self.health, self.engine = create_engine_server(config, exit_process=self.exits.append)
        self.server.start()
        self.engine.start()
        self.address = f"127.0.0.1:{port}"
        self._channel = create_channel(self.address, SETTINGS)
        self.stub = engine_pb2_grpc.EngineStub(self._channel)

    def deliver(self, tuples: list[tuple[TupleMeta, bytes]], timeout: float = 30) -> list[Any]:
        frames = (f for meta, data in tuples for f in frames_for_bytes(meta, data, SETTINGS.chunk_bytes))
        return list(self.stub.Deliver(frames, timeout=timeout))

    def close(self) -> None:
        self._channel.close()
        stopper = threading.Thread(target=self.engine.stop, args=(1.0,))
        stopper.start()
        stopper.join(5)
        if self.engine.lane is not None:
            self.engine.lane.stop()
        self.server.stop(0).wait(5)


def engine_config(*, master: str, repository: str, channel_id: str = "w1/0", **overrides: Any) -> EngineConfig:
    values = {
        "channel_id": channel_id,
        "image": TEST_IMAGE,
        "pipeline": TEST_PIPELINE,
        "listen": "127.0.0.1:0",
        "master_address": master,
        "repository_address": repository,
        "chunk_bytes": 1024,
        "pull_wait": 1.0,
        "rpc_deadline": 5.0,
        "grace_seconds": 1.0,
        **overrides,
    }
    return build(EngineConfig, "engine", overrides=values)


def make_tuple(tuple_id: int, data: bytes, image: str = TEST_IMAGE, **attributes: str) -> tuple[TupleMeta, bytes]:
    meta = TupleMeta(
        tuple_id=tuple_id,
        source="test",
        image=image,
        size=len(data),
        crc32=crc32(data),
        name=f"t{tuple_id}",
        attempt=1,
        attributes=attributes,
        accepted_unix=1.0,
    )
    return meta, data


def register_channel(
    master: Master, engine: RunningEngine | str, channel_id: str = "w1/0", *, lane_address: str = ""
) -> None:
    """Register the engine's channel (and its payload lane, if given) as a worker would, and keep
    that worker alive with heartbeats (a loaded machine can take longer than ``expiry_seconds``
    over one test) until the master goes. ``engine`` may be just an address (an engine not
    running there yet)."""
    worker_id = channel_id.split("/")[0]
    master.stub.RegisterWorker(
        master_pb2.RegisterWorkerRequest(
            worker_id=worker_id,
            host="test",
            cpus=1,
            channels=[
                master_pb2.ChannelInfo(
                    channel_id=channel_id,
                    image=TEST_IMAGE,
                    lane_address=lane_address,
                    address=engine if isinstance(engine, str) else engine.address,
                    state=master_pb2.FREE,
                )
            ],
        ),
        timeout=5,
    )

    def heartbeat() -> None:
        try:
            while master.stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id=worker_id), timeout=5).known:
                time.sleep(0.5)
        except (grpc.RpcError, ValueError):
            pass  # the master has stopped (or its channel closed): the test is over

    threading.Thread(target=heartbeat, name=f"heartbeat-{worker_id}", daemon=True).start()
