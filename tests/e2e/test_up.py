"""`hio up`, the README's demo command, as a newcomer runs it (on free ports)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.harness import free_port, hio_env

pytestmark = pytest.mark.slow


def test_hio_up_streams_the_samples_and_summarises_the_repository(tmp_path: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "hio.cli",
        "up",
        "--data-dir",
        str(tmp_path / "var"),
        "--master-address",
        f"127.0.0.1:{free_port()}",
        "--repository-address",
        f"127.0.0.1:{free_port()}",
        "--http-listen",
        f"127.0.0.1:{free_port()}",
        "--http-listen-master",
        f"127.0.0.1:{free_port()}",
        "--http-listen-worker",
        f"127.0.0.1:{free_port()}",
        "--runtime",
        "process",
        "--no-kd",
    ]
    done = subprocess.run(args, cwd=tmp_path, env=hio_env(), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "all 36 tuples processed and stored" in out
    assert "36 feature records in the repository" in out
    assert "hio/microscopy: 24 tuples" in out and "hio/simulation: 12 tuples" in out
    assert "object_count" in out and "A_period" in out, "the pipelines' features are summarised"
    logs = tmp_path / "var" / "logs"
    assert {p.name for p in logs.glob("*.log")} >= {"master.log", "repository.log", "worker.log"}


def test_hio_up_elastic_starts_workers_and_engines_as_the_load_asks(tmp_path: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "hio.cli",
        "up",
        "--data-dir",
        str(tmp_path / "var"),
        "--master-address",
        f"127.0.0.1:{free_port()}",
        "--repository-address",
        f"127.0.0.1:{free_port()}",
        "--http-listen",
        "",
        "--http-listen-master",
        f"127.0.0.1:{free_port()}",
        "--runtime",
        "process",
        "--no-kd",
        "--scaling",
        "elastic",
    ]
    done = subprocess.run(args, cwd=tmp_path, env=hio_env(), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "all 36 tuples processed and stored" in out
    # Engines the master started on workers it started: it starts two at once (one in use, one
    # headroom) and plans the engines on whichever registers first, so which one is a race.
    processed_by = re.search(r"^  processed by: (.+)$", out, re.MULTILINE)
    assert processed_by, out
    channels = [part.split(" (")[0] for part in processed_by.group(1).split(", ")]
    assert channels and all(re.fullmatch(r"elastic-\d+/\d+", c) for c in channels), processed_by.group(0)
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "var")], capture_output=True, text=True, check=False)
    assert leftovers.stdout == "", "every role and worker stops with hio up"


def test_hio_up_refuses_to_start_beside_a_running_system(tmp_path: Path) -> None:
    """Its health checks would find the other system's roles and run the demo against them."""
    from tests.harness import HioProcess

    master = f"127.0.0.1:{free_port()}"
    with HioProcess("master", ["--listen", master, "--data-dir", str(tmp_path / "other")], tmp_path) as other:
        other.wait_started(master)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hio.cli",
                "up",
                "--runtime",
                "process",
                "--no-kd",
                "--master-address",
                master,
                "--repository-address",
                f"127.0.0.1:{free_port()}",
                "--http-listen",
                "",
                "--http-listen-master",
                "",
                "--http-listen-worker",
                "",
                "--data-dir",
                str(tmp_path / "up"),
            ],
            capture_output=True,
            text=True,
            env=hio_env(),
            timeout=60,
            cwd=tmp_path,
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{master} (master)" in proc.stdout and "already in use" in proc.stdout


def test_hio_up_keep_serves_a_gateway_s_ingest_api_and_says_where(tmp_path: Path) -> None:
    """What an integrator needs from the one-machine setup (docs/ingest.md): a gateway whose
    ingest API is up, at the address hio up prints; Ctrl-C stops it with the rest."""
    import grpc

    from hio.proto import ingest_pb2, ingest_pb2_grpc
    from tests.harness import health_of, wait_for

    ingest = f"127.0.0.1:{free_port()}"
    args = [
        sys.executable,
        "-m",
        "hio.cli",
        "up",
        "--keep",
        "--no-kd",
        "--runtime",
        "process",
        "--data-dir",
        str(tmp_path / "var"),
        "--master-address",
        f"127.0.0.1:{free_port()}",
        "--repository-address",
        f"127.0.0.1:{free_port()}",
        "--http-listen",
        "",
        "--ingest-listen",
        ingest,
    ]
    proc = subprocess.Popen(
        args, cwd=tmp_path, env=hio_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        wait_for(
            lambda: any(f"gateway ingest API at {ingest}" in line for line in lines) or proc.poll() is not None,
            timeout=240,
            interval=0.5,
            what="hio up --keep to say where its ingest API is",
        )
        assert proc.poll() is None, "".join(lines)
        assert health_of(ingest, "hio.proto.Ingest") == "SERVING"
        with grpc.insecure_channel(ingest) as channel:
            status = ingest_pb2_grpc.IngestStub(channel).GetGatewayStatus(
                ingest_pb2.GetGatewayStatusRequest(), timeout=5
            )
        assert status.chunk_bytes == 1 << 20
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
        reader.join(5)
    assert code == 0, "".join(lines)
    assert (tmp_path / "var" / "logs" / "gateway.log").exists()
