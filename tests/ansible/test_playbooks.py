"""The playbooks parse, reference only resolvable modules, and the example
inventory has the groups site.yml deploys."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ansible.helpers import ANSIBLE_DIR, ansible_env, ansible_tool, inventory_json, require_collections

PLAYBOOKS = ["provision.yml", "site.yml"]


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_syntax_check(playbook: str, tmp_path: Path) -> None:
    require_collections()
    proc = subprocess.run(
        [ansible_tool("ansible-playbook"), "--syntax-check", "-i", "inventory.example.yml", playbook],
        cwd=ANSIBLE_DIR,
        env=ansible_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"playbook: {playbook}" in proc.stdout


def test_every_yaml_file_parses() -> None:
    files = [p for p in ANSIBLE_DIR.rglob("*.yml") if "collections" not in p.parts]
    files += list(ANSIBLE_DIR.rglob("*.yml.example"))
    assert len(files) >= 15
    for path in files:
        try:
            yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            pytest.fail(f"{path.relative_to(ANSIBLE_DIR)} is not valid YAML: {exc}")


def test_requirements_name_the_collections_used() -> None:
    module_key = re.compile(r"^\s*(?:-\s+)?([a-z0-9_]+\.[a-z0-9_]+)\.[a-z0-9_]+:\s*$")
    used = set()
    for path in ANSIBLE_DIR.rglob("*.yml"):
        if "collections" in path.parts:
            continue
        for line in path.read_text().splitlines():
            match = module_key.match(line)
            if match and match.group(1) != "ansible.builtin":
                used.add(match.group(1))
    required = {c["name"] for c in yaml.safe_load((ANSIBLE_DIR / "requirements.yml").read_text())["collections"]}
    assert used, "found no collection modules at all"
    assert used <= required, f"used but not in requirements.yml: {used - required}"


def test_example_inventory_has_every_group(tmp_path: Path) -> None:
    data = inventory_json(ANSIBLE_DIR / "inventory.example.yml", tmp_path)
    for group in ("master", "repository", "workers", "gateways", "kd"):
        assert data[group]["hosts"], f"group {group} is empty"
    assert len(data["master"]["hosts"]) == 1
    assert len(data["workers"]["hosts"]) == 4
    assert len(data["gateways"]["hosts"]) == 2
    assert data["monitoring"]["hosts"] == ["hio-master"], "the optional group site.yml puts Prometheus on"
    master = data["_meta"]["hostvars"]["hio-master"]
    assert master["hio_private_ip"] == "192.168.10.10"


def test_example_group_vars_match_the_thesis_setup() -> None:
    example = yaml.safe_load((ANSIBLE_DIR / "group_vars" / "all.yml.example").read_text())
    defaults = yaml.safe_load((ANSIBLE_DIR / "roles" / "openstack" / "defaults" / "main.yml").read_text())
    for source in (example, defaults):
        assert source["hio_os_workers"] == 4 and source["hio_os_gateways"] == 2
        assert source["hio_os_flavors"]["master"] == source["hio_os_flavors"]["repository"] == "ssc.xlarge"
        assert source["hio_os_flavors"]["worker"] == source["hio_os_flavors"]["gateway"] == "ssc.large"
    # Every variable the example sets has a default somewhere: a typo would be silently ignored.
    known: set[str] = set()
    for path in (ANSIBLE_DIR / "roles").glob("*/defaults/main.yml"):
        known |= set(yaml.safe_load(path.read_text()))
    assert set(example) <= known, f"unknown variables in the example: {set(example) - known}"
