"""What a test run makes outside its own processes (Docker hosts, network namespaces) goes when
the run ends in any way, SIGKILL included, when no teardown of the run's own can run.

A run starts a :class:`Reaper` before it makes anything: ``python -m <module> --reap <run>``,
in a session of its own (a Ctrl-C reaches only the run), whose standard input is a pipe from the
run. The kernel closes that pipe when the run's process ends, however it ends; the reaper, in
the module's ``--reap`` entry, then calls :func:`reap` with the module's removal for ``run``.
A run that removed its own calls :meth:`Reaper.close`: the reaper looks, finds nothing, and
ends. What a reaper could not remove, each module's next run removes (its ``remove_stale``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Reaper:
    """The reaper of run ``run`` of ``module`` (see the module docstring)."""

    def __init__(self, module: str, run: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--reap", run],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )

    def close(self) -> None:
        """End the reaper once the run has removed what it made (it looks, and ends)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def reap(run: str, remove: Callable[[str], list[str]]) -> None:
    """In a reaper: wait for the end of standard input, then ``remove(run)``; say what went."""
    sys.stdin.buffer.read()
    removed = remove(run)
    if removed:
        print(f"removed what run {run} left: {', '.join(removed)}", file=sys.stderr)
