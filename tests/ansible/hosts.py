"""Hosts that Ansible reaches over SSH, on one machine: Docker containers that boot systemd.

Each host is a container of ``hio/ansible-host`` on a Docker network of its own run: systemd is
its init, sshd lets ``deploy`` in with a key the run makes (passwordless sudo, as on a fresh cloud
server), and this machine reaches it at its address on that network, as a control machine
reaches servers on their private network. The image is Debian bookworm debootstrapped by
``images/make-base.sh`` with systemd, sshd and the packages the roles would apt-get (so the hosts
need no package mirror), then ``tests/ansible/host/Dockerfile`` built with networking off. It is
built once and kept, tagged by a hash of what it is made from (like the engine images); a new
recipe replaces the old tag.

What systemd needs of Docker here (docs/deploy.md, "site.yml on hosts of this machine", says
why): ``CAP_SYS_ADMIN`` (the units' ``PrivateTmp``, ``ProtectSystem`` and ``ProtectHome`` are
mount namespaces; without it systemd skips them silently), the machine's cgroup tree mounted
writable with the machine's cgroup namespace (systemd makes its units' cgroups below the
container's own), ``/run`` and ``/run/lock`` as tmpfs, and no AppArmor profile (Docker's denies
mounts). ``--privileged`` is not needed, and does not start where dockerd lacks a capability.

Containers and networks carry the label ``io.harmonicio.test-hosts=<pid>-<start ticks>`` of the
run that made them, and its folder of keys is ``<tmp>/hio-hosts-<pid>-<start ticks>-*``. A run
removes its own at the end. A run that is killed (SIGKILL included) cannot, so each run starts a
reaper first (:class:`tests.reaper.Reaper`, ``python -m tests.ansible.hosts --reap <run>``),
which removes what that run made when the run ends, so no host's roles (KD's Spark driver among
them) outlive a stopped test run. What a reaper could not remove, the next run does
(:func:`remove_stale`).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from tests.reaper import Reaper, reap, run_gone, run_id

REPO = Path(__file__).resolve().parents[2]
HOST_DIR = Path(__file__).resolve().parent / "host"
MAKE_BASE = REPO / "images" / "make-base.sh"
IMAGE = "hio/ansible-host"
LABEL = "io.harmonicio.test-hosts"
KEYS_PREFIX = "hio-hosts-"
USER = "deploy"
USER_UID = 1000  # useradd --uid in host/Dockerfile
# Besides what make-base.sh always installs and what the roles apt-get (role_packages).
SYSTEM_PACKAGES = ("systemd-sysv", "openssh-server", "sudo", "iproute2", "procps")
BOOT_TIMEOUT = 60.0


class HostsUnavailable(RuntimeError):
    """Hosts cannot be made here: the message says why (the tests skip with it)."""


def role_packages() -> list[str]:
    """The Debian packages site.yml's roles install (hio_python_packages, hio_java_packages):
    in the image already, as on an offline site's prepared image (hio_manage_packages: false)."""
    common = yaml.safe_load((REPO / "ansible" / "roles" / "common" / "defaults" / "main.yml").read_text())
    return [*common["hio_python_packages"], *common["hio_java_packages"]]


def packages() -> list[str]:
    return sorted({*SYSTEM_PACKAGES, *role_packages()})


def image_name() -> str:
    """``hio/ansible-host:<hash>``: the hash of the packages, the Dockerfile and make-base.sh."""
    recipe = hashlib.sha256(",".join(packages()).encode())
    for path in (HOST_DIR / "Dockerfile", MAKE_BASE):
        recipe.update(path.read_bytes())
    return f"{IMAGE}:{recipe.hexdigest()[:12]}"


def docker_client() -> Any:
    """A Docker client that answered, or HostsUnavailable saying why not."""
    try:
        import docker
    except ImportError:
        raise HostsUnavailable("the docker package is not installed (pip install 'harmonicio[docker]')") from None
    try:
        client = docker.from_env(timeout=300)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means the same here: no engine to use
        raise HostsUnavailable(f"no Docker engine answers ({exc}); run .ci/setup-docker.sh as root") from None
    return client


def require_tools() -> None:
    missing = [tool for tool in ("ssh", "ssh-keygen") if shutil.which(tool) is None]
    if missing:
        raise HostsUnavailable(f"{', '.join(missing)} not found (apt-get install openssh-client)")


def ensure_image(client: Any) -> str:
    """The host image, built when missing (a few minutes: debootstrap); older ones removed."""
    import docker.errors

    name = image_name()
    try:
        client.images.get(name)
        return name
    except docker.errors.ImageNotFound:
        pass
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise HostsUnavailable(f"{name} is not built, and building it needs root and debootstrap")
    root = f"{IMAGE}-root:{name.rpartition(':')[2]}"
    print(f"\nbuilding {name}: debootstrap with {', '.join(packages())} (a few minutes, once)", flush=True)
    made = subprocess.run(
        ["bash", str(MAKE_BASE), "--force", "--packages", ",".join(packages()), root],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if made.returncode != 0:
        raise RuntimeError(f"{MAKE_BASE} failed:\n{made.stderr[-3000:]}")
    try:
        client.images.build(
            path=str(HOST_DIR), tag=name, buildargs={"ROOT_IMAGE": root}, network_mode="none", rm=True, pull=False
        )
    finally:
        client.images.remove(root, noprune=True)  # the layers stay: the host image is built on them
    for image in client.images.list(name=IMAGE):
        if name not in image.tags:
            client.images.remove(image.id, force=True)
    return name


def made_by(client: Any, run: str) -> tuple[list[Any], list[Any], list[Path]]:
    """The containers (running or not), networks and key folders of run ``run``."""
    labelled = {"label": f"{LABEL}={run}"}
    folders = list(Path(tempfile.gettempdir()).glob(f"{KEYS_PREFIX}{run}-*"))
    return client.containers.list(all=True, filters=labelled), client.networks.list(filters=labelled), folders


def remove_run(client: Any, run: str) -> list[str]:
    """Remove the containers, network and key folder of run ``run``, whatever their state; their names."""
    containers, networks, folders = made_by(client, run)
    for container in containers:
        container.remove(force=True)
    for network in networks:
        network.remove()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return [*(c.name for c in containers), *(n.name for n in networks), *map(str, folders)]


def remove_stale(client: Any) -> list[str]:
    """Remove the containers, networks and key folders of runs whose process is gone; their names."""
    labelled = {"label": LABEL}
    owners = {container.labels.get(LABEL, "") for container in client.containers.list(all=True, filters=labelled)}
    owners |= {network.attrs.get("Labels", {}).get(LABEL, "") for network in client.networks.list(filters=labelled)}
    owners |= {
        "-".join(folder.name.removeprefix(KEYS_PREFIX).split("-")[:2])
        for folder in Path(tempfile.gettempdir()).glob(f"{KEYS_PREFIX}*-*-*")
    }
    return [name for owner in sorted(owners) if run_gone(owner) for name in remove_run(client, owner)]


class Hosts:
    """The hosts of one run: a network, a key pair, a container per host. ``close()`` removes
    them all, whatever state they are in."""

    def __init__(self, client: Any, image: str) -> None:
        self.client = client
        self.image = image
        self.run = run_id()
        self.reaper = Reaper("tests.ansible.hosts", self.run)  # before anything it would remove is made
        # Short: ssh's control sockets live here.
        self.dir = Path(tempfile.mkdtemp(prefix=f"{KEYS_PREFIX}{self.run}-"))
        self.key = self.dir / "id_ed25519"
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hio-test-{self.run}", "-f", str(self.key)],
            check=True,
            timeout=30,
        )
        self.containers: dict[str, Any] = {}
        self.addresses: dict[str, str] = {}
        self.network = client.networks.create(f"hiohosts-{self.run}", driver="bridge", labels={LABEL: self.run})

    def add(self, name: str) -> str:
        """Boot host ``name`` (its hostname too); its address once sshd lets ``deploy`` in."""
        container = self.client.containers.create(
            self.image,
            name=f"hiohosts-{self.run}-{name}",
            hostname=name,
            labels={LABEL: self.run},
            network=self.network.name,
            cap_add=["SYS_ADMIN"],
            security_opt=["apparmor=unconfined"],
            cgroupns="host",
            volumes={"/sys/fs/cgroup": {"bind": "/sys/fs/cgroup", "mode": "rw"}},
            tmpfs={"/run": "", "/run/lock": ""},
        )
        self.containers[name] = container
        container.put_archive(f"/home/{USER}/.ssh", self._authorized_keys())
        container.start()
        container.reload()
        address: str = container.attrs["NetworkSettings"]["Networks"][self.network.name]["IPAddress"]
        self.addresses[name] = address
        self._wait_for_ssh(name)
        return address

    def _authorized_keys(self) -> bytes:
        data = self.key.with_suffix(".pub").read_bytes()
        info = tarfile.TarInfo("authorized_keys")
        info.size, info.mode, info.uid, info.gid = len(data), 0o600, USER_UID, USER_UID
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()

    def _wait_for_ssh(self, name: str) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT
        while True:
            probe = self.ssh(name, "sudo systemctl is-system-running --wait", timeout=BOOT_TIMEOUT)
            if probe.returncode == 0 or probe.stdout.strip() == "degraded":
                return
            container = self.containers[name]
            container.reload()
            if container.status != "running":
                logs = container.logs(tail=20).decode(errors="replace")
                raise HostsUnavailable(f"systemd does not boot in a container here ({container.status}):\n{logs}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no SSH within {BOOT_TIMEOUT:.0f}s: {probe.stdout}{probe.stderr}")
            time.sleep(0.5)

    def ssh_options(self) -> list[str]:
        """What ssh needs to reach the hosts: the key, no known_hosts written anywhere."""
        return [
            "-i",
            str(self.key),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "ConnectTimeout=5",
        ]

    def ssh(
        self, name: str, command: str, stdin: bytes | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """``command`` on host ``name`` as ``deploy``, through sshd as an operator runs it."""
        proc = subprocess.run(
            ["ssh", *self.ssh_options(), f"{USER}@{self.addresses[name]}", command],
            input=stdin,
            capture_output=True,
            timeout=timeout,
        )
        return subprocess.CompletedProcess(
            proc.args, proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
        )

    def inventory_vars(self) -> dict[str, Any]:
        """Connection variables of every host: deploy over SSH with this run's key, sudo."""
        return {
            "ansible_user": USER,
            "ansible_ssh_private_key_file": str(self.key),
            "ansible_ssh_common_args": "-o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no",
            "ansible_python_interpreter": "/usr/bin/python3",
        }

    def journal(self, name: str, unit: str, lines: int = 60) -> str:
        """The end of a unit's journal on host ``name`` (for failure messages)."""
        out = self.ssh(name, f"sudo journalctl -u {unit} -n {lines} --no-pager", timeout=30)
        return out.stdout + out.stderr

    def close(self) -> None:
        """Remove every container, the network and the keys; what that could not remove, the
        reaper does as it ends (and an error here says what failed)."""
        self.containers.clear()
        try:
            remove_run(self.client, self.run)
        finally:
            self.reaper.close()


def main() -> int:
    """``python -m tests.ansible.hosts``: build the host image ahead of the tests (CI does, while
    it lints), so that the site.yml test does not build it inside the test run. Where it cannot
    be built here, say why and succeed: the test skips with the same reason. With ``--reap RUN``:
    a run's reaper (:class:`tests.reaper.Reaper`)."""
    if sys.argv[1:2] == ["--reap"]:
        reap(sys.argv[2], lambda run: remove_run(docker_client(), run))
        return 0
    try:
        print(f"hosts: image {ensure_image(docker_client())} ready", flush=True)
    except HostsUnavailable as exc:
        print(f"hosts: no host image: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
