import os
import sys
from pathlib import Path

import pytest

# Tests run from a checkout; make `tests.harness` importable without installing tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import free_port


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
