"""The gateway daemon's metrics (docs/monitoring.md), read from :meth:`Gateway.status`
at each scrape: its spool, what became of its tuples, its delivery attempts and the
calls refused. Labels: ``route`` (direct, queue), ``peer`` (master, engine) and ``code``
(a gRPC status code's name)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from hio.gateway.client import Gateway, GatewayStatus
from hio.metrics import Scraped, counter, counters, gauge, role_registry


def gateway_registry(gateway: Gateway) -> CollectorRegistry:
    """The gateway's registry, reading ``gateway`` at each scrape."""
    return role_registry(Scraped(lambda: families(gateway.status())))


def families(status: GatewayStatus) -> Iterator[Metric]:
    yield gauge("hio_gateway_spooled_tuples", "Tuples in the spool (not yet stored or enqueued)", status.spooled_tuples)
    yield gauge("hio_gateway_spooled_bytes", "Payload bytes in the spool", status.spooled_bytes)
    yield gauge("hio_gateway_spool_limit_bytes", "Bound of the spool (spool_bytes)", status.spool_bytes_limit)
    yield gauge(
        "hio_gateway_spool_sync_failed",
        "1 after an fsync of the spool failed: the gateway takes no new tuple until it is restarted; else 0",
        int(bool(status.spool_failure)),
    )
    yield gauge(
        "hio_gateway_oldest_spooled_seconds",
        "Seconds since the oldest spooled tuple was accepted (0 when the spool is empty)",
        status.oldest_spooled_seconds,
    )
    yield counters(
        "hio_gateway_tuples_delivered",
        "Tuples delivered: stored by an engine (direct) or enqueued at the master (queue)",
        ["route"],
        {("direct",): status.sent_direct, ("queue",): status.sent_queue},
    )
    yield counter(
        "hio_gateway_tuples_failed", "Tuples refused for good or dead-lettered (no longer spooled)", status.failed
    )
    yield counter(
        "hio_gateway_retries", "Delivery attempts charged to a tuple (it failed, and is sent again)", status.retries
    )
    yield counters(
        "hio_gateway_delivery_attempts",
        "Tuples streamed to a peer, by route (direct to an engine, or to the master's queue); every try counts",
        ["route"],
        {("direct",): 0, ("queue",): 0} | {(route,): n for route, n in status.attempts.items()},
    )
    yield counters(
        "hio_gateway_refusals",
        "Calls that failed, by peer (master, engine) and gRPC status code (UNAVAILABLE: not reached)",
        ["peer", "code"],
        {(peer, code): n for (peer, code), n in status.refusals.items()},
    )
    yield gauge(
        "hio_gateway_master_reachable",
        "1 while the master answers; 0 while every call to it fails",
        0 if status.master_unreachable_seconds else 1,
    )
