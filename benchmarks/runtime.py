"""Per-tuple overhead of the docker runtime against the local-process runtime.

Starts a repository, a master and one worker with one ``hio/synthetic``
engine (``--runtime process``, then ``--runtime docker``), and sends tuples of
``--size`` bytes one at a time with no processing cost (``cost_ms=0``): each
``Gateway.send`` returns once the features are STORED, so its wall time is the
whole per-tuple path (route, stream, process, compress, store). The difference
between the runtimes is what the container adds.

    .venv/bin/python -m benchmarks.runtime [--tuples 200] [--size 1048576] [--json out.json]

Needs a Docker engine and the images (`make images`) for the docker runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hio.cluster import LocalCluster
from hio.gateway import Gateway

IMAGE = "hio/synthetic"
WARMUP = 5


def run_one(runtime: str, tuples: int, size: int, root: Path) -> dict[str, float]:
    """Per-tuple latencies (seconds) of ``tuples`` sequential sends on ``runtime``."""
    with LocalCluster(
        root, workers={f"bench-{runtime}": [f"{IMAGE}=1"]}, runtime=runtime, worker_timeout=120
    ) as cluster:
        payload = os.urandom(size)
        latencies = []
        with Gateway(
            master_address=cluster.master,
            repository_address=cluster.repository,
            data_dir=str(root / "gw"),
            source="bench",
            progress=False,
            streams=1,
        ) as gw:
            for i in range(WARMUP + tuples):
                start = time.perf_counter()
                gw.send(payload, image=IMAGE, name=f"t{i}", attributes={"cost_ms": "0"}, timeout=120)
                if i >= WARMUP:
                    latencies.append(time.perf_counter() - start)
        return summarise(latencies, size)


def summarise(latencies: list[float], size: int) -> dict[str, float]:
    ordered = sorted(latencies)
    total = sum(latencies)
    return {
        "tuples": len(latencies),
        "mean_ms": 1000 * total / len(latencies),
        "p50_ms": 1000 * statistics.median(ordered),
        "p95_ms": 1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "tuples_per_s": len(latencies) / total,
        "mb_per_s": len(latencies) * size / total / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tuples", type=int, default=200, help="measured tuples per runtime")
    parser.add_argument("--size", type=int, default=1024 * 1024, help="bytes per tuple")
    parser.add_argument("--runtimes", default="process,docker", help="comma-separated runtimes")
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.tuples < 1 or args.size < 1:
        parser.error("--tuples and --size must be positive")
    results: dict[str, dict[str, float]] = {}
    for runtime in [r.strip() for r in args.runtimes.split(",") if r.strip()]:
        with tempfile.TemporaryDirectory(prefix=f"hio-bench-{runtime}-") as tmp:
            results[runtime] = run_one(runtime, args.tuples, args.size, Path(tmp))
        r = results[runtime]
        print(
            f"{runtime:>8}: {r['tuples']:.0f} tuples of {args.size} B: mean {r['mean_ms']:.2f} ms, "
            f"p50 {r['p50_ms']:.2f} ms, p95 {r['p95_ms']:.2f} ms, {r['tuples_per_s']:.1f} tuples/s, "
            f"{r['mb_per_s']:.1f} MB/s",
            flush=True,
        )
    if "process" in results and "docker" in results:
        extra = results["docker"]["mean_ms"] - results["process"]["mean_ms"]
        print(f"docker overhead per tuple: {extra:+.2f} ms mean ({extra / results['process']['mean_ms']:+.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
