"""Machines that run ``hio worker``, asked for and given back by the master's scaler
(docs/elasticity.md: the ``local`` and ``openstack`` drivers).

A driver is a module named in :data:`DRIVERS` with ``create_provisioner(config, state_dir,
options) -> Provisioner``: the master's :class:`~hio.master.config.MasterConfig`, the master's
folder (the driver keeps its files in a subfolder of it) and ``provisioner_options`` as a dict,
whose unknown names the driver refuses with a :class:`~hio.config.ConfigError` naming
``provisioner_options``. Every call returns promptly (``create`` answers ``BUILDING``: the
worker registers itself under ``worker_id``, and the scaler polls :meth:`Provisioner.state` for
failures) and is made from one thread, never under the master's lock, except
:meth:`Provisioner.worker_cpus`, which answers from what the driver knows. A call the cloud
refuses or fails raises :class:`ProvisionError`: the scaler logs it and goes on.
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
DRIVERS = {"local": "hio.master.provisioners.local", "openstack": "hio.master.provisioners.openstack"}


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


def check_options(driver: str, options: dict[str, str], known: list[str] | tuple[str, ...]) -> None:
    """Refuse an option the driver does not have, naming those it has."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"provisioner_options: the {driver} driver has no option {', '.join(unknown)}; it has {', '.join(known)}"
        )


def open_provisioner(config: MasterConfig, state_dir: Path) -> Provisioner | None:
    """The driver ``config.provisioner`` names (one of :data:`DRIVERS`, as the config's
    validation holds), made from ``provisioner_options`` (a driver refuses options it does
    not know: a typo stops the master at start); None for none."""
    if not config.provisioner:
        return None
    module = importlib.import_module(DRIVERS[config.provisioner])
    driver: Provisioner = module.create_provisioner(config, state_dir, parse_options(config.provisioner_options))
    return driver
