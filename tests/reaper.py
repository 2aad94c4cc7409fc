"""What a test run makes outside its own processes (Docker hosts, network namespaces) goes when
the run ends in any way, SIGKILL included, when no teardown of the run's own can run.

A run is named ``<pid>-<start ticks>`` (:func:`run_id`), a name no other process has, and labels
what it makes with it; :func:`run_gone` tells a run that has ended from one still going.

A run starts a :class:`Reaper` before it makes anything: ``python -m <module> --reap <run>``,
in a session of its own (a Ctrl-C reaches only the run), whose standard input is a pipe from the
run. The kernel closes that pipe when the run's process ends, however it ends; the reaper, in
the module's ``--reap`` entry, then calls :func:`reap` with the module's removal for ``run``.
A run that removed its own calls :meth:`Reaper.close`: the reaper looks, finds nothing, and
ends. What a reaper could not remove, each module's next run removes (its ``remove_stale``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from hio.process.procs import start_ticks

REPO = Path(__file__).resolve().parents[1]


def run_id(pid: int | None = None) -> str:
    """``<pid>-<start ticks>``: names this process (or ``pid``) for good (pids are reused)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{start_ticks(pid)}"


def run_gone(run: str) -> bool:
    """Whether the run ``<pid>-<start ticks>`` has ended."""
    pid = run.split("-")[0]
    return not pid.isdigit() or run_id(int(pid)) != run


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


def kill_a_run(script: str, *args: str, before: Callable[[str], None]) -> str:
    """Run ``script`` (``python -c``, from the checkout) as a test run that makes something and
    prints a name for it; call ``before(name)`` on it, then kill the run with SIGKILL, so that
    no teardown of its own runs. The name, for the caller to see what its reaper removed."""
    run = subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert run.stdout is not None and run.stderr is not None
        name = run.stdout.readline().strip()
        assert name, f"the run ended before it made anything:\n{run.stderr.read()[-3000:]}"
        before(name)
        return name
    finally:
        run.kill()
        run.wait()
