"""The preview people look at: one PNG per interval with the clusters in a 2-D
PCA projection, the dendrogram of the cluster centres, and tuples processed
over time. Drawn off-screen (Agg); at most ``max_points`` points are drawn so
the picture costs the same however large the store grows."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np
from hio.kd.model import Clustering
from hio.kd.store import Group


def pca_2d(points: np.ndarray, extra: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Project ``points`` and ``extra`` on the two main axes of ``points``."""
    centre = points.mean(axis=0)
    _, _, vt = np.linalg.svd(points - centre, full_matrices=False)
    axes = vt[:2].T
    if axes.shape[1] < 2:
        axes = np.hstack([axes, np.zeros((axes.shape[0], 2 - axes.shape[1]))])
    return (points - centre) @ axes, (extra - centre) @ axes


def _scatter(ax, group: Group, result: Clustering, max_points: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    pick = result.sample
    if len(pick) > max_points:
        pick = np.sort(np.random.default_rng(seed).choice(pick, size=max_points, replace=False))
    scaled = (group.values[pick] - result.mean) / result.std
    xy, centres = pca_2d(scaled, result.centres)
    ax.scatter(xy[:, 0], xy[:, 1], c=result.labels[pick], cmap="tab10", s=6, alpha=0.6,
               vmin=0, vmax=max(9, len(result.centres) - 1))
    ax.scatter(centres[:, 0], centres[:, 1], c="black", marker="x", s=60)
    for index, (x, y) in enumerate(centres):
        ax.annotate(str(index), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=9)
    ax.set_title(f"clusters (PCA), {group.count} tuples")
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")


def _dendrogram(ax, result: Clustering) -> None:  # type: ignore[no-untyped-def]
    if len(result.linkage) == 0:
        ax.text(0.5, 0.5, "one cluster", ha="center", va="center")
        ax.set_axis_off()
        return
    from scipy.cluster.hierarchy import dendrogram

    labels = [f"{i} ({n})" for i, n in enumerate(result.counts.tolist())]
    dendrogram(result.linkage, ax=ax, labels=labels, leaf_rotation=45)
    ax.set_title("dendrogram of cluster centres (Ward)")
    ax.set_ylabel("distance")


def _history(ax, history: list[tuple[float, int]]) -> None:  # type: ignore[no-untyped-def]
    if history:
        start = history[0][0]
        ax.step([(t - start) / 60.0 for t, _ in history], [n for _, n in history], where="post")
    ax.set_title("tuples processed")
    ax.set_xlabel("minutes since first interval")
    ax.set_ylabel("tuples")


def render(group: Group | None, result: Clustering | None, history: list[tuple[float, int]],
           *, max_points: int = 5000, seed: int = 1, title: str = "") -> bytes:
    """The preview as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.6), dpi=90)
    axes = fig.subplots(1, 3)
    if group is not None and result is not None:
        _scatter(axes[0], group, result, max_points, seed)
        _dendrogram(axes[1], result)
    else:
        for ax in axes[:2]:
            ax.text(0.5, 0.5, "no features yet", ha="center", va="center")
            ax.set_axis_off()
    _history(axes[2], history)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    fig.suptitle(f"HarmonicIO knowledge discovery {title} - {stamp}".strip())
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` so a viewer never sees half a PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
