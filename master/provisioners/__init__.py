"""Machines that run ``hio worker``, asked for and given back by the master's scaler.

A :class:`Provisioner` is the one door between the elastic control loop and
whatever hosts workers: ``local`` starts ``hio worker`` processes on the
master's machine (tests, the demo, the experiment); ``openstack`` creates
servers whose cloud-init installs and starts the worker. The scaler decides
*when* (bins in use + headroom, within min and max, drained before deleted);
a driver only does *what* it is told and reports what exists, so that a
master that restarts can adopt the workers it asked for instead of leaking
them.

Every call returns promptly: ``create`` asks for a worker and answers
``BUILDING``; the scaler sees it become a registered worker through the
master's own registry (a worker registers itself under ``worker_id``), and
polls :meth:`Provisioner.state` for failures (a server that failed to boot).
The scaler calls a driver from one thread, never under the master's lock,
except :meth:`Provisioner.worker_cpus`, which answers from what the driver
already knows. A call the driver's cloud refuses or fails raises
:class:`ProvisionError`: the scaler logs it and goes on (what exists is asked
again at the next poll), so one error type covers every driver.

A driver is a module named in :data:`DRIVERS` with a function
``create_provisioner(config, state_dir, options) -> Provisioner``: ``config``
is the master's :class:`~hio.master.config.MasterConfig` (addresses, TLS,
``worker_cpus``, ``worker_prefix``), ``state_dir`` the master's folder (a
driver keeps its own files in a subfolder of it), ``options`` the
``provisioner_options`` setting as a dict (``NAME=VALUE`` items), whose
unknown names the driver refuses with a :class:`~hio.config.ConfigError`
naming ``provisioner_options``: the master then refuses to start. A driver
that can tell at once that its options will not work (a cloud that does not
know the flavor) refuses them there too.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hio.config import ConfigError

if TYPE_CHECKING:
    from hio.master.config import MasterConfig

#: driver name -> its module; each module has ``create_provisioner(config, state_dir, options)``
DRIVERS = {
    "local": "hio.master.provisioners.local",
    "openstack": "hio.master.provisioners.openstack",
}


class WorkerState(enum.Enum):
    BUILDING = "building"  # asked for; not yet known to run (it registers itself with the master)
    RUNNING = "running"  # the machine or process runs (registration is the master's business)
    FAILED = "failed"  # will not come up (boot error, process exited): delete it, maybe ask again
    GONE = "gone"  # does not exist (deleted, or never created)


class ProvisionError(RuntimeError):
    """A driver's cloud refused or failed a request; the message says what was asked and
    the cloud's words. ``setting`` names the setting or driver option to change when one
    is at fault (``provisioner_options flavor``: an unknown flavor), else it is ''."""

    def __init__(self, message: str, *, setting: str = "") -> None:
        super().__init__(message)
        self.setting = setting


@dataclasses.dataclass(frozen=True)
class WorkerRequest:
    """What a new worker needs to join: the id it registers under, how it reaches the
    master, and the token it presents ('' when the cluster has no tokens)."""

    worker_id: str
    master_address: str
    token: str = ""


@dataclasses.dataclass(frozen=True)
class ProvisionedWorker:
    worker_id: str
    state: WorkerState
    detail: str = ""  # the driver's words: a server id and status, a pid, why it failed


class Provisioner(Protocol):
    """A driver of worker machines (see the module's words). Implementations are
    thread-safe and idempotent: deleting what is gone, or creating an id that exists,
    is not an error."""

    name: str

    def create(self, request: WorkerRequest) -> ProvisionedWorker:
        """Ask for a worker; returns at once (``BUILDING``), never waits for it to boot."""

    def state(self, worker_id: str) -> ProvisionedWorker:
        """What the driver knows of one worker it was asked for."""

    def delete(self, worker_id: str) -> None:
        """Give a worker back (the scaler drained it first)."""

    def adopt(self) -> list[ProvisionedWorker]:
        """Every worker of this cluster the driver finds still existing, e.g. after the
        master restarted (the scaler keeps those it wants and deletes the rest)."""

    def worker_cpus(self) -> int:
        """vCPUs of a worker this driver adds: the packer counts the workers to ask for
        by it. Called under the master's lock, so it answers without calling a cloud."""

    def close(self) -> None:
        """Let go of what the driver holds open (a connection to its cloud) when the master
        stops; the workers stay as they are, for a restarted master to adopt."""


def parse_options(items: tuple[str, ...]) -> dict[str, str]:
    """``provisioner_options`` (``NAME=VALUE`` each) as a dict; later items win."""
    options: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"provisioner_options: {item!r} must look like NAME=VALUE")
        options[name.strip().replace("-", "_")] = value.strip()
    return options


def open_provisioner(config: MasterConfig, state_dir: Path) -> Provisioner | None:
    """The driver ``config.provisioner`` names, made from ``provisioner_options``; None for
    none. ``state_dir`` is the master's folder: a driver keeps what it must remember under
    it (a folder of its own name). A driver refuses options it does not know with a
    ConfigError naming ``provisioner_options``, so a typo stops the master at start."""
    if not config.provisioner:
        return None
    module_name = DRIVERS.get(config.provisioner)
    if module_name is None:
        raise ConfigError(f"provisioner must be one of {', '.join(DRIVERS)} (or empty), got {config.provisioner!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"provisioner {config.provisioner!r} cannot be loaded: {exc}") from None
    driver: Provisioner = module.create_provisioner(config, state_dir, parse_options(config.provisioner_options))
    return driver
