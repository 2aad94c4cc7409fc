"""The microscopy pipeline on real generated images and on hand-made edge cases."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from hio.worker.pipelines import imaging, microscopy, samples
from tests.pipelines.conftest import Info, with_attributes


def _tiff(pixels: np.ndarray) -> bytes:
    return samples.encode_image(pixels, "tif")


def _clean_image(cells: int = 25, seed: int = 3, size: int = 384) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(seed)
    return samples.make_cell_image(rng, size, cells, (7.0, 11.0), (300.0, 500.0))


def _numbers(features: dict) -> dict[str, float]:
    return {k: v for k, v in features.items() if isinstance(v, float)}


@pytest.fixture(scope="module")
def sample_images(tmp_path_factory: pytest.TempPathFactory) -> list:
    return samples.generate_microscopy(tmp_path_factory.mktemp("micro"), count=6, seed=11, size=256)


def test_sample_images_give_all_features_finite(sample_images: list, info: Info) -> None:
    for path in sample_images:
        features = microscopy.process(path.read_bytes(), info)
        for name in [
            *microscopy.KD_FEATURES,
            "p01_intensity",
            "p99_intensity",
            "object_area_std",
            "object_area_median",
            "width",
            "height",
        ]:
            assert isinstance(features[name], float), name
        assert all(math.isfinite(v) for v in _numbers(features).values()), path.name
        hist = features["object_area_hist"]
        assert len(hist) == len(microscopy.AREA_BIN_EDGES) - 1
        assert sum(hist) == features["object_count"]
        assert features["width"] == features["height"] == 256.0
        assert features["format"] == ("PNG" if path.suffix == ".png" else "TIFF")
        assert features["bit_depth"] == (8.0 if path.suffix == ".png" else 16.0)
        assert 0.0 <= features["min_intensity"] <= features["p50_intensity"] <= features["max_intensity"] <= 1.0


@pytest.mark.parametrize("fmt", ["tif", "png"])
def test_object_count_matches_known_cells(fmt: str, info: Info) -> None:
    pixels, cells = _clean_image()
    assert cells == 25
    features = microscopy.process(samples.encode_image(pixels, fmt), info)
    assert features["object_count"] == cells
    mean_area = features["object_area_mean"]
    assert math.pi * 6**2 < mean_area < math.pi * 12**2


def test_min_object_area_drops_small_objects(info: Info) -> None:
    pixels, cells = _clean_image()
    data = _tiff(pixels)
    assert microscopy.process(data, with_attributes(min_object_area="100000"))["object_count"] == 0
    assert microscopy.process(data, with_attributes(min_object_area="5"))["object_count"] >= cells


def test_focus_lower_for_blurred_copy(info: Info) -> None:
    pixels, _ = _clean_image()
    blurred = np.clip(np.rint(imaging.gaussian_blur(pixels, 4.0)), 0, 65535).astype(np.uint16)
    sharp = microscopy.process(_tiff(pixels), info)
    soft = microscopy.process(_tiff(blurred), info)
    assert soft["focus_laplacian_var"] < 0.5 * sharp["focus_laplacian_var"]
    assert soft["focus_tenengrad"] < 0.5 * sharp["focus_tenengrad"]


def test_png_and_tiff_of_same_scene_agree(info: Info) -> None:
    pixels, _ = _clean_image()
    tif = microscopy.process(samples.encode_image(pixels, "tif"), info)
    png = microscopy.process(samples.encode_image(pixels, "png"), info)
    assert png["mean_intensity"] == pytest.approx(tif["mean_intensity"], rel=0.02)
    assert png["foreground_fraction"] == pytest.approx(tif["foreground_fraction"], rel=0.05)


def test_rgb_is_reduced_to_luminance(info: Info) -> None:
    gray = np.tile(np.linspace(0, 255, 64).astype(np.uint8), (48, 1))
    rgb = np.stack([gray, gray, gray], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(rgb, mode="RGB").save(buffer, format="PNG")
    from_rgb = microscopy.process(buffer.getvalue(), info)
    buffer = io.BytesIO()
    Image.fromarray(gray).save(buffer, format="PNG")
    from_gray = microscopy.process(buffer.getvalue(), info)
    assert from_rgb["mean_intensity"] == pytest.approx(from_gray["mean_intensity"], abs=1e-9)
    assert from_rgb["bit_depth"] == 8.0


def _two_page_tiff(first: np.ndarray, second: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(first).save(buffer, format="TIFF", save_all=True, append_images=[Image.fromarray(second)])
    return buffer.getvalue()


def test_multipage_tiff_first_page_or_mean(info: Info) -> None:
    data = _two_page_tiff(np.full((32, 32), 1000, np.uint16), np.full((32, 32), 3000, np.uint16))
    first = microscopy.process(data, info)
    mean = microscopy.process(data, with_attributes(pages="mean"))
    assert first["pages"] == 1.0 and first["mean_intensity"] == pytest.approx(1000 / 65535)
    assert mean["pages"] == 2.0 and mean["mean_intensity"] == pytest.approx(2000 / 65535)


def test_multipage_mean_refuses_pages_of_different_size() -> None:
    data = _two_page_tiff(np.zeros((32, 32), np.uint16), np.zeros((16, 16), np.uint16))
    with pytest.raises(ValueError, match="pages=mean needs identical pages"):
        microscopy.process(data, with_attributes(pages="mean"))


def test_constant_image_has_no_objects(info: Info) -> None:
    features = microscopy.process(_tiff(np.full((40, 50), 700, np.uint16)), info)
    assert features["object_count"] == 0.0 and features["foreground_fraction"] == 0.0
    assert features["entropy"] == 0.0 and features["focus_laplacian_var"] == 0.0
    assert features["width"] == 50.0 and features["height"] == 40.0


def test_deterministic(sample_images: list, info: Info) -> None:
    data = sample_images[0].read_bytes()
    assert microscopy.process(data, info) == microscopy.process(data, info)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not a decodable TIFF or PNG"),
        (b"\x00garbage" * 100, "not a decodable TIFF or PNG"),
    ],
)
def test_garbage_is_refused_clearly(data: bytes, message: str, info: Info) -> None:
    with pytest.raises(ValueError, match=message):
        microscopy.process(data, info)


def test_truncated_image_is_refused(info: Info) -> None:
    pixels, _ = _clean_image(cells=5, size=128)
    for data in (_tiff(pixels)[:3000], samples.encode_image(pixels, "png")[:2000]):
        with pytest.raises(ValueError, match="microscopy: "):
            microscopy.process(data, info)


def test_other_formats_are_refused(info: Info) -> None:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(buffer, format="JPEG")
    with pytest.raises(ValueError, match="TIFF or PNG"):
        microscopy.process(buffer.getvalue(), info)


def test_tiny_image_is_refused(info: Info) -> None:
    with pytest.raises(ValueError, match="at least 3x3"):
        microscopy.process(_tiff(np.zeros((2, 2), np.uint16)), info)


@pytest.mark.parametrize(
    "attributes, name",
    [
        ({"min_object_area": "ten"}, "min_object_area"),
        ({"min_object_area": "0"}, "min_object_area"),
        ({"focus_sigma": "nan"}, "focus_sigma"),
        ({"segment_sigma": "-1"}, "segment_sigma"),
        ({"pages": "all"}, "pages"),
    ],
)
def test_bad_parameters_are_named(attributes: dict, name: str) -> None:
    pixels, _ = _clean_image(cells=3, size=64)
    with pytest.raises(ValueError, match=f"attribute {name}="):
        microscopy.process(_tiff(pixels), Info(attributes=attributes))
