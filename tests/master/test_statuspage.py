"""The master's status page without a browser: the Master domain object, its page on a real
HTTP endpoint over loopback, and a real repository server in this process. The history's
ring, /status.json against GetStatus and GetScaling, the preview fetched from the
repository, cached and never waited for, and a page that loads nothing from elsewhere.
(A browser drives it against a running cluster in tests/e2e/test_status_page.py.)"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from hio.master import preview as preview_module
from hio.master.core import Master
from hio.master.stats import SAMPLE_SECONDS, SAMPLES, History, Stats
from hio.master.statuspage import PAGE, StatusPage
from hio.proto import repository_pb2
from hio.proto.master_pb2 import ChannelInfo, RouteItem
from hio.proto.master_pb2 import TupleOutcome as Outcome
from hio.transport.http import HttpEndpoint, role_routes
from tests.master.helpers import config, meta_for
from tests.repository.records import knowledge, png_bytes
from tests.repository.test_service import Running, config_for

IMAGE = "hio/synthetic"


class Served:
    """A master and its status page on an HTTP endpoint of this process."""

    def __init__(self, tmp_path: Path, **overrides: object) -> None:
        self.master = Master(config(tmp_path, **overrides)).start()
        self.page = StatusPage(self.master)
        self.endpoint = HttpEndpoint(self.master.config, "127.0.0.1:0", role_routes(None, self.page.routes()))
        self.endpoint.start()
        self.url = f"http://{self.endpoint.address}"

    def get(self, path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(self.url + path, timeout=10) as reply:
            return reply.status, reply.read()

    def json(self) -> dict[str, Any]:
        return json.loads(self.get("/status.json")[1])  # type: ignore[no-any-return]

    def close(self) -> None:
        self.endpoint.close()
        self.page.close()
        self.master.close()


@pytest.fixture
def silent_repository() -> Iterator[str]:
    """An address that takes connections and never answers: a repository that hangs."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.fixture
def repository(tmp_path: Path) -> Iterator[Running]:
    running = Running(config_for(tmp_path / "repository"))
    yield running
    running.close()


@pytest.fixture
def quick_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preview_module, "REFRESH_SECONDS", 0.2)


def test_the_history_samples_throughput_and_mean_latency_every_interval_for_an_hour() -> None:
    now = [0.0]
    stats = Stats(clock=lambda: now[0])
    history = History(clock=lambda: now[0], wall=lambda: 1e9 + now[0])
    history.observe(stats)  # the start
    for _ in range(20):
        stats.outcome(ok=True, size=1, latency=0.5)
    stats.outcome(ok=True, size=1, latency=2.0)
    stats.outcome(ok=True, size=1)  # no acceptance time: counted, not in the latency
    now[0] = SAMPLE_SECONDS / 2
    history.observe(stats)
    assert history.samples() == [], "nothing before an interval has passed"
    now[0] = SAMPLE_SECONDS
    history.observe(stats)
    (sample,) = history.samples()
    assert sample.unix == 1e9 + SAMPLE_SECONDS
    assert sample.tuples_per_second == pytest.approx(22 / SAMPLE_SECONDS)
    assert sample.latency_seconds == pytest.approx((20 * 0.5 + 2.0) / 21)
    now[0] += SAMPLE_SECONDS
    history.observe(stats)
    assert history.samples()[-1].tuples_per_second == 0 and history.samples()[-1].latency_seconds is None
    for _ in range(SAMPLES + 5):
        now[0] += SAMPLE_SECONDS
        history.observe(stats)
    assert len(history.samples()) == SAMPLES, "an hour of samples, the oldest dropped"


def test_the_master_takes_history_samples_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hio.master.stats.SAMPLE_SECONDS", 0.3)
    master = Master(config(tmp_path)).start()
    try:
        deadline = time.monotonic() + 10
        while len(master.history_samples()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(master.history_samples()) >= 2
    finally:
        master.close()


def test_status_json_holds_what_hio_status_json_prints_with_the_latest_dead_letters(tmp_path: Path) -> None:
    served = Served(tmp_path)
    try:
        master = served.master
        master.register_worker("w1", "host-1", 2, [ChannelInfo(channel_id="w1/0", image=IMAGE, address="a:1")])
        master.route(source="t", image=IMAGE, items=[RouteItem(size=10)] * 2)
        now = time.time()
        master.report("w1/0", [Outcome(tuple_id=1, ok=True, size=10, accepted_unix=now - 1)], release=True)
        for n in range(12):
            meta = meta_for(100 + n, b"x")
            meta.attempt = 4 if n == 11 else 1  # the attempt it would have been next
            master.dead.add(meta, f"failed {n}", b"x")
        data = served.json()
        expected = json_format.MessageToDict(master.status(), always_print_fields_with_no_presence=True)
        for moving in ("uptimeSeconds", "workers"):  # the clock moves between the two looks
            data["status"].pop(moving), expected.pop(moving)
        assert data["status"] == expected
        assert data["status"]["warnings"] == ["12 dead letters (see `hio dead-letters`)"]
        assert data["scaling"] is None, "fixed scaling shows no plan"
        letters = data["dead_letters"]
        assert [d["meta"]["tupleId"] for d in letters] == [str(111 - n) for n in range(10)], "the latest ten"
        assert letters[0]["reason"] == "failed 11"
        assert (letters[0]["attempts"], letters[1]["attempts"]) == (3, 1), "the attempts made, not the next one"
        assert data["history"]["sample_seconds"] == SAMPLE_SECONDS
    finally:
        served.close()


def test_status_json_shows_the_elastic_plan_with_its_latest_decisions(tmp_path: Path) -> None:
    served = Served(tmp_path, scaling="elastic", max_workers=3)
    try:
        served.master.set_scaling(pin={IMAGE: 2})
        plan = served.json()["scaling"]
        assert plan["mode"] == "elastic" and plan["maxWorkers"] == 3
        assert any(d["subject"] == IMAGE for d in plan["decisions"]), plan["decisions"]
        assert [(i["image"], i["wanted"], i["pinned"]) for i in plan["images"] if i["image"] == IMAGE] == [
            (IMAGE, 2, True)
        ]
    finally:
        served.close()


def test_status_json_answers_at_once_while_the_repository_hangs_and_then_says_so(
    tmp_path: Path, silent_repository: str
) -> None:
    served = Served(tmp_path, repository_address=silent_repository)
    try:
        started = time.monotonic()
        first = served.json()["preview"]
        assert time.monotonic() - started < 1.0, "the page does not wait for the repository"
        assert first["state"] == "waiting" and silent_repository in first["message"]
        deadline = time.monotonic() + 3 * preview_module.FETCH_TIMEOUT + 5
        while served.json()["preview"]["state"] == "waiting" and time.monotonic() < deadline:
            time.sleep(0.2)
        later = served.json()["preview"]
        assert later["state"] == "unreachable" and later["since_unix"] > 0
        assert later["message"] == f"the repository at {silent_repository} does not answer (DEADLINE_EXCEEDED)"
        assert served.get("/healthz")[0] == 200
    finally:
        served.close()


def test_the_preview_is_fetched_from_the_repository_cached_and_fetched_again_when_it_changes(
    tmp_path: Path, repository: Running, quick_refresh: None
) -> None:
    served = Served(tmp_path, repository_address=repository.address)
    stub = repository.stub()
    try:
        assert _settled(served)["state"] == "none"
        png = png_bytes()
        stub.PutKnowledge(
            repository_pb2.PutKnowledgeRequest(knowledge=knowledge(40).SerializeToString(), preview_png=png)
        )
        shown = _settled(served, lambda p: p["state"] == "ok")
        assert shown["summary"]["tuples"] == 40 and shown["summary"]["groups"][0]["clusters"] == 3
        assert served.get(f"/preview.png?v={shown['version']}") == (200, png)
        stub.PutKnowledge(
            repository_pb2.PutKnowledgeRequest(knowledge=knowledge(41).SerializeToString(), preview_png=png)
        )
        changed = _settled(served, lambda p: p["summary"]["tuples"] == 41)
        assert changed["version"] != shown["version"], "a new knowledge is a new image"
    finally:
        served.close()


def test_a_repository_that_stops_answering_keeps_the_last_preview_and_says_since_when(
    tmp_path: Path, repository: Running, quick_refresh: None
) -> None:
    served = Served(tmp_path, repository_address=repository.address)
    try:
        request = repository_pb2.PutKnowledgeRequest(
            knowledge=knowledge(7).SerializeToString(), preview_png=png_bytes()
        )
        repository.stub().PutKnowledge(request)
        shown = _settled(served, lambda p: p["state"] == "ok")
        repository.close()
        gone = _settled(served, lambda p: p["state"] == "unreachable")
        assert gone["message"] == f"the repository at {repository.address} does not answer (UNAVAILABLE)"
        assert gone["summary"] == shown["summary"] and gone["version"] == shown["version"]
        assert served.get("/preview.png")[1] == png_bytes()
    finally:
        served.close()
        repository.close = lambda: None  # type: ignore[method-assign]  # closed above


def test_the_page_loads_nothing_from_outside_the_cluster() -> None:
    # the only URL in it is the SVG namespace, a name and never fetched
    assert re.findall(r"(?:https?:)?//[\w.-]+", PAGE) == ["http://www.w3.org"]
    assert not re.search(r"\b(?:src|href)\s*=\s*[\"'](?!/)", PAGE), "no attribute loads from elsewhere"
    assert "@import" not in PAGE and "url(" not in PAGE and "@font-face" not in PAGE


def test_the_page_allows_exactly_its_own_inline_script_and_style(tmp_path: Path) -> None:
    served = Served(tmp_path)
    try:
        with urllib.request.urlopen(served.url + "/", timeout=10) as reply:
            policy = reply.headers["Content-Security-Policy"]
            assert reply.headers["Content-Type"] == "text/html; charset=utf-8"
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "img-src 'self'" in policy
        assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'(;|$)", policy)
        assert "unsafe-inline" not in policy
    finally:
        served.close()


def _settled(served: Served, done: Any = lambda p: p["state"] != "waiting", timeout: float = 15.0) -> dict[str, Any]:
    """The preview once ``done`` holds for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        preview = served.json()["preview"]
        if done(preview):
            return preview  # type: ignore[no-any-return]
        time.sleep(0.1)
    raise AssertionError(f"the preview did not settle: {served.json()['preview']}")
