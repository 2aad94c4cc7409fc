"""The master's metrics, read from the Master domain object (no network): what a report,
a route and elastic scaling show, and nothing at all with metrics off."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hio.master.core import Master
from hio.proto.master_pb2 import ChannelInfo, RouteItem
from hio.proto.master_pb2 import TupleOutcome as Outcome

IMAGE = "hio/synthetic"


def samples(master: Master) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert master.metrics is not None
    text = generate_latest(master.metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_report_counts_outcomes_by_image_and_observes_the_latency_to_stored(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master()
    master.register_worker("w1", "host", 1, [ChannelInfo(channel_id="w1/0", image=IMAGE, address="127.0.0.1:1")])
    master.route(source="t", image=IMAGE, items=[RouteItem(size=10)] * 3)
    now = time.time()
    master.report(
        "w1/0",
        [
            Outcome(tuple_id=1, ok=True, size=10, accepted_unix=now - 2.0, stored_unix=now - 1.5),
            Outcome(tuple_id=2, ok=True, size=20, accepted_unix=now - 2.0, stored_unix=now - 1.0),
            Outcome(tuple_id=3, ok=False, size=30, message="boom"),
        ],
        release=False,
    )
    s = samples(master)
    image = (("image", IMAGE),)
    assert s["hio_master_tuples_done_total", image] == 2
    assert s["hio_master_tuples_failed_total", image] == 1
    assert s["hio_master_done_bytes_total", image] == 30
    assert s["hio_master_tuples_routed_total", (("image", IMAGE), ("route", "direct"))] == 3
    assert s["hio_master_route_wait_seconds_count", (("route", "direct"),)] == 1
    assert s["hio_master_tuple_latency_seconds_count", ()] == 2
    assert s["hio_master_tuple_latency_seconds_sum", ()] == pytest.approx(0.5 + 1.0, abs=0.05)
    assert s["hio_master_tuple_latency_seconds_bucket", (("le", "1.0"),)] == 2
    assert s["hio_master_channels", (("image", IMAGE), ("state", "direct"))] == 1
    assert ("hio_master_workers_wanted", ()) not in s, "fixed scaling has no elastic plan"


def test_elastic_scaling_shows_the_plan(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master(scaling="elastic", min_workers=0, max_workers=3)
    s = samples(master)
    assert s["hio_master_workers_wanted", ()] == 0 and s["hio_master_workers_present", ()] == 0
    master.set_scaling(pin={IMAGE: 2})
    assert samples(master)["hio_master_engines_wanted", (("image", IMAGE),)] == 2


def test_with_metrics_off_the_master_measures_nothing(make_master) -> None:  # type: ignore[no-untyped-def]
    master = make_master(metrics=False)
    assert master.metrics is None
    master.route(source="t", image=IMAGE, items=[RouteItem(size=10)])
    assert master.stats.routed_queue == 1, "the master's own counters go on"
