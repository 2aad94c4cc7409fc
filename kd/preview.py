"""The preview people look at: one PNG per interval with, for each clustered
group (one row each, largest first, at most ``max_rows``), the clusters in a
2-D PCA projection and the dendrogram of the cluster centres; beside them,
once, the tuples processed over time. Drawn off-screen (Agg); at most
``max_points`` points per group are drawn so the picture costs the same however
large the store grows."""

from __future__ import annotations

import io
import time
from typing import TYPE_CHECKING

import numpy as np

from hio.kd.model import Clustering, GroupResult, sample_indices
from hio.kd.store import Group

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def pca_2d(points: np.ndarray, extra: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Project ``points`` and ``extra`` on the two main axes of ``points``."""
    centre = points.mean(axis=0)
    _, _, vt = np.linalg.svd(points - centre, full_matrices=False)
    axes = vt[:2].T
    if axes.shape[1] < 2:
        axes = np.hstack([axes, np.zeros((axes.shape[0], 2 - axes.shape[1]))])
    return (points - centre) @ axes, (extra - centre) @ axes


def _scatter(ax: Axes, group: Group, result: Clustering, max_points: int, seed: int) -> None:
    pick = result.sample[sample_indices(len(result.sample), max_points, seed)]
    scaled = (group.values[pick] - result.mean) / result.std
    xy, centres = pca_2d(scaled, result.centres)
    ax.scatter(
        xy[:, 0],
        xy[:, 1],
        c=result.labels[pick],
        cmap="tab10",
        s=6,
        alpha=0.6,
        vmin=0,
        vmax=max(9, len(result.centres) - 1),
    )
    ax.scatter(centres[:, 0], centres[:, 1], c="black", marker="x", s=60)
    for index, (x, y) in enumerate(centres):
        ax.annotate(str(index), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=9)
    ax.set_title(f"{group.image}: clusters (PCA), {group.count} tuples", fontsize=10)
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")


def _dendrogram(ax: Axes, result: Clustering) -> None:
    if len(result.linkage) == 0:
        _empty(ax, "one cluster")
        return
    from scipy.cluster.hierarchy import dendrogram

    labels = [f"{i} ({n})" for i, n in enumerate(result.counts.tolist())]
    dendrogram(result.linkage, ax=ax, labels=labels, leaf_rotation=45)
    ax.set_title("dendrogram of cluster centres (Ward)", fontsize=10)
    ax.set_ylabel("distance")


def _history(ax: Axes, history: list[tuple[float, int]]) -> None:
    if history:
        start = history[0][0]
        ax.step([(t - start) / 60.0 for t, _ in history], [n for _, n in history], where="post", marker="o")
    ax.set_title("tuples processed")
    ax.set_xlabel("minutes since first interval")
    ax.set_ylabel("tuples")


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center")
    ax.set_axis_off()


def render(
    results: list[GroupResult],
    history: list[tuple[float, int]],
    *,
    max_points: int = 5000,
    seed: int = 1,
    max_rows: int = 4,
    title: str = "",
) -> bytes:
    """The preview as PNG bytes: a row (scatter, dendrogram) per clustered group."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    shown = [r for r in results if r.clustering is not None][: max(1, max_rows)]
    rows = max(1, len(shown))
    fig = Figure(figsize=(15, 0.6 + 4.0 * rows), dpi=90)
    grid = fig.add_gridspec(rows, 3)
    for row, result in enumerate(shown):
        assert result.clustering is not None
        _scatter(fig.add_subplot(grid[row, 0]), result.group, result.clustering, max_points, seed)
        _dendrogram(fig.add_subplot(grid[row, 1]), result.clustering)
    if not shown:
        _empty(fig.add_subplot(grid[0, 0]), "no features yet")
        _empty(fig.add_subplot(grid[0, 1]), "no features yet")
    _history(fig.add_subplot(grid[0, 2]), history)
    more = len(results) - len(shown)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    note = f" ({more} more groups not drawn)" if more > 0 else ""
    fig.suptitle(" ".join(p for p in ("HarmonicIO knowledge discovery", title, f"- {stamp}{note}") if p))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
