"""The simulation pipeline: known signals, real Brusselator realizations, hostile input."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

from hio.worker.pipelines import samples, simulation
from tests.pipelines.conftest import Info, with_attributes


def _npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _sine(
    period: float, *, dt: float = 0.05, span: float = 200.0, trend: float = 0.0, noise: float = 0.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, span, dt)
    x = 100.0 + 20.0 * np.sin(2 * math.pi * t / period + 0.3) + trend * t + rng.normal(0, noise, t.size)
    return t, x


@pytest.mark.parametrize("period, trend, noise", [(7.3, 0.0, 0.0), (7.3, 0.5, 5.0), (23.0, -0.2, 2.0), (1.1, 0.0, 1.0)])
def test_period_of_sine_is_recovered(period: float, trend: float, noise: float, info: Info) -> None:
    t, x = _sine(period, trend=trend, noise=noise)
    features = simulation.process(_npz(t=t, x=x[None, :]), info)
    assert features["A_period"] == pytest.approx(period, rel=0.01)


def test_period_with_uneven_sampling(info: Info) -> None:
    rng = np.random.default_rng(1)
    t = np.sort(rng.uniform(0, 150, 3000))
    x = 50 + 10 * np.sin(2 * math.pi * t / 5.0)
    assert simulation.process(_npz(t=t, x=x), info)["A_period"] == pytest.approx(5.0, rel=0.02)


def test_no_clear_peak_gives_zero_period(info: Info) -> None:
    rng = np.random.default_rng(2)
    white = rng.normal(0, 1, 4000)
    walk = np.cumsum(rng.normal(0, 1, 4000))
    slow = 10 * np.sin(2 * math.pi * np.arange(4000) / 3000.0)  # 1.3 cycles: a trend, not a period
    features = simulation.process(_npz(x=np.stack([white, walk, slow])), info)
    assert features["A_period"] == 0.0
    assert features["B_period"] == 0.0
    assert features["C_period"] == 0.0


def test_autocorrelation_sane(info: Info) -> None:
    rng = np.random.default_rng(3)
    noise = rng.normal(0, 1, 20000)
    ar = np.zeros_like(noise)
    for i in range(1, noise.size):
        ar[i] = 0.8 * ar[i - 1] + noise[i]
    smooth = np.sin(np.arange(20000) * 0.01)
    features = simulation.process(_npz(x=np.stack([noise, ar, smooth])), info)
    assert abs(features["A_autocorr1"]) < 0.03
    assert features["B_autocorr1"] == pytest.approx(0.8, abs=0.02)
    assert features["C_autocorr1"] > 0.99


def test_statistics_and_constant_series(info: Info) -> None:
    x = np.stack([np.tile([1.0, 3.0], 50), np.full(100, 7.0), np.zeros(100)])
    features = simulation.process(_npz(x=x, species=np.array(["u", "v", "w"])), info)
    assert features["u_mean"] == 2.0 and features["u_var"] == 1.0 and features["u_cv"] == 0.5
    assert features["u_autocorr1"] == pytest.approx(-0.99)
    assert features["v_var"] == 0.0 and features["v_autocorr1"] == 0.0 and features["v_period"] == 0.0
    assert features["w_cv"] == 0.0
    assert features["species_count"] == 3.0 and features["timepoints"] == 100.0 and features["t_span"] == 99.0


def test_voxels_are_summed(info: Info) -> None:
    rng = np.random.default_rng(4)
    t = np.linspace(0, 50, 500)
    per_voxel = rng.poisson(20, size=(2, 8, 500))
    summed = simulation.process(_npz(t=t, x=per_voxel), info)
    direct = simulation.process(_npz(t=t, x=per_voxel.sum(axis=1)), info)
    assert summed.pop("voxels") == 8.0 and direct.pop("voxels") == 1.0
    assert summed == direct


def test_plain_npy_is_accepted(info: Info) -> None:
    _, x = _sine(10.0, dt=1.0, span=400.0)
    features = simulation.process(_npy(np.stack([x, 2 * x])), info)
    assert features["A_period"] == pytest.approx(10.0, rel=0.01)
    assert features["B_mean"] == pytest.approx(2 * features["A_mean"])
    assert features["t_span"] == 399.0


@pytest.fixture(scope="module")
def realizations(tmp_path_factory: pytest.TempPathFactory) -> list:
    size = samples.SimulationSize(voxels=8, timepoints=3000)
    return samples.generate_simulation(tmp_path_factory.mktemp("sim"), count=6, seed=5, size=size)


def test_brusselator_samples_give_finite_features(realizations: list, info: Info) -> None:
    by_regime: dict[str, list[dict]] = {}
    for path in realizations:
        features = simulation.process(path.read_bytes(), info)
        assert set(simulation.KD_FEATURES) <= set(features)
        assert all(math.isfinite(v) for v in features.values())
        assert features["voxels"] == 8.0 and features["timepoints"] == 3000.0
        by_regime.setdefault(path.stem.split("_")[-1], []).append(features)
    oscillating, steady = by_regime["oscillating"], by_regime["steady"]
    assert all(f["A_period"] > 0 for f in oscillating + by_regime["fast"])
    assert min(f["A_var"] for f in oscillating) > 5 * max(f["A_var"] for f in steady)


def test_pickled_object_arrays_are_refused(info: Info) -> None:
    objects = np.array([{"evil": 1}, None], dtype=object)
    with pytest.raises(ValueError, match="pickled data is refused"):
        simulation.process(_npz(x=objects), info)
    with pytest.raises(ValueError, match="pickled data is refused"):
        simulation.process(_npz(x=np.ones((2, 10)), species=objects), info)
    with pytest.raises(ValueError, match="pickled data is refused"):
        simulation.process(_npy(objects), info)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "neither .npz nor .npy"),
        (b"hello world, not numpy", "neither .npz nor .npy"),
        (b"PK\x03\x04" + b"\x00" * 60, "damaged"),
        (_npy(np.ones((2, 50)))[:90], "damaged"),
        (_npz(y=np.ones(10)), "no array 'x'"),
        (_npz(x=np.ones((2, 3, 4, 5))), "expected \\(T,\\)"),
        (_npz(x=np.ones((2, 5))), "at least 8 needed"),
        (_npz(x=np.ones((2, 20)) * 1j), "real numeric"),
        (_npz(x=np.array([[np.nan] * 20])), "NaN"),
        (_npz(x=np.ones((1, 20)), t=np.arange(19)), "'t' must be"),
        (_npz(x=np.ones((1, 20)), t=np.r_[np.arange(10), np.arange(10)]), "strictly increasing"),
        (_npz(x=np.ones((2, 20)), species=np.array(["A", "A"])), "not unique"),
        (_npz(x=np.ones((1, 20)), species=np.array(["bad name!"])), "invalid species name"),
    ],
)
def test_bad_input_is_refused_clearly(data: bytes, message: str, info: Info) -> None:
    with pytest.raises(ValueError, match=message):
        simulation.process(data, info)


def test_truncated_sample_is_refused(realizations: list, info: Info) -> None:
    data = realizations[0].read_bytes()
    with pytest.raises(ValueError, match="simulation: "):
        simulation.process(data[: len(data) // 2], info)


def test_parameters_are_checked_and_used() -> None:
    t, x = _sine(7.3, noise=20.0)
    data = _npz(t=t, x=x)
    assert simulation.process(data, with_attributes(min_peak_power="0.99"))["A_period"] == 0.0
    with pytest.raises(ValueError, match="attribute min_cycles="):
        simulation.process(data, with_attributes(min_cycles="0"))


def test_a_periodic_signal_in_noise_is_significant_against_red_noise_and_red_noise_is_not() -> None:
    t, x = _sine(7.3, noise=30.0)
    rng = np.random.default_rng(3)
    red = np.zeros(4000)
    for i in range(1, red.size):  # AR(1): the null the surrogates are drawn from
        red[i] = 0.95 * red[i - 1] + rng.normal()
    info = with_attributes(period_surrogates="200", min_peak_power="0")
    periodic = simulation.process(_npz(t=t, x=x), info)
    noise = simulation.process(_npz(x=red), info)
    assert periodic["A_period"] == pytest.approx(7.3, rel=0.01)
    assert periodic["A_period_p"] == pytest.approx(1 / 201)  # no surrogate reaches its peak
    assert noise["A_period_p"] > 0.05
    assert simulation.process(_npz(x=red), info) == noise  # surrogates seeded by the series: reproducible


def test_red_noise_surrogates_have_the_fitted_autocorrelation_and_variance() -> None:
    rng = np.random.default_rng(4)
    series = np.zeros(4000)
    for i in range(1, series.size):
        series[i] = 0.8 * series[i - 1] + rng.normal()
    surrogates = simulation.red_noise(series - series.mean(), 300, np.random.default_rng(5))
    assert surrogates.shape == (300, 4000)
    lag1 = np.mean([simulation.autocorrelation(row, 1) for row in surrogates])
    assert lag1 == pytest.approx(simulation.autocorrelation(series, 1), abs=0.02)
    assert surrogates.var(axis=1).mean() == pytest.approx(series.var(), rel=0.1)


def test_the_period_p_value_is_computed_only_when_asked_and_its_count_is_bounded(info: Info) -> None:
    t, x = _sine(7.3)
    data = _npz(t=t, x=x)
    assert "A_period_p" not in simulation.process(data, info)
    for bad in ("-1", "10001", "1.5"):
        with pytest.raises(ValueError, match="attribute period_surrogates="):
            simulation.process(data, with_attributes(period_surrogates=bad))
