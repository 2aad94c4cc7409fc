"""A Spark standalone cluster on loopback for tests: a master and workers, each a
JVM started from the virtualenv's pyspark (``$SPARK_HOME/bin/spark-class``, with
``SPARK_HOME`` the pyspark package folder), as an operator starts one.

    with SparkStandalone(tmp_path, workers=2) as cluster:
        run KD with spark_master=cluster.url
        cluster.running_tasks(0)    # what worker 0's executor is doing
        cluster.kill_worker(0)      # SIGKILL, its executor too
        cluster.start_worker(0)     # the same worker, back (a new JVM)

Every daemon binds to 127.0.0.1 (``SPARK_LOCAL_IP`` and ``--host``) on ports
chosen free, keeps its work and scratch folders under ``root`` and logs to
``root/logs/``. The JVMs die with the thread of this process that started them
(:func:`tests.harness.die_with_starter`), so a test run killed with -9 leaves none behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import IO, Any, Self

from hio.process.procs import children, free_port, spawn
from tests.harness import die_with_starter

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
TASK_LINE = re.compile(r"Executor: (Running|Finished) task \S+ in stage \S+ \(TID (\d+)\)")


def spark_home() -> Path:
    """The pyspark package folder: it holds ``bin/spark-class`` and the jars."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


class SparkStandalone:
    """A master and ``workers`` workers (``cores`` and ``memory`` each) on loopback."""

    def __init__(self, root: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.root = Path(root)
        self.cores = cores
        self.memory = memory
        self.port = free_port()
        self.webui_port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.master: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes] | None] = [None] * workers
        self._logs: list[IO[bytes]] = []

    def _env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HIO_", "SPARK_", "PYSPARK_"))}
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_LOCAL_DIRS=str(self.root / name / "scratch"),
            SPARK_DAEMON_MEMORY="256m",
        )
        return env

    def _launch(self, name: str, main_class: str, args: list[str]) -> subprocess.Popen[bytes]:
        (self.root / name / "scratch").mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        log = open(self.root / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - open while the JVM writes; closed by stop()
        self._logs.append(log)
        command = [str(spark_home() / "bin" / "spark-class"), main_class, "--host", "127.0.0.1", *args]
        return spawn(
            lambda: subprocess.Popen(
                die_with_starter(command),
                cwd=self.root / name,
                env=self._env(name),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        )

    def start(self, timeout: float = 120.0) -> Self:
        """Start the master and every worker; return once all workers are registered."""
        self.master = self._launch(
            "master", MASTER_CLASS, ["--port", str(self.port), "--webui-port", str(self.webui_port)]
        )
        for index in range(len(self.workers)):
            self.start_worker(index, wait=False)
        self.wait_workers(timeout)
        return self

    def start_worker(self, index: int, wait: bool = True, timeout: float = 120.0) -> None:
        """Start worker ``index`` (again, after ``kill_worker``); wait until the master has it."""
        assert self.workers[index] is None, f"worker {index} was started and not killed"
        name = f"worker-{index}"
        args = ["--port", str(free_port()), "--webui-port", str(free_port()), "--cores", str(self.cores)]
        args += ["--memory", self.memory, "--work-dir", str(self.root / name / "work"), self.url]
        self.workers[index] = self._launch(name, WORKER_CLASS, args)
        if wait:
            self.wait_workers(timeout)

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker ``index`` with the executors it started and their Python workers, at
        once, as when its host goes down: whatever task ran there is cut off. The worker is
        then forgotten (``wait_workers`` and ``stop`` leave it out) until ``start_worker``."""
        worker = self.workers[index]
        assert worker is not None, f"worker {index} was never started"
        tree, todo = [], [worker.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children(pid)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        worker.wait(30)
        self.workers[index] = None

    def running_tasks(self, index: int) -> set[int]:
        """Tasks (ids) the newest executor of worker ``index`` started and has not finished, from its
        log: what a kill of that worker cuts off (and, once it is dead, what it did cut off)."""
        folders = list((self.root / f"worker-{index}" / "work").glob("app-*/*/"))
        if not folders:
            return set()
        log = max(folders, key=lambda p: p.stat().st_mtime_ns) / "stderr"
        started: set[int] = set()
        finished: set[int] = set()
        for match in TASK_LINE.finditer(log.read_text(errors="replace") if log.exists() else ""):
            (started if match.group(1) == "Running" else finished).add(int(match.group(2)))
        return started - finished

    def state(self) -> dict[str, Any]:
        """The master's own view (its web UI's JSON): workers, applications, cores."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.webui_port}/json/", timeout=5) as reply:
            return dict(json.load(reply))

    def alive_workers(self) -> int:
        try:
            return sum(1 for w in self.state().get("workers", []) if w.get("state") == "ALIVE")
        except OSError:
            return 0

    def wait_workers(self, timeout: float = 120.0) -> None:
        """Wait until the master counts every worker started and not killed ALIVE; raise with
        the logs if not, at once if one of them (or the master) has exited."""
        started = [(index, w) for index, w in enumerate(self.workers) if w is not None]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            gone = [f"worker {i} (exit {w.returncode})" for i, w in started if w.poll() is not None]
            if self.master is not None and self.master.poll() is not None:
                gone.append(f"the master (exit {self.master.returncode})")
            if gone:
                raise RuntimeError(f"the Spark daemons {', '.join(gone)} exited:\n{self.output()}")
            if self.alive_workers() == len(started):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Spark master did not count {len(started)} live workers:\n{self.output()}")

    def output(self, limit: int = 3000) -> str:
        """The tail of every daemon's log."""
        parts = []
        for path in sorted((self.root / "logs").glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-limit:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM every daemon (workers first: they take their executors along), then wait."""
        for proc in [*self.workers, self.master]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [*self.workers, self.master]:
            if proc is not None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
