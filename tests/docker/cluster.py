"""Real `hio` processes for the Docker tests: repository, master, workers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import docker

from hio.cluster import LocalCluster
from hio.process.procs import RoleProcess
from hio.proto import features_pb2, master_pb2
from hio.up import read_features
from hio.worker.docker_launcher import LABEL_WORKER
from tests.harness import HioProcess, wait_for


class Cluster(LocalCluster):
    """A repository and a master; workers are added and removed by the test."""

    def __init__(self, root: Path) -> None:
        super().__init__(
            root,
            process=HioProcess,
            stop_timeout=30.0,
            master_args=["--expiry-seconds", "4", "--heartbeat-interval", "0.5", "--log-level", "info"],
        )

    def add_worker(self, worker_id: str = "", engines: Sequence[str] = (), **options: Any) -> RoleProcess:
        """Engines in containers unless ``runtime`` says otherwise; not waited for (each test
        waits for what it expects, with :meth:`wait_free`)."""
        options.setdefault("runtime", "docker")
        options.setdefault("wait", False)
        options["args"] = ["--restart-backoff-max", "2", *options.get("args", ())]
        return super().add_worker(worker_id, engines, **options)

    def channels(self, worker_id: str) -> list[master_pb2.ChannelInfo]:
        return [ch for w in self.status().workers if w.worker_id == worker_id for ch in w.channels]

    def wait_free(self, worker_id: str, count: int, timeout: float = 90) -> list[master_pb2.ChannelInfo]:
        def ready() -> list[master_pb2.ChannelInfo] | None:
            chans = self.channels(worker_id)
            free = [c for c in chans if c.state == master_pb2.FREE]
            return chans if len(free) >= count else None

        return wait_for(
            ready,
            timeout=timeout,
            interval=0.3,
            what=lambda: f"{count} free channels on {worker_id}:\n{self.procs[worker_id].output()}",
        )

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
        lines = [
            (
                f"master: queues {[(q.image, q.length, q.leased) for q in status.queues]}, dead letters "
                f"{status.dead_letters}, failed {status.tuples_failed}, channels "
                f"{[(c.channel_id, c.state, c.processing, c.detail) for w in status.workers for c in w.channels]}"
            )
        ]
        return "\n".join([*lines, self.output(3000)])


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
