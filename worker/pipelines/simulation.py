"""Simulation pipeline (image ``hio/simulation``): time-series features of one realization.

A tuple is one realization of a stochastic (reaction-diffusion) model, stored
with numpy's own formats and always loaded with ``allow_pickle=False`` (an
array of Python objects is refused, never unpickled):

* ``.npz`` (``numpy.savez`` or ``savez_compressed``) with
    - ``x``: copy numbers, shape ``(S, T)`` (species x time) or ``(S, V, T)``
      (species x voxels x time; voxels are summed to the whole-domain count),
      or ``(T,)`` for a single species; integer or float.
    - ``t``: ``(T,)`` strictly increasing sample times. Optional: without it
      the samples are taken as 0, 1, 2, ... time units.
    - ``species``: optional ``(S,)`` string array of names (letters, digits,
      ``_ . -``; at most 64 characters). Default names: A, B, C, ... Z, S26, ...
* ``.npy``: a plain ``(S, T)`` (or ``(T,)``) array, unit time step.

Features per species ``N`` (the name): ``N_mean``, ``N_var`` (population
variance), ``N_cv`` (std / |mean|, 0 for a zero mean), ``N_autocorr1`` (lag-1
autocorrelation, 0 for a constant series) and ``N_period``: the dominant period,
in the time units of ``t``, from the Hann-windowed periodogram of the linearly
detrended series (resampled to a uniform grid when ``t`` is not uniform),
refined by parabolic interpolation of the log power. It is 0 when there is no
clear peak: the peak must lie at ``min_cycles`` or more cycles per series
(default 3; slower "peaks" are trends or red noise) and hold at least
``min_peak_power`` (default 0.15) of the detrended series' spectral power in
its three bins. Plus ``species_count``, ``timepoints``, ``voxels``, ``t_span``.

With ``period_surrogates`` = N > 0, each species also gets ``N_period_p``: how
likely red noise is to make a peak as strong. The detrended series is fitted
with an AR(1) process (its lag-1 autocorrelation and variance), N realizations
of that process are drawn, and ``N_period_p`` = (1 + the number whose strongest
peak, at ``min_cycles`` or more cycles, holds at least the series' peak share)
/ (N + 1): the Monte Carlo p-value of the peak against red noise, the usual
test of a spectral peak in a noisy time series. Its cost grows with N (about a
tenth of a second of CPU per 100 surrogates of an 8000-sample series), and it
is reproducible: the surrogates are drawn from a generator seeded by the series.

Tuple attributes (optional): ``min_cycles`` (1..1000), ``min_peak_power`` (0..1),
``period_surrogates`` (0..10000, default 0).
"""

from __future__ import annotations

import io
import logging
import math
import re
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from hio.worker.pipelines.params import attr_float, attr_int, attributes_of

log = logging.getLogger("hio.worker.pipelines.simulation")

DEFAULT_SPECIES = ("A", "B")
KD_FEATURES = [f"{s}_{f}" for s in DEFAULT_SPECIES for f in ("mean", "var", "autocorr1", "period")]
"""Clustered features: the first two species under their default names A and B
(the shipped sample data names its two Brusselator species so)."""

MAX_SPECIES = 256
MAX_SURROGATES = 10_000
MIN_TIMEPOINTS = 8
MAX_UNPACKED_BYTES = 1 << 30  # a compressed .npz may not expand past this
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class Params:
    """Period-detection settings, from the tuple attributes."""

    min_cycles: float = 3.0
    min_peak_power: float = 0.15
    period_surrogates: int = 0

    @classmethod
    def from_info(cls, info: Any) -> Params:
        attrs = attributes_of(info)
        return cls(
            min_cycles=attr_float(attrs, "min_cycles", cls.min_cycles, 1.0, 1000.0),
            min_peak_power=attr_float(attrs, "min_peak_power", cls.min_peak_power, 0.0, 1.0),
            period_surrogates=attr_int(attrs, "period_surrogates", cls.period_surrogates, 0, MAX_SURROGATES),
        )


@dataclass(frozen=True)
class Realization:
    """One decoded realization: whole-domain counts per species over time."""

    t: np.ndarray  # (T,) float64, strictly increasing
    x: np.ndarray  # (S, T) float64
    species: tuple[str, ...]
    voxels: int


def _load_npz(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of an .npz tuple, refusing pickles and oversized expansion."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        unpacked = sum(item.file_size for item in archive.infolist())
    if unpacked > MAX_UNPACKED_BYTES:
        raise ValueError(f"simulation: .npz expands to {unpacked} bytes; at most {MAX_UNPACKED_BYTES} allowed")
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {key: _load_member(npz, key) for key in ("t", "x", "species") if key in npz.files}
    if "x" not in arrays:
        raise ValueError("simulation: .npz has no array 'x' (species x [voxels x] time)")
    return arrays


def _load_member(npz: Any, key: str) -> np.ndarray:
    try:
        return npz[key]
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise ValueError(f"simulation: array {key!r} holds Python objects; pickled data is refused") from None
        raise ValueError(f"simulation: array {key!r} is unreadable ({exc})") from None


def _load_arrays(data: bytes) -> dict[str, np.ndarray]:
    """Arrays of an .npz or .npy tuple; every decode failure becomes a ValueError."""
    head = bytes(data[:8])
    try:
        if head.startswith(_ZIP_MAGIC):
            return _load_npz(data)
        if head.startswith(_NPY_MAGIC):
            return {"x": np.load(io.BytesIO(data), allow_pickle=False)}
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise ValueError("simulation: .npy array holds Python objects; pickled data is refused") from None
        if str(exc).startswith("simulation:"):
            raise
        raise ValueError(f"simulation: damaged numpy data ({exc})") from None
    except (zipfile.BadZipFile, OSError, EOFError, KeyError) as exc:
        raise ValueError(f"simulation: damaged .npz/.npy tuple ({type(exc).__name__}: {exc})") from None
    raise ValueError(f"simulation: tuple of {len(data)} bytes is neither .npz nor .npy (starts with {head[:8]!r})")


def _counts(x: np.ndarray) -> tuple[np.ndarray, int]:
    """(S, T) float counts from a (T,), (S, T) or (S, V, T) array, and the voxel count."""
    if x.dtype.kind not in "biuf":
        raise ValueError(f"simulation: 'x' has dtype {x.dtype}; a real numeric array is needed")
    if x.ndim not in (1, 2, 3):
        raise ValueError(f"simulation: 'x' has shape {x.shape}; expected (T,), (S, T) or (S, V, T)")
    voxels = x.shape[1] if x.ndim == 3 else 1
    x = x.sum(axis=1, dtype=np.float64) if x.ndim == 3 else np.atleast_2d(x)  # to (S, T)
    if not 1 <= x.shape[0] <= MAX_SPECIES:
        raise ValueError(f"simulation: 'x' has {x.shape[0]} species; 1..{MAX_SPECIES} allowed")
    if x.shape[1] < MIN_TIMEPOINTS:
        raise ValueError(f"simulation: 'x' has {x.shape[1]} time points; at least {MIN_TIMEPOINTS} needed")
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("simulation: 'x' contains NaN or infinite values")
    return x, voxels


def _times(t: np.ndarray | None, count: int) -> np.ndarray:
    """Checked sample times, or 0..count-1 when absent."""
    if t is None:
        return np.arange(count, dtype=np.float64)
    if t.dtype.kind not in "iuf" or t.ndim != 1 or t.shape[0] != count:
        raise ValueError(f"simulation: 't' must be a numeric ({count},) array, not {t.dtype} {t.shape}")
    t = t.astype(np.float64)
    if not np.all(np.isfinite(t)) or not np.all(np.diff(t) > 0):
        raise ValueError("simulation: 't' must be finite and strictly increasing")
    return t


def _species(names: np.ndarray | None, count: int) -> tuple[str, ...]:
    """Checked species names, or the defaults: A, B, ..., Z, then S26, S27, ..."""
    if names is None:
        return tuple(chr(ord("A") + i) if i < 26 else f"S{i}" for i in range(count))
    if names.dtype.kind not in "US" or names.ndim != 1 or names.shape[0] != count:
        raise ValueError(f"simulation: 'species' must be a ({count},) string array, not {names.dtype} {names.shape}")
    result = tuple(n.decode("ascii", "replace") if isinstance(n, bytes) else str(n) for n in names.tolist())
    if bad := [n for n in result if not _NAME.match(n)]:
        raise ValueError(f"simulation: invalid species name {bad[0]!r} (letters, digits, _ . -; 1..64 chars)")
    if len(set(result)) != len(result):
        raise ValueError("simulation: species names are not unique")
    return result


def decode_realization(data: bytes) -> Realization:
    """Decode an .npz/.npy tuple (see the module docstring) or raise ValueError."""
    arrays = _load_arrays(data)
    x, voxels = _counts(arrays["x"])
    t = _times(arrays.get("t"), x.shape[1])
    species = _species(arrays.get("species"), x.shape[0])
    return Realization(t=t, x=x, species=species, voxels=voxels)


def autocorrelation(series: np.ndarray, lag: int = 1) -> float:
    """Sample autocorrelation at ``lag`` (0 for a constant series)."""
    centred = series - series.mean()
    denominator = float(np.dot(centred, centred))
    if denominator <= 0 or lag >= len(series):
        return 0.0
    return float(np.dot(centred[:-lag], centred[lag:]) / denominator)


def _uniform(t: np.ndarray, series: np.ndarray) -> tuple[np.ndarray, float]:
    """The series on a uniform grid of the same length, and its step."""
    step = (t[-1] - t[0]) / (len(t) - 1)
    if np.allclose(np.diff(t), step, rtol=1e-6, atol=0.0):
        return series, float(step)
    grid = np.linspace(t[0], t[-1], len(t))
    return np.interp(grid, t, series), float(step)


def _detrend(series: np.ndarray) -> np.ndarray:
    """The series minus its least-squares straight line."""
    k = np.arange(len(series), dtype=np.float64)
    k -= k.mean()
    centred = series - series.mean()
    denominator = float(np.dot(k, k))
    slope = float(np.dot(k, centred)) / denominator if denominator > 0 else 0.0
    return centred - slope * k


def _refine_peak(power: np.ndarray, k: int) -> float:
    """Sub-bin peak position from a parabola through the log power of bins k-1, k, k+1."""
    if k <= 0 or k >= len(power) - 1:
        return float(k)
    a, b, c = np.log(power[k - 1 : k + 2] + 1e-300)
    curvature = a - 2.0 * b + c
    if curvature >= 0:
        return float(k)
    return k + 0.5 * float(a - c) / float(curvature)


def _power(detrended: np.ndarray) -> np.ndarray:
    """Hann-windowed periodogram of each row (the last axis is time)."""
    n = detrended.shape[-1]
    return np.abs(np.fft.rfft(detrended * np.hanning(n), axis=-1)) ** 2


def _peak_shares(power: np.ndarray, min_cycles: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row of periodograms: the strongest bin at ``min_cycles`` or more cycles, and the
    share of the row's power (bin 0 left out) its three bins hold."""
    first = max(1, math.ceil(min_cycles))
    if power.shape[-1] <= first:
        return np.zeros(power.shape[:-1], dtype=np.int64), np.zeros(power.shape[:-1])
    k = np.argmax(power[..., first:], axis=-1) + first
    padded = np.pad(power, [(0, 0)] * (power.ndim - 1) + [(1, 1)])
    padded[..., 1] = 0.0  # bin 0 (the mean) is no one's neighbour
    around = np.take_along_axis(padded, k[..., None] + np.arange(3), axis=-1).sum(axis=-1)
    total = power[..., 1:].sum(axis=-1)
    return k, np.where(total > 0, around / np.where(total > 0, total, 1.0), 0.0)


def dominant_period(t: np.ndarray, series: np.ndarray, params: Params = Params()) -> float:
    """The dominant period in units of ``t``, or 0 when the spectrum has no clear peak."""
    values, step = _uniform(t, series)
    power = _power(_detrend(values))
    if float(power[1:].sum()) <= 0 or len(power) < 3:
        return 0.0
    k = int(np.argmax(power[1:])) + 1
    share = float(power[max(1, k - 1) : k + 2].sum() / power[1:].sum())
    if k < params.min_cycles or share < params.min_peak_power:
        return 0.0
    return len(values) * step / _refine_peak(power, k)


def red_noise(detrended: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` realizations (rows) of the AR(1) process fitted to a detrended series:
    y[0] drawn from its stationary law, y[i] = phi y[i-1] + e[i], by one FFT convolution of
    the innovations with phi**k (exact over the series' length: no burn-in to cut)."""
    n = len(detrended)
    phi = min(max(autocorrelation(detrended, 1), 0.0), 0.9999)
    variance = float(detrended.var())
    innovations = rng.standard_normal((count, n)) * math.sqrt(variance * (1.0 - phi * phi))
    innovations[:, 0] = rng.standard_normal(count) * math.sqrt(variance)
    size = 1 << (2 * n - 1).bit_length()
    impulse = phi ** np.arange(n, dtype=np.float64)
    spectrum = np.fft.rfft(innovations, size, axis=-1) * np.fft.rfft(impulse, size)
    return np.fft.irfft(spectrum, size, axis=-1)[:, :n]


def period_p_value(t: np.ndarray, series: np.ndarray, params: Params) -> float:
    """The red-noise p-value of the series' strongest peak (see the module docstring)."""
    detrended = _detrend(_uniform(t, series)[0])
    _k, observed = _peak_shares(_power(detrended), params.min_cycles)
    if float(observed) <= 0.0:
        return 1.0
    rng = np.random.default_rng(zlib.crc32(detrended.tobytes()))
    surrogates = red_noise(detrended, params.period_surrogates, rng)
    surrogates -= surrogates.mean(axis=-1, keepdims=True)
    _k, shares = _peak_shares(_power(surrogates), params.min_cycles)
    return float((1 + np.count_nonzero(shares >= observed)) / (params.period_surrogates + 1))


def series_features(name: str, t: np.ndarray, series: np.ndarray, params: Params) -> dict[str, float]:
    """Mean, variance, CV, lag-1 autocorrelation and dominant period of one species (and the
    period's red-noise p-value, with ``period_surrogates``)."""
    mean = float(series.mean())
    variance = float(series.var())
    features = {
        f"{name}_mean": mean,
        f"{name}_var": variance,
        f"{name}_cv": math.sqrt(variance) / abs(mean) if mean != 0 else 0.0,
        f"{name}_autocorr1": autocorrelation(series, 1),
        f"{name}_period": dominant_period(t, series, params),
    }
    if params.period_surrogates:
        features[f"{name}_period_p"] = period_p_value(t, series, params)
    return features


def analyse(realization: Realization, params: Params) -> dict[str, float | str | list[float]]:
    t = realization.t
    features: dict[str, float | str | list[float]] = {
        "species_count": float(len(realization.species)),
        "timepoints": float(len(t)),
        "voxels": float(realization.voxels),
        "t_span": float(t[-1] - t[0]),
    }
    for name, series in zip(realization.species, realization.x, strict=True):
        features.update(series_features(name, t, series, params))
    return features


def process(data: bytes, info: Any) -> dict[str, float | str | list[float]]:
    """Pipeline entry point: features of one .npz/.npy realization tuple."""
    params = Params.from_info(info)
    features = analyse(decode_realization(data), params)
    log.debug(
        "analysed realization",
        extra={"tuple_id": getattr(info, "tuple_id", None), "species": features["species_count"]},
    )
    return features
