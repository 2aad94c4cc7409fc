"""The sample dataset: deterministic, cached, in the documented format, fast enough."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
import pytest

from hio.settings import BUILTIN_IMAGES
from hio.worker.api import pipeline_for_image
from hio.worker.pipelines import microscopy, samples, simulation
from tests.pipelines.conftest import Info

SMALL_SIM = samples.SimulationSize(voxels=4, timepoints=400)


def _digests(paths: list[Path]) -> list[tuple[str, str]]:
    return [(p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in paths]


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    first = samples.generate_microscopy(tmp_path / "a", count=4, seed=3, size=128)
    second = samples.generate_microscopy(tmp_path / "b", count=4, seed=3, size=128)
    other = samples.generate_microscopy(tmp_path / "c", count=4, seed=4, size=128)
    assert _digests(first) == _digests(second)
    assert [d for _, d in _digests(first)] != [d for _, d in _digests(other)]
    sims = [samples.generate_simulation(tmp_path / d, count=3, seed=3, size=SMALL_SIM) for d in ("s1", "s2")]
    assert _digests(sims[0]) == _digests(sims[1])


def test_smaller_count_is_a_prefix(tmp_path: Path) -> None:
    two = samples.generate_simulation(tmp_path / "two", count=2, seed=9, size=SMALL_SIM)
    five = samples.generate_simulation(tmp_path / "five", count=5, seed=9, size=SMALL_SIM)
    assert _digests(two) == _digests(five)[:2]
    images = samples.generate_microscopy(tmp_path / "i2", count=2, seed=9, size=96)
    more = samples.generate_microscopy(tmp_path / "i3", count=3, seed=9, size=96)
    assert _digests(images) == _digests(more)[:2]


def test_cache_hit_and_repair(tmp_path: Path) -> None:
    paths = samples.generate_microscopy(tmp_path, count=3, seed=1, size=96)
    digests = _digests(paths)
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert samples.generate_microscopy(tmp_path, count=3, seed=1, size=96) == paths
    assert [p.stat().st_mtime_ns for p in paths] == stamps
    good = paths[1].read_bytes()
    paths[1].write_bytes(good[:100])  # a damaged file is regenerated
    assert samples.generate_microscopy(tmp_path, count=3, seed=1, size=96) == paths
    assert paths[1].read_bytes() == good
    changed = samples.generate_microscopy(tmp_path, count=3, seed=2, size=96)  # other request
    assert _digests(changed) != digests
    fewer = samples.generate_microscopy(tmp_path, count=2, seed=2, size=96)  # stale files go
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in fewer] + [samples.MANIFEST])


def test_realization_file_format(tmp_path: Path) -> None:
    path = samples.generate_simulation(tmp_path, count=1, seed=1, size=SMALL_SIM)[0]
    with np.load(path, allow_pickle=False) as npz:
        assert npz["t"].shape == (400,) and npz["x"].shape == (2, 4, 400)
        assert npz["x"].dtype == np.int32 and npz["x"].min() >= 0
        assert list(npz["species"]) == ["A", "B"]
        assert str(npz["regime"]) == "oscillating"
        assert np.all(np.diff(npz["t"]) > 0)


def test_invalid_requests_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size >= 64"):
        samples.generate_microscopy(tmp_path, count=1, size=10)
    with pytest.raises(ValueError, match="dt="):
        samples.generate_simulation(tmp_path, count=1, size=samples.SimulationSize(dt=1.0))


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[tuple[Path, str]], float]:
    started = time.perf_counter()
    files = samples.generate_demo_dataset(tmp_path_factory.mktemp("demo"))
    elapsed = time.perf_counter() - started
    print(f"\ndemo dataset: {len(files)} files in {elapsed:.1f} s")
    return files, elapsed


def test_demo_dataset_layout(demo: tuple[list[tuple[Path, str]], float]) -> None:
    files, elapsed = demo
    images = [p for p, image in files if image == samples.MICROSCOPY_IMAGE]
    realizations = [p for p, image in files if image == samples.SIMULATION_IMAGE]
    assert len(images) == samples.DEMO_IMAGES and len(realizations) == samples.DEMO_REALIZATIONS
    assert {image for _, image in files} <= set(BUILTIN_IMAGES)
    assert all(p.parent.name == "microscopy" for p in images)
    assert any(p.suffix == ".png" for p in images) and any(p.suffix == ".tif" for p in images)
    assert all(1_000_000 <= p.stat().st_size <= 6_000_000 for p in realizations)
    assert elapsed < 120, "far beyond the ~20 s budget: something is badly wrong"
    started = time.perf_counter()
    assert samples.generate_demo_dataset(files[0][0].parent.parent) == files
    assert time.perf_counter() - started < 5.0


def test_demo_images_form_distinct_populations(demo: tuple[list[tuple[Path, str]], float]) -> None:
    by_population: dict[str, list[dict]] = {}
    for path, image in demo[0][:12]:  # four of each population
        if image == samples.MICROSCOPY_IMAGE:
            features = microscopy.process(path.read_bytes(), Info())
            by_population.setdefault(path.stem.split("_")[-1], []).append(features)
    sparse, dense, defocused = by_population["sparse"], by_population["dense"], by_population["defocused"]
    assert max(f["object_count"] for f in sparse) < min(f["object_count"] for f in dense)
    assert max(f["object_area_mean"] for f in dense) < min(f["object_area_mean"] for f in sparse)
    in_focus = [f["focus_laplacian_norm"] for f in sparse + dense]
    assert max(f["focus_laplacian_norm"] for f in defocused) < min(in_focus)


def test_demo_realizations_have_features(demo: tuple[list[tuple[Path, str]], float]) -> None:
    for path, image in demo[0]:
        if image == samples.SIMULATION_IMAGE:
            features = simulation.process(path.read_bytes(), Info())
            assert set(simulation.KD_FEATURES) <= set(features)
            if "steady" not in path.name:
                assert features["A_period"] > 0, path.name


def test_builtin_pipelines_resolve() -> None:
    import importlib

    for image in BUILTIN_IMAGES:
        module_name, _, function = pipeline_for_image(image).partition(":")
        module = importlib.import_module(module_name)
        assert callable(getattr(module, function)), image
        assert all(isinstance(name, str) for name in getattr(module, "KD_FEATURES", []))
