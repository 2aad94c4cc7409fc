"""The master's status page in a real headless browser (Debian's chromium, driven through
its chromedriver with selenium) against a running cluster of real `hio` processes.

One cluster for the module, with a tokens file: a repository, a master, worker w1 with two
hio/synthetic engines and worker w2 with one test/echo engine (whose tuples with
``mode=fail`` fail: dead letters). Tuples flow through gateways in this process: stored
directly, queued for hio/microscopy (no engine runs it, so they wait), and failed. A
knowledge with a preview image is put into the repository as KD would put it.

The tests run in the file's order: the last ones stop the repository and then the master.
Without chromium and chromedriver (``apt-get install chromium chromium-driver``) or
selenium, every test is skipped and says which is missing.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from hio.cluster import LocalCluster
from hio.proto import features_pb2, repository_pb2, repository_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.net import create_channel
from tests.harness import cluster_gateway, hio_env, local_cluster, stop_cleanly, wait_for

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.slow

REPO_ROOT = str(Path(__file__).resolve().parents[2])
SYNTHETIC = "hio/synthetic"
ECHO = "test/echo"
WAITING = "hio/microscopy"  # no engine runs it: its tuples wait in the queue
DIRECT = 8
QUEUED = 3
TOKENS = {
    "cluster": ("cluster-token", "any"),
    "viewer": ("viewer-token", "viewer"),
    "gateway": ("lab-token", "gateway"),
}
CLUSTER, VIEWER, GATEWAY = (TOKENS[role][0] for role in ("cluster", "viewer", "gateway"))
#: What chromium needs on a machine without a network or a screen (it stalls on refused
#: connections without them); each browser also gets a new, empty --user-data-dir.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1600",
)


def browser_missing() -> str:
    """Why no browser can be driven here ('' when one can)."""
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install -y chromium chromium-driver, as root)"
    try:
        import selenium  # noqa: F401 - only whether it imports
    except ImportError:
        return "selenium is not installed (make setup installs it with the dev extras)"
    return ""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    reason = browser_missing()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(shutil.which("chromium"))
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def cluster(browser: WebDriver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("status-page")
    tokens = root / "tokens"
    tokens.write_text("".join(f"{token} {role} {name}\n" for name, (token, role) in TOKENS.items()))
    c = local_cluster(
        root,
        settings=ClusterSettings(tokens_file=str(tokens), token=CLUSTER),
        workers={"w1": [f"{SYNTHETIC}=2"], "w2": [f"{ECHO}=1"]},
        worker_args=["--pipelines", f"{ECHO}=tests.worker.pipe_test:process", "--max-attempts", "2"],
        master_args=["--max-attempts", "2"],
        env={"PYTHONPATH": REPO_ROOT},
    )
    try:
        c.start()
        _flow(c)
        yield c
    finally:
        stop_cleanly(c)


def _flow(cluster: LocalCluster) -> None:
    """Tuples stored, queued and failed; a knowledge with its preview in the repository."""
    with cluster_gateway(cluster, "lab", token=CLUSTER) as lab:
        for n in range(DIRECT):
            lab.submit(os.urandom(30_000), image=SYNTHETIC, name=f"plate-{n}.bin").result(timeout=60)
        for n in range(QUEUED):
            lab.submit(os.urandom(10_000), image=WAITING, name=f"slide-{n}.tif").result(timeout=60)
        lab.submit(b"oops", image=ECHO, name="bad.tif", attributes={"mode": "fail"})
        wait_for(
            lambda: cluster.status().dead_letters == 1 and cluster.status().tuples_done == DIRECT,
            timeout=90,
            what=lambda: f"the tuples settled; the cluster's logs:\n{cluster.output()}",
        )
    knowledge = features_pb2.Knowledge(computed_unix=time.time(), tuple_count=DIRECT, up_to_offset=DIRECT)
    group = knowledge.groups.add(image=SYNTHETIC, feature_names=["size", "first"], tuple_count=DIRECT)
    group.algorithm = "agglomerative"
    for n in range(2):
        group.clusters.add(id=n, centre=[float(n), 0.0], count=DIRECT // 2)
    with create_channel(cluster.repository, cluster.settings) as channel:
        repository_pb2_grpc.RepositoryStub(channel).PutKnowledge(
            repository_pb2.PutKnowledgeRequest(knowledge=knowledge.SerializeToString(), preview_png=preview_png()),
            timeout=10,
        )


def preview_png(width: int = 240, height: int = 160) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (width, height), "white")
    for x in range(width):
        image.putpixel((x, height // 2 + int(40 * ((x % 60) / 60 - 0.5))), (31, 111, 235))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def page_url(cluster: LocalCluster) -> str:
    return f"http://{cluster.http['master']}/"


def hio_status(cluster: LocalCluster) -> dict[str, Any]:
    """What ``hio status --json`` prints, run as a user runs it (with a viewer token)."""
    result = subprocess.run(
        [sys.executable, "-m", "hio.cli", "status", "--json", "--master-address", cluster.master],
        env=hio_env({"HIO_TOKEN": VIEWER}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


#: One look at the page, read in one script so the figures are of the same redraw.
READ_PAGE = """
const figure = (name) => document.querySelector(`[data-figure="${name}"]`).textContent;
const rows = (selector) => [...document.querySelectorAll(selector)];
return {
  updated: document.querySelector('#updated').textContent,
  tuples_done: figure('tuples-done'),
  dead_letters: figure('dead-letters'),
  free: figure('channels-free'), busy: figure('channels-busy'), down: figure('channels-down'),
  workers: figure('workers'),
  worker_rows: rows('tr[data-worker]').map((r) => r.dataset.worker),
  channel_states: rows('tr[data-channel]').map((r) => r.dataset.state),
  queues: Object.fromEntries(rows('tr[data-queue]').map(
    (r) => [r.dataset.queue, r.querySelector('[data-field=length]').textContent])),
  warnings: rows('#warnings li').map((li) => li.textContent),
  dead_rows: rows('#dead-letters tr[data-tuple]').map((r) => r.dataset.tuple),
};
"""


def read_page(driver: WebDriver) -> dict[str, Any]:
    return driver.execute_script(READ_PAGE)  # type: ignore[no-any-return]


def page_updated(driver: WebDriver) -> bool:
    """The page shows a cluster's answer (False while a form's submission is still loading it)."""
    from selenium.common.exceptions import JavascriptException

    try:
        return str(read_page(driver)["updated"]).startswith("updated ")
    except JavascriptException:  # the page being replaced: its elements are not there yet
        return False


def refusal(driver: WebDriver) -> str:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return str(driver.find_element(By.ID, "refusal").text)
    except (NoSuchElementException, StaleElementReferenceException):  # the page being replaced
        return ""


def as_int(text: str) -> int:
    return int(text.replace(",", ""))


def from_page(page: dict[str, Any]) -> dict[str, Any]:
    """The page's figures, in the terms of ``hio status --json``."""
    return {
        "tuplesDone": as_int(page["tuples_done"]),
        "deadLetters": as_int(page["dead_letters"]),
        "channels": (as_int(page["free"]), as_int(page["busy"]), as_int(page["down"])),
        "workers": sorted(page["worker_rows"]),
        "workerCount": as_int(page["workers"]),
        "states": sorted(page["channel_states"]),
        "queues": {image: as_int(length) for image, length in page["queues"].items()},
        "warnings": page["warnings"],
    }


def from_status(status: dict[str, Any]) -> dict[str, Any]:
    workers = status["workers"]
    return {
        "tuplesDone": int(status["tuplesDone"]),
        "deadLetters": int(status["deadLetters"]),
        "channels": (int(status["channelsFree"]), int(status["channelsBusy"]), int(status["channelsDown"])),
        "workers": sorted(w["workerId"] for w in workers),
        "workerCount": len(workers),
        "states": sorted(c["state"] for w in workers for c in w["channels"]),
        "queues": {q["image"]: int(q["length"]) for q in status["queues"]},
        "warnings": status["warnings"],
    }


def signed_in(driver: WebDriver, cluster: LocalCluster) -> None:
    """The page open in ``driver``, signed in with the viewer token."""
    from selenium.webdriver.common.by import By

    driver.get(page_url(cluster))
    if driver.find_elements(By.ID, "token"):
        driver.find_element(By.ID, "token").send_keys(VIEWER)
        driver.find_element(By.CSS_SELECTOR, "form button").click()
    wait_for(lambda: page_updated(driver), timeout=30, what="the page's first answer")


def test_the_page_asks_for_a_token_and_refuses_a_role_that_may_not_read_it(
    browser: WebDriver, cluster: LocalCluster
) -> None:
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.get(page_url(cluster))
    assert "missing token" in browser.find_element(By.ID, "refusal").text
    assert not browser.find_elements(By.ID, "main"), "nothing of the cluster is shown without a token"
    browser.find_element(By.ID, "token").send_keys(GATEWAY)
    browser.find_element(By.CSS_SELECTOR, "form button").click()  # the answer is a new page, loaded after the click
    wait_for(
        lambda: "role 'gateway' may not call /" in refusal(browser),
        timeout=30,
        what=lambda: f"the gateway's token refused; the page says {refusal(browser)!r}",
    )
    browser.find_element(By.ID, "token").send_keys(VIEWER)
    browser.find_element(By.CSS_SELECTOR, "form button").click()
    wait_for(lambda: page_updated(browser), timeout=30, what="the signed-in page")
    assert browser.current_url == page_url(cluster)
    (cookie,) = browser.get_cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and VIEWER not in cookie["value"]


def test_the_numbers_on_the_page_agree_with_hio_status_json(browser: WebDriver, cluster: LocalCluster) -> None:
    signed_in(browser, cluster)
    status = from_status(hio_status(cluster))
    assert status["workers"] == ["w1", "w2"] and status["queues"] == {WAITING: QUEUED}
    assert status["tuplesDone"] == DIRECT and status["deadLetters"] == 1
    assert f"no channel offers image {WAITING}; {QUEUED} tuples wait in its queue" in status["warnings"]
    wait_for(
        lambda: from_page(read_page(browser)) == from_status(hio_status(cluster)),
        timeout=30,
        what=lambda: f"the page {from_page(read_page(browser))} to agree with {from_status(hio_status(cluster))}",
    )
    page = read_page(browser)
    assert len(page["dead_rows"]) == 1
    assert sorted(page["channel_states"]) == ["FREE", "FREE", "FREE"]


def test_the_page_updates_itself_as_tuples_flow(browser: WebDriver, cluster: LocalCluster) -> None:
    signed_in(browser, cluster)
    browser.execute_script("window.loadedOnce = true;")  # gone if the page were loaded again
    before = as_int(read_page(browser)["tuples_done"])
    more = 6
    with cluster_gateway(cluster, "more", token=CLUSTER) as lab:
        for n in range(more):
            lab.submit(os.urandom(20_000), image=SYNTHETIC, name=f"more-{n}.bin").result(timeout=60)
    wait_for(
        lambda: as_int(read_page(browser)["tuples_done"]) == before + more,
        timeout=30,
        what=lambda: f"the page to count {before + more} tuples done: {read_page(browser)}",
    )
    assert browser.execute_script("return window.loadedOnce === true;"), "redrawn in place, not reloaded"


def test_the_page_shows_the_knowledge_preview_and_the_charts_of_the_last_hour(
    browser: WebDriver, cluster: LocalCluster
) -> None:
    signed_in(browser, cluster)
    preview = """
const image = document.querySelector('#preview-image');
const tuples = document.querySelector('[data-figure="preview-tuples"]');
return {width: image.complete ? image.naturalWidth : 0, tuples: tuples ? tuples.textContent : '',
        samples: Number(document.querySelector('#throughput-chart').dataset.samples || 0),
        paths: document.querySelectorAll('#throughput-chart path.line').length};
"""
    shown = wait_for(
        lambda: (lambda p: p if p["width"] and p["samples"] >= 1 else None)(browser.execute_script(preview)),
        timeout=40,
        what=lambda: f"the preview and a sample in the charts: {browser.execute_script(preview)}",
    )
    assert shown["width"] == 240 and shown["tuples"] == str(DIRECT) and shown["paths"] >= 1


def test_the_preview_part_says_when_the_repository_does_not_answer(browser: WebDriver, cluster: LocalCluster) -> None:
    from selenium.webdriver.common.by import By

    signed_in(browser, cluster)
    cluster.remove("repository")
    message = wait_for(
        lambda: (lambda t: t if "does not answer" in t else "")(browser.find_element(By.ID, "preview-message").text),
        timeout=40,
        what="the preview part to say the repository does not answer",
    )
    assert re.fullmatch(
        rf"the repository at {cluster.repository} does not answer \(\w+\) since \d\d:\d\d:\d\d", message
    )
    assert not browser.find_element(By.ID, "banner").is_displayed(), "the master itself still answers"


def test_the_page_says_since_when_the_master_is_unreachable(browser: WebDriver, cluster: LocalCluster) -> None:
    from selenium.webdriver.common.by import By

    signed_in(browser, cluster)
    cluster.remove("master")
    banner = wait_for(
        lambda: (lambda b: b.text if b.is_displayed() else "")(browser.find_element(By.ID, "banner")),
        timeout=20,
        what="the unreachable banner",
    )
    assert re.match(r"master unreachable since \d\d:\d\d:\d\d \(no connection\)", banner), banner
    assert "the page shows its last answer" in banner
