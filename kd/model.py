"""Knowledge from one group of accumulated features.

1. Normalise: per feature, mean and standard deviation over *all* the group's
   tuples, kept up to date as tuples arrive (``Group.mean_std``; a constant
   feature gets std 1, so it neither explodes nor matters).
2. Divisive hierarchy: Spark ML ``BisectingKMeans`` fitted on a uniform sample
   of at most ``sample_size`` normalised points. The sample bounds an
   interval's cost: fitting is the expensive, iterative part, and a uniform
   sample of 10,000 points places a handful of centres as well as all points.
3. Every tuple of the group is assigned to its nearest centre (one vectorised
   pass in the driver; microseconds per thousand tuples), giving exact counts.
4. Agglomerative hierarchy: Ward linkage of the centres (scipy), the
   dendrogram a scientist reads to see which clusters are related.

Every group (one image with one feature set: different pipelines measure
different things, so their features share no space) is clustered on its own,
the largest ``max_groups`` of them each interval, so an interval costs at most
``max_groups`` bounded fits whatever the store holds. The knowledge lists every
group; its top-level fields repeat the main group (most tuples) for readers
that know only one.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hio.kd.store import Group
from hio.proto import features_pb2

if TYPE_CHECKING:
    from hio.kd.config import KDConfig


@dataclass(frozen=True)
class Clustering:
    mean: np.ndarray
    std: np.ndarray
    centres: np.ndarray  # (k, d), normalised space
    labels: np.ndarray  # (n,) cluster of every tuple of the group
    counts: np.ndarray  # (k,)
    linkage: np.ndarray  # (k-1, 4) scipy linkage matrix over centres
    sample: np.ndarray  # indices of the points the model was fitted on
    algorithm: str


def sample_indices(n: int, size: int, seed: int) -> np.ndarray:
    """``size`` of ``range(n)`` drawn with ``seed``, in ascending order (all of them when
    ``n <= size``): the fit's sample, and the preview's pick from that sample, both keep
    the rows' order."""
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
    from pyspark.sql.functions import col

    # Spark splits a cluster by nudging its centre by 1e-4 x its norm: at the
    # origin (where normalised data is centred) both halves start identical and
    # the root never splits. Fitting shifted points (k-means is translation
    # invariant) and shifting the centres back avoids that.
    shift = np.ones(points.shape[1])
    # Arrow hands the sample to the JVM in one columnar batch (no per-row Python
    # objects); one partition, cached: BisectingKMeans iterates over it.
    flat = pa.array(np.ascontiguousarray(points + shift, dtype=np.float64).ravel())
    column = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, points.shape[1], dtype=np.int32)), flat)
    frame = spark.createDataFrame(pa.table({"x": column})).select(array_to_vector(col("x")).alias("features"))
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


def assign(
    values: np.ndarray, centres: np.ndarray, mean: np.ndarray, std: np.ndarray, block: int = 65_536
) -> np.ndarray:
    """Index of the nearest centre (in the normalised space) of each raw row of ``values``,
    in blocks: each block is normalised on its way, so memory stays bounded and no
    normalised copy of every row is made."""
    labels = np.empty(len(values), dtype=np.int32)
    sq = (centres**2).sum(axis=1)
    for start in range(0, len(values), block):
        chunk = (values[start : start + block] - mean) / std
        dist = sq[None, :] - 2.0 * chunk @ centres.T
        labels[start : start + block] = dist.argmin(axis=1)
    return labels


def ward_linkage(centres: np.ndarray) -> np.ndarray:
    if len(centres) < 2:
        return np.empty((0, 4))
    from scipy.cluster.hierarchy import linkage

    return linkage(centres, method="ward")


def cluster(spark: Any, group: Group, config: KDConfig) -> Clustering:
    """Cluster every tuple of ``group`` with ``config``'s k, sample size, seed and
    iterations (see the module docstring)."""
    k, seed = config.k, config.seed
    values = group.values
    mean, std = group.mean_std()
    sample = sample_indices(len(values), config.sample_size, seed)
    points = (values[sample] - mean) / std
    k_eff = min(k, _distinct_rows(points))
    centres = _fit_centres(spark, points, k_eff, seed, config.max_iterations)
    labels = assign(values, centres, mean, std)
    counts = np.bincount(labels, minlength=len(centres))
    algorithm = (
        f"BisectingKMeans(k={k}, fitted on {len(sample)} of {len(values)} tuples, seed={seed}); "
        f"nearest-centre assignment; Ward linkage of centres; group image='{group.image}'"
    )
    return Clustering(mean, std, centres, labels, counts, ward_linkage(centres), sample, algorithm)


@dataclass(frozen=True)
class GroupResult:
    """One group and its clustering (None: not clustered this interval, ``note`` says why)."""

    group: Group
    clustering: Clustering | None
    note: str = ""


def plan(groups: list[Group], image: str, max_groups: int) -> tuple[Group | None, list[Group]]:
    """(main group, the groups to cluster). ``groups`` come most tuples first; the
    main group is the first (of ``image`` when given) and is always clustered,
    with the largest others up to ``max_groups`` in all."""
    main = next((g for g in groups if not image or g.image == image), None)
    others = [g for g in groups if g is not main][: max(0, max_groups - (main is not None))]
    return main, ([main] if main is not None else []) + others


def cluster_groups(spark: Any, groups: list[Group], chosen: list[Group], config: KDConfig) -> list[GroupResult]:
    """A result per group (in ``groups`` order); only ``chosen`` ones are clustered.

    A fit on a bounded sample costs Spark job overhead far more than arithmetic
    and runs on one partition, so fitting ``fit_parallelism`` groups at once (one
    driver thread each; Spark schedules concurrent jobs) makes an interval with
    two groups cost about what one group does."""

    def fit(group: Group) -> Clustering:
        return cluster(spark, group, config)

    parallelism = config.fit_parallelism
    if parallelism > 1 and len(chosen) > 1:
        with ThreadPoolExecutor(max_workers=min(parallelism, len(chosen)), thread_name_prefix="hio-kd-fit") as pool:
            fitted = dict(zip(map(id, chosen), pool.map(fit, chosen), strict=True))
    else:
        fitted = {id(g): fit(g) for g in chosen}
    results = []
    for group in groups:
        if id(group) in fitted:
            results.append(GroupResult(group, fitted[id(group)]))
        else:
            note = (
                f"not clustered: only the {len(chosen)} largest groups are clustered each interval "
                f"(max_groups); group image='{group.image}'"
            )
            results.append(GroupResult(group, None, note))
    return results


def listed_counts(results: list[GroupResult], max_assignments: int) -> list[int]:
    """How many of each group's most recent tuples get their assignment listed:
    the ``max_assignments`` most recent (highest offset) clustered tuples over
    all groups. A group's offsets are increasing, so its listed ones are its last."""
    offsets = [r.group.offsets for r in results if r.clustering is not None]
    total = sum(len(o) for o in offsets)
    if total <= max_assignments:
        return [r.group.count if r.clustering is not None else 0 for r in results]
    if max_assignments <= 0:
        return [0] * len(results)
    everything = np.concatenate([o[-max_assignments:] for o in offsets])
    cut = len(everything) - max_assignments
    threshold = np.partition(everything, cut)[cut]
    return [
        len(r.group.offsets) - int(np.searchsorted(r.group.offsets, threshold)) if r.clustering is not None else 0
        for r in results
    ]


def group_message(result: GroupResult, listed: int) -> features_pb2.KnowledgeGroup:
    """The ``KnowledgeGroup`` of one group, with its last ``listed`` assignments."""
    group, clustering = result.group, result.clustering
    message = features_pb2.KnowledgeGroup(
        image=group.image, feature_names=list(group.names), tuple_count=group.count, algorithm=result.note
    )
    if clustering is None:
        return message
    message.algorithm = clustering.algorithm
    message.feature_mean.extend(clustering.mean.tolist())
    message.feature_std.extend(clustering.std.tolist())
    for index, (centre, count) in enumerate(zip(clustering.centres.tolist(), clustering.counts.tolist(), strict=True)):
        message.clusters.add(id=index, centre=centre, count=count)
    for left, right, distance, size in clustering.linkage.tolist():
        message.dendrogram.add(left=int(left), right=int(right), distance=float(distance), size=int(size))
    start = group.count - listed
    ids, labels = group.ids[start:].tolist(), clustering.labels[start:].tolist()
    message.assignments.extend(features_pb2.Assignment(tuple_id=t, cluster=c) for t, c in zip(ids, labels, strict=True))
    return message


def _fill_main(knowledge: features_pb2.Knowledge, main: features_pb2.KnowledgeGroup) -> None:
    """Top-level fields = the main group (what readers of one group expect)."""
    knowledge.tuple_count, knowledge.algorithm = main.tuple_count, main.algorithm
    for name in ("feature_names", "feature_mean", "feature_std", "clusters", "dendrogram", "assignments"):
        getattr(knowledge, name).extend(getattr(main, name))


def to_knowledge(
    results: list[GroupResult],
    main: Group | None,
    *,
    up_to_offset: int,
    malformed: int,
    new_records: int,
    interval_seconds: float,
    max_assignments: int,
) -> features_pb2.Knowledge:
    """The ``Knowledge`` message: every group in ``groups`` (in ``results`` order),
    ``main`` in the top-level fields; at most ``max_assignments`` assignments in
    all groups, the most recent."""
    knowledge = features_pb2.Knowledge(
        computed_unix=time.time(),
        up_to_offset=up_to_offset,
        malformed_records=malformed,
        new_records=new_records,
        interval_seconds=interval_seconds,
    )
    listed = listed_counts(results, max_assignments)
    for result, count in zip(results, listed, strict=True):
        message = knowledge.groups.add()
        message.CopyFrom(group_message(result, count))
        if result.group is main:
            _fill_main(knowledge, message)
    knowledge.assignments_omitted = sum(r.group.count for r in results) - sum(listed)
    if main is None:
        knowledge.algorithm = (
            "none: no well-formed feature records yet"
            if not results
            else "none: no feature records of the preferred image; see groups"
        )
    return knowledge
