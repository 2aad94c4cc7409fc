"""Knowledge of several groups without Spark: which groups are clustered, the
assignment bound shared by all groups, backward-compatible top-level fields,
and the text people read. (Clustering itself runs on Spark in test_kd_spark.)"""

from __future__ import annotations

import numpy as np

from hio.kd.model import (
    Clustering,
    GroupResult,
    assign,
    listed_counts,
    plan,
    to_knowledge,
    ward_linkage,
)
from hio.kd.preview import render
from hio.kd.report import format_knowledge
from hio.kd.store import Group
from hio.proto import features_pb2


def group(image: str, names: tuple[str, ...], offsets: list[int], seed: int = 0) -> Group:
    g = Group(image, names)
    values = np.random.default_rng(seed).normal(size=(len(offsets), len(names)))
    values[::2] += 10.0  # two clear blobs
    g.add(np.array(offsets, dtype=np.uint64) + 1000, np.array(offsets, dtype=np.int64), values)
    return g


def clustered(g: Group) -> GroupResult:
    """A two-cluster result computed directly (the centres of the two blobs)."""
    mean, std = g.mean_std()
    scaled = (g.values - mean) / std
    centres = np.stack([scaled[::2].mean(axis=0), scaled[1::2].mean(axis=0)])
    labels = assign(g.values, centres, mean, std, block=7)  # raw rows normalised block by block ...
    assert (labels == ((scaled[:, None, :] - centres[None]) ** 2).sum(axis=2).argmin(axis=1)).all()  # ... = nearest
    return GroupResult(
        g,
        Clustering(
            mean,
            std,
            centres,
            labels,
            np.bincount(labels, minlength=2),
            ward_linkage(centres),
            np.arange(g.count),
            f"test image='{g.image}'",
        ),
    )


def test_plan_keeps_main_and_bounds_clustered_groups() -> None:
    big, mid, small = group("a", ("x",), list(range(1, 11))), group("b", ("y",), [11, 12, 13]), group("c", ("z",), [14])
    ordered = [big, mid, small]
    assert plan(ordered, "", 8) == (big, [big, mid, small])
    assert plan(ordered, "", 2) == (big, [big, mid])
    assert plan(ordered, "c", 2) == (small, [small, big])  # the preferred image is always clustered
    assert plan(ordered, "absent", 1) == (None, [big])
    assert plan([], "", 4) == (None, [])


def test_assignment_bound_is_shared_by_all_groups_most_recent_first() -> None:
    first = group("hio/microscopy", ("a", "b"), [*range(1, 7), 20, 21])  # 8 tuples
    second = group("hio/simulation", ("u",), list(range(7, 20)))  # 13 tuples, offsets 7..19
    results = [clustered(second), clustered(first)]
    assert listed_counts(results, 100) == [13, 8]
    assert listed_counts(results, 5) == [3, 2]  # offsets 17, 18, 19 and 20, 21
    assert listed_counts(results, 0) == [0, 0]
    knowledge = to_knowledge(
        results, second, up_to_offset=21, malformed=0, new_records=21, interval_seconds=0.1, max_assignments=5
    )
    assert [g.image for g in knowledge.groups] == ["hio/simulation", "hio/microscopy"]
    assert [g.tuple_count for g in knowledge.groups] == [13, 8]
    listed = [a.tuple_id for g in knowledge.groups for a in g.assignments]
    assert sorted(listed) == [1017, 1018, 1019, 1020, 1021]
    assert knowledge.assignments_omitted == 21 - 5
    # top level: the main group, exactly as its entry in `groups`
    main = knowledge.groups[0]
    assert knowledge.tuple_count == 13 and list(knowledge.feature_names) == ["u"]
    assert list(knowledge.clusters) == list(main.clusters) and list(knowledge.assignments) == list(main.assignments)
    assert knowledge.algorithm == main.algorithm


def test_group_beyond_max_groups_is_counted_not_clustered() -> None:
    big, small = group("a", ("x", "y"), list(range(1, 11))), group("b", ("z",), [11, 12])
    results = [clustered(big), GroupResult(small, None, "not clustered: max_groups")]
    knowledge = to_knowledge(
        results, big, up_to_offset=12, malformed=2, new_records=12, interval_seconds=0.1, max_assignments=100
    )
    assert sum(g.tuple_count for g in knowledge.groups) == 12
    assert not knowledge.groups[1].clusters and not knowledge.groups[1].assignments
    assert knowledge.assignments_omitted == 2
    text = format_knowledge(knowledge)
    assert "tuples:        12 (up to repository offset 12)" in text
    assert "group 1 of 2: image a, 10 tuples (main" in text
    assert "group 2 of 2: image b, 2 tuples" in text and "not clustered: max_groups" in text
    assert "assignments:   10 listed, 2 omitted" in text


def test_no_groups_and_absent_preferred_image() -> None:
    empty = to_knowledge([], None, up_to_offset=0, malformed=0, new_records=0, interval_seconds=0.0, max_assignments=10)
    assert empty.algorithm.startswith("none") and not empty.groups
    only = clustered(group("a", ("x",), [1, 2, 3, 4]))
    other = to_knowledge(
        [only], None, up_to_offset=4, malformed=0, new_records=4, interval_seconds=0.0, max_assignments=10
    )
    assert other.tuple_count == 0 and not other.clusters and other.groups[0].tuple_count == 4
    assert "preferred image" in other.algorithm


def test_preview_draws_a_row_per_group() -> None:
    def height(png: bytes) -> int:
        return int.from_bytes(png[20:24], "big")  # PNG IHDR height

    one = render([clustered(group("a", ("x", "y"), list(range(1, 21))))], [(1.0, 20)])
    two = render(
        [
            clustered(group("a", ("x", "y"), list(range(1, 21)))),
            clustered(group("b", ("u", "v", "w"), list(range(21, 31)), seed=3)),
        ],
        [(1.0, 30)],
    )
    capped = render(
        [clustered(group(f"g{i}", ("x", "y"), list(range(10 * i + 1, 10 * i + 11)))) for i in range(3)], [], max_rows=2
    )
    assert one.startswith(b"\x89PNG") and two.startswith(b"\x89PNG")
    assert height(two) > height(one) and height(capped) == height(two)


def test_knowledge_without_groups_still_reads() -> None:
    """Knowledge without groups prints its one group from the top-level fields."""
    k = features_pb2.Knowledge(
        tuple_count=3, feature_names=["a"], feature_mean=[0.0], feature_std=[1.0], algorithm="old"
    )
    k.clusters.add(id=0, centre=[0.0], count=3)
    text = format_knowledge(k)
    assert "algorithm:     old" in text and "#0           3 tuples" in text and "group 1" not in text


def test_a_group_keeps_its_rows_and_their_mean_and_std_as_batches_arrive() -> None:
    """Rows appended over many intervals (the arrays grow past their first capacity) are
    kept in order, and the running mean and std agree with numpy's over every row."""
    rng = np.random.default_rng(3)
    g = Group("a", ("x", "y", "flat"))
    batches = [rng.normal(loc=1e6, scale=s, size=(n, 3)) for n, s in [(1, 1.0), (700, 5.0), (3, 0.1), (2500, 2.0)]]
    offset = 0
    for batch in batches:
        batch[:, 2] = 7.0  # a constant feature
        offsets = np.arange(offset, offset + len(batch), dtype=np.int64)
        g.add(offsets.astype(np.uint64) + 10, offsets, batch)
        offset += len(batch)
    g.add(np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64), np.empty((0, 3)))
    every = np.concatenate(batches)
    assert g.count == len(every) == 3204
    assert (g.values == every).all() and (g.offsets == np.arange(3204)).all() and (g.ids == g.offsets + 10).all()
    mean, std = g.mean_std()
    assert np.allclose(mean, every.mean(axis=0), rtol=0, atol=1e-6)
    assert np.allclose(std[:2], every[:, :2].std(axis=0), rtol=1e-9)
    assert std[2] == 1.0  # constant: neither explodes nor matters
