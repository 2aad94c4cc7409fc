from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hio.repository.store import FeatureStore, StoreOptions


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "repository"


@pytest.fixture
def store(store_dir: Path) -> Iterator[FeatureStore]:
    s = FeatureStore(store_dir, StoreOptions(segment_bytes=4096))
    yield s
    s.close()
