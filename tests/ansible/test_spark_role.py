"""The spark role's units for real: rendered for one host on loopback, with this
test's virtualenv as the prefix (it holds the pyspark the role installs), the
master and the worker started exactly as systemd starts them (ExecStart,
Environment, WorkingDirectory) are a Spark standalone cluster: the worker
registers with the cores and memory the role gave it, and both stop on SIGTERM
with an exit code the units count as success."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hio.process.procs import free_port
from tests.ansible.helpers import (
    local_vars,
    read_unit,
    require_collections,
    run_playbook,
    start_from_unit,
    write_inventory,
)
from tests.harness import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.spark]

PLAYBOOK = """
- name: Render the spark role's units, without installing anything
  hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role: {name: common, tasks_from: system, public: true}
    - ansible.builtin.include_role: {name: spark, tasks_from: units}
"""


def master_state(webui_port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{webui_port}/json/", timeout=5) as reply:
            return dict(json.load(reply))
    except OSError:
        return {}


def test_the_rendered_units_run_a_spark_cluster(tmp_path: Path) -> None:
    require_collections()
    ports = {name: free_port() for name in ("master", "master_webui", "worker", "worker_webui")}
    host = "hio-spark"
    common = {
        **local_vars(tmp_path),
        "hio_prefix": sys.prefix,  # this virtualenv: pyspark's spark-class and the python that finds it
        "hio_spark_master_port": ports["master"],
        "hio_spark_master_webui_port": ports["master_webui"],
        "hio_spark_worker_port": ports["worker"],
        "hio_spark_worker_webui_port": ports["worker_webui"],
        "hio_spark_worker_cores": 1,
        "hio_spark_worker_memory": "768m",
        "hio_spark_daemon_memory": "256m",
    }
    playbook = tmp_path / "render.yml"
    playbook.write_text(PLAYBOOK)
    inventory = write_inventory(
        tmp_path / "inventory.yml", {"spark": [host]}, {host: {"hio_private_ip": "127.0.0.1"}}, common
    )
    run_playbook(playbook, inventory, tmp_path)
    units = tmp_path / host / "etc/systemd/system"
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in ("hio-spark-master", "hio-spark-worker"):
            daemons[name] = start_from_unit(units / f"{name}.service", tmp_path / f"{name}.log")

        def worker_registered() -> list[dict[str, Any]]:
            return [w for w in master_state(ports["master_webui"]).get("workers", []) if w.get("state") == "ALIVE"]

        workers = wait_for(
            worker_registered,
            timeout=120,
            interval=0.5,
            what=lambda: "\n".join((tmp_path / f"{n}.log").read_text()[-3000:] for n in daemons),
        )
        assert [(w["host"], w["cores"], w["memory"]) for w in workers] == [("127.0.0.1", 1, 768)]
        assert master_state(ports["master_webui"])["url"] == f"spark://127.0.0.1:{ports['master']}"
    finally:
        for proc in reversed(daemons.values()):
            proc.send_signal(signal.SIGTERM)
        codes = {name: proc.wait(60) for name, proc in daemons.items()}
    # systemd counts 0, death by the KillSignal, and SuccessExitStatus as a clean stop.
    success = {0, -signal.SIGTERM, int(read_unit(units / "hio-spark-worker.service")["SuccessExitStatus"][0])}
    assert set(codes.values()) <= success, codes
