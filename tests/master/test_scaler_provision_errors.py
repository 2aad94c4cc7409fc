"""The scaler outlives what a driver's cloud refuses or fails: the openstack driver against
the HTTP double (tests/openstack_double.py), on the master's domain object with a
fake clock. A refused creation is logged with the cloud's words, recorded as a decision
and not asked again during its back-off; a cloud that stops answering fails every call,
and each is logged while the loop goes on."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("openstack")

from hio.master.core import Master
from hio.master.provisioners.openstack import OpenStackProvisioner
from hio.master.scaler import Scaler
from hio.master.workers import RETRY_SECONDS, Action
from tests.master.helpers import config
from tests.openstack_double import CLOUD, OpenStackDouble

pytestmark = pytest.mark.filterwarnings("ignore::PendingDeprecationWarning:openstack")

QUOTA = "Quota exceeded for instances: Requested 1, but already used 0 of 0 instances (HTTP 403)"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cloud() -> Iterator[OpenStackDouble]:
    with OpenStackDouble() as double:
        yield double
        assert double.unknown == [], "openstacksdk asked the double for something it does not serve"


@pytest.fixture
def elastic(cloud: OpenStackDouble, tmp_path: Path) -> Iterator[tuple[Master, Clock, OpenStackProvisioner]]:
    """An elastic master with the openstack driver (as ``hio master`` opens it), its scaler on a
    fake clock."""
    clouds = cloud.clouds_yaml(tmp_path)
    master = Master(
        config(
            tmp_path,
            scaling="elastic",
            provisioner="openstack",
            provisioner_options=(f"cloud={CLOUD}", f"clouds_file={clouds}", "image=hio-worker-image", "api_timeout=5"),
            advertise_address="192.0.2.10:7000",
            repository_address="192.0.2.11:7100",
            max_workers=2,
        )
    )
    assert master.scaler is not None
    driver = master.scaler.pool.driver
    assert isinstance(driver, OpenStackProvisioner)
    clock = Clock()
    master.scaler = Scaler(master, driver, clock=clock)
    try:
        yield master, clock, driver
    finally:
        master.close()


def decisions(master: Master) -> list[tuple[str, str, str]]:
    assert master.scaler is not None
    return [(d.subject, d.action, d.reason) for d in master.scaler.decisions]


def test_a_refused_creation_is_logged_and_asked_again_after_its_back_off(
    cloud: OpenStackDouble,
    elastic: tuple[Master, Clock, OpenStackProvisioner],
    caplog: pytest.LogCaptureFixture,
) -> None:
    master, clock, _driver = elastic
    scaler = master.scaler
    assert scaler is not None
    cloud.max_servers = 0  # the project's quota is used up
    with caplog.at_level(logging.WARNING, logger="hio.master.scaler"):
        scaler.tick()  # the headroom worker is wanted; Nova refuses it
    assert cloud.servers == {}
    [failed] = [r for r in caplog.records if r.getMessage() == "provisioner call failed"]
    assert (failed.call, failed.worker) == ("create", "elastic-1")  # type: ignore[attr-defined]
    assert failed.error == f"create server hio-worker-elastic-1: {QUOTA}"  # type: ignore[attr-defined]
    back_off = f"no worker is asked for in the next {RETRY_SECONDS:g} s"
    assert ("elastic-1", "creation failed", f"{failed.error}; {back_off}") in decisions(master)  # type: ignore[attr-defined]
    assert ("elastic-1", "drop worker", "gone: no server") in decisions(master)  # the poll found no server

    cloud.max_servers = 20
    clock.now += RETRY_SECONDS - 1
    scaler.tick()
    assert cloud.servers == {}  # within the back-off: not asked again
    clock.now += 1
    scaler.tick()
    [server] = cloud.servers.values()
    assert server["name"] == "hio-worker-elastic-2"


def test_a_cloud_that_stops_answering_fails_every_call_and_the_loop_goes_on(
    cloud: OpenStackDouble,
    elastic: tuple[Master, Clock, OpenStackProvisioner],
    caplog: pytest.LogCaptureFixture,
) -> None:
    master, clock, driver = elastic
    scaler = master.scaler
    assert scaler is not None
    scaler.tick()
    assert [s["name"] for s in cloud.servers.values()] == ["hio-worker-elastic-1"]
    cloud.stop()  # its port now refuses connections
    with caplog.at_level(logging.WARNING, logger="hio.master.scaler"):
        clock.now += 3
        scaler.tick()  # the poll asks about the worker that has not registered
        scaler.pool.adopt()
        scaler.pool.act([Action("delete", "elastic-1")], "192.0.2.10:7000", "")
    failed = [r for r in caplog.records if r.getMessage() == "provisioner call failed"]
    assert [r.call for r in failed] == ["state", "adopt", "delete"]  # type: ignore[attr-defined]
    assert all("the cloud cannot be reached" in r.error for r in failed)  # type: ignore[attr-defined]
    assert "elastic-1" in scaler.pool.provisioned  # not known to be gone: kept, asked again later

    master.close()
    assert driver._conn is None  # the master's stop closed the connection to the cloud
