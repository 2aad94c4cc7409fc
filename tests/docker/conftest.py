"""Docker tests: run only where a Docker engine answers and the images exist.

Skipped (with the reason printed by ``-ra``) otherwise; ``.ci/setup-docker.sh``
starts the engine and builds the images.
"""

from __future__ import annotations

import pytest

ENGINE_IMAGES = ("hio/base", "hio/microscopy", "hio/simulation", "hio/synthetic")
NO_ENGINE_NEEDED = "test_offline.py"  # runs everywhere: no Docker engine involved


def _skip_reason() -> str | None:
    try:
        from hio.worker.docker_launcher import DockerLauncher, docker_available
    except ImportError as exc:
        return f"docker launcher not importable: {exc}"
    if not docker_available():
        return "no Docker engine answers (run .ci/setup-docker.sh as root)"
    missing = [image for image in ENGINE_IMAGES if not DockerLauncher.has_image(image)]
    if missing:
        return f"images {', '.join(missing)} not built (run `make images`)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything here `docker`; skip it all, with the reason, when Docker is unusable."""
    ours = [
        item
        for item in items
        if "tests/docker/" in item.nodeid.replace("\\", "/")
        and not item.nodeid.replace("\\", "/").split("::")[0].endswith(NO_ENGINE_NEEDED)
    ]
    if not ours:
        return
    reason = _skip_reason()
    for item in ours:
        item.add_marker(pytest.mark.docker)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
