"""``hio send FILE...``: send files as tuples, wait until stored, report.

Tuples an earlier ``hio send`` (same ``--source``) left spooled go first: a
file named again that is one of them (same name, size, mtime and content) is not
sent twice, and ``hio send`` with no FILE only finishes them.
``hio send --drop-spooled`` drops them instead, naming each.

A tuple whose processing failed on an engine is in the master's queue, which
tries it again: it counts as delivered and is listed (``RETRYING``) with the
engine's error.

Exit codes: 0 when every file was STORED or ENQUEUED; 1 when some failed (one
line each) or the master went away mid-way (what was not delivered stays
spooled and goes with the next ``hio send``); 2 for unusable input or a master
unreachable from the start.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast

import grpc

from hio.config import ConfigError, state_dir
from hio.gateway.client import Gateway, TupleFuture
from hio.gateway.config import SendConfig, infer_image, walk_files
from hio.gateway.spool import Spool, SpoolFull, SpoolInUse, safe_name, spooled_metas
from hio.proto.tuple_pb2 import TupleMeta, TupleReceipt
from hio.transport.frames import WireFrame, crc32_of_file, frames_for_file
from hio.transport.net import create_channel, rpc_error_text, send_frames

if TYPE_CHECKING:
    from tqdm import tqdm

MB = 1e6


def run_send(config: SendConfig) -> int:
    """Send ``config.files`` (folders walked); print a summary. Blocks; returns the exit code."""
    if config.drop_spooled:
        return _drop_spooled(config)
    try:
        files = _collect(config.files)
        images = {path: infer_image(path, config.image) for path in files}
    except ConfigError as exc:
        return _unusable(str(exc))
    if config.files and not files:
        return _unusable("no files to send (hidden and .part/.tmp files are skipped)")
    if not config.wait:
        return _hand_over(config, files, images)
    if not files and not spooled_metas(send_spool(config)):
        return _unusable(
            f"nothing to send: no FILE named, and no earlier hio send (source "
            f"'{config.resolved_source()}') left tuples spooled"
        )
    problem = _master_problem(config)
    if problem:
        return _unusable(problem)
    return _Sender(config, files, images).run()


def _unusable(problem: str) -> int:
    """Say why ``hio send`` cannot start; the exit code."""
    print(f"hio send: {problem}", file=sys.stderr)
    return 2


def _collect(names: tuple[str, ...]) -> list[Path]:
    """Files named, with folders walked in name order; refuses missing paths."""
    files: list[Path] = []
    for name in names:
        path = Path(name)
        if path.is_dir():
            files += walk_files(path)
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"{name}: no such file or folder")
    return files


def send_spool(config: SendConfig) -> Path:
    """The spool folder of ``hio send`` for this source (what Gateway opens for it)."""
    return state_dir(config.data_dir, "gateway") / "spool" / safe_name(_spool_name(config))


def _spool_in_use(config: SendConfig) -> int:
    """Say that a running ``hio send`` of this source holds its spool; the exit code."""
    return _unusable(
        f"another hio send of source '{config.resolved_source()}' is running and holds its "
        "spool; wait for it to finish (or stop it), or give this one its own --source"
    )


def _spool_name(config: SendConfig) -> str:
    return f"send-{config.resolved_source()}"


def _drop_spooled(config: SendConfig) -> int:
    """Drop what earlier ``hio send`` runs left spooled (a misspelt image, files no
    longer wanted), naming each tuple; nothing is sent."""
    root = send_spool(config)
    try:
        spool = Spool(root, config.spool_bytes, memory_bytes=0)
    except SpoolInUse:  # a running hio send holds it
        return _spool_in_use(config)
    try:
        entries = spool.entries()
        for entry in entries:
            meta = entry.meta
            print(
                f"dropped {meta.name or '(unnamed)'} ({meta.size / MB:.1f} MB, image {meta.image}"
                f"{f', id {meta.tuple_id}' if meta.tuple_id else ''})"
            )
        spool.remove_many(entries)
    finally:
        spool.close()
    print(
        f"dropped {len(entries)} spooled tuples ({sum(e.size for e in entries) / MB:.1f} MB) of source "
        f"'{config.resolved_source()}'"
    )
    return 0


def _master_problem(config: SendConfig) -> str:
    """'' when the master answers within connect_seconds, else a message naming it."""
    channel = create_channel(config.master_address, config)
    try:
        grpc.channel_ready_future(channel).result(timeout=config.connect_seconds)
        return ""
    except grpc.FutureTimeoutError:
        return (
            f"cannot reach the master at {config.master_address} within {config.connect_seconds:.0f}s: "
            "is it running there, and does a firewall let this host reach that port? (--master-address)"
        )
    finally:
        channel.close()


class _Sender:
    """One ``hio send`` run: spool, wait with a progress bar, summarise."""

    def __init__(self, config: SendConfig, files: list[Path], images: dict[Path, str]) -> None:
        self.config = config
        self.files = files
        self.images = images
        self.failures: list[str] = []
        self.tuples = len(files)  # the files, and the resumed tuples not among them
        self.bar: tqdm[NoReturn] | None = None
        self._tick_lock = threading.Lock()
        self._settled = 0
        self.unserved: dict[TupleFuture, str] = {}  # given up on: no engine serves the image
        self.refusal = ""  # the master refused us (token, certificate)

    def run(self) -> int:
        try:
            gateway = Gateway(self.config, spool_name=_spool_name(self.config))
        except SpoolInUse:
            return _spool_in_use(self.config)
        except ConfigError as exc:
            return _unusable(str(exc))
        start = time.monotonic()
        futures = self._resumed(gateway)
        resumed = {label for label in futures.values() if isinstance(label, Path)}  # files among them
        sizes = [st.st_size for p in self.files if p not in resumed and (st := _stat(p)) is not None]
        total = sum(sizes) + sum(f.size for f in futures)  # a file gone by now is reported by its submit
        self.bar = _progress(self.config, total)
        for future in futures:  # after the bar exists, so one settled already counts on it
            future.add_done_callback(self._tick)
        try:
            futures.update(self._submit_all(gateway, resumed))
            gave_up = self._wait(gateway, futures)
        finally:
            if self.bar is not None:
                self.bar.close()
            gateway.close(timeout=self.config.grace_seconds, drain=False)
        return self._summary(gateway, futures, time.monotonic() - start, gave_up)

    def _resumed(self, gateway: Gateway) -> dict[TupleFuture, Path | str]:
        """The tuples an earlier run left spooled, each matched to the file it was (same
        name, size, mtime and content CRC) when that file is named again, else labelled
        by its name: they are waited for, and a file among them is not sent twice."""
        by_identity: dict[tuple[str, int, float], list[Path]] = {}
        for path in self.files:
            st = _stat(path)
            if st is not None:
                by_identity.setdefault((path.name, st.st_size, st.st_mtime), []).append(path)
        futures: dict[TupleFuture, Path | str] = {}
        for future in gateway.resumed_futures:
            same = _same_file(future, by_identity.get((future.name, future.size, future.created_unix), []))
            if same is None:
                futures[future] = f"{future.name or '(unnamed)'} (spooled earlier)"
                self.tuples += 1
            else:
                futures[future] = same
                if future.image != self.images[same]:
                    print(
                        f"hio send: {same} was spooled earlier for image '{future.image}' and goes "
                        f"as that; to send it for '{self.images[same]}', drop it first "
                        "(hio send --drop-spooled)",
                        file=sys.stderr,
                    )
        if futures:
            named = sum(isinstance(label, Path) for label in futures.values())
            among = f", {named} of them among the files named" if named else ""
            print(f"resuming {len(futures)} tuples left spooled by an earlier hio send{among}", file=sys.stderr)
        return futures

    def _submit_all(self, gateway: Gateway, resumed: set[Path]) -> dict[TupleFuture, Path | str]:
        futures: dict[TupleFuture, Path | str] = {}
        for path in self.files:
            if path in resumed:
                continue
            future = self._submit(gateway, path)
            if future is not None:
                future.add_done_callback(self._tick)
                futures[future] = path
        return futures

    def _submit(self, gateway: Gateway, path: Path) -> TupleFuture | None:
        """Spool one file, waiting while the spool is full (as long as the master answers)."""
        while True:
            try:
                return gateway.submit_file(path, image=self.images[path], timeout=1.0)
            except SpoolFull:
                if gateway.status().master_unreachable_seconds > self.config.connect_seconds:
                    self.failures.append(f"{path}: not spooled: spool full and the master is unreachable")
                    return None
            except Exception as exc:  # noqa: BLE001 - the file is reported as failed (hio's errors say why)
                self.failures.append(f"{path}: {exc}")
                return None

    def _tick(self, future: concurrent.futures.Future[int]) -> None:
        """Progress: called from delivery threads as each tuple settles."""
        with self._tick_lock:
            self._settled += 1
            if self.bar is not None:
                self.bar.update(getattr(future, "size", 0))
                self.bar.set_postfix_str(f"{self._settled}/{self.tuples} tuples", refresh=False)

    def _wait(self, gateway: Gateway, futures: dict[TupleFuture, Path | str]) -> bool:
        """Wait for every future; True when we gave up because the master stayed away.

        Files whose image no engine serves are given up on after ``image_wait_seconds``
        (a misspelt --image, or workers not started): waiting on would never end.
        """
        pending = set(futures)
        while pending:
            # wait() hands back the futures it was given
            pending = cast("set[TupleFuture]", concurrent.futures.wait(pending, timeout=0.5).not_done)
            status = gateway.status()
            if pending and status.master_unreachable_seconds > self.config.connect_seconds:
                return True
            if pending and status.master_refusal:  # a token or certificate: waiting cannot help
                self.refusal = status.master_refusal
                return True
            for image, (seconds, words) in status.unserved_images.items():
                if seconds > self.config.image_wait_seconds:
                    self._give_up_on(image, words, pending)
        return False

    def _give_up_on(self, image: str, words: str, pending: set[TupleFuture]) -> None:
        for future in [f for f in pending if f.image == image]:
            pending.discard(future)
            self.unserved[future] = (
                f"not delivered: no engine serves image '{image}' after "
                f"{self.config.image_wait_seconds:.0f}s (master: {words}); "
                "it stays spooled for the next hio send (hio send --drop-spooled "
                "drops it)"
            )

    def _summary(self, gateway: Gateway, futures: dict[TupleFuture, Path | str], seconds: float, gave_up: bool) -> int:
        ok = {f for f in futures if f.done() and not f.cancelled() and f.exception() is None}
        retrying = []
        for future, path in futures.items():
            if future in ok:
                if future.detail:
                    retrying.append(
                        f"{path}: {future.detail}; it is in the master's queue, which tries it "
                        "again (hio dead-letters lists it if every attempt fails)"
                    )
                continue
            if future in self.unserved:  # closing failed it too, with less to say
                self.failures.append(f"{path}: {self.unserved[future]}")
            elif future.done() and future.exception() is not None:
                self.failures.append(f"{path}: {future.exception()}")
            elif not future.done():
                self.failures.append(f"{path}: not delivered (stays spooled for the next hio send)")
        status = gateway.status()
        mbytes = sum(f.size for f in ok) / MB
        again = f", {len(retrying)} queued again after their processing failed" if retrying else ""
        print(
            f"sent {len(ok)} of {self.tuples} tuples ({mbytes:.1f} MB) in {seconds:.1f} s: "
            f"{status.sent_direct} direct, {status.sent_queue} queued{again}, {len(self.failures)} failed; "
            f"{mbytes / max(seconds, 1e-9):.1f} MB/s",
        )
        for line in retrying:
            print(f"RETRYING {line}")
        for line in self.failures:
            print(f"FAILED {line}")
        if gave_up and self.refusal:
            print(f"hio send: {self.refusal}; the files not sent stay spooled for the next hio send", file=sys.stderr)
        elif gave_up:
            print(
                f"hio send: the master at {self.config.master_address} was unreachable for more than "
                f"{self.config.connect_seconds:.0f}s; gave up waiting",
                file=sys.stderr,
            )
        return 0 if not self.failures and not gave_up else 1


def _progress(config: SendConfig, total_bytes: int) -> tqdm[NoReturn] | None:
    if not (config.progress and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc="sending", file=sys.stderr)


# -- --no-wait: hand the files to the gateway daemon ------------------------------------


def _hand_over(config: SendConfig, files: list[Path], images: dict[Path, str]) -> int:
    """Stream the files to the daemon's ingest API; done once it spooled (ACCEPTED) each."""
    channel = create_channel(config.ingest_listen, config)
    try:
        submit = send_frames(channel, "Ingest", "Submit")
        accepted = 0
        for receipt in submit(_ingest_frames(config, files, images), timeout=config.stream_timeout_seconds):
            accepted += receipt.state == TupleReceipt.ACCEPTED
    except grpc.RpcError as exc:
        print(
            f"hio send: gateway at {config.ingest_listen}: {rpc_error_text(exc, config)} "
            f"({accepted} of {len(files)} accepted)",
            file=sys.stderr,
        )
        return 2 if exc.code() == grpc.StatusCode.UNAVAILABLE and not accepted else 1
    finally:
        channel.close()
    print(f"handed {accepted} of {len(files)} tuples to the gateway at {config.ingest_listen}")
    return 0 if accepted == len(files) else 1


def _ingest_frames(config: SendConfig, files: list[Path], images: dict[Path, str]) -> Iterator[WireFrame]:
    for path in files:
        crc, size = crc32_of_file(path)
        meta = TupleMeta(
            image=images[path],
            name=path.name,
            size=size,
            crc32=crc,
            created_unix=path.stat().st_mtime,
            source=config.source,
        )
        yield from frames_for_file(meta, path, config.chunk_bytes, encode=True)


def _same_file(future: TupleFuture, candidates: list[Path]) -> Path | None:
    """The named file a spooled tuple was: among those of its name, size and mtime (files
    of one name in several folders), the first whose content has its CRC; taken off
    ``candidates``, so no file stands for two tuples."""
    for path in candidates:
        try:
            crc, _ = crc32_of_file(path)
        except OSError:
            continue
        if crc == future.crc32:
            candidates.remove(path)
            return path
    return None


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None
