"""ProcessLauncher with real engine processes, and launcher selection."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hio.config import ConfigError, build
from hio.proto import engine_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.frames import TupleFrame
from hio.transport.net import create_channel, wait_healthy
from hio.worker.api import PIPELINE_EXIT_CODE
from hio.worker.config import WorkerConfig
from hio.worker.controller import engine_env
from hio.worker.launcher import EngineSpec, ProcessLauncher, select_launcher
from tests.harness import error_after_stop, free_port, wait_for
from tests.master.helpers import CHUNK, frames
from tests.worker.conftest import REPO_ROOT, TEST_IMAGE, TEST_PIPELINE


def _worker(tmp_path: Path, **overrides: object) -> WorkerConfig:
    values = {
        "data_dir": str(tmp_path),
        "worker_id": "wl",
        "master_address": f"127.0.0.1:{free_port()}",
        "repository_address": f"127.0.0.1:{free_port()}",
        "engines": (TEST_IMAGE,),
        "pipelines": (f"{TEST_IMAGE}={TEST_PIPELINE}",),
        "runtime": "process",
        **overrides,
    }
    return build(WorkerConfig, "worker", overrides=values)


def _spec(config: WorkerConfig, pipeline: str = TEST_PIPELINE) -> EngineSpec:
    port = free_port()
    env = engine_env(config, channel_id="wl/0", image=TEST_IMAGE, pipeline=pipeline, port=port)
    env["PYTHONPATH"] = REPO_ROOT
    return EngineSpec(channel_id="wl/0", image=TEST_IMAGE, port=port, env=env)


def test_process_engine_starts_serves_and_stops_cleanly(tmp_path: Path) -> None:
    config = _worker(tmp_path)
    launcher = ProcessLauncher(config)
    handle = launcher.start(_spec(config))
    try:
        wait_healthy(f"127.0.0.1:{handle.spec.port}", ClusterSettings(), timeout=30)
        assert launcher.poll(handle) is None
        launcher.stop(handle, timeout=10)
        assert launcher.poll(handle) == 0
        assert Path(handle.log_path).parent == tmp_path / "worker" / "wl" / "engines"
        assert "starting engine wl/0" in launcher.logs(handle)
    finally:
        launcher.cleanup()


def test_crash_exit_code_and_log_are_visible(tmp_path: Path) -> None:
    config = _worker(tmp_path)
    launcher = ProcessLauncher(config)
    broken = launcher.start(_spec(config, pipeline="tests.worker.pipe_broken:process"))
    assert wait_for(lambda: launcher.poll(broken) is not None, timeout=30, what="the broken engine to exit")
    assert launcher.poll(broken) == PIPELINE_EXIT_CODE
    last = launcher.logs(broken, lines=5).strip().splitlines()[-1]
    assert last.startswith("hio engine: cannot load the pipeline:") and "hio_no_such_module" in last
    running = launcher.start(_spec(config))
    wait_healthy(f"127.0.0.1:{running.spec.port}", ClusterSettings(), timeout=30)
    os.kill(int(running.ident), signal.SIGKILL)
    assert wait_for(lambda: launcher.poll(running) is not None, timeout=10, what="the killed engine")
    assert launcher.poll(running) == -signal.SIGKILL
    launcher.cleanup()


def test_a_pipeline_whose_setup_raises_is_named_with_the_pipeline_exit_code(tmp_path: Path) -> None:
    config = _worker(tmp_path)
    launcher = ProcessLauncher(config)
    try:
        broken = launcher.start(_spec(config, pipeline="tests.worker.pipe_setup_fails:process"))
        assert wait_for(lambda: launcher.poll(broken) is not None, timeout=30, what="the engine to exit")
        assert launcher.poll(broken) == PIPELINE_EXIT_CODE, "not a crash its worker would blame on the port"
        log = launcher.logs(broken, lines=40)
        assert "pipe_setup_fails.py" in log, "the traceback says where the user's code failed"
        assert log.strip().splitlines()[-1] == (
            "hio engine: cannot load the pipeline: RuntimeError: no calibration file at /data/calibration.npz"
        )
    finally:
        launcher.cleanup()


def test_cleanup_kills_what_is_still_running(tmp_path: Path) -> None:
    config = _worker(tmp_path)
    launcher = ProcessLauncher(config)
    handle = launcher.start(_spec(config))
    launcher.cleanup()
    assert handle.native.poll() is not None


def test_select_launcher(tmp_path: Path) -> None:
    assert isinstance(select_launcher(_worker(tmp_path)), ProcessLauncher)
    # "auto" falls back to processes: test images never exist in a local Docker store
    assert isinstance(select_launcher(_worker(tmp_path, runtime="auto")), ProcessLauncher)
    try:
        from hio.worker.docker_launcher import docker_available

        usable = docker_available()
    except ImportError:
        usable = False
    if usable:
        pytest.skip("a Docker engine answers here; the refusal below cannot be shown")
    with pytest.raises(ConfigError, match="runtime is 'docker'"):
        select_launcher(_worker(tmp_path, runtime="docker"))


def test_a_runtime_that_cannot_answer_for_a_moment_does_not_stop_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Docker daemon restarting, an API timeout: the supervision pass logs it and tries again
    next pass; the engines keep running and the worker does not exit."""
    import time

    from hio.worker.controller import Controller

    config = _worker(tmp_path)
    launcher = ProcessLauncher(config)
    controller = Controller(config, "wl", launcher)
    try:
        controller.tick(time.monotonic())  # starts the engines
        slots = controller.slots
        assert slots and all(slot.handle is not None for slot in slots)
        poll = launcher.poll

        def unreachable(handle: object) -> int | None:
            raise ConnectionError("Connection aborted: the runtime is restarting")

        monkeypatch.setattr(launcher, "poll", unreachable)
        controller.tick(time.monotonic())  # logs the error, does not raise
        monkeypatch.setattr(launcher, "poll", poll)
        assert all(slot.handle is not None and launcher.poll(slot.handle) is None for slot in slots)
    finally:
        controller.stop_engines(2.0)


def test_a_tuple_still_arriving_when_the_engine_stops_is_cut_off_with_the_reason(tmp_path: Path) -> None:
    """A Deliver stalled in the middle of a tuple has half of grace_seconds to finish once the
    engine stops; then the engine ends the stream itself (UNAVAILABLE, saying to send the rest
    elsewhere), not the server's stop with CANCELLED."""
    config = _worker(tmp_path, grace_seconds=2.0)
    launcher = ProcessLauncher(config)
    release = threading.Event()
    tuple_frames = frames(7, os.urandom(3 * CHUNK), image=TEST_IMAGE)

    def stalled_sender() -> Iterator[TupleFrame]:
        yield tuple_frames[0]  # the metadata and the first chunk of three
        release.wait(60)

    try:
        handle = launcher.start(_spec(config))
        address = f"127.0.0.1:{handle.spec.port}"
        wait_healthy(address, ClusterSettings(), timeout=30)
        with create_channel(address, ClusterSettings()) as channel:
            stream = engine_pb2_grpc.EngineStub(channel).Deliver(stalled_sender(), timeout=60)
            time.sleep(0.5)  # the first frame arrives
            error, took = error_after_stop(lambda: os.kill(int(handle.ident), signal.SIGTERM), stream)
        release.set()
        assert wait_for(lambda: launcher.poll(handle) is not None, timeout=10, what="the engine to exit")
        assert launcher.poll(handle) == 0
    finally:
        release.set()
        launcher.cleanup()
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert error.details() == "channel wl/0 is stopping; send the rest elsewhere"
    assert 0.8 < took < 2.5, f"cut off {took:.1f} s after the stop; the tuple had 1 s to finish"
