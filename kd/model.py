"""Knowledge from one group of accumulated features.

1. Normalise: per feature, mean and standard deviation over *all* the group's
   tuples (a constant feature gets std 1, so it neither explodes nor matters).
2. Divisive hierarchy: Spark ML ``BisectingKMeans`` fitted on a uniform sample
   of at most ``sample_size`` normalised points. The sample bounds an
   interval's cost: fitting is the expensive, iterative part, and a uniform
   sample of 10,000 points places a handful of centres as well as all points.
3. Every tuple of the group is assigned to its nearest centre (one vectorised
   pass in the driver; microseconds per thousand tuples), giving exact counts.
4. Agglomerative hierarchy: Ward linkage of the centres (scipy), the
   dendrogram a scientist reads to see which clusters are related.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from hio.kd.store import Group
from hio.proto import features_pb2


@dataclass(frozen=True)
class Clustering:
    mean: np.ndarray
    std: np.ndarray
    centres: np.ndarray          # (k, d), normalised space
    labels: np.ndarray           # (n,) cluster of every tuple of the group
    counts: np.ndarray           # (k,)
    linkage: np.ndarray          # (k-1, 4) scipy linkage matrix over centres
    sample: np.ndarray           # indices of the points the model was fitted on
    algorithm: str


def normalise(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scaled values, mean, std) with std 1 where a feature is constant."""
    mean = values.mean(axis=0)
    std = values.std(axis=0)
    std = np.where(std > 1e-12, std, 1.0)
    return (values - mean) / std, mean, std


def _sample(n: int, size: int, seed: int) -> np.ndarray:
    if n <= size:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def _fit_centres(spark: Any, points: np.ndarray, k: int, seed: int, max_iter: int) -> np.ndarray:
    """BisectingKMeans centres of ``points`` (k already capped by distinct points)."""
    if k <= 1:
        return points.mean(axis=0, keepdims=True)
    import pyarrow as pa
    from pyspark.ml.clustering import BisectingKMeans
    from pyspark.ml.functions import array_to_vector

    # Spark splits a cluster by nudging its centre by 1e-4 x its norm: at the
    # origin (where normalised data is centred) both halves start identical and
    # the root never splits. Fitting shifted points (k-means is translation
    # invariant) and shifting the centres back avoids that.
    shift = np.ones(points.shape[1])
    # Arrow hands the sample to the JVM in one columnar batch (no per-row Python
    # objects); one partition, cached: BisectingKMeans iterates over it.
    flat = pa.array(np.ascontiguousarray(points + shift, dtype=np.float64).ravel())
    column = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, points.shape[1], dtype=np.int32)), flat)
    frame = spark.createDataFrame(pa.table({"x": column})).select(array_to_vector("x").alias("features"))
    frame = frame.coalesce(1).cache()
    try:
        model = BisectingKMeans(k=k, seed=seed, maxIter=max_iter, minDivisibleClusterSize=1.0).fit(frame)
    finally:
        frame.unpersist()
    return np.array([np.asarray(c, dtype=float) for c in model.clusterCenters()]) - shift


def _distinct_rows(points: np.ndarray) -> int:
    """Number of distinct rows (bytes-wise), without a lexicographic row sort."""
    rows = np.ascontiguousarray(points)
    return len(np.unique(rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()))


def assign(points: np.ndarray, centres: np.ndarray, block: int = 65_536) -> np.ndarray:
    """Index of the nearest centre of each point, in blocks to bound memory."""
    labels = np.empty(len(points), dtype=np.int32)
    sq = (centres ** 2).sum(axis=1)
    for start in range(0, len(points), block):
        chunk = points[start:start + block]
        dist = sq[None, :] - 2.0 * chunk @ centres.T
        labels[start:start + block] = dist.argmin(axis=1)
    return labels


def ward_linkage(centres: np.ndarray) -> np.ndarray:
    if len(centres) < 2:
        return np.empty((0, 4))
    from scipy.cluster.hierarchy import linkage

    return linkage(centres, method="ward")


def cluster(spark: Any, group: Group, *, k: int, sample_size: int, seed: int, max_iter: int) -> Clustering:
    """Cluster every tuple of ``group`` (see the module docstring)."""
    scaled, mean, std = normalise(group.values)
    sample = _sample(len(scaled), sample_size, seed)
    points = scaled[sample]
    k_eff = min(k, _distinct_rows(points))
    centres = _fit_centres(spark, points, k_eff, seed, max_iter)
    labels = assign(scaled, centres)
    counts = np.bincount(labels, minlength=len(centres))
    algorithm = (f"BisectingKMeans(k={k}, fitted on {len(sample)} of {len(scaled)} tuples, seed={seed}); "
                 f"nearest-centre assignment; Ward linkage of centres; group image='{group.image}'")
    return Clustering(mean, std, centres, labels, counts, ward_linkage(centres), sample, algorithm)


def to_knowledge(group: Group | None, result: Clustering | None, *, up_to_offset: int, malformed: int,
                 new_records: int, interval_seconds: float, max_assignments: int) -> features_pb2.Knowledge:
    """The ``Knowledge`` message; assignments are the most recent ``max_assignments`` tuples."""
    knowledge = features_pb2.Knowledge(
        computed_unix=time.time(), up_to_offset=up_to_offset, malformed_records=malformed,
        new_records=new_records, interval_seconds=interval_seconds)
    if group is None or result is None:
        knowledge.algorithm = "none: no well-formed feature records yet"
        return knowledge
    knowledge.tuple_count = group.count
    knowledge.feature_names.extend(group.names)
    knowledge.feature_mean.extend(result.mean.tolist())
    knowledge.feature_std.extend(result.std.tolist())
    knowledge.algorithm = result.algorithm
    for index, (centre, count) in enumerate(zip(result.centres.tolist(), result.counts.tolist())):
        knowledge.clusters.add(id=index, centre=centre, count=count)
    for left, right, distance, size in result.linkage.tolist():
        knowledge.dendrogram.add(left=int(left), right=int(right), distance=float(distance), size=int(size))
    start = max(0, group.count - max_assignments)
    ids, labels = group.ids[start:].tolist(), result.labels[start:].tolist()
    knowledge.assignments.extend(features_pb2.Assignment(tuple_id=t, cluster=c) for t, c in zip(ids, labels))
    return knowledge
