"""Directory watch: files an instrument drops into a folder become tuples.

Polls the folder (no inotify dependency, works on network filesystems). A file
is taken once its size and mtime have not changed for ``settle_seconds``;
hidden files and ``.part``/``.tmp``/``.partial`` files are ignored. A taken file
is spooled (hard link or copy; never modified) and moved to ``done_dir`` (same
relative path) only once STORED or ENQUEUED. The spool remembers which files
it took, so a restart never sends a file twice. A delivered file that cannot be
moved (a done folder it may not write) stays, is logged, and is moved again
each pass; it is not taken again, after a restart either (the gateway keeps
such files, with each one's inode, size and mtime, in ``unmoved.json`` beside
its spool; a new file written under the same name later is a new tuple).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from hio.config import ConfigError
from hio.gateway.client import Gateway
from hio.gateway.config import infer_image, walk_files
from hio.gateway.spool import SpoolFull
from hio.transport.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("hio.gateway")


class DirectoryWatcher:
    """Feeds settled files of ``watch`` into a :class:`Gateway`. Thread-safe start/stop."""

    def __init__(
        self,
        gateway: Gateway,
        watch: str | os.PathLike[str],
        done_dir: str | os.PathLike[str],
        *,
        settle_seconds: float,
        poll_seconds: float = 0.25,
        image: str = "",
    ) -> None:
        self._gateway = gateway
        self.watch = Path(watch).resolve()
        self.done_dir = Path(done_dir).resolve()
        self._settle = settle_seconds
        self._poll = poll_seconds
        self._image = image
        self._seen: dict[Path, tuple[int, int, float]] = {}  # path -> (size, mtime_ns, unchanged since)
        self._refused: dict[Path, tuple[int, int]] = {}  # files we cannot send, until they change
        self._spool_full_logged = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hio-gateway-watch", daemon=True)
        self._thread.start()
        log.info("watching", extra={"folder": str(self.watch), "done": str(self.done_dir)})

    def stop(self) -> None:
        """Stop scanning (files already taken stay in the spool). Blocks until the scan ends."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.scan_once()
            except Exception:  # keep watching whatever one scan hits
                log.exception("watch scan failed", extra={"folder": str(self.watch)})
            self._stop.wait(self._poll)

    def scan_once(self, now: float | None = None) -> int:
        """One pass over the folder; spools settled files. Returns how many it took."""
        now = time.monotonic() if now is None else now
        self._gateway.retry_moves()
        taken_before = self._gateway.spool.move_sources() | self._gateway.unmoved_sources()
        present: set[Path] = set()
        took = 0
        for path in walk_files(self.watch, self.done_dir):
            present.add(path)
            if str(path) in taken_before or not self._settled(path, now):
                continue
            result = self._take(path)
            if result == "full":
                break  # try again next pass
            took += result == "taken"
        for gone in set(self._seen) - present:
            del self._seen[gone]
        return took

    def _settled(self, path: Path, now: float) -> bool:
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        seen = self._seen.get(path)
        if seen is None or seen[:2] != (st.st_size, st.st_mtime_ns):
            self._seen[path] = (st.st_size, st.st_mtime_ns, now)
            return False
        if self._refused.get(path) == seen[:2]:
            return False
        return now - seen[2] >= self._settle

    def _take(self, path: Path) -> str:
        """Spool one file: "taken", "refused" (cannot be sent as is), or "full" (spool)."""
        target = self.done_dir / path.relative_to(self.watch)
        try:
            image = infer_image(path, self._image)
            self._gateway.submit_file(path, image=image, move_to=target, timeout=0)
        except (SpoolFull, FailedPrecondition) as exc:  # full, or its disk failed to sync: try later
            if not self._spool_full_logged:
                self._spool_full_logged = True
                log.warning(
                    "spool full; new files wait in the folder"
                    if isinstance(exc, SpoolFull)
                    else "the spool takes no new files; they wait in the folder",
                    extra={"error": exc.message},
                )
            return "full"
        except (ConfigError, InvalidArgument) as exc:
            self._refused[path] = self._seen[path][:2]
            log.warning("file not sent", extra={"path": str(path), "error": str(exc)})
            return "refused"
        except FileNotFoundError:
            return "refused"
        self._spool_full_logged = False
        self._seen.pop(path, None)
        log.debug("file taken", extra={"path": str(path)})
        return "taken"
