"""`hio worker` before any master exists: engines run, SIGTERM stops everything."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from hio.settings import ClusterSettings
from hio.transport.net import wait_healthy
from tests.harness import HioProcess, engine_pids, free_port, health_of, wait_for
from tests.worker.conftest import REPO_ROOT, TEST_IMAGE, TEST_PIPELINE


def test_worker_without_master_runs_engines_and_exits_cleanly(tmp_path: Path) -> None:
    grace = 2.0
    listen = f"127.0.0.1:{free_port()}"
    worker = HioProcess(
        "worker",
        [
            "--master-address",
            f"127.0.0.1:{free_port()}",
            "--repository-address",
            f"127.0.0.1:{free_port()}",
            "--data-dir",
            str(tmp_path / "data"),
            "--worker-id",
            "alone",
            "--listen",
            listen,
            "--runtime",
            "process",
            "--engines",
            f"{TEST_IMAGE}=2",
            "--pipelines",
            f"{TEST_IMAGE}={TEST_PIPELINE}",
            "--grace-seconds",
            str(grace),
        ],
        tmp_path,
        env={"PYTHONPATH": REPO_ROOT},
    )
    worker.start()
    try:
        assert worker.proc is not None
        pids = wait_for(
            lambda: len(p := engine_pids(worker.proc.pid)) == 2 and p,
            timeout=30,  # type: ignore[union-attr]
            what="two engine processes",
        )
        assert set(pids) == {"alone/0", "alone/1"}
        # alive (its server answers), not ready: the master does not answer it
        assert health_of(listen, "liveness") == "SERVING" and health_of(listen) == "NOT_SERVING"
        for n in (0, 1):
            log = tmp_path / "data" / "worker" / "alone" / "engines" / f"{n}.log"
            port = int(log.read_text().split("on port ")[1].split()[0])
            wait_healthy(f"127.0.0.1:{port}", ClusterSettings(), timeout=30)
        started = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(grace + 15) == 0, worker.output()
        assert time.monotonic() - started < grace + 15
        for pid in pids.values():
            assert not Path(f"/proc/{pid}").exists(), f"engine {pid} outlived its worker"
        assert "master unreachable" in worker.output()
    finally:
        worker.kill()


def test_engines_stop_when_their_worker_is_killed(tmp_path: Path) -> None:
    worker = HioProcess(
        "worker",
        [
            "--master-address",
            f"127.0.0.1:{free_port()}",
            "--repository-address",
            f"127.0.0.1:{free_port()}",
            "--data-dir",
            str(tmp_path / "data"),
            "--worker-id",
            "orphan",
            "--runtime",
            "process",
            "--engines",
            f"{TEST_IMAGE}=1",
            "--pipelines",
            f"{TEST_IMAGE}={TEST_PIPELINE}",
        ],
        tmp_path,
        env={"PYTHONPATH": REPO_ROOT},
    )
    worker.start()
    try:
        assert worker.proc is not None
        pids = wait_for(lambda: engine_pids(worker.proc.pid), timeout=30, what="the engine process")  # type: ignore[union-attr]
        engine_pid = pids["orphan/0"]
        time.sleep(1.0)  # let the engine reach its serving loop
        worker.proc.send_signal(signal.SIGKILL)  # the controller alone, not its process group
        worker.proc.wait(10)
        wait_for(
            lambda: (
                not Path(f"/proc/{engine_pid}").exists()
                or Path(f"/proc/{engine_pid}/stat").read_text().split()[2] == "Z"
            ),
            timeout=15,
            what="the orphaned engine to exit",
        )
    finally:
        worker.kill()
