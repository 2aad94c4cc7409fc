"""Knowledge discovery on Spark (``hio kd``): every interval, read only the new
feature records from the repository (a Structured Streaming query over a
Python data source whose offsets are repository offsets), accumulate them as
Parquet, cluster them hierarchically, and write knowledge and a preview back.

Importing this package is cheap: pyspark is imported only when KD runs.
"""

from __future__ import annotations

from hio.kd.config import KDConfig

__all__ = ["KDConfig", "run_kd"]


def run_kd(config: KDConfig) -> int:
    """Run KD until SIGTERM/SIGINT (exit 0), or one catch-up pass with ``once``."""
    from hio.kd.job import run

    return run(config)
