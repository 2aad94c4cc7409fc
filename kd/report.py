"""Knowledge as text for people (``hio knowledge``). Pure formatting: no Spark,
no network, so any tool can print what KD last wrote."""

from __future__ import annotations

import time

from hio.proto import features_pb2

MAX_CENTRE_FEATURES = 8

# Both a Knowledge (its top-level, main group) and a KnowledgeGroup: the fields
# describing one clustering have the same names in both.
Clustered = features_pb2.Knowledge | features_pb2.KnowledgeGroup


def _when(unix: float) -> str:
    if unix <= 0:
        return "never"
    age = max(0.0, time.time() - unix)
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(unix))} ({age:.0f} s ago)"


def _header(k: features_pb2.Knowledge) -> list[str]:
    total = sum(g.tuple_count for g in k.groups) if k.groups else k.tuple_count
    listed = sum(len(g.assignments) for g in k.groups) if k.groups else len(k.assignments)
    lines = [
        f"computed:      {_when(k.computed_unix)}",
        f"tuples:        {total} (up to repository offset {k.up_to_offset})",
        f"last interval: {k.new_records} new records in {k.interval_seconds:.2f} s",
        f"malformed:     {k.malformed_records} records skipped",
    ]
    if k.groups:
        lines += [
            f"groups:        {len(k.groups)} (image + feature set, each clustered on its own)",
            f"assignments:   {listed} listed, {k.assignments_omitted} omitted (bound over all groups)",
        ]
    else:
        lines.append(f"algorithm:     {k.algorithm or '-'}")
    return lines


def _features(k: Clustered) -> list[str]:
    if not k.feature_names:
        return []
    lines = ["", "features (normalisation: (x - mean) / std):"]
    width = max(len(n) for n in k.feature_names)
    # a report shows what the message holds (a short list: fewer lines, not a failure)
    for name, mean, std in zip(k.feature_names, k.feature_mean, k.feature_std, strict=False):
        lines.append(f"  {name:<{width}}  mean {mean:12.6g}  std {std:12.6g}")
    return lines


def _clusters(k: Clustered) -> list[str]:
    if not k.clusters:
        return []
    total = sum(c.count for c in k.clusters) or 1
    names = list(k.feature_names)[:MAX_CENTRE_FEATURES]
    lines = ["", "clusters (centre in original units):"]
    for c in k.clusters:
        original = [m + s * v for v, m, s in zip(c.centre, k.feature_mean, k.feature_std, strict=False)]
        centre = ", ".join(f"{n}={v:.4g}" for n, v in zip(names, original, strict=False))  # the first names only
        more = " ..." if len(c.centre) > MAX_CENTRE_FEATURES else ""
        lines.append(f"  #{c.id:<3d} {c.count:>9d} tuples ({100.0 * c.count / total:5.1f}%)  {centre}{more}")
    return lines


def _dendrogram(k: Clustered) -> list[str]:
    if not k.dendrogram:
        return []
    n = len(k.clusters)

    def label(node: int) -> str:
        return f"#{node}" if node < n else f"m{node - n}"

    lines = ["", "dendrogram (agglomerative merges of cluster centres, closest first):"]
    for index, m in enumerate(k.dendrogram):
        lines.append(
            f"  m{index:<3d} = {label(m.left)} + {label(m.right)}   distance {m.distance:.4g}, {m.size} clusters"
        )
    return lines


def _assignments(k: Clustered) -> list[str]:
    if not k.assignments:
        return []
    shown = k.assignments[-5:]
    sample = ", ".join(f"{a.tuple_id}->#{a.cluster}" for a in shown)
    return ["", f"assignments: {len(k.assignments)} of {k.tuple_count} tuples listed; latest: {sample}"]


def _is_main(k: features_pb2.Knowledge, group: features_pb2.KnowledgeGroup) -> bool:
    return (group.tuple_count, list(group.feature_names), group.algorithm) == (
        k.tuple_count,
        list(k.feature_names),
        k.algorithm,
    )


def _group(k: features_pb2.Knowledge, index: int, group: features_pb2.KnowledgeGroup) -> list[str]:
    main = " (main: the top-level fields)" if _is_main(k, group) else ""
    title = f"=== group {index + 1} of {len(k.groups)}: image {group.image or '-'}, {group.tuple_count} tuples{main}"
    lines = ["", title, f"algorithm:     {group.algorithm or '-'}"]
    if not group.feature_mean:
        lines.append(f"features:      {', '.join(group.feature_names) or '-'}")
    return lines + _clustering(group)


def _clustering(k: Clustered) -> list[str]:
    return _features(k) + _clusters(k) + _dendrogram(k) + _assignments(k)


def format_knowledge(knowledge: features_pb2.Knowledge) -> str:
    """A readable multi-line summary of ``knowledge``: every group, or (knowledge
    without groups) the one group in the top-level fields."""
    lines = ["knowledge discovery", *_header(knowledge)]
    if not knowledge.groups:
        lines += _clustering(knowledge)
    for index, group in enumerate(knowledge.groups):
        lines += _group(knowledge, index, group)
    return "\n".join(lines)
