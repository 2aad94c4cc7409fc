"""PayloadPeers: each peer's payload channel is chosen once, when first connected, and again
only after its lane broke (or could not be reached) and LANE_RETRY_SECONDS passed."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from hio.transport import payload
from hio.transport.payload import PayloadPeers


class _Made:
    def __init__(self, kind: str, where: str) -> None:
        self.kind, self.where = kind, where


def peers() -> PayloadPeers:
    return PayloadPeers(
        lanes=True,
        logger=logging.getLogger("test"),
        lane=lambda lane: _Made("lane", lane),
        grpc=lambda address: _Made("grpc", address),
    )  # type: ignore[arg-type,return-value] - a stand-in channel


def test_a_peer_is_chosen_once_and_moved_to_grpc_when_its_lane_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "LANE_RETRY_SECONDS", 0.3)
    chooser = peers()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        lane = f"127.0.0.1:{listener.getsockname()[1]}"
        first = chooser.get("peer:1", lane)
        assert first.kind == "lane" and chooser.get("peer:1", lane) is first, "chosen once, kept"
        chooser.broken("peer:1", lane, "closed without a status")
        assert chooser.get("peer:1", lane).kind == "grpc"
        time.sleep(0.4)
        assert chooser.get("peer:1", lane).kind == "lane", "chosen again once the retry time passed"
    assert chooser.get("peer:1", "").kind == "grpc", "a peer without a lane is gRPC's"


def test_a_lane_that_cannot_be_reached_at_connect_leaves_the_peer_on_grpc(caplog: pytest.LogCaptureFixture) -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        lane = f"127.0.0.1:{closed.getsockname()[1]}"
    chooser = peers()
    with caplog.at_level(logging.WARNING):
        assert chooser.get("peer:1", lane).kind == "grpc"
        assert chooser.get("peer:1", lane).kind == "grpc"
    assert [r.getMessage() for r in caplog.records] == ["payload lane unreachable; this peer uses gRPC"]
    off = PayloadPeers(
        lanes=False,
        logger=logging.getLogger("test"),
        lane=lambda lane: _Made("lane", lane),
        grpc=lambda address: _Made("grpc", address),
    )  # type: ignore[arg-type,return-value] - a stand-in channel
    assert off.get("peer:1", lane).kind == "grpc", "lanes off (or TLS): every peer is gRPC's"
