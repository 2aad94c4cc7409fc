"""site.yml for real on this machine: the common and master roles deploy the
wheel into a fresh virtualenv under a tmp prefix (systemd steps off), the
master starts from exactly the command and environment of its rendered unit,
answers health and an authenticated `hio status`, drains on SIGTERM with exit
0; a second run changes nothing."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from hio.process.procs import child_env, free_port
from hio.settings import ClusterSettings
from hio.transport.net import wait_healthy
from tests.ansible.helpers import (
    REPO,
    base_python,
    build_wheel,
    local_vars,
    recap,
    require_collections,
    run_playbook,
    start_from_unit,
    write_inventory,
)

pytestmark = pytest.mark.slow


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
