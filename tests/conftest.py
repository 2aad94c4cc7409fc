import os
import sys
from pathlib import Path

import pytest

# Tests run from a checkout; make `tests.harness` importable without installing tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The gRPC settings every `hio` command runs with (hio/cli.py), before grpc is imported: among
# them fork support off, so the Spark driver JVMs pyspark starts here (a fork with a
# preexec_fn) are not aborted by it.
import hio.cli  # noqa: F401 - imported for those settings
from tests.harness import free_port

#: Every JVM the tests start (Spark drivers, executors, a standalone cluster's daemons, and the
#: launcher each spark-submit runs first) compiles with the quick JIT only and collects with the
#: serial collector: the tests' JVMs live seconds to minutes, where the optimising JIT's warm-up
#: costs more CPU than it gives back on two cores. What Spark computes does not change.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def pytest_configure(config: pytest.Config) -> None:
    """Each parallel worker (pytest-xdist's gw0, gw1, ...) gives its roles ports from a share of
    its own: two workers' clusters never race for one port. JVMs start with
    :data:`TEST_JVM_OPTIONS` unless the caller set ``JAVA_TOOL_OPTIONS``."""
    from hio.process import procs

    os.environ.setdefault("JAVA_TOOL_OPTIONS", TEST_JVM_OPTIONS)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        procs.PORT_SHARE = (int(worker[2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with slow tests first, each file's tests together and in their order:
    pytest-xdist hands its workers a file at a time in this order (make's
    ``--no-loadscope-reorder``: by default it orders the files by their number of tests, which
    puts the longest files, of one to five tests, last), so the long files start early, the
    short ones fill in at the end, and the workers finish near each other."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(autouse=True)
def _no_stray_hio_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings in the caller's environment must not leak into tests."""
    for key in list(os.environ):
        if key.startswith("HIO_"):
            monkeypatch.delenv(key)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Roles a test started and nothing stopped (a fixture cut short, Ctrl-C) stop with the
    session, gracefully; should this process die instead, they die with it (the lifeline)."""
    from hio.process.procs import stop_all

    left = stop_all()
    if left:
        print(f"\nstopped at the end of the session, left running by their tests: {', '.join(sorted(left))}")
