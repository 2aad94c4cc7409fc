"""The numpy image kernels: labelling matches scipy exactly, Otsu splits two modes."""

from __future__ import annotations

import numpy as np
import pytest

from hio.worker.pipelines import imaging, microscopy, samples


def _masks() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    ring = np.zeros((20, 20), bool)
    ring[3:17, 3:17] = True
    ring[5:15, 5:15] = False
    diagonal = np.eye(12, dtype=bool)
    return [rng.random((120, 90)) > p for p in (0.3, 0.5, 0.7)] + [
        ring,
        diagonal,
        diagonal[::-1],
        np.ones((4, 7), bool),
        np.zeros((4, 7), bool),
        np.ones((1, 1), bool),
    ]


@pytest.mark.parametrize("connectivity", [4, 8])
def test_run_labelling_equals_scipy(connectivity: int) -> None:
    ndimage = pytest.importorskip("scipy.ndimage")
    structure = np.ones((3, 3), bool) if connectivity == 8 else None
    for mask in _masks():
        ours, count = imaging._label_runs(mask, connectivity)
        theirs, expected = ndimage.label(mask, structure=structure)
        assert count == expected
        np.testing.assert_array_equal(ours, theirs)


def test_run_labelling_known_shapes() -> None:
    diagonal = np.eye(6, dtype=bool)
    assert imaging._label_runs(diagonal, 8)[1] == 1
    assert imaging._label_runs(diagonal, 4)[1] == 6
    ring = _masks()[3]
    labels, count = imaging._label_runs(ring, 8)
    assert count == 1 and labels[10, 10] == 0 and labels[3, 3] == 1


def test_label_components_rejects_bad_connectivity() -> None:
    with pytest.raises(ValueError, match="connectivity"):
        imaging.label_components(np.ones((3, 3), bool), connectivity=6)


def test_otsu_splits_two_modes() -> None:
    rng = np.random.default_rng(2)
    low, high = rng.normal(10, 1, 5000), rng.normal(30, 2, 1000)
    threshold, effectiveness = imaging.otsu_threshold(np.concatenate([low, high]).reshape(60, 100))
    assert 12 < threshold < 25
    assert np.mean(low > threshold) < 0.01 and np.mean(high <= threshold) < 0.01
    assert effectiveness > 0.85
    assert imaging.otsu_threshold(np.full((5, 5), 2.0)) == (2.0, 0.0)


def test_gaussian_blur_preserves_mean_and_smooths() -> None:
    rng = np.random.default_rng(4)
    image = rng.random((64, 80))
    blurred = imaging.gaussian_blur(image, 2.0)
    assert blurred.mean() == pytest.approx(image.mean(), rel=1e-2)
    assert blurred.std() < 0.3 * image.std()
    np.testing.assert_array_equal(imaging.gaussian_blur(image, 0.0), image)
    spot = np.zeros((64, 64))
    spot[20:40, 20:40] = 1.0
    np.testing.assert_allclose(imaging.fft_gaussian_blur(spot, 3.0), imaging.gaussian_blur(spot, 3.0), atol=0.01)


def test_microscopy_without_scipy_gives_same_features(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("scipy.ndimage")
    pixels, _ = samples.make_cell_image(np.random.default_rng(8), 200, 15, (5.0, 9.0), (200.0, 400.0))
    data = samples.encode_image(pixels, "tif")
    with_scipy = microscopy.process(data, None)
    monkeypatch.setattr(imaging, "_ndimage", None)
    assert microscopy.process(data, None) == with_scipy
