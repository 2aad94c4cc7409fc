"""Small image-analysis kernels in numpy: blur, derivatives, Otsu, connected components.

They live here, not in scipy, because engines install only the core
dependencies (numpy, pillow); :func:`label_components` uses
``scipy.ndimage.label`` when scipy happens to be installed (it is faster on
pathological masks) and an exact run-length union-find otherwise. Both give
the same labels in the same raster order.
"""

from __future__ import annotations

import math

import numpy as np

try:  # optional accelerator; the numpy path below is exact too
    from scipy import ndimage as _ndimage
except ImportError:  # pragma: no cover - exercised where scipy is absent
    _ndimage = None


def gaussian_kernel(sigma: float) -> np.ndarray:
    """Normalised 1-D Gaussian taps out to 3 sigma (at least one tap each side)."""
    radius = max(1, math.ceil(3.0 * sigma))
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    taps = np.exp(-0.5 * (x / sigma) ** 2)
    return taps / taps.sum()


def _convolve_axis(image: np.ndarray, taps: np.ndarray, axis: int) -> np.ndarray:
    """Correlate along ``axis`` with ``taps`` (symmetric edges) as a sum of shifted slices.

    Slicing along the axis (rather than transposing) keeps memory access
    contiguous, which is what makes this fast enough on megapixel images.
    """
    radius = len(taps) // 2
    pad = [(0, 0), (0, 0)]
    pad[axis] = (radius, radius)
    padded = np.pad(image, pad, mode="symmetric")
    length = image.shape[axis]
    out = np.zeros(image.shape, dtype=np.float64)
    for k, weight in enumerate(taps):
        out += weight * (padded[k : k + length] if axis == 0 else padded[:, k : k + length])
    return out


def gaussian_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of a 2-D image; ``sigma <= 0`` returns a float copy."""
    image = np.asarray(image, dtype=np.float64)
    if sigma <= 0:
        return image.copy()
    taps = gaussian_kernel(sigma)
    return _convolve_axis(_convolve_axis(image, taps, 0), taps, 1)


def fft_gaussian_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur through the FFT, with periodic borders: fast for large sigma.

    For content that fades to zero well inside the border (as rendered cells
    do), the wrap-around is immaterial.
    """
    image = np.asarray(image, dtype=np.float64)
    if sigma <= 0:
        return image.copy()
    fy = np.fft.fftfreq(image.shape[0])[:, None]
    fx = np.fft.rfftfreq(image.shape[1])[None, :]
    transfer = np.exp(-2.0 * (math.pi * sigma) ** 2 * (fy**2 + fx**2))
    return np.fft.irfft2(np.fft.rfft2(image) * transfer, s=image.shape)


def laplacian(image: np.ndarray) -> np.ndarray:
    """4-neighbour discrete Laplacian with symmetric (edge-repeating) borders."""
    p = np.pad(np.asarray(image, dtype=np.float64), 1, mode="symmetric")
    return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4.0 * p[1:-1, 1:-1]


def sobel(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sobel derivatives (gy, gx) with symmetric borders."""
    p = np.pad(np.asarray(image, dtype=np.float64), 1, mode="symmetric")
    gx = (p[:-2, 2:] + 2.0 * p[1:-1, 2:] + p[2:, 2:]) - (p[:-2, :-2] + 2.0 * p[1:-1, :-2] + p[2:, :-2])
    gy = (p[2:, :-2] + 2.0 * p[2:, 1:-1] + p[2:, 2:]) - (p[:-2, :-2] + 2.0 * p[:-2, 1:-1] + p[:-2, 2:])
    return gy, gx


def otsu_threshold(image: np.ndarray, bins: int = 256) -> tuple[float, float]:
    """Otsu's threshold and its effectiveness (between-class / total variance, 0..1).

    Foreground is ``image > threshold``. A constant image has no threshold: it
    returns ``(max, 0.0)`` so that nothing is foreground.
    """
    lo, hi = float(image.min()), float(image.max())
    if hi <= lo:
        return hi, 0.0
    hist, edges = np.histogram(image, bins=bins, range=(lo, hi))
    hist = hist.astype(np.float64)
    centers = 0.5 * (edges[:-1] + edges[1:])
    total = hist.sum()
    w0 = np.cumsum(hist)
    w1 = total - w0
    s0 = np.cumsum(hist * centers)
    s1 = s0[-1] - s0
    valid = (w0 > 0) & (w1 > 0)
    between = np.zeros_like(hist)
    between[valid] = w0[valid] * w1[valid] * (s0[valid] / w0[valid] - s1[valid] / w1[valid]) ** 2
    k = int(np.argmax(between))
    variance = float(np.var(image))
    effectiveness = float(between[k] / total**2 / variance) if variance > 0 else 0.0
    return float(centers[k]), min(1.0, effectiveness)


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Horizontal runs of True in raster order: (row, start, end-exclusive)."""
    padded = np.pad(mask.astype(np.int8), ((0, 0), (1, 1)))
    step = np.diff(padded, axis=1)
    rows, starts = np.nonzero(step == 1)
    _, ends = np.nonzero(step == -1)
    return rows, starts, ends


def _touching_pairs(
    rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, width: int, connectivity: int
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (a, b) of runs on consecutive rows that touch (a above b).

    Runs are sorted by (row, column), so the runs of the row above that touch
    run b form one contiguous index range found with two binary searches.
    """
    stride = width + 2
    slack = 1 if connectivity == 8 else 0
    end_keys = rows * stride + ends
    start_keys = rows * stride + starts
    above = (rows - 1) * stride
    lo = np.searchsorted(end_keys, above + starts + (1 - slack), side="left")
    hi = np.searchsorted(start_keys, above + ends - (1 - slack), side="right")
    counts = np.clip(hi - lo, 0, None)
    total = int(counts.sum())
    b = np.repeat(np.arange(len(rows)), counts)
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    a = np.repeat(lo, counts) + offsets
    return a, b


def _union_find_roots(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Root (smallest member) of every node's set after joining each pair."""
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        rx, ry = find(x), find(y)
        if rx != ry:
            parent[max(rx, ry)] = min(rx, ry)
    return np.fromiter((find(i) for i in range(n)), dtype=np.int64, count=n)


def _label_runs(mask: np.ndarray, connectivity: int) -> tuple[np.ndarray, int]:
    """Exact labelling without scipy: run-length encoding + union-find over runs."""
    labels = np.zeros(mask.shape, dtype=np.int32)
    rows, starts, ends = _runs(mask)
    if len(rows) == 0:
        return labels, 0
    a, b = _touching_pairs(rows, starts, ends, mask.shape[1], connectivity)
    roots = _union_find_roots(len(rows), a, b)
    unique_roots, run_label = np.unique(roots, return_inverse=True)
    labels[mask] = np.repeat(run_label.astype(np.int32) + 1, ends - starts)
    return labels, len(unique_roots)


def label_components(mask: np.ndarray, connectivity: int = 8) -> tuple[np.ndarray, int]:
    """Label the connected True regions 1..n in raster order of their first pixel."""
    if connectivity not in (4, 8):
        raise ValueError(f"connectivity must be 4 or 8, not {connectivity}")
    mask = np.asarray(mask, dtype=bool)
    if _ndimage is not None:
        structure = np.ones((3, 3), dtype=bool) if connectivity == 8 else None
        labels, count = _ndimage.label(mask, structure=structure)
        return labels.astype(np.int32, copy=False), int(count)
    return _label_runs(mask, connectivity)
