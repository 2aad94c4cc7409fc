"""Real `hio` processes for the Docker tests: repository, master, workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import docker

from hio.common.net import create_channel
from hio.common.settings import ClusterSettings
from hio.gateway import Gateway
from hio.proto import features_pb2, master_pb2, master_pb2_grpc
from hio.up import read_features
from hio.worker.docker_launcher import LABEL_WORKER
from tests.harness import HioProcess, free_port, wait_for


class Cluster:
    """A repository and a master; workers are added and removed by the test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.master = f"127.0.0.1:{free_port()}"
        self.repository = f"127.0.0.1:{free_port()}"
        self.settings = ClusterSettings(master_address=self.master, repository_address=self.repository)
        self.common = ["--master-address", self.master, "--repository-address", self.repository]
        self.procs: dict[str, HioProcess] = {
            "repository": HioProcess("repository", ["--listen", self.repository, "--http-listen", "",
                                                    "--data-dir", str(root / "repo"), *self.common], root),
            "master": HioProcess("master", ["--listen", self.master, "--data-dir", str(root / "master"),
                                            "--expiry-seconds", "4", "--heartbeat-interval", "0.5",
                                            "--log-level", "info",
                                            *self.common], root),
        }

    def start(self) -> "Cluster":
        for name in ("repository", "master"):
            self.procs[name].start().wait_healthy(getattr(self, name))
        return self

    def add_worker(self, worker_id: str, engines: list[str], runtime: str = "docker",
                   extra: list[str] | None = None) -> HioProcess:
        args = ["--worker-id", worker_id, "--runtime", runtime, "--data-dir", str(self.root / worker_id),
                "--restart-backoff-max", "2", *self.common, *(extra or [])]
        for entry in engines:
            args += ["--engines", entry]
        proc = HioProcess("worker", args, self.root, name=worker_id).start()
        self.procs[worker_id] = proc
        return proc

    def stop_worker(self, worker_id: str) -> None:
        self.procs.pop(worker_id).stop(timeout=30)

    def status(self) -> master_pb2.GetStatusResponse:
        with create_channel(self.master, self.settings) as channel:
            return master_pb2_grpc.MasterStub(channel).GetStatus(master_pb2.GetStatusRequest(), timeout=10)

    def channels(self, worker_id: str) -> list[master_pb2.ChannelInfo]:
        return [ch for w in self.status().workers if w.worker_id == worker_id for ch in w.channels]

    def wait_free(self, worker_id: str, count: int, timeout: float = 90) -> list[master_pb2.ChannelInfo]:
        def ready() -> list[master_pb2.ChannelInfo] | None:
            chans = self.channels(worker_id)
            free = [c for c in chans if c.state == master_pb2.FREE]
            return chans if len(free) >= count else None
        return wait_for(ready, timeout=timeout, interval=0.3,
                        what=lambda: f"{count} free channels on {worker_id}:\n{self.procs[worker_id].output()}")

    def gateway(self, name: str, **overrides: Any) -> Gateway:
        return Gateway(master_address=self.master, repository_address=self.repository,
                       data_dir=str(self.root / f"gw-{name}"), source=name, progress=False, **overrides)

    def records(self) -> list[features_pb2.FeatureRecord]:
        return read_features(self.settings)

    def wait_stored(self, ids: list[int], timeout: float = 120) -> dict[int, list[features_pb2.FeatureRecord]]:
        wanted = set(ids)

        def stored() -> dict[int, list[features_pb2.FeatureRecord]] | None:
            found: dict[int, list[features_pb2.FeatureRecord]] = {}
            for record in self.records():
                if record.tuple_id in wanted:
                    found.setdefault(record.tuple_id, []).append(record)
            return found if set(found) == wanted else None
        try:
            return wait_for(stored, timeout=timeout, interval=0.3, what=f"{len(ids)} tuples stored")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnosis()}") from None

    def diagnosis(self) -> str:
        """Where tuples may be instead: the master's view and every process's last output."""
        status = self.status()
        lines = [f"master: queues {[(q.image, q.length, q.leased) for q in status.queues]}, dead letters "
                 f"{status.dead_letters}, failed {status.tuples_failed}, channels "
                 f"{[(c.channel_id, c.state, c.processing, c.detail) for w in status.workers for c in w.channels]}"]
        lines += [f"--- {name} ---\n{proc.output(3000)}" for name, proc in self.procs.items()]
        return "\n".join(lines)

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            self.procs[name].stop(timeout=30)


def containers_of(worker_id: str, all_states: bool = True) -> list[Any]:
    """Containers labelled for ``worker_id`` (the tests' view, straight from Docker)."""
    client = docker.from_env()
    return client.containers.list(all=all_states, filters={"label": f"{LABEL_WORKER}={worker_id}"})


def remove_containers_of(worker_id: str) -> None:
    for container in containers_of(worker_id):
        container.remove(force=True)


def comparable(record: features_pb2.FeatureRecord) -> dict[str, Any]:
    """A record's features without what legitimately differs between runs."""
    out: dict[str, Any] = {}
    for name, value in record.features.items():
        kind = value.WhichOneof("kind")
        out[name] = list(value.array.values) if kind == "array" else getattr(value, kind)
    return out
