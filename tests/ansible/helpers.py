"""Running the project's Ansible content locally, without a cloud.

Playbooks run with ``ansible-playbook`` from the same virtualenv as the tests
(ansible-core plus the collections of the ``ansible`` package, or
``ansible/collections`` filled by ``ansible-galaxy``). Every run is against
``localhost`` with a local connection and folders under a test's tmp dir.
"""

from __future__ import annotations

import getpass
import grp
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hio.process.procs import LIFELINE_ENV, child_env
from tests.harness import die_with_starter

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "ansible"
BIN = Path(sys.executable).parent
COLLECTIONS = ("openstack.cloud", "community.crypto")
# What a clean copy of the checkout needs to build the wheel (a stale build/
# in the working tree must not leak into it).
WHEEL_SOURCES = ("pyproject.toml", "README.md", "hio", "proto", "master", "worker", "gateway", "repository", "kd")


def ansible_tool(name: str) -> str:
    """Path of an Ansible command next to this interpreter; skip the test if missing."""
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed: .venv/bin/pip install ansible-core==2.19.14 ansible==12.3.0")
    return str(path)


def collection_available(name: str) -> bool:
    """True when ``namespace.collection`` resolves from the venv or ansible/collections."""
    namespace, collection = name.split(".")
    local = ANSIBLE_DIR / "collections" / "ansible_collections" / namespace / collection
    if local.is_dir():
        return True
    try:
        return importlib.util.find_spec(f"ansible_collections.{namespace}.{collection}") is not None
    except ModuleNotFoundError:
        return False


def require_collections() -> None:
    missing = [c for c in COLLECTIONS if not collection_available(c)]
    if missing:
        pytest.skip(
            f"collections {', '.join(missing)} missing: ansible-galaxy collection install "
            f"-r ansible/requirements.yml -p ansible/collections (or pip install ansible==12.3.0)"
        )


def collection_version(name: str) -> tuple[int, ...]:
    """Version of the collection ansible-playbook uses: ansible/collections first, then the venv's."""
    namespace, collection = name.split(".")
    local = ANSIBLE_DIR / "collections" / "ansible_collections" / namespace / collection
    if not local.is_dir():
        spec = importlib.util.find_spec(f"ansible_collections.{namespace}.{collection}")
        assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
        local = Path(next(iter(spec.submodule_search_locations)))
    manifest = json.loads((local / "MANIFEST.json").read_text())
    return tuple(int(part) for part in manifest["collection_info"]["version"].split("."))


def openstack_modules_env(tmp: Path) -> dict[str, str]:
    """Environment for openstack.cloud modules run on this machine.

    openstack.cloud before 2.6.0 (2.5.0 is the one the ``ansible`` package for
    Python 3.11 bundles) reads ``openstack.version`` without importing it, and
    openstacksdk 4.15 and later no longer imports it itself: every module fails
    with "module 'openstack' has no attribute 'version'". Operators install the
    collection from ansible/requirements.yml (2.6.0 or later). Where only the
    bundled one is at hand, the modules' Python imports that one module of
    openstacksdk first (a ``sitecustomize`` on PYTHONPATH); the collection and
    openstacksdk themselves run as they are."""
    sdk = tuple(int(part) for part in importlib.metadata.version("openstacksdk").split(".")[:2])
    if collection_version("openstack.cloud") >= (2, 6, 0) or sdk < (4, 15):
        return {}
    preload = tmp / "openstack-preload"
    preload.mkdir(exist_ok=True)
    (preload / "sitecustomize.py").write_text(
        "import warnings\n\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore', DeprecationWarning)\n"
        "    import openstack.version  # noqa: F401 - what openstack.cloud < 2.6.0 reads\n"
    )
    return {"PYTHONPATH": str(preload)}


def ansible_env(tmp: Path) -> dict[str, str]:
    """Environment for ansible-playbook: our ansible.cfg, a private local temp, no HIO_*,
    and no OS_* (an OpenStack RC sourced in the caller's shell names a real cloud)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HIO_", "ANSIBLE_", "OS_"))}
    env.update(
        {
            "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
            "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-local"),
            "ANSIBLE_REMOTE_TEMP": str(tmp / "ansible-remote"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_RETRY_FILES_ENABLED": "0",
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        }
    )
    return env


def run_playbook(
    playbook: Path,
    inventory: Path,
    tmp: Path,
    *args: str,
    timeout: float = 900,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a playbook (``env``: more environment, which wins); fail the test with its
    output when it fails, unless ``check`` is false."""
    cmd = [ansible_tool("ansible-playbook"), "-i", str(inventory), str(playbook), *args]
    proc = subprocess.run(
        cmd,
        cwd=ANSIBLE_DIR,
        env=ansible_env(tmp) | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def recap(output: str, host: str) -> dict[str, int]:
    """The PLAY RECAP counters of ``host`` (ok, changed, failed, ...)."""
    for line in output.splitlines():
        if line.startswith(host + " ") and "ok=" in line:
            return {k: int(v) for k, v in (item.split("=") for item in line.split(":", 1)[1].split())}
    raise AssertionError(f"no PLAY RECAP line for {host} in:\n{output[-3000:]}")


def local_identity() -> dict[str, str]:
    """Run services as whoever runs the tests: no users are created on this machine."""
    user = getpass.getuser()
    return {"hio_user": user, "hio_group": grp.getgrgid(os.getgid()).gr_name, "hio_config_owner": user}


def write_inventory(
    path: Path, groups: dict[str, list[str]], host_vars: dict[str, dict[str, Any]], common_vars: dict[str, Any]
) -> Path:
    """A YAML inventory of local hosts: ``groups`` maps group -> host names."""
    inventory: dict[str, Any] = {
        "all": {
            "vars": common_vars,
            "hosts": host_vars,
            "children": {g: {"hosts": {h: {} for h in hosts}} for g, hosts in groups.items()},
        }
    }
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path


def local_vars(tmp: Path) -> dict[str, Any]:
    """Variables that confine a deployment to ``tmp/<host>/``: no apt, no users, no systemd."""
    per_host = str(tmp) + "/{{ inventory_hostname }}"
    return {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "hio_become": False,
        "hio_gather_facts": False,
        "hio_manage_user": False,
        "hio_manage_packages": False,
        "hio_systemd": False,
        "hio_cli_link": "",
        "hio_prefix": per_host + "/opt/hio",
        "hio_etc_dir": per_host + "/etc/hio",
        "hio_data_dir": per_host + "/var/lib/hio",
        "hio_systemd_dir": per_host + "/etc/systemd/system",
        "hio_credentials_dir": str(tmp / "credentials"),
        **local_identity(),
    }


def read_unit(path: Path) -> dict[str, list[str]]:
    """A systemd unit as key -> values (keys may repeat, e.g. Environment)."""
    values: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "[")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values.setdefault(key, []).append(value)
    return values


def start_from_unit(unit_path: Path, log: Path) -> subprocess.Popen[bytes]:
    """Run the unit's ExecStart with its Environment= lines, in its WorkingDirectory, as
    systemd would (and so that it dies with this test process, as every role a test starts)."""
    unit = read_unit(unit_path)
    assignments = [shlex.split(item)[0] for item in unit["Environment"]]  # Environment="A=b c" is one variable
    env = child_env({**dict(item.split("=", 1) for item in assignments), LIFELINE_ENV: str(os.getpid())})
    with open(log, "wb") as out:
        return subprocess.Popen(
            die_with_starter(shlex.split(unit["ExecStart"][0])),
            cwd=unit["WorkingDirectory"][0],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def inventory_json(inventory: Path, tmp: Path) -> dict[str, Any]:
    out = subprocess.run(
        [ansible_tool("ansible-inventory"), "-i", str(inventory), "--list"],
        cwd=ANSIBLE_DIR,
        env=ansible_env(tmp),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


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
