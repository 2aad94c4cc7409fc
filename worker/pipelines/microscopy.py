"""Microscopy pipeline (image ``hio/microscopy``): intensity, focus and object features.

Input: one image per tuple, TIFF or PNG (other formats are refused, so the
decoder surface stays small). Accepted pixel modes: 8-bit and 16-bit
grayscale, 32-bit integer and float grayscale, bilevel, palette, RGB(A)/LA.
Colour is converted to luminance with the Rec. 601 weights (the same as
Pillow's ``L`` conversion), computed in floating point so no precision is lost.

Intensities are reported as a **fraction of the format's full scale** (8-bit
/255, 16-bit /65535, float as is), so an 8-bit PNG and a 16-bit TIFF of the same
scene give the same features and knowledge discovery does not cluster by file
format. ``bit_depth`` says what the file held.

Multi-page TIFF: by default the first page is analysed (``pages=first``); with
the tuple attribute ``pages=mean`` all pages (same size required, at most
:data:`MAX_PAGES`) are averaged first, e.g. for a z-stack or repeated exposures.

Features (all numbers unless noted):

* ``width``, ``height``, ``pages``, ``bit_depth``, ``format`` (str)
* intensity: ``mean_intensity``, ``std_intensity``, ``min_intensity``,
  ``max_intensity``, ``p01_intensity``, ``p50_intensity``, ``p99_intensity``,
  ``entropy`` (bits, of a 256-bin histogram over the image's own min..max, so
  it does not depend on how much of the full scale a camera uses; it does
  depend on bit depth, so it is not among the clustered features)
* focus, on the image smoothed with ``focus_sigma`` (default 2 px) so that shot
  noise does not pass for sharpness: ``focus_laplacian_var`` (variance of the
  Laplacian), ``focus_tenengrad`` (mean squared Sobel gradient magnitude) and
  ``focus_laplacian_norm`` (Laplacian variance / variance of the smoothed
  image: contrast-free, so a few dim sharp cells still rank above many bright
  blurred ones)
* objects: Otsu's threshold on the image smoothed with ``segment_sigma``
  (default 1 px), 8-connected components, those smaller than
  ``min_object_area`` pixels (default 20) dropped: ``object_count``,
  ``object_area_mean``, ``object_area_std``, ``object_area_median``,
  ``object_intensity_mean``, ``foreground_fraction`` (kept objects' pixels /
  all pixels), ``otsu_threshold``, ``otsu_effectiveness`` (between-class /
  total variance; low values mean the image is not bimodal and the objects
  are not trustworthy), and ``object_area_hist``: a list of object counts in
  the fixed log-spaced area bins :data:`AREA_BIN_EDGES` (pixels; the last bin
  is open-ended), identical for every image so histograms compare.

Tuple attributes (all optional): ``pages`` (first|mean), ``focus_sigma``,
``segment_sigma`` (0..20 px), ``min_object_area`` (1..10^6 px).
"""

from __future__ import annotations

import io
import logging
import math
import struct  # Pillow's TIFF parser raises struct.error on truncated tags
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageSequence, UnidentifiedImageError

from hio.worker.pipelines import imaging
from hio.worker.pipelines.params import attr_choice, attr_float, attr_int, attributes_of

log = logging.getLogger("hio.worker.pipelines.microscopy")

KD_FEATURES = [
    "mean_intensity",
    "std_intensity",
    "focus_laplacian_var",
    "focus_laplacian_norm",
    "object_count",
    "object_area_mean",
    "foreground_fraction",
]

FORMATS = ("TIFF", "PNG")
MAX_PIXELS = 1 << 26  # 64 Mpx per page: bounds memory (~0.5 GB of float64)
MIN_SIDE = 3  # the derivatives need a neighbourhood
MAX_PAGES = 1024
HIST_BINS = 256
AREA_BIN_EDGES: tuple[float, ...] = (0.0, *(float(2**k) for k in range(5, 17)), math.inf)
"""Object-area histogram edges in pixels: [0,32), [32,64), ..., [32768,65536), [65536,inf)."""

_LUMA = np.array([0.299, 0.587, 0.114])
_GRAY: dict[str, tuple[float, int]] = {  # grayscale mode -> (full scale, bits)
    "1": (1.0, 1),
    "L": (255.0, 8),
    **dict.fromkeys(("I;16", "I;16L", "I;16B", "I;16N"), (65535.0, 16)),
    "F": (1.0, 32),
}
_COLOUR_MODES = ("RGB", "RGBA", "RGBX", "P", "PA", "LA", "CMYK", "YCbCr", "LAB", "HSV")


@dataclass(frozen=True)
class Params:
    """Per-tuple settings, from the tuple attributes (see the module docstring)."""

    pages: str = "first"
    focus_sigma: float = 2.0
    segment_sigma: float = 1.0
    min_object_area: int = 20

    @classmethod
    def from_info(cls, info: Any) -> Params:
        attrs = attributes_of(info)
        return cls(
            pages=attr_choice(attrs, "pages", cls.pages, ("first", "mean")),
            focus_sigma=attr_float(attrs, "focus_sigma", cls.focus_sigma, 0.0, 20.0),
            segment_sigma=attr_float(attrs, "segment_sigma", cls.segment_sigma, 0.0, 20.0),
            min_object_area=attr_int(attrs, "min_object_area", cls.min_object_area, 1, 1_000_000),
        )


@dataclass(frozen=True)
class DecodedImage:
    """Grayscale pixels as a fraction of full scale, plus what the file held."""

    pixels: np.ndarray  # float64, 2-D
    bit_depth: int
    pages: int
    format: str


def _page_pixels(page: Image.Image) -> tuple[np.ndarray, float, int]:
    """(float pixels, full scale, bits) of one page, colour reduced to luminance."""
    mode = page.mode
    if mode in _GRAY:
        return np.asarray(page, dtype=np.float64), *_GRAY[mode]
    if mode == "I":
        pixels = np.asarray(page, dtype=np.float64)
        if pixels.size and (pixels.min() < 0 or pixels.max() > 65535):
            return pixels, float(2**31 - 1), 32
        return pixels, 65535.0, 16
    if mode in _COLOUR_MODES:
        rgb = np.asarray(page.convert("RGB"), dtype=np.float64)
        return rgb @ _LUMA, 255.0, 8
    raise ValueError(
        f"microscopy: unsupported pixel mode {mode!r} "
        f"(supported: 8/16-bit grayscale, 32-bit int/float grayscale, RGB(A), palette)"
    )


def _check_page_size(page: Image.Image) -> None:
    width, height = page.size
    if width < MIN_SIDE or height < MIN_SIDE:
        raise ValueError(f"microscopy: image is {width}x{height} pixels; at least {MIN_SIDE}x{MIN_SIDE} needed")
    if width * height > MAX_PIXELS:
        raise ValueError(f"microscopy: image is {width}x{height} pixels; at most {MAX_PIXELS} per page allowed")


def _read_pages(image: Image.Image, mode: str) -> tuple[np.ndarray, float, int, int]:
    """Pixels of the first page, or the mean of all pages: (pixels, scale, bits, pages)."""
    total: np.ndarray | None = None
    scale, bits, count = 1.0, 0, 0
    for page in ImageSequence.Iterator(image):
        _check_page_size(page)
        pixels, page_scale, page_bits = _page_pixels(page)
        if total is None:
            total, scale, bits = pixels, page_scale, page_bits
        elif pixels.shape != total.shape or page_scale != scale:
            raise ValueError(
                f"microscopy: page {count} is {pixels.shape[1]}x{pixels.shape[0]} "
                f"({page_bits}-bit), unlike page 0; pages=mean needs identical pages"
            )
        else:
            total = total + pixels
        count += 1
        if mode == "first":
            break
        if count > MAX_PAGES:
            raise ValueError(f"microscopy: more than {MAX_PAGES} pages; pages=mean refused")
    if total is None:
        raise ValueError("microscopy: image has no pages")
    return total / count, scale, bits, count


def decode_image(data: bytes, pages: str = "first") -> DecodedImage:
    """Decode a TIFF/PNG tuple to grayscale in [0, 1] of full scale, or raise ValueError."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            fmt = image.format or "?"
            pixels, scale, bits, count = _read_pages(image, pages)
    except (UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise ValueError(
            f"microscopy: tuple of {len(data)} bytes is not a decodable TIFF or PNG image ({type(exc).__name__}: {exc})"
        ) from None
    except (OSError, SyntaxError, EOFError, struct.error) as exc:
        raise ValueError(f"microscopy: damaged {len(data)}-byte image ({type(exc).__name__}: {exc})") from None
    if not np.all(np.isfinite(pixels)):
        raise ValueError("microscopy: image contains NaN or infinite pixel values")
    return DecodedImage(pixels=pixels / scale, bit_depth=bits, pages=count, format=fmt)


def histogram_entropy(pixels: np.ndarray, bins: int = HIST_BINS) -> float:
    """Shannon entropy (bits) of the histogram over the image's own value range."""
    lo, hi = float(pixels.min()), float(pixels.max())
    if hi <= lo:
        return 0.0
    counts, _ = np.histogram(pixels, bins=bins, range=(lo, hi))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def intensity_features(pixels: np.ndarray) -> dict[str, float]:
    """Global intensity statistics (fractions of full scale)."""
    p01, p50, p99 = np.percentile(pixels, [1.0, 50.0, 99.0])
    return {
        "mean_intensity": float(pixels.mean()),
        "std_intensity": float(pixels.std()),
        "min_intensity": float(pixels.min()),
        "max_intensity": float(pixels.max()),
        "p01_intensity": float(p01),
        "p50_intensity": float(p50),
        "p99_intensity": float(p99),
        "entropy": histogram_entropy(pixels),
    }


def focus_features(pixels: np.ndarray, sigma: float) -> dict[str, float]:
    """Variance of the Laplacian and Tenengrad: both drop when an image is defocused."""
    smooth = imaging.gaussian_blur(pixels, sigma)
    gy, gx = imaging.sobel(smooth)
    laplacian_var = float(imaging.laplacian(smooth).var())
    variance = float(smooth.var())
    return {
        "focus_laplacian_var": laplacian_var,
        "focus_tenengrad": float(np.mean(gx * gx + gy * gy)),
        "focus_laplacian_norm": laplacian_var / variance if variance > 0 else 0.0,
    }


def object_features(pixels: np.ndarray, sigma: float, min_area: int) -> dict[str, float | list[float]]:
    """Otsu segmentation, connected components, small-object removal, object statistics."""
    smooth = imaging.gaussian_blur(pixels, sigma)
    threshold, effectiveness = imaging.otsu_threshold(smooth)
    labels, count = imaging.label_components(smooth > threshold, connectivity=8)
    areas = np.bincount(labels.ravel(), minlength=count + 1)[1:]
    sums = np.bincount(labels.ravel(), weights=pixels.ravel(), minlength=count + 1)[1:]
    keep = areas >= min_area
    areas, sums = areas[keep].astype(np.float64), sums[keep]
    found = len(areas) > 0
    area_counts, _ = np.histogram(areas, bins=np.asarray(AREA_BIN_EDGES))
    return {
        "object_count": float(len(areas)),
        "object_area_mean": float(areas.mean()) if found else 0.0,
        "object_area_std": float(areas.std()) if found else 0.0,
        "object_area_median": float(np.median(areas)) if found else 0.0,
        "object_intensity_mean": float(sums.sum() / areas.sum()) if found else 0.0,
        "foreground_fraction": float(areas.sum() / pixels.size),
        "otsu_threshold": threshold,
        "otsu_effectiveness": effectiveness,
        "object_area_hist": [float(c) for c in area_counts],
    }


def analyse(image: DecodedImage, params: Params) -> dict[str, float | str | list[float]]:
    pixels = image.pixels
    return {
        "width": float(pixels.shape[1]),
        "height": float(pixels.shape[0]),
        "pages": float(image.pages),
        "bit_depth": float(image.bit_depth),
        "format": image.format,
        **intensity_features(pixels),
        **focus_features(pixels, params.focus_sigma),
        **object_features(pixels, params.segment_sigma, params.min_object_area),
    }


def process(data: bytes, info: Any) -> dict[str, float | str | list[float]]:
    """Pipeline entry point: features of one TIFF/PNG image tuple."""
    params = Params.from_info(info)
    features = analyse(decode_image(data, params.pages), params)
    log.debug(
        "analysed image", extra={"tuple_id": getattr(info, "tuple_id", None), "objects": features["object_count"]}
    )
    return features
