"""The report of `hio bench`: plots like the paper's Fig. 3 and Fig. 4, and
``docs/benchmarks.md`` with the tables, the targets and the cells Spark wins.

Reads only the results CSV, so the report can be regenerated from a
committed CSV without measuring again (``hio bench --systems`` of points
already done does exactly that).
"""

from __future__ import annotations

import csv
import math
import os
import time
from pathlib import Path
from typing import Any

HIO = "hio-direct"
SPARK = ("spark-file", "spark-socket")
COLORS = {"hio-direct": "#2e7d32", "hio-queue": "#81c784", "spark-file": "#1565c0", "spark-socket": "#ef6c00"}

Row = dict[str, Any]


def size_label(size: int) -> str:
    for unit, scale in (("MB", 10**6), ("KB", 10**3)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def cost_label(cost_ms: float) -> str:
    if cost_ms == 0:
        return "0"
    return f"{cost_ms / 1000:g} s" if cost_ms >= 1000 else f"{cost_ms:g} ms"


def read_rows(path: Path) -> list[Row]:
    """Rows of the results CSV with numbers parsed (missing numbers are NaN)."""
    if not path.exists():
        return []
    rows: list[Row] = []
    with open(path, newline="") as fh:
        for raw in csv.DictReader(fh):
            row: Row = dict(raw)
            for key in (
                "size",
                "cost_ms",
                "max_rate",
                "bound",
                "fraction",
                "loopback_mb_s",
                "p50_ms",
                "p99_ms",
                "latency_rate",
                "first_fail_rate",
                "load_avg",
                "seconds",
                "cpu_slots",
                "steal",
            ):
                try:
                    row[key] = float(raw.get(key) or "nan")
                except ValueError:
                    row[key] = math.nan
            row["size"] = int(row["size"])
            rows.append(row)
    return rows


def _cells(rows: list[Row]) -> tuple[list[int], list[float]]:
    return sorted({r["size"] for r in rows}), sorted({r["cost_ms"] for r in rows})


def _index(rows: list[Row]) -> dict[tuple[str, int, float], Row]:
    return {(r["system"], r["size"], r["cost_ms"]): r for r in rows}


def _rate(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "–"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _pct(fraction: float | None) -> str:
    """A fraction of the bound as a percentage, readable down to tiny fractions."""
    if fraction is None or math.isnan(fraction):
        return "–"
    if fraction >= 0.01 or fraction == 0:
        return f"{fraction:.0%}"
    return f"{fraction * 100:.2g}%"


def best_per_cell(rows: list[Row]) -> dict[tuple[int, float], Row]:
    """The row with the highest rate in each (size, cost) cell; on a tie, the system listed first
    in :data:`COLORS` (so the picture does not depend on the order the runs were made in)."""
    order = {name: n for n, name in enumerate(COLORS)}
    best: dict[tuple[int, float], Row] = {}
    for row in sorted(rows, key=lambda r: order.get(r["system"], len(order))):
        key = (row["size"], row["cost_ms"])
        if key not in best or row["max_rate"] > best[key]["max_rate"]:
            best[key] = row
    return best


# -- plots ----------------------------------------------------------------------------------


def plot_heatmap(rows: list[Row], path: Path) -> None:
    """Fig. 3: the best system per cell (colour), its rate in bold, the others below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    sizes, costs = _cells(rows)
    index = _index(rows)
    systems = sorted({r["system"] for r in rows}, key=lambda s: list(COLORS).index(s) if s in COLORS else 99)
    best = best_per_cell(rows)
    fig, ax = plt.subplots(figsize=(2.3 * len(sizes) + 1.5, 1.25 * len(costs) + 1.6))
    for x, size in enumerate(sizes):
        for y, cost in enumerate(costs):
            winner = best.get((size, cost))
            colour = COLORS.get(winner["system"], "#999999") if winner else "#eeeeee"
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=colour, alpha=0.35, edgecolor="white"))
            lines = []
            for system in systems:
                row = index.get((system, size, cost))
                if row is not None:
                    lines.append((system, row))
            for n, (system, row) in enumerate(lines):
                is_best = winner is not None and system == winner["system"]
                ax.text(
                    x + 0.5,
                    y + 0.82 - n * 0.19,
                    f"{system}: {_rate(row['max_rate'])}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    fontweight="bold" if is_best else "normal",
                )
    ax.set_xlim(0, len(sizes))
    ax.set_ylim(0, len(costs))
    ax.set_xticks([i + 0.5 for i in range(len(sizes))], [size_label(s) for s in sizes])
    ax.set_yticks([i + 0.5 for i in range(len(costs))], [cost_label(c) for c in costs])
    ax.set_xlabel("message size")
    ax.set_ylabel("CPU cost per message")
    ax.set_title("Max sustained frequency (messages/s); colour = best system (ties: first in the legend)", fontsize=10)
    ax.legend(
        handles=[Patch(facecolor=COLORS.get(s, "#999"), alpha=0.5, label=s) for s in systems],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=len(systems),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frequency(rows: list[Row], path: Path) -> None:
    """Fig. 4: frequency against size, one panel per cost, with the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes, costs = _cells(rows)
    index = _index(rows)
    systems = sorted({r["system"] for r in rows}, key=lambda s: list(COLORS).index(s) if s in COLORS else 99)
    cols = min(2, len(costs))
    nrows = math.ceil(len(costs) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    for n, cost in enumerate(costs):
        ax = axes[n // cols][n % cols]
        bounds = [(s, index_bound(rows, s, cost)) for s in sizes]
        ax.plot([s for s, b in bounds if b], [b for _, b in bounds if b], "k--", label="bound", linewidth=1)
        for system in systems:
            points = [(s, index[(system, s, cost)]["max_rate"]) for s in sizes if (system, s, cost) in index]
            points = [(s, r) for s, r in points if r > 0]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", color=COLORS.get(system), label=system)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"CPU cost {cost_label(cost)} per message")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("max frequency (messages/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for n in range(len(costs), nrows * cols):
        axes[n // cols][n % cols].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def index_bound(rows: list[Row], size: int, cost: float) -> float:
    for row in rows:
        if row["size"] == size and row["cost_ms"] == cost and not math.isnan(row["bound"]):
            return row["bound"]
    return 0.0


def _bound_cell(rows: list[Row], size: int, cost: float) -> str:
    """The bound of a cell; a range when runs that measured different loopback speeds share it."""
    bounds = sorted(
        {
            row["bound"]
            for row in rows
            if row["size"] == size and row["cost_ms"] == cost and not math.isnan(row["bound"])
        }
    )
    if not bounds:
        return "–"
    if bounds[-1] - bounds[0] <= 1e-9 * bounds[-1]:
        return _rate(bounds[0])
    return f"{_rate(bounds[0])} – {_rate(bounds[-1])}"


# -- targets ---------------------------------------------------------------------------------


def cpu_left_fraction(row: Row) -> float:
    """The row's rate against the bound recomputed with the CPU the hypervisor left during the point.

    ``min(loopback / size, 2 * (1 - steal) / cost)``: on a virtual machine
    whose host takes part of our cores, no system can beat it. NaN when
    steal was not measured.
    """
    steal = row.get("steal", math.nan)
    if math.isnan(steal) or row["cost_ms"] <= 0:
        return math.nan
    network = row["loopback_mb_s"] * 1e6 / row["size"] if not math.isnan(row["loopback_mb_s"]) else math.inf
    bound = min(network, 2 * (1 - steal) / (row["cost_ms"] / 1000))
    return row["max_rate"] / bound if bound > 0 else math.nan


def _left(row: Row) -> str:
    left = cpu_left_fraction(row)
    return "" if math.isnan(left) else f" ({left:.0%} of the CPU left, steal {row['steal']:.0%})"


def check_targets(rows: list[Row]) -> list[tuple[str, str, str]]:
    """(target, status, detail) for each target of the benchmark issue."""

    index = _index(rows)
    out: list[tuple[str, str, str]] = []

    def hio(size: int, cost: float) -> Row | None:
        return index.get((HIO, size, cost))

    for size in (10**6, 10**7):
        row = hio(size, 0.0)
        if row is None:
            out.append((f"{size_label(size)}, no cost: >= 50% of bound", "not measured", ""))
            continue
        ok = row["fraction"] >= 0.5
        out.append(
            (
                f"{size_label(size)}, no cost: >= 50% of bound",
                "met" if ok else "NOT met",
                f"{_rate(row['max_rate'])}/s = {_pct(row['fraction'])} of {_rate(row['bound'])}/s",
            )
        )
        spark = index.get(("spark-file", size, 0.0))
        if spark is None:
            out.append((f"{size_label(size)}, no cost: >= 5x Spark file source", "not measured", ""))
        else:
            ratio = row["max_rate"] / spark["max_rate"] if spark["max_rate"] > 0 else math.inf
            out.append(
                (
                    f"{size_label(size)}, no cost: >= 5x Spark file source",
                    "met" if ratio >= 5 else "NOT met",
                    f"{ratio:.1f}x ({_rate(row['max_rate'])} vs {_rate(spark['max_rate'])}/s)",
                )
            )
    heavy = [r for r in rows if r["system"] == HIO and r["cost_ms"] >= 100]
    if heavy:
        low = [r for r in heavy if r["fraction"] < 0.9]
        detail = "; ".join(
            f"{size_label(r['size'])} x {cost_label(r['cost_ms'])}: {r['fraction']:.0%}{_left(r)}"
            for r in sorted(heavy, key=lambda r: (r["cost_ms"], r["size"]))
        )
        out.append(("cost >= 100 ms: >= 90% of bound in every cell", "met" if not low else "NOT met", detail))
    else:
        out.append(("cost >= 100 ms: >= 90% of bound in every cell", "not measured", ""))
    small = hio(100, 0.0)
    out.append(
        (
            "100-byte tuples: >= 10,000/s",
            "not measured" if small is None else ("met" if small["max_rate"] >= 10_000 else "NOT met"),
            "" if small is None else f"{_rate(small['max_rate'])}/s",
        )
    )
    losses = spark_wins(rows)
    worse = [(row, ratio) for row, ratio in losses if ratio > 2]
    out.append(
        (
            "no cell where Spark beats this system by more than 2x",
            "met" if not worse else "NOT met",
            "; ".join(
                f"{size_label(r['size'])} x {cost_label(r['cost_ms'])}: {r['system']} {ratio:.1f}x"
                for r, ratio in worse
            )
            or "none",
        )
    )
    return out


def spark_wins(rows: list[Row]) -> list[tuple[Row, float]]:
    """Cells where the best Spark source beats this system: (Spark's row, its factor)."""
    index = _index(rows)
    wins = []
    sizes, costs = _cells(rows)
    for size in sizes:
        for cost in costs:
            ours = index.get((HIO, size, cost))
            theirs = [index[(s, size, cost)] for s in SPARK if (s, size, cost) in index]
            if ours is None or not theirs:
                continue
            best = max(theirs, key=lambda r: r["max_rate"])
            if best["max_rate"] > ours["max_rate"]:
                ratio = best["max_rate"] / ours["max_rate"] if ours["max_rate"] > 0 else math.inf
                wins.append((best, ratio))
    return wins


# -- the document -----------------------------------------------------------------------------


def _table(rows: list[Row], systems: list[str]) -> list[str]:

    sizes, costs = _cells(rows)
    index = _index(rows)
    lines = ["| system | cost | " + " | ".join(size_label(s) for s in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    for cost in costs:
        lines.append(
            f"| *bound* | {cost_label(cost)} | " + " | ".join(f"*{_bound_cell(rows, s, cost)}*" for s in sizes) + " |"
        )
        for system in systems:
            cells = []
            for size in sizes:
                row = index.get((system, size, cost))
                cells.append("–" if row is None else f"{_rate(row['max_rate'])} ({_pct(row['fraction'])})")
            lines.append(f"| {system} | {cost_label(cost)} | " + " | ".join(cells) + " |")
    return lines


def _latency_table(rows: list[Row]) -> list[str]:

    with_latency = [r for r in rows if not math.isnan(r["p50_ms"])]
    if not with_latency:
        return ["No latency measured (no latency size in the grid)."]
    lines = ["| system | size | cost | at rate (/s) | p50 (ms) | p99 (ms) |", "|---|---|---|---|---|---|"]
    for r in sorted(with_latency, key=lambda r: (r["size"], r["cost_ms"], r["system"])):
        lines.append(
            f"| {r['system']} | {size_label(r['size'])} | {cost_label(r['cost_ms'])} | "
            f"{_rate(r['latency_rate'])} | {r['p50_ms']:,.0f} | {r['p99_ms']:,.0f} |"
        )
    return lines


def _failures(rows: list[Row]) -> list[str]:

    lines = ["| system | size | cost | first failing rate (/s) | why |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["system"], r["cost_ms"], r["size"])):
        if r.get("first_fail_reason"):
            lines.append(
                f"| {r['system']} | {size_label(r['size'])} | {cost_label(r['cost_ms'])} | "
                f"{_rate(r['first_fail_rate'])} | {r['first_fail_reason']} |"
            )
    return lines


def _span(values: list[float]) -> str:
    low, high = f"{min(values):.0%}", f"{max(values):.0%}"
    return low if low == high else f"{low}–{high}"


def _runs_table(rows: list[Row]) -> list[str]:
    """Which commit, machine and day each system's rows come from (the CSV's own columns), so a
    grid merged from several runs says what it merged."""

    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r["system"], r.get("commit") or "", r.get("machine") or ""), []).append(r)
    if not any(commit or machine for _, commit, machine in groups):
        return ["The results file records no commit or machine (it predates those columns)."]
    lines = [
        "| system | cells | commit | machine | finished | loopback (MB/s) | steal |",
        "|---|---|---|---|---|---|---|",
    ]
    order = {name: n for n, name in enumerate(COLORS)}
    for (system, commit, machine), group in sorted(
        groups.items(), key=lambda g: (order.get(g[0][0], 99), min(r.get("finished_at") or "" for r in g[1]))
    ):
        days = sorted({(r.get("finished_at") or "")[:10] for r in group} - {""})
        loop = sorted({r["loopback_mb_s"] for r in group if not math.isnan(r["loopback_mb_s"])})
        steal = [r["steal"] for r in group if not math.isnan(r.get("steal", math.nan))]
        lines.append(
            f"| {system} | {len(group)} | {f'`{commit}`' if commit else '–'} | {machine or '–'} | "
            f"{' to '.join(dict.fromkeys((days[0], days[-1]))) if days else '–'} | "
            f"{', '.join(f'{b:,.0f}' for b in loop) or '–'} | "
            f"{_span(steal) if steal else 'not recorded'} |"
        )
    return lines


# How cost grows with the cluster and the store is measured apart (`hio bench-scale`, its own page).
SCALE_LINK = (
    "How cost grows with scale (the master's routes/s by channels, the repository's restart and "
    "index by records stored, KD's interval by records stored): [benchmarks/scale.md](benchmarks/scale.md)."
)


def write_report(results: Path, out_dir: Path, config: Any = None) -> Path:
    """Plots under ``out_dir/benchmarks/`` and ``out_dir/benchmarks.md``; returns the doc's path."""

    rows = read_rows(results)
    plots = out_dir / "benchmarks"
    plots.mkdir(parents=True, exist_ok=True)
    doc = out_dir / "benchmarks.md"
    systems = sorted({r["system"] for r in rows}, key=lambda s: list(COLORS).index(s) if s in COLORS else 99)
    stem = results.stem
    lines = [
        "# Benchmarks: HarmonicIO against Spark Structured Streaming",
        "",
        (
            "*Generated by `hio bench` (`make bench`); do not edit by hand. "
            f"Source data: [`{results.name}`](benchmarks/{results.name}), every step in "
            f"[`{stem}-steps.csv`](benchmarks/{stem}-steps.csv).*"
        ),
        "",
        SCALE_LINK,
        "",
    ]
    if not rows:
        doc.write_text("\n".join([*lines, "No results yet: run `hio bench`.", ""]))
        return doc
    plot_heatmap(rows, plots / f"{stem}-best.png")
    plot_frequency(rows, plots / f"{stem}-frequency.png")
    loopback = sorted({r["loopback_mb_s"] for r in rows if not math.isnan(r["loopback_mb_s"])})
    loads = [r["load_avg"] for r in rows if not math.isnan(r["load_avg"])]
    slots = [r["cpu_slots"] for r in rows if not math.isnan(r.get("cpu_slots", math.nan))]
    steals = [r["steal"] for r in rows if not math.isnan(r.get("steal", math.nan))]
    lines += [
        "## How it was measured",
        "",
        (
            "Maximum sustained frequency per (message size, CPU cost per message) as in Blamey et al., "
            "*Apache Spark Streaming, Kafka and HarmonicIO* (Fig. 3, Fig. 4), on one "
            f"{os.cpu_count()}-core machine, every system with two processing slots:"
        ),
        "",
        (
            "* **hio-direct**: this system as deployed: gateway (in-process library) -> master route -> "
            "worker with two `hio/synthetic` engines (real processes) -> repository; the master picks direct "
            "or queue. **hio-queue**: the same, every tuple forced through the master's backlog queue."
        ),
        (
            "* **spark-file**: Spark Structured Streaming (`local[2]`), `binaryFile` source; each message "
            "written beside the watched folder and renamed into it; fresh folder and checkpoint per point."
        ),
        (
            "* **spark-socket**: Spark Structured Streaming (`local[2]`), `socket` source (lines; text-safe "
            "payloads); the benchmark is the server Spark reads from."
        ),
        "",
        (
            "One message generator (a 48-byte header naming step, sequence and send time, then the body), one "
            "CPU burn (`hio.worker.pipelines.synthetic.burn_cpu`, thread CPU time, not wall time). "
            "A step sends N messages paced at the target rate and passes only if the source kept the pace, "
            ">= 95% were finished within a grace after the last send (4 s or twice the latency seen, plus 2x "
            "the cost), the backlog (sent - finished) did not grow once the pipeline was full (least-squares "
            "slope; steps last at least three latencies), and there were no errors. The rate ramps up, "
            "then bisects to within 5%. "
            "Finished means: features stored in the repository (this system); the micro-batch that processed "
            "it completed (Spark). Latency is from accepted (gateway) / sent (Spark) to finished, at half the "
            "maximum rate."
        ),
        "",
        (
            "The bound is `min(loopback bandwidth / size, 2 / cost)`; loopback bandwidth (one TCP stream, "
            f"measured by each run): {', '.join(f'{b:,.0f}' for b in loopback)} MB/s. Cells show "
            "messages/s and, in brackets, the fraction of the bound."
        ),
        "",
        (
            f"**Load.** The 1-minute load average after each point was {min(loads):.1f} to {max(loads):.1f} "
            f"on {os.cpu_count()} cores; it counts the measured system's own processes and threads, so it "
            "says little about other work on the machine. The CPU share below does."
        )
        if loads
        else "",
        "",
        (
            f"Before each point two processes burned 0.2 s of CPU each: the machine gave "
            f"{min(slots):.2f} to {max(slots):.2f} of the 2 slots the bound assumes (column `cpu_slots` "
            "of the CSV); a CPU-bound cell cannot exceed `cpu_slots / cost`."
        )
        if slots
        else "",
        "",
        (
            f"**Steal.** This is a virtual machine: while the points ran, its hypervisor took "
            f"{min(steals):.0%} to {max(steals):.0%} of the machine's CPU time for other guests (column `steal`, "
            "from `/proc/stat`, measured around each point's steps; "
            f"{sum(1 for r in rows if not math.isnan(r.get('steal', math.nan)))} of {len(rows)} points have it). "
            "No system can use CPU the host does not give it: for costly cells the targets also show the "
            "rate against `min(loopback / size, 2 x (1 - steal) / cost)`. It is a rough guide only: steal is "
            "averaged over a point's steps, quiet moments included, and some 1 s cells come out above 100% "
            "of it."
        )
        if steals
        else "",
        "",
        (
            "**Runs.** Each row of the CSV records when it finished, the commit it measured (`+changes`: "
            "with uncommitted changes to the code) and the machine; the grid below merges these runs:"
        ),
        "",
        *_runs_table(rows),
        "",
        "## Best system per cell (Fig. 3)",
        "",
        f"![best system per cell](benchmarks/{stem}-best.png)",
        "",
        "## Frequency against size (Fig. 4)",
        "",
        f"![frequency against size](benchmarks/{stem}-frequency.png)",
        "",
        "## Maximum sustained frequency (messages/s, fraction of bound)",
        "",
        *_table(rows, systems),
        "",
        "## Latency at half the maximum rate",
        "",
        *_latency_table(rows),
        "",
        "## Targets",
        "",
        "| target | status | detail |",
        "|---|---|---|",
        *[f"| {t} | {s} | {d} |" for t, s, d in check_targets(rows)],
        "",
        "## Cells where Spark wins",
        "",
    ]
    wins = spark_wins(rows)
    if wins:
        for row, ratio in wins:
            lines.append(
                f"* {size_label(row['size'])} x {cost_label(row['cost_ms'])}: {row['system']} "
                f"{_rate(row['max_rate'])}/s, {ratio:.2f}x this system."
            )
    else:
        lines.append("None.")
    lines += [
        "",
        "## Why each first failing step failed",
        "",
        *_failures(rows),
        "",
        f"*Written {time.strftime('%Y-%m-%d %H:%M:%S')}.*",
        "",
    ]
    analysis = out_dir / "benchmarks" / "analysis.md"
    if analysis.exists():
        lines[-2:-2] = ["## Analysis", "", analysis.read_text().strip(), ""]
    doc.write_text("\n".join(lines))
    return doc
