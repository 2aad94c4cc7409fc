"""hio.metrics: what the roles' counters are built from, without a network."""

from __future__ import annotations

import operator

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hio.metrics import BucketCounts, Scraped, Tally, bucket_counts, gauge, histogram, histograms, role_registry


def test_a_tally_keeps_counting_across_restarts_and_sources_that_go_away() -> None:
    cpu: Tally[tuple[str, str], float] = Tally(float, operator.add)
    cpu.update({("w/0", "pid-1"): "a", ("w/1", "pid-2"): "a"}, {("w/0", "pid-1"): 5.0, ("w/1", "pid-2"): 1.0})
    assert cpu.totals() == {"a": 6.0}
    # w/0's engine restarted (a new pid, starting again from 0); w/1 did not answer this time
    cpu.update({("w/0", "pid-3"): "a", ("w/1", "pid-2"): "a"}, {("w/0", "pid-3"): 0.5})
    assert cpu.totals() == {"a": 6.5}, "the restarted engine's 5 s stay counted; w/1 keeps its last figure"
    cpu.update({("w/0", "pid-3"): "a"}, {("w/0", "pid-3"): 2.0})  # w/1 removed
    assert cpu.totals() == {"a": 8.0}


def test_engine_histograms_add_up_per_image() -> None:
    first, second = histogram("x_seconds", "x", (0.1, 1.0)), histogram("x_seconds", "x", (0.1, 1.0))
    for seconds in (0.05, 0.5, 2.0):
        first.observe(seconds)
    second.observe(0.05)
    total = bucket_counts(first) + bucket_counts(second) + BucketCounts.empty()
    assert total.bounds == (0.1, 1.0, float("inf")) and total.counts == (2, 3, 4)
    assert total.total == pytest.approx(2.6)
    with pytest.raises(ValueError, match="different buckets"):
        _ = total + bucket_counts(histogram("y_seconds", "y", (5.0,)))
    registry = role_registry(Scraped(lambda: [histograms("hio_t_seconds", "t", ["image"], {("a",): total})]))
    [family] = [
        f for f in text_string_to_metric_families(generate_latest(registry).decode()) if f.name.startswith("hio")
    ]
    assert {s.labels.get("le"): s.value for s in family.samples if s.name.endswith("_bucket")} == {
        "0.1": 2,
        "1.0": 3,
        "+Inf": 4,
    }


def test_each_role_object_has_a_registry_of_its_own() -> None:
    """Several roles in one process (the tests) must not see each other's figures."""
    first = role_registry(Scraped(lambda: [gauge("hio_first_value", "f", 1.0)]))
    second = role_registry(Scraped(lambda: [gauge("hio_second_value", "s", 2.0)]))
    assert "hio_first_value 1.0" in generate_latest(first).decode()
    assert "hio_first_value" not in generate_latest(second).decode()
    assert "hio_second_value" not in generate_latest(first).decode()
