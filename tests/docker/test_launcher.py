"""DockerLauncher against a real Docker engine: start, poll, logs, stop,
limits, labels, credentials, a missing image, and garbage collection that
never touches containers we did not start."""

from __future__ import annotations

import io
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

docker = pytest.importorskip("docker")

from hio.worker.config import WorkerConfig
from hio.worker.controller import engine_env
from hio.worker.docker_launcher import (
    LABEL_CHANNEL,
    LABEL_MANAGED,
    LABEL_WORKER,
    DockerLauncher,
    ImageMissing,
    container_name,
    docker_available,
)
from hio.worker.launcher import EngineHandle, EngineSpec
from tests.docker.cluster import Cluster
from tests.harness import free_port, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("launcher")).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def worker_id() -> Iterator[str]:
    wid = f"t-{uuid.uuid4().hex[:8]}"
    yield wid
    client = docker.from_env()
    for container in client.containers.list(all=True, filters={"label": f"{LABEL_WORKER}={wid}"}):
        container.remove(force=True)


def make_spec(
    cluster: Cluster, worker_id: str, n: int = 1, image: str = "hio/synthetic", **config: object
) -> EngineSpec:
    wc = WorkerConfig(
        worker_id=worker_id, master_address=cluster.master, repository_address=cluster.repository, **config
    )  # type: ignore[arg-type]
    port = free_port()
    channel = f"{worker_id}/{n}"
    return EngineSpec(
        channel_id=channel,
        image=image,
        port=port,
        env=engine_env(wc, channel_id=channel, image=image, pipeline="", port=port),
        cpus=0.5,
        memory_bytes=256 * 1024 * 1024,
    )


def launcher_for(worker_id: str) -> DockerLauncher:
    return DockerLauncher(WorkerConfig(worker_id=worker_id))


def test_docker_available_answers() -> None:
    assert docker_available() is True


def test_engine_container_runs_with_labels_limits_and_host_network(cluster: Cluster, worker_id: str) -> None:
    launcher = launcher_for(worker_id)
    spec = make_spec(cluster, worker_id, log_level="info")
    handle = launcher.start(spec)
    try:
        assert isinstance(handle, EngineHandle) and handle.spec == spec
        cluster_settings = cluster.settings
        from hio.transport.net import wait_healthy

        wait_healthy(f"127.0.0.1:{spec.port}", cluster_settings, timeout=60)  # reachable over host networking
        assert launcher.poll(handle) is None
        container = docker.from_env().containers.get(handle.ident)
        assert container.name == container_name(worker_id, spec.channel_id) == f"hio-{worker_id}-1"
        assert container.labels[LABEL_MANAGED] == "true"
        assert container.labels[LABEL_WORKER] == worker_id
        assert container.labels[LABEL_CHANNEL] == spec.channel_id
        host = container.attrs["HostConfig"]
        assert host["NetworkMode"] == "host"
        assert host["NanoCpus"] == 500_000_000
        assert host["Memory"] == 256 * 1024 * 1024
        assert host["RestartPolicy"]["Name"] in ("", "no"), "the controller owns restarts"
        env = dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
        assert env["HIO_ENGINE_LISTEN"] == f"127.0.0.1:{spec.port}"
        assert env["HIO_MASTER_ADDRESS"] == cluster.master
        assert env["HIO_PIPELINE"] == "hio.worker.pipelines.synthetic:process", "the image names its pipeline"
        assert container.attrs["Config"]["Healthcheck"]["Test"][0] == "CMD"
        wait_for(
            lambda: container.reload() or container.attrs["State"].get("Health", {}).get("Status") == "healthy",
            timeout=60,
            interval=1,
            what="Docker health check to pass",
        )
        assert "engine" in launcher.logs(handle, 50).lower()
    finally:
        launcher.stop(handle, timeout=10)
    assert launcher.poll(handle) == -1, "a stopped container is removed"
    with pytest.raises(docker.errors.NotFound):
        docker.from_env().containers.get(handle.ident)


def test_an_engine_container_s_cpu_is_read_from_its_cgroup(cluster: Cluster, worker_id: str) -> None:
    launcher = launcher_for(worker_id)
    spec = make_spec(cluster, worker_id)
    handle = launcher.start(spec)
    try:
        from hio.transport.net import wait_healthy

        wait_healthy(f"127.0.0.1:{spec.port}", cluster.settings, timeout=60)
        assert launcher.poll(handle) is None  # the container's state, its main process's pid among it
        first = launcher.cpu_usage(handle)
        assert first is not None and first.cpu_seconds > 0  # starting Python and the engine took some
        assert isinstance(handle.cpu_source, Path), "the cgroup counter, not the stats API"
        assert first.wait_seconds is not None  # the host sees the container's processes
        later = wait_for(
            lambda: (u := launcher.cpu_usage(handle)) is not None and u.cpu_seconds > first.cpu_seconds and u,
            timeout=30,
            what="the counter to grow",
        )
        assert later.cpu_seconds > first.cpu_seconds
    finally:
        launcher.stop(handle, timeout=10)


def test_exit_code_and_logs_of_an_engine_that_cannot_start(cluster: Cluster, worker_id: str) -> None:
    launcher = launcher_for(worker_id)
    spec = make_spec(cluster, worker_id)
    bad = EngineSpec(**{**spec.__dict__, "env": {k: v for k, v in spec.env.items() if k != "HIO_ENGINE_CHANNEL_ID"}})
    handle = launcher.start(bad)
    code = wait_for(lambda: launcher.poll(handle), timeout=60, what="the engine to exit")
    assert code == 2
    assert "channel_id is required" in launcher.logs(handle, 20)
    again = launcher.start(bad)  # same channel: the exited container is replaced, not a name clash
    assert again.ident != handle.ident
    launcher.stop(again, timeout=5)


def test_killed_container_reports_its_exit(cluster: Cluster, worker_id: str) -> None:
    launcher = launcher_for(worker_id)
    handle = launcher.start(make_spec(cluster, worker_id))
    docker.from_env().containers.get(handle.ident).kill()
    assert wait_for(lambda: launcher.poll(handle), timeout=30, what="exit code") == 137
    launcher.cleanup()
    assert launcher.poll(handle) == -1, "cleanup removed our exited container"


def test_missing_image_is_a_clear_error_and_never_pulled(cluster: Cluster, worker_id: str) -> None:
    launcher = launcher_for(worker_id)
    image = f"hio/not-built-{uuid.uuid4().hex[:6]}"
    assert DockerLauncher.has_image(image) is False
    with pytest.raises(ImageMissing, match=f"image {image} not found locally; build it with `make images`"):
        launcher.start(make_spec(cluster, worker_id, image=image))
    assert not docker.from_env().containers.list(all=True, filters={"label": f"{LABEL_WORKER}={worker_id}"})


def test_credentials_reach_the_container(cluster: Cluster, worker_id: str, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nnot-a-real-ca\n-----END CERTIFICATE-----\n")
    ca.chmod(0o600)
    launcher = launcher_for(worker_id)
    spec = make_spec(cluster, worker_id, token_file=str(token_file))
    spec = EngineSpec(**{**spec.__dict__, "env": {**spec.env, "HIO_TLS_CA": str(ca)}})
    handle = launcher.start(spec)
    try:
        container = docker.from_env().containers.get(handle.ident)
        env = dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
        assert env["HIO_TOKEN"] == "s3cret-token"
        assert env["HIO_TLS_CA"] == "/run/hio/tls_ca", "host paths are rewritten to the copy inside"
        stream, _ = container.get_archive("/run/hio/tls_ca")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.getmember("tls_ca")
            assert (member.uid, member.mode & 0o777) == (10001, 0o400), "readable by the engine user only"
            assert tar.extractfile(member).read() == ca.read_bytes()  # type: ignore[union-attr]
    finally:
        launcher.stop(handle, timeout=5)


def test_cleanup_removes_only_our_exited_containers(cluster: Cluster, worker_id: str) -> None:
    client = docker.from_env()
    tag = uuid.uuid4().hex[:8]
    exited = {"entrypoint": ["python3", "-c", "pass"], "detach": True}
    foreign = client.containers.run("hio/base", name=f"someone-else-{tag}", **exited)
    other_worker = client.containers.run(
        "hio/base", name=f"other-worker-{tag}", **exited, labels={LABEL_MANAGED: "true", LABEL_WORKER: f"other-{tag}"}
    )
    unmanaged = client.containers.run("hio/base", name=f"mislabelled-{tag}", **exited, labels={LABEL_WORKER: worker_id})
    try:
        launcher = launcher_for(worker_id)
        running = launcher.start(make_spec(cluster, worker_id, n=1))
        dead = launcher.start(make_spec(cluster, worker_id, n=2))
        client.containers.get(dead.ident).kill()
        for c in (foreign, other_worker, unmanaged):
            c.wait(timeout=30)
        wait_for(lambda: launcher.poll(dead) is not None, timeout=30, what="killed engine to exit")
        launcher.cleanup()
        assert launcher.poll(dead) == -1, "our exited container is gone"
        assert launcher.poll(running) is None, "our running container is left alone"
        for c in (foreign, other_worker, unmanaged):
            c.reload()
            assert c.status == "exited", f"{c.name} (not ours) is never touched"
        launcher.stop(running, timeout=5)
    finally:
        for c in (foreign, other_worker, unmanaged):
            c.remove(force=True)


def test_a_foreign_container_holding_our_name_is_not_removed(cluster: Cluster, worker_id: str) -> None:
    client = docker.from_env()
    spec = make_spec(cluster, worker_id, n=7)
    squatter = client.containers.create(
        "hio/base", name=container_name(worker_id, spec.channel_id), entrypoint=["python3", "-c", "pass"]
    )
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            launcher_for(worker_id).start(spec)
        squatter.reload()
        assert squatter.status == "created"
    finally:
        squatter.remove(force=True)
