"""The sample dataset: real, deterministic microscopy images and simulation realizations.

Nothing is downloaded: everything is generated from a seed, so a demo, a
benchmark and a test see the same bytes on every machine (same seed, same
numpy, same Pillow -> same files).

Microscopy (:func:`generate_microscopy`): fluorescence-like images of cells.
A scene is a slightly uneven background plus non-overlapping elliptic cells
(soft edges, brighter interior), optionally defocused by a Gaussian blur,
then photon shot noise (Poisson), camera gain, offset and read noise. Three
populations, visibly distinct, cycle with the index so every population is
present in any set of three or more images:

* ``sparse``: few large, dim cells, in focus;
* ``dense``: many small, bright cells, in focus;
* ``defocused``: a medium number of medium cells, blurred.

Three of four images are 16-bit TIFF; every fourth is an 8-bit PNG of the
same kind of scene (the 16-bit values scaled by 1/257, so the pipeline's
full-scale-normalised features agree between formats).

Simulation (:func:`generate_simulation`): realizations of the Brusselator
(``0 -> X``, ``X -> 0``, ``2X + Y -> 3X``, ``X -> Y``; rates a, 1, 1/omega^2, b)
on a ring of voxels with diffusive jumps between neighbours, simulated by
tau-leaping (Poisson firings of all reaction and jump channels per leap,
clamped to the molecules present, so counts never go negative).
Three parameter regimes cycle with the index: ``oscillating`` (a=1, b>2: a
limit cycle), ``steady`` (a=1, b<2: fluctuations about a stable focus) and
``fast`` (a=2, b>5: a faster cycle). Each file is an ``.npz`` in the format the
simulation pipeline reads: ``t`` (T,), ``x`` (2, V, T) int32, ``species``
``["A", "B"]`` (A is the activator X, B the inhibitor Y), plus ``params``
(a, b, d, omega) and ``regime``. Realizations are simulated in groups of
:data:`SIM_GROUP` sharing one random stream, so a smaller count yields a prefix
of a larger one with the same seed.

Generated folders carry a ``manifest.json``; when it matches the request and
all files are there with their recorded sizes, nothing is regenerated.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from hio.storage.files import atomic_write
from hio.worker.pipelines import imaging

log = logging.getLogger("hio.worker.pipelines.samples")

MANIFEST = "manifest.json"
FORMAT_VERSION = 1  # bump when generation changes, to invalidate caches
MICROSCOPY_IMAGE = "hio/microscopy"
SIMULATION_IMAGE = "hio/simulation"
DEMO_IMAGES = 24
DEMO_REALIZATIONS = 12
SIM_GROUP = 12

# Camera model: ADU = OFFSET + GAIN * photons + read noise, clipped to 16 bits.
BACKGROUND_PHOTONS = 40.0
GAIN = 55.0
OFFSET = 400.0
READ_NOISE = 8.0
REFERENCE_SIZE = 512.0  # population radii and blurs are given at this size


@dataclass(frozen=True)
class Population:
    """A kind of scene: ranges are drawn uniformly per image (radii/blur at 512 px)."""

    name: str
    cells: tuple[int, int]
    radius: tuple[float, float]
    photons: tuple[float, float]
    blur: tuple[float, float]


POPULATIONS = (
    Population("sparse", (6, 14), (16.0, 26.0), (110.0, 220.0), (0.0, 0.0)),
    Population("dense", (45, 80), (5.0, 9.0), (350.0, 650.0), (0.0, 0.0)),
    Population("defocused", (18, 36), (9.0, 15.0), (200.0, 400.0), (5.0, 8.0)),
)


@dataclass(frozen=True)
class Regime:
    """A Brusselator parameter regime; ranges are drawn uniformly per realization."""

    name: str
    a: tuple[float, float]
    b: tuple[float, float]
    d: tuple[float, float]  # jump rate per molecule and direction


REGIMES = (
    Regime("oscillating", (1.0, 1.0), (2.7, 3.2), (2.0, 4.0)),
    Regime("steady", (1.0, 1.0), (1.3, 1.7), (2.0, 4.0)),
    Regime("fast", (2.0, 2.0), (6.0, 7.0), (2.0, 4.0)),
)


def _recorded(out_dir: Path) -> tuple[Any, list[tuple[str, int]]]:
    """The request and the (name, size) files the folder's manifest records; (None, []) without one."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
        return manifest.get("request"), [(str(name), int(size)) for name, size in manifest.get("files", [])]
    except (OSError, ValueError, TypeError, AttributeError):
        return None, []


def _generate(out_dir: Path, request: dict[str, Any], make_files: Callable[[], list[tuple[str, bytes]]]) -> list[Path]:
    """The files of a previous identical generation, if all are intact, else those of
    ``make_files`` written, then the manifest that makes them a cache hit.

    Files an earlier, different generation recorded (only those, never anything else)
    that this one does not rewrite are removed, so a folder watcher never streams a
    stale mix.
    """
    recorded, before = _recorded(out_dir)
    if recorded == request and all((out_dir / n).is_file() and (out_dir / n).stat().st_size == z for n, z in before):
        return [out_dir / name for name, _ in before]
    files = make_files()
    log.info("generated samples", extra={"kind": request["kind"], "dir": str(out_dir), "count": len(files)})
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in {name for name, _ in before if "/" not in name} - {name for name, _ in files}:
        (out_dir / stale).unlink(missing_ok=True)
    for name, data in files:
        atomic_write(out_dir / name, data, durable=False)  # a reader never sees half a file
    manifest = {"request": request, "files": [[name, len(data)] for name, data in files]}
    atomic_write(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode(), durable=False)
    return [out_dir / name for name, _ in files]


def _place_cells(
    rng: np.random.Generator, size: int, count: int, radius: tuple[float, float], gap: float = 3.0
) -> list[tuple[float, float, float]]:
    """Up to ``count`` non-overlapping (y, x, r) discs, fully inside the image."""
    placed: list[tuple[float, float, float]] = []
    for _ in range(count * 200):
        if len(placed) == count:
            break
        r = rng.uniform(*radius)
        margin = r + 4.0
        if size <= 2 * margin:
            continue
        y, x = rng.uniform(margin, size - margin, size=2)
        if all(math.hypot(y - py, x - px) >= r + pr + gap for py, px, pr in placed):
            placed.append((float(y), float(x), float(r)))
    return placed


def _add_cell(canvas: np.ndarray, y: float, x: float, r: float, photons: float, aspect: float, angle: float) -> None:
    """Add one soft-edged elliptic cell (major radius r) with a brighter interior."""
    half = math.ceil(r) + 3
    y0, y1 = max(0, int(y) - half), min(canvas.shape[0], int(y) + half + 1)
    x0, x1 = max(0, int(x) - half), min(canvas.shape[1], int(x) + half + 1)
    yy, xx = np.mgrid[y0:y1, x0:x1]
    dy, dx = yy - y, xx - x
    u = dx * math.cos(angle) + dy * math.sin(angle)
    v = -dx * math.sin(angle) + dy * math.cos(angle)
    rho = np.sqrt((u / r) ** 2 + (v / (r * aspect)) ** 2)
    edge = 1.0 / (1.0 + np.exp((rho - 1.0) * r * aspect / 0.8))  # ~1 px soft edge
    interior = 0.75 + 0.25 * np.clip(1.0 - rho**2, 0.0, 1.0)
    canvas[y0:y1, x0:x1] += photons * edge * interior


def make_cell_image(
    rng: np.random.Generator,
    size: int,
    cells: int,
    radius: tuple[float, float],
    photons: tuple[float, float],
    blur: float = 0.0,
) -> tuple[np.ndarray, int]:
    """A uint16 fluorescence-like image and how many cells it really holds.

    Radii and blur are in pixels of this image. Cells never overlap and never
    touch the border, so the count is exact ground truth for segmentation.
    """
    yy, xx = np.mgrid[0:size, 0:size] / max(size - 1, 1)
    tilt = rng.uniform(-0.1, 0.1, size=2)
    scene = BACKGROUND_PHOTONS * (1.0 + tilt[0] * (yy - 0.5) + tilt[1] * (xx - 0.5))
    signal = np.zeros((size, size))
    placed = _place_cells(rng, size, cells, radius)
    for y, x, r in placed:
        _add_cell(signal, y, x, r, rng.uniform(*photons), rng.uniform(0.6, 1.0), rng.uniform(0, math.pi))
    scene += imaging.fft_gaussian_blur(signal, blur) if blur > 0 else signal
    adu = OFFSET + GAIN * rng.poisson(scene) + rng.normal(0.0, READ_NOISE, scene.shape)
    return np.clip(np.rint(adu), 0, 65535).astype(np.uint16), len(placed)


def encode_image(pixels: np.ndarray, fmt: str) -> bytes:
    """TIFF (16-bit as given) or PNG (8-bit, scaled by 1/257) bytes of a uint16 image."""
    if fmt == "png":
        pixels = np.rint(pixels / 257.0).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG" if fmt == "png" else "TIFF")
    return buffer.getvalue()


def _microscopy_file(seed: int, index: int, size: int) -> tuple[str, bytes]:
    """File name and bytes of sample image ``index``: depends only on (seed, index, size)."""
    rng = np.random.default_rng([seed, index, 1])
    population = POPULATIONS[index % len(POPULATIONS)]
    scale = size / REFERENCE_SIZE
    pixels, _ = make_cell_image(
        rng,
        size,
        int(rng.integers(population.cells[0], population.cells[1] + 1)),
        (population.radius[0] * scale, population.radius[1] * scale),
        population.photons,
        rng.uniform(*population.blur) * scale,
    )
    fmt = "png" if index % 4 == 3 else "tif"
    return f"cells_{index:04d}_{population.name}.{fmt}", encode_image(pixels, fmt)


def generate_microscopy(
    out_dir: str | os.PathLike[str], count: int = DEMO_IMAGES, seed: int = 7, size: int = 512
) -> list[Path]:
    """Write ``count`` sample images (size x size) into ``out_dir``; return their paths."""
    if count < 0 or size < 64:
        raise ValueError(f"generate_microscopy: need count >= 0 and size >= 64 (got {count}, {size})")
    request = {"kind": "microscopy", "version": FORMAT_VERSION, "count": count, "seed": seed, "size": size}
    return _generate(Path(out_dir), request, lambda: [_microscopy_file(seed, i, size) for i in range(count)])


def _shift(values: np.ndarray, step: int) -> np.ndarray:
    """Values moved ``step`` voxels along the ring (last axis), like ``np.roll`` but cheaper."""
    n = values.shape[-1]
    step %= n
    out = np.empty_like(values)
    out[..., step:] = values[..., : n - step]
    out[..., :step] = values[..., n - step :]
    return out


def _leap(
    rng: np.random.Generator, z: np.ndarray, born: np.ndarray, b: np.ndarray, jump: np.ndarray, omega: float, dt: float
) -> np.ndarray:
    """One tau-leap of all eight channels of state ``z`` = (X, Y), shape (2, R, V).

    Channels: 0 -> X, X -> 0, X -> Y, 2X + Y -> 3X, and a jump left and right
    for each species. Every channel fires Poisson(propensity * dt) times, all
    drawn in one call (this loop is the generator's hot spot); outflows are then
    clamped, in a fixed order, to the molecules present, so counts never go
    negative.
    """
    x, y = z
    fires = rng.poisson(np.stack([born, x * dt, b * x, x * (x - 1) * y * (dt / omega**2)]))
    moves = rng.poisson(jump * np.concatenate([z, z]))
    died = np.minimum(fires[1], x)
    converted = np.minimum(fires[2], x - died)
    catalysed = np.minimum(fires[3], y)
    z = z + np.stack([fires[0] - died - converted + catalysed, converted - catalysed])
    left = np.minimum(moves[:2], z)
    right = np.minimum(moves[2:], z - left)
    return z - left - right + _shift(left, -1) + _shift(right, 1)


def simulate_brusselator(
    rng: np.random.Generator,
    a: np.ndarray,
    b: np.ndarray,
    d: np.ndarray,
    *,
    omega: float,
    voxels: int,
    timepoints: int,
    dt: float,
    substeps: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Tau-leaping of R realizations at once: (t (T,), counts (R, 2, V, T) int32).

    ``a``, ``b``, ``d`` have one entry per realization. Starts near the steady
    state (X=a*omega, Y=b/a*omega) with Poisson scatter; records every
    ``substeps`` leaps of ``dt``.
    """
    r = len(a)
    a, b, d = a[:, None], b[:, None], d[:, None]
    born = np.broadcast_to(a * omega * dt, (r, voxels))
    rate_b, jump = b * dt, d * dt
    z = np.stack(
        [rng.poisson(np.broadcast_to(a * omega, (r, voxels))), rng.poisson(np.broadcast_to(b / a * omega, (r, voxels)))]
    ).astype(np.int64)
    out = np.empty((r, 2, voxels, timepoints), dtype=np.int32)
    for k in range(timepoints):
        out[:, :, :, k] = z.transpose(1, 0, 2)
        for _ in range(substeps):
            z = _leap(rng, z, born, rate_b, jump, omega, dt)
    t = np.arange(timepoints) * (dt * substeps)
    return t, out


@dataclass(frozen=True)
class SimulationSize:
    """How big and fine each realization is (defaults: ~2 MB per file)."""

    voxels: int = 32
    timepoints: int = 8000
    dt: float = 0.0125
    substeps: int = 1
    omega: float = 40.0


def _simulation_group(seed: int, group: int, size: SimulationSize) -> list[tuple[str, bytes]]:
    """Files of realizations group*SIM_GROUP .. +SIM_GROUP-1, simulated together."""
    rng = np.random.default_rng([seed, group, 2])
    indices = range(group * SIM_GROUP, (group + 1) * SIM_GROUP)
    regimes = [REGIMES[i % len(REGIMES)] for i in indices]
    params = np.array([[rng.uniform(*g.a), rng.uniform(*g.b), rng.uniform(*g.d)] for g in regimes])
    t, counts = simulate_brusselator(
        rng,
        *params.T,  # a, b, d
        omega=size.omega,
        voxels=size.voxels,
        timepoints=size.timepoints,
        dt=size.dt,
        substeps=size.substeps,
    )
    files = []
    for j, index in enumerate(indices):
        buffer = io.BytesIO()
        np.savez(
            buffer,
            t=t,
            x=counts[j],
            species=np.array(["A", "B"]),
            params=np.array([*params[j], size.omega]),
            regime=np.array(regimes[j].name),
        )
        files.append((f"brusselator_{index:04d}_{regimes[j].name}.npz", buffer.getvalue()))
    return files


def generate_simulation(
    out_dir: str | os.PathLike[str],
    count: int = DEMO_REALIZATIONS,
    seed: int = 7,
    size: SimulationSize = SimulationSize(),
) -> list[Path]:
    """Write ``count`` Brusselator realizations (.npz) into ``out_dir``; return their paths."""
    if count < 0 or size.voxels < 1 or size.timepoints < 8 or size.substeps < 1:
        raise ValueError(f"generate_simulation: invalid count {count} or size {size}")
    if not 0 < size.dt <= 0.1:
        raise ValueError(f"generate_simulation: dt={size.dt} must be in (0, 0.1] for tau-leaping")
    request = {"kind": "simulation", "version": FORMAT_VERSION, "count": count, "seed": seed, "size": asdict(size)}
    groups = range(-(-count // SIM_GROUP))
    return _generate(
        Path(out_dir), request, lambda: [f for g in groups for f in _simulation_group(seed, g, size)][:count]
    )


def generate_demo_dataset(out_dir: str | os.PathLike[str], seed: int = 7) -> list[tuple[Path, str]]:
    """The demo set: images in ``out_dir/microscopy``, realizations in ``out_dir/simulation``.

    Returns (file, image name) pairs, images first, ready to hand to a gateway.
    """
    out = Path(out_dir)
    images = generate_microscopy(out / "microscopy", DEMO_IMAGES, seed)
    realizations = generate_simulation(out / "simulation", DEMO_REALIZATIONS, seed)
    return [(p, MICROSCOPY_IMAGE) for p in images] + [(p, SIMULATION_IMAGE) for p in realizations]
