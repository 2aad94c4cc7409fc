"""`hio up`, the README's demo command, as a newcomer runs it (on free ports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import free_port, hio_env

pytestmark = pytest.mark.slow


def test_hio_up_streams_the_samples_and_summarises_the_repository(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "hio.cli", "up", "--data-dir", str(tmp_path / "var"),
            "--master-address", f"127.0.0.1:{free_port()}",
            "--repository-address", f"127.0.0.1:{free_port()}",
            "--http-listen", f"127.0.0.1:{free_port()}", "--runtime", "process", "--no-kd"]
    done = subprocess.run(args, cwd=tmp_path, env=hio_env(), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "all 36 tuples processed and stored" in out
    assert "36 feature records in the repository" in out
    assert "hio/microscopy: 24 tuples" in out and "hio/simulation: 12 tuples" in out
    assert "object_count" in out and "A_period" in out, "the pipelines' features are summarised"
    logs = tmp_path / "var" / "logs"
    assert {p.name for p in logs.glob("*.log")} >= {"master.log", "repository.log", "worker.log"}
