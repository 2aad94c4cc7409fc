"""Streaming through containerised engines, with real `hio` processes: the
four promises of the docker runtime.

* the same tuples give the same features as with the local-process runtime;
* a container killed in the middle of a tuple is restarted, the tuple is
  processed again, and its features are stored once;
* two images on one worker each get their own tuples;
* an image missing on the worker: the channel is DOWN naming the image and
  `make images`, and the tuple waits in the master's queue (it is processed
  once the image exists).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

docker = pytest.importorskip("docker")

from hio.proto import master_pb2
from hio.worker.pipelines.samples import generate_microscopy
from tests.docker.cluster import Cluster, comparable, containers_of, remove_containers_of
from tests.harness import cluster_gateway, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def worker_id(cluster: Cluster) -> Iterator[str]:
    """A fresh worker id; its containers are removed after the cluster stopped."""
    wid = f"dw-{uuid.uuid4().hex[:8]}"
    yield wid
    remove_containers_of(wid)


def send_all(cluster: Cluster, name: str, items: list[tuple[bytes, str, dict[str, str]]]) -> list[int]:
    with cluster_gateway(cluster, name, streams=2) as gw:
        futures = [
            gw.submit(data, image=image, name=f"{name}-{i}", attributes=attrs)
            for i, (data, image, attrs) in enumerate(items)
        ]
        return [f.result(timeout=180) for f in futures]


def test_containers_give_the_same_features_as_processes(cluster: Cluster, worker_id: str, tmp_path: Path) -> None:
    images = [p.read_bytes() for p in generate_microscopy(tmp_path / "samples", count=3, size=256)]
    synthetic = [os.urandom(300_000 + i) for i in range(3)]
    items = [(d, "hio/microscopy", {}) for d in images] + [(d, "hio/synthetic", {"cost_ms": "5"}) for d in synthetic]
    engines = ["hio/microscopy=1", "hio/synthetic=1"]

    features: dict[str, list[dict]] = {}
    for runtime in ("process", "docker"):
        wid = f"{worker_id}-{runtime[0]}"
        cluster.add_worker(wid, engines, runtime=runtime)
        cluster.wait_free(wid, 2)
        ids = send_all(cluster, runtime, items)
        stored = cluster.wait_stored(ids)
        features[runtime] = [comparable(stored[i][0]) for i in ids]
        assert all(stored[i][0].engine.startswith(wid) for i in ids)
        cluster.remove(wid)
        remove_containers_of(wid)
    assert features["docker"] == features["process"]


def test_a_container_killed_mid_tuple_is_restarted_and_the_tuple_stored_once(cluster: Cluster, worker_id: str) -> None:
    cluster.add_worker(worker_id, ["hio/synthetic=1"])
    cluster.wait_free(worker_id, 1)
    [first] = containers_of(worker_id, all_states=False)
    with cluster_gateway(cluster, "kill", streams=1) as gw:
        future = gw.submit(os.urandom(1_000_000), image="hio/synthetic", name="victim", attributes={"cost_ms": "4000"})
        # The channel is BUSY while the tuple arrives, then FREE with `processing` set once the
        # engine has taken it into its processing slot and handed the channel over.
        wait_for(
            lambda: any(ch.state != master_pb2.FREE or ch.processing for ch in cluster.channels(worker_id)),
            timeout=30,
            what="the tuple to reach the engine",
        )
        time.sleep(1.0)  # well inside the 4 s of processing
        first.kill()
        tuple_id = future.result(timeout=180)
    stored = cluster.wait_stored([tuple_id])
    time.sleep(1.0)
    counts = Counter(r.tuple_id for r in cluster.records())
    assert counts[tuple_id] == 1, "features stored once"
    assert stored[tuple_id][0].meta.size == 1_000_000
    running = containers_of(worker_id, all_states=False)
    assert len(running) == 1 and running[0].id != first.id, "the controller started a new container"
    assert cluster.wait_free(worker_id, 1)


def test_two_images_on_one_worker_each_get_their_own_tuples(cluster: Cluster, worker_id: str, tmp_path: Path) -> None:
    cluster.add_worker(worker_id, ["hio/synthetic=1", "hio/microscopy=1"])
    channels = cluster.wait_free(worker_id, 2)
    image_of = {ch.channel_id: ch.image for ch in channels}
    assert sorted(image_of.values()) == ["hio/microscopy", "hio/synthetic"]
    micro = [p.read_bytes() for p in generate_microscopy(tmp_path / "s", count=4, size=128)]
    items = [(d, "hio/microscopy", {}) for d in micro] + [
        (os.urandom(50_000), "hio/synthetic", {"cost_ms": "20"}) for _ in range(6)
    ]
    ids = send_all(cluster, "two", items)
    stored = cluster.wait_stored(ids)
    for tuple_id in ids:
        record = stored[tuple_id][0]
        assert image_of[record.engine] == record.meta.image, "each tuple went to its own image's engine"
    labels = {c.labels["io.harmonicio.image"] for c in containers_of(worker_id, all_states=False)}
    assert labels == {"hio/synthetic", "hio/microscopy"}


def test_a_missing_image_is_reported_and_its_tuple_waits_in_the_queue(cluster: Cluster, worker_id: str) -> None:
    image = f"hio/missing-{uuid.uuid4().hex[:6]}"
    cluster.add_worker(worker_id, ["hio/synthetic=1", f"{image}=1"])
    cluster.wait_free(worker_id, 1)
    expected = f"image {image} not found locally; build it with `make images`"

    def down_with_detail() -> master_pb2.ChannelInfo | None:
        return next(
            (
                ch
                for ch in cluster.channels(worker_id)
                if ch.image == image and ch.state == master_pb2.DOWN and expected in ch.detail
            ),
            None,
        )

    wait_for(down_with_detail, timeout=30, what="the channel DOWN naming the missing image")
    with cluster_gateway(cluster, "missing", streams=1) as gw:
        future = gw.submit(os.urandom(10_000), image=image, name="patient", attributes={"cost_ms": "0"})
        wait_for(
            lambda: any(q.image == image and q.length == 1 for q in cluster.status().queues),
            timeout=30,
            what="the tuple waiting in the master's queue",
        )
        tuple_id = future.result(timeout=30)  # ENQUEUED: the gateway's job is done, nothing is lost
        client = docker.from_env()
        client.images.get("hio/synthetic").tag(image)  # "build" the image: the next restart finds it
        try:
            stored = cluster.wait_stored([tuple_id], timeout=90)
        finally:
            remove_containers_of(worker_id)
            client.images.remove(image)
    assert stored[tuple_id][0].meta.image == image


def test_bring_your_own_pipeline_image_gets_tuples_by_name(cluster: Cluster, worker_id: str) -> None:
    import numpy as np

    from hio.images import ImagesConfig, build_all

    built = build_all(ImagesConfig(images=("example-byo",)))
    assert [name for name, _ in built] == ["example/spectra:latest"]
    cluster.add_worker(worker_id, ["example/spectra=1"])
    cluster.wait_free(worker_id, 1)
    trace = np.sin(2 * np.pi * 50 * np.arange(2000) / 1000).astype("<f4").tobytes()
    [tuple_id] = send_all(cluster, "byo", [(trace, "example/spectra", {"sample_rate": "1000"})])
    record = cluster.wait_stored([tuple_id])[tuple_id][0]
    assert record.features["peak_frequency"].number == pytest.approx(50.0)
    assert list(record.kd_features) == ["peak_frequency", "spectral_centroid", "rms"]


def test_containers_go_when_the_process_that_started_the_cluster_is_killed(tmp_path: Path) -> None:
    """The worker dies with its starter, and stops its containers as it goes."""
    import signal

    from tests.e2e.test_no_orphans import all_gone, start_parent

    worker_id = f"dw-{uuid.uuid4().hex[:8]}"
    try:
        parent, pids = start_parent(tmp_path, worker_id, runtime="docker")
        assert len(containers_of(worker_id, all_states=False)) == 2
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        all_gone(pids, 30)
        assert containers_of(worker_id) == [], "the worker stopped and removed its containers"
    finally:
        remove_containers_of(worker_id)
