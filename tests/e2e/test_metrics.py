"""Every role's /metrics, scraped over HTTP from real `hio` processes while tuples flow,
parsed as Prometheus parses it: the counters that must move, by value; label values
from bounded sets only; answers while the roles are busy; a secured role's token and TLS.

One cluster for the module: a repository, a master, a worker with two hio/synthetic
engines and one test/echo engine (whose tuples with ``mode=fail`` fail), and a gateway
daemon watching a folder; more tuples come from gateways in this process.
"""

from __future__ import annotations

import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from hio.cluster import LocalCluster
from hio.gateway import Gateway
from hio.settings import ClusterSettings
from hio.transport.certs import generate
from hio.worker.metrics import ENGINE_STATS_TIMEOUT
from tests.harness import HioProcess, cluster_gateway, free_port, local_cluster, stop_cleanly, wait_for

pytestmark = pytest.mark.slow

REPO_ROOT = str(Path(__file__).resolve().parents[2])
ECHO = "test/echo"
SYNTHETIC = "hio/synthetic"
WATCHED = 12  # tuples the gateway daemon takes from its folder (direct)
QUEUED = 5  # tuples sent through the master's queue
FAILING = 2  # tuples whose every processing fails: dead letters
ATTEMPTS = 3  # the master's and the engines' max_attempts

#: Every label value a metric may carry: nothing a tuple, a worker or an engine names.
ALLOWED = {
    "image": {SYNTHETIC, ECHO, "hio/microscopy", "hio/simulation"},
    "route": {"direct", "queue"},
    "state": {"free", "direct", "queue", "down", "up", "live", "expired"},
    "peer": {"master", "engine"},
    "result": {"new", "duplicate"},
    "consumer": {"kd"},
    "code": {
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
        "INTERNAL",
    },
}


def scrape(address: str, token: str = "", context: ssl.SSLContext | None = None) -> list[Sample]:
    """Every sample of a role's /metrics, as Prometheus' text parser reads them."""
    scheme = "https" if context is not None else "http"
    request = urllib.request.Request(
        f"{scheme}://{address}/metrics", headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    with urllib.request.urlopen(request, timeout=10, context=context) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The value of the one sample named ``name`` with ``labels`` (others may have more labels)."""
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


class MetricsCluster(LocalCluster):
    def __init__(self, root: Path) -> None:
        super().__init__(
            root,
            process=HioProcess,
            workers={"w1": [f"{SYNTHETIC}=2", f"{ECHO}=1"]},
            worker_args=["--pipelines", f"{ECHO}=tests.worker.pipe_test:process", "--max-attempts", str(ATTEMPTS)],
            master_args=["--max-attempts", str(ATTEMPTS)],
            env={"PYTHONPATH": REPO_ROOT},
        )
        self.watch = root / "incoming"
        self.watch.mkdir()

    def start(self) -> MetricsCluster:
        super().start()
        ingest = f"127.0.0.1:{free_port()}"
        try:
            self.add(
                "gateway",
                [
                    *("--watch", str(self.watch), "--image", SYNTHETIC, "--settle-seconds", "0.2"),
                    *("--ingest-listen", ingest, "--source", "lab"),
                ],
                health=ingest,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def scrape(self, role: str) -> list[Sample]:
        return scrape(self.http[role])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsCluster]:
    c = MetricsCluster(tmp_path_factory.mktemp("metrics"))
    try:
        c.start()
        _flow(c)
        yield c
    finally:
        stop_cleanly(c)


def _flow(cluster: MetricsCluster) -> None:
    """Tuples of many names: through the watched folder (direct), forced through the queue,
    and some that always fail; returns once the master has settled every one of them."""
    for n in range(WATCHED):
        (cluster.watch / f"plate-{n:02d}.bin").write_bytes(os.urandom(50_000 + n))
    wait_for(  # before any is queued: a route finds tuples of its image queued and joins them
        lambda: value(cluster.scrape("master"), "hio_master_tuples_done_total", image=SYNTHETIC) == WATCHED,
        timeout=60,
        what=lambda: f"the watched files stored; the cluster's logs:\n{cluster.output()}",
    )
    with cluster_gateway(cluster, "queued", force_queue=True) as queued, cluster_gateway(cluster, "failing") as failing:
        for n in range(QUEUED):
            queued.submit(os.urandom(20_000), image=SYNTHETIC, name=f"run-{n}.npz").result(timeout=60)
        for n in range(FAILING):
            failing.submit(b"oops", image=ECHO, name=f"bad-{n}.tif", attributes={"mode": "fail"})
        wait_for(
            lambda: (
                value(cluster.scrape("master"), "hio_master_dead_letters") == FAILING
                and value(cluster.scrape("master"), "hio_master_tuples_done_total", image=SYNTHETIC) == WATCHED + QUEUED
            ),
            timeout=120,
            what=lambda: f"every tuple settled; the cluster's logs:\n{cluster.output()}",
        )
        wait_for(lambda: value(cluster.scrape("gateway"), "hio_gateway_spooled_tuples") == 0, timeout=30)
    wait_for(  # a route's reservation the gateway never used lapses after reservation_seconds
        lambda: value(cluster.scrape("master"), "hio_master_channels", image=SYNTHETIC, state="free") == 2,
        timeout=60,
        what=lambda: f"both synthetic channels free again; the cluster's logs:\n{cluster.output()}",
    )


def test_the_master_counts_routes_outcomes_dead_letters_and_latencies(cluster: MetricsCluster) -> None:
    m = cluster.scrape("master")
    stored = WATCHED + QUEUED
    assert value(m, "hio_master_tuples_done_total", image=SYNTHETIC) == stored
    assert value(m, "hio_master_tuples_done_total", image=ECHO) == 0
    assert value(m, "hio_master_tuples_failed_total", image=ECHO) == FAILING * ATTEMPTS
    assert value(m, "hio_master_dead_letters") == FAILING
    assert value(m, "hio_master_tuples_routed_total", route="queue", image=SYNTHETIC) == QUEUED
    assert value(m, "hio_master_tuples_routed_total", route="direct", image=SYNTHETIC) >= WATCHED
    assert value(m, "hio_master_done_bytes_total", image=SYNTHETIC) == sum(50_000 + n for n in range(WATCHED)) + (
        QUEUED * 20_000
    )
    assert value(m, "hio_master_tuple_latency_seconds_count") == stored
    assert 0 < value(m, "hio_master_tuple_latency_seconds_sum") < stored * 60
    assert value(m, "hio_master_route_wait_seconds_count", route="queue") >= 1
    assert value(m, "hio_master_queue_tuples", image=SYNTHETIC) == 0
    assert value(m, "hio_master_channels", image=SYNTHETIC, state="free") == 2
    assert value(m, "hio_master_workers", state="live") == 1
    assert value(m, "hio_master_engines_running", image=ECHO) == 1
    assert value(m, "process_cpu_seconds_total") > 0


def test_the_repository_counts_records_bytes_and_fsyncs(cluster: MetricsCluster) -> None:
    r = cluster.scrape("repository")
    assert value(r, "hio_repository_records") == WATCHED + QUEUED
    assert value(r, "hio_repository_records_put_total", result="new") == WATCHED + QUEUED
    assert value(r, "hio_repository_records_put_total", result="duplicate") == 0
    assert value(r, "hio_repository_stored_bytes") > 0
    assert value(r, "hio_repository_fsync_seconds_count") >= 1


def test_the_worker_shows_its_engines_and_their_process_times_by_image(cluster: MetricsCluster) -> None:
    w = cluster.scrape("w1")
    assert value(w, "hio_worker_engines", image=SYNTHETIC, state="up") == 2
    assert value(w, "hio_worker_engines", image=ECHO, state="up") == 1
    assert value(w, "hio_worker_engine_restarts_total", image=SYNTHETIC) == 0
    assert value(w, "hio_worker_process_seconds_count", image=SYNTHETIC) == WATCHED + QUEUED
    assert value(w, "hio_worker_process_seconds_count", image=ECHO) == FAILING * ATTEMPTS, "failed calls count"
    assert value(w, "hio_worker_process_seconds_bucket", image=SYNTHETIC, le="+Inf") == WATCHED + QUEUED
    assert value(w, "hio_worker_engine_cpu_seconds_total", image=SYNTHETIC) > 0
    assert value(w, "hio_worker_engine_cpu_share", image=SYNTHETIC) >= 0


def test_the_gateway_daemon_shows_its_spool_and_deliveries(cluster: MetricsCluster) -> None:
    g = cluster.scrape("gateway")
    assert value(g, "hio_gateway_tuples_delivered_total", route="direct") == WATCHED
    assert value(g, "hio_gateway_tuples_delivered_total", route="queue") == 0
    assert value(g, "hio_gateway_delivery_attempts_total", route="direct") >= WATCHED
    assert value(g, "hio_gateway_spooled_tuples") == 0 and value(g, "hio_gateway_spooled_bytes") == 0
    assert value(g, "hio_gateway_oldest_spooled_seconds") == 0
    assert value(g, "hio_gateway_master_reachable") == 1
    assert value(g, "hio_gateway_tuples_failed_total") == 0


def test_no_label_carries_a_tuple_worker_or_engine_name(cluster: MetricsCluster) -> None:
    names = [f"plate-{n:02d}" for n in range(WATCHED)] + [f"run-{n}" for n in range(QUEUED)] + ["bad-0", "w1"]
    for role in ("master", "repository", "w1", "gateway"):
        for sample in cluster.scrape(role):
            for label, text in sample.labels.items():
                if label == "le":  # a histogram's bucket bound
                    continue
                assert text in ALLOWED.get(label, set()), f"{role}: {sample.name} has {label}={text!r}"
                assert not any(name in text for name in names), f"{role}: {sample.name} names {text!r}"


def test_every_metric_a_role_shows_is_listed_in_docs_monitoring(cluster: MetricsCluster) -> None:
    for role in ("master", "repository", "w1", "gateway"):
        assert_documented(cluster.http[role])


def assert_documented(address: str) -> None:
    """Every metric family at ``address`` is named in docs/monitoring.md."""
    doc = (Path(REPO_ROOT) / "docs" / "monitoring.md").read_text()
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    for family in families:  # a counter's family is named without its _total
        assert f"`{family.name}`" in doc or f"`{family.name}_total`" in doc, f"{address}: {family.name}"


def test_metrics_answer_while_the_roles_are_busy(cluster: MetricsCluster) -> None:
    """Engines burning CPU in process(), a stream of tuples: every scrape answers, in time."""
    payload = os.urandom(1_000_000)
    slowest: dict[str, float] = {}
    with cluster_gateway(cluster, "busy") as gateway:
        busy = [
            gateway.submit(payload, image=SYNTHETIC, name=f"busy-{n}", attributes={"cost_ms": "1500"}) for n in range(4)
        ]
        busy += [gateway.submit(payload, image=SYNTHETIC, name=f"flow-{n}") for n in range(30)]
        wait_for(
            lambda: value(cluster.scrape("w1"), "hio_worker_engine_cpu_share", image=SYNTHETIC) > 0.5,
            timeout=30,
            what="the synthetic engines busy",
        )
        while not all(f.done() for f in busy):
            for role in ("master", "repository", "w1", "gateway"):
                started = time.monotonic()
                assert cluster.scrape(role)
                slowest[role] = max(slowest.get(role, 0.0), time.monotonic() - started)
        for future in busy:
            future.result(timeout=60)
    assert slowest.keys() == {"master", "repository", "w1", "gateway"}
    assert max(slowest.values()) < ENGINE_STATS_TIMEOUT + 2.0, slowest


def test_a_secured_role_asks_for_a_viewer_token_over_tls(tmp_path: Path) -> None:
    paths = generate(tmp_path / "certs", ("master", "prometheus"), ("localhost", "127.0.0.1"))
    tokens = tmp_path / "tokens"
    tokens.write_text("viewer-token viewer prometheus\ngateway-token gateway lab\n")
    address, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = ["--listen", address, "--http-listen", http, "--data-dir", str(tmp_path / "m")]
    args += ["--tokens-file", str(tokens), "--tls-cert", str(paths["master"]), "--tls-key", str(paths["master-key"])]
    args += ["--tls-ca", str(paths["ca"])]
    trusting = ssl.create_default_context(cafile=str(paths["ca"]))
    with HioProcess("master", args, tmp_path):
        wait_for(lambda: _answers(f"https://{http}/healthz", trusting), timeout=30, what="the master's HTTP endpoint")
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            scrape(http, "viewer-token", ssl.create_default_context())
        with pytest.raises(urllib.error.HTTPError) as refused:
            scrape(http, context=trusting)
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as forbidden:
            scrape(http, "gateway-token", trusting)
        assert forbidden.value.code == 403
        assert value(scrape(http, "viewer-token", trusting), "hio_master_dead_letters") == 0


def _answers(url: str, context: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as reply:
            return reply.status == 200
    except OSError:
        return False


def test_local_cluster_names_every_roles_endpoint(cluster: MetricsCluster) -> None:
    assert set(cluster.http) == {"repository", "master", "w1", "gateway"}
    for address in cluster.http.values():
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=5) as reply:
            assert reply.read() == b"ok\n"


def test_local_clusters_side_by_side_have_no_port_in_common_and_metrics_turn_off(tmp_path: Path) -> None:
    first = local_cluster(tmp_path / "a")
    second = local_cluster(tmp_path / "b", settings=ClusterSettings(metrics=False))
    try:
        first.start()
        second.start()
        ports = [*first.http.values(), *second.http.values(), first.master, second.master]
        assert len(set(ports)) == len(ports) == 6
        assert value(scrape(first.http["master"]), "hio_master_workers", state="live") == 0
        for address in second.http.values():
            with pytest.raises(urllib.error.HTTPError) as off:
                scrape(address)
            assert off.value.code == 404 and b"metrics = false" in off.value.read()
            assert _answers(f"http://{address}/healthz", ssl.create_default_context())
    finally:
        stop_cleanly(second)
        stop_cleanly(first)


@pytest.mark.spark
def test_kd_shows_its_intervals_the_records_they_took_in_and_its_lag(tmp_path: Path) -> None:
    cluster = local_cluster(tmp_path, workers={"w1": [f"{SYNTHETIC}=2"]})
    try:
        cluster.start()

        def send(count: int, prefix: str) -> None:
            with Gateway(
                master_address=cluster.master,
                repository_address=cluster.repository,
                data_dir=str(tmp_path / f"gw-{prefix}"),
                source=prefix,
                progress=False,
            ) as gateway:
                futures = [
                    gateway.submit(os.urandom(5_000), image=SYNTHETIC, name=f"{prefix}-{n}") for n in range(count)
                ]
                for future in futures:
                    future.result(timeout=60)

        def kd_settled(stored: int) -> bool:
            try:
                k = scrape(cluster.http["kd"])
            except OSError:  # KD's endpoint not up yet
                return False
            return (  # the interval's figures come once it ends: after it stored and learnt
                value(k, "hio_kd_stored_records") == stored
                and value(k, "hio_kd_lag_records") == 0
                and value(k, "hio_kd_interval_records_sum") == stored
            )

        send(20, "first")
        cluster.add("kd", ["--interval", "2", "--k", "2"])
        wait_for(lambda: kd_settled(20), timeout=240, what=lambda: f"KD caught up; logs:\n{cluster.output()}")
        send(7, "second")
        wait_for(lambda: kd_settled(27), timeout=120, what=lambda: f"KD caught up again; logs:\n{cluster.output()}")
        k = scrape(cluster.http["kd"])
        assert value(k, "hio_kd_interval_records_count") == value(k, "hio_kd_interval_seconds_count") >= 2
        assert value(k, "hio_kd_query_failures_total") == 0, cluster.output(20_000, "kd")
        assert_documented(cluster.http["kd"])
        assert value(scrape(cluster.http["repository"]), "hio_repository_consumer_lag_records", consumer="kd") == 0
    finally:
        stop_cleanly(cluster)
