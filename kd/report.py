"""Knowledge as text for people (``hio knowledge``). Pure formatting: no Spark,
no network, so any tool can print what KD last wrote."""

from __future__ import annotations

import time

from hio.proto import features_pb2

MAX_CENTRE_FEATURES = 8


def _when(unix: float) -> str:
    if unix <= 0:
        return "never"
    age = max(0.0, time.time() - unix)
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(unix))} ({age:.0f} s ago)"


def _header(k: features_pb2.Knowledge) -> list[str]:
    return [
        f"computed:      {_when(k.computed_unix)}",
        f"tuples:        {k.tuple_count} (up to repository offset {k.up_to_offset})",
        f"last interval: {k.new_records} new records in {k.interval_seconds:.2f} s",
        f"malformed:     {k.malformed_records} records skipped",
        f"algorithm:     {k.algorithm or '-'}",
    ]


def _features(k: features_pb2.Knowledge) -> list[str]:
    if not k.feature_names:
        return []
    lines = ["", "features (normalisation: (x - mean) / std):"]
    width = max(len(n) for n in k.feature_names)
    for name, mean, std in zip(k.feature_names, k.feature_mean, k.feature_std):
        lines.append(f"  {name:<{width}}  mean {mean:12.6g}  std {std:12.6g}")
    return lines


def _clusters(k: features_pb2.Knowledge) -> list[str]:
    if not k.clusters:
        return []
    total = sum(c.count for c in k.clusters) or 1
    names = list(k.feature_names)[:MAX_CENTRE_FEATURES]
    lines = ["", "clusters (centre in original units):"]
    for c in k.clusters:
        original = [m + s * v for v, m, s in zip(c.centre, k.feature_mean, k.feature_std)]
        centre = ", ".join(f"{n}={v:.4g}" for n, v in zip(names, original))
        more = " ..." if len(c.centre) > MAX_CENTRE_FEATURES else ""
        lines.append(f"  #{c.id:<3d} {c.count:>9d} tuples ({100.0 * c.count / total:5.1f}%)  {centre}{more}")
    return lines


def _dendrogram(k: features_pb2.Knowledge) -> list[str]:
    if not k.dendrogram:
        return []
    n = len(k.clusters)

    def label(node: int) -> str:
        return f"#{node}" if node < n else f"m{node - n}"

    lines = ["", "dendrogram (agglomerative merges of cluster centres, closest first):"]
    for index, m in enumerate(k.dendrogram):
        lines.append(f"  m{index:<3d} = {label(m.left)} + {label(m.right)}"
                     f"   distance {m.distance:.4g}, {m.size} clusters")
    return lines


def _assignments(k: features_pb2.Knowledge) -> list[str]:
    if not k.assignments:
        return []
    shown = k.assignments[-5:]
    sample = ", ".join(f"{a.tuple_id}->#{a.cluster}" for a in shown)
    return ["", f"assignments: {len(k.assignments)} of {k.tuple_count} tuples listed; latest: {sample}"]


def format_knowledge(knowledge: features_pb2.Knowledge) -> str:
    """A readable multi-line summary of ``knowledge``."""
    lines = ["knowledge discovery"]
    lines += _header(knowledge)
    lines += _features(knowledge)
    lines += _clusters(knowledge)
    lines += _dendrogram(knowledge)
    lines += _assignments(knowledge)
    return "\n".join(lines)
