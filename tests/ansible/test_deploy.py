"""site.yml for real on this machine: the common and master roles deploy the
wheel into a fresh virtualenv under a tmp prefix (systemd steps off), the
master starts from exactly the command and environment of its rendered unit,
answers health and an authenticated `hio status`, drains on SIGTERM with exit
0; a second run changes nothing."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hio.process.procs import child_env, free_port
from hio.settings import ClusterSettings
from hio.transport.net import wait_healthy
from tests.ansible.helpers import (
    REPO,
    base_python,
    local_vars,
    recap,
    require_collections,
    run_playbook,
    start_from_unit,
    write_inventory,
)

pytestmark = pytest.mark.slow

# What a clean copy of the checkout needs to build the wheel (a stale build/
# in the working tree must not leak into it).
WHEEL_SOURCES = ("pyproject.toml", "README.md", "hio", "proto", "master", "worker", "gateway", "repository", "kd")


def build_wheel(dest: Path) -> Path:
    """``pip wheel --no-deps`` of a clean copy of the checkout, as an operator would."""
    src = dest / "src"
    src.mkdir(parents=True)
    for name in WHEEL_SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.exists():
            shutil.copy2(path, src / name)
    dist = dest / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(dist)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(dist.glob("harmonicio-*.whl"))


def test_site_deploys_a_master_that_serves(tmp_path: Path) -> None:
    require_collections()
    wheelhouse = REPO / "wheelhouse"
    if not any(wheelhouse.glob("grpcio-*.whl")):
        pytest.skip("no wheelhouse/ with the dependency wheels for an offline install")
    wheel = build_wheel(tmp_path)
    port = free_port()
    host = "hio-local"
    common = {
        **local_vars(tmp_path),
        "hio_dist_dir": str(wheel.parent),
        "hio_host_wheelhouse": str(wheelhouse),
        "hio_python": base_python(),
        "hio_bind_host": "127.0.0.1",
        "hio_address": "127.0.0.1",
        "hio_master_port": port,
        "hio_log_level": "info",
        "hio_cli_link": str(tmp_path / host / "usr/local/bin/hio"),
    }
    (tmp_path / host / "usr/local/bin").mkdir(parents=True)
    inventory = write_inventory(
        tmp_path / "inventory.yml",
        {"master": [host], "repository": ["hio-repo"]},
        {host: {}, "hio-repo": {"hio_private_ip": "127.0.0.1"}},
        common,
    )
    site = REPO / "ansible" / "site.yml"
    first = run_playbook(site, inventory, tmp_path, "--limit", host)
    assert recap(first.stdout, host)["changed"] > 0

    root = tmp_path / host
    unit_path = root / "etc/systemd/system/hio-master.service"
    assert (root / "opt/hio/bin/hio").exists()
    log = tmp_path / "master.log"
    proc = start_from_unit(unit_path, log)
    try:
        wait_healthy(f"127.0.0.1:{port}", ClusterSettings(), timeout=60, ready=False)  # no worker: not ready
        # The operators' command finds hio.toml by itself and presents the admin token.
        status = subprocess.run(
            [str(root / "usr/local/bin/hio"), "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
            cwd=tmp_path,
        )
        assert status.returncode == 0, status.stdout + status.stderr + log.read_text()
        assert "master up" in status.stdout
        # Without the admin token the master refuses: the tokens file is in force.
        anonymous = subprocess.run(
            [str(root / "opt/hio/bin/hio"), "status", "--master-address", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
            cwd=tmp_path,
        )
        assert anonymous.returncode != 0
        assert "token" in (anonymous.stdout + anonymous.stderr).lower()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log.read_text()

    second = run_playbook(site, inventory, tmp_path, "--limit", host)
    assert recap(second.stdout, host)["changed"] == 0, second.stdout[-6000:]
