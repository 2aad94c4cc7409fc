"""Example "bring your own pipeline": spectral features of a 1-D signal.

A tuple is a little-endian float32 time series (say, one detector trace).
The engine imports this module once (``setup()`` runs then), and calls
``process(data, info)`` for every tuple routed to image "example/spectra";
the returned dict becomes the tuple's features in the repository, and
knowledge discovery clusters the ones named in ``KD_FEATURES``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

KD_FEATURES = ["peak_frequency", "spectral_centroid", "rms"]

_window_cache: dict[int, np.ndarray] = {}


def setup() -> None:
    """Runs once per engine, before the first tuple: load models, warm caches here."""
    _window_cache.clear()


def _window(n: int) -> np.ndarray:
    if n not in _window_cache:
        _window_cache[n] = np.hanning(n).astype(np.float32)
    return _window_cache[n]


def process(data: bytes, info: Any) -> dict[str, float | str | list[float]]:
    """Features of one trace; ``info.attributes["sample_rate"]`` in Hz (default 1)."""
    if len(data) % 4 or len(data) < 16:
        raise ValueError(f"tuple {info.tuple_id}: expected float32 samples, got {len(data)} bytes")
    signal = np.frombuffer(data, dtype="<f4").astype(np.float64)
    rate = float(info.attributes.get("sample_rate", "1"))
    spectrum = np.abs(np.fft.rfft((signal - signal.mean()) * _window(signal.size))) ** 2
    freqs = np.fft.rfftfreq(signal.size, d=1.0 / rate)
    total = float(spectrum.sum()) or 1.0
    return {
        "samples": float(signal.size),
        "rms": float(np.sqrt(np.mean(signal**2))),
        "peak_frequency": float(freqs[int(np.argmax(spectrum))]),
        "spectral_centroid": float((freqs * spectrum).sum() / total),
        "band_power": [float(p) for p in np.array_split(spectrum, 8) for p in [p.sum() / total]],
        "unit": "Hz",
    }
