"""Settings of the gateway (``hio gateway``) and of ``hio send``.

Imports nothing heavy (no grpc): ``hio.cli`` loads this module to build flags.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from hio.config import FSYNC_POLICIES, ConfigError, between, check_address, one_of, positive, same_port, setting
from hio.settings import SERVER_SETTINGS, ClusterSettings, GiB, MiB

HTTP_LISTEN = "127.0.0.1:7380"  # where the role's HTTP endpoint listens by default

# File extension -> engine image, used when no image is given.
IMAGE_BY_EXTENSION: dict[str, str] = {
    **dict.fromkeys((".tif", ".tiff", ".png", ".jpg", ".jpeg"), "hio/microscopy"),
    **dict.fromkeys((".npz", ".npy"), "hio/simulation"),
}

# Files a directory walk or watch never takes: still being written, or hidden.
IGNORED_SUFFIXES = (".part", ".tmp", ".partial")


def walk_files(root: Path, skip: Path | None = None) -> Iterator[Path]:
    """The files under ``root`` in name order, but for hidden ones and those an instrument is
    still writing; hidden folders (and the resolved folder ``skip``) are not entered."""
    for folder, dirs, files in os.walk(root):
        base = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and (skip is None or (base / d).resolve() != skip))
        for name in sorted(files):
            if not name.startswith(".") and not name.lower().endswith(IGNORED_SUFFIXES):
                yield base / name


def infer_image(path: str | os.PathLike[str], image: str = "") -> str:
    """The engine image for a file: ``image`` if given, else by extension.

    Raises ConfigError naming the file when the extension is unknown.
    """
    if image:
        return image
    suffix = Path(path).suffix.lower()
    try:
        return IMAGE_BY_EXTENSION[suffix]
    except KeyError:
        known = ", ".join(sorted(IMAGE_BY_EXTENSION))
        raise ConfigError(
            f"{path}: cannot tell the image from the extension '{suffix or '(none)'}' (known: {known}); pass --image"
        ) from None


@dataclasses.dataclass(frozen=True)
class GatewayConfig(ClusterSettings):
    """Everything ``hio gateway`` and the :class:`hio.gateway.Gateway` library use."""

    source: str = setting("", "who produces the tuples (TupleMeta.source); empty = this host's name")
    image: str = setting(
        "",
        "engine image of the tuples; empty = infer from the file extension "
        "(.tif/.tiff/.png/.jpg -> hio/microscopy, .npz/.npy -> hio/simulation)",
    )
    spool_bytes: int = setting(2 * GiB, "bound of the on-disk spool; a full spool refuses (or blocks) new tuples")
    spool_fsync: str = setting(
        "batch",
        "when spooled tuples reach the disk: always (before submit returns), "
        "batch (within ~100 ms; a crash of the gateway loses nothing, a power "
        "loss at most the last 100 ms, and never more than 256 MiB: submit then waits "
        "for the disk) or never (left to the OS)",
    )
    spool_memory_bytes: int = setting(
        64 * MiB,
        "payloads submitted as bytes are also kept in memory up to "
        "this much, so delivery need not read them back from disk",
    )
    streams: int = setting(4, "parallel delivery streams (batches in flight)")
    batch_tuples: int = setting(256, "most tuples per route and stream (small ones travel packed)")
    batch_bytes: int = setting(
        64 * MiB,
        "most bytes per batch; a larger tuple goes alone (each batch costs a "
        "route and a stream: 8 MiB batches carried a third fewer 1-10 MB tuples)",
    )
    pack_bytes: int = setting(
        1 * MiB,
        "tuples of at most a quarter of this travel packed, several in one gRPC "
        "message of at most this many bytes; 0 = one message per tuple",
    )
    max_attempts: int = setting(3, "delivery attempts before a tuple is handed to the master's dead letters")
    force_queue: bool = setting(False, "always route through the master's backlog queue")
    lanes: bool = setting(
        True,
        "send payloads to a peer (engine, master) over its payload lane when it offers "
        "one (TCP, TLS as gRPC's; sendfile from the spool without TLS; connections kept from "
        "call to call), else over gRPC; a lane that fails is left for gRPC a minute",
    )
    ingest_listen: str = setting("127.0.0.1:7300", "host:port of the local ingest gRPC API; empty = off")
    http_listen: str = setting(
        HTTP_LISTEN,
        "hio gateway: host:port of the HTTP endpoint (/metrics, /healthz; docs/monitoring.md); empty = none",
    )
    watch: str = setting("", "folder to watch for new files; empty = no watch")
    done_dir: str = setting("", "where watched files go once stored; empty = <watch>/.hio-done")
    settle_seconds: float = setting(1.0, "a watched file is complete once its size and mtime are unchanged this long")
    poll_seconds: float = setting(0.25, "how often the watched folder is scanned")
    progress: bool = setting(True, "show a progress bar when stderr is a terminal")
    grace_seconds: float = setting(10.0, "on SIGTERM: time to finish in-flight streams")
    route_timeout_seconds: float = setting(15.0, "deadline of one RouteTuples call (beyond route_wait_seconds)")
    route_wait_seconds: float = setting(
        5.0,
        "when every channel is busy, how long the master may hold a batch "
        "for one before sending it to the queue (0-30; 0 = queue at once)",
    )
    stream_timeout_seconds: float = setting(900.0, "deadline of one delivery stream (a whole batch)")
    connect_seconds: float = setting(
        20.0, "hio send / the library: how long the master may stay unreachable before giving up"
    )
    image_wait_seconds: float = setting(
        30.0,
        "hio send / the library's blocking calls: how long to wait for "
        "an engine that serves a tuple's image (no worker offers it yet) "
        "before giving up on it; it stays spooled (the daemon waits on)",
    )

    def resolved_source(self) -> str:
        return self.source or socket.gethostname() or "gateway"

    def resolved_done_dir(self) -> str:
        if self.done_dir:
            return self.done_dir
        return str(Path(self.watch) / ".hio-done") if self.watch else ""

    def validate(self) -> None:
        self.validate_cluster()
        for name in (
            "spool_bytes",
            "batch_tuples",
            "batch_bytes",
            "max_attempts",
            "settle_seconds",
            "poll_seconds",
            "route_timeout_seconds",
            "stream_timeout_seconds",
            "connect_seconds",
            "image_wait_seconds",
        ):
            positive(name, getattr(self, name))
        between("streams", self.streams, 1, 256)
        between("spool_memory_bytes", self.spool_memory_bytes, 0)
        between("grace_seconds", self.grace_seconds, 0, unit=" s")
        between("route_wait_seconds", self.route_wait_seconds, 0, 30, unit=" s")
        one_of("spool_fsync", self.spool_fsync, FSYNC_POLICIES)
        if not 0 <= self.pack_bytes <= 8 * MiB:
            raise ConfigError(f"pack_bytes must be between 0 and 8 MiB, got {self.pack_bytes}")
        if self.spool_bytes < self.chunk_bytes:
            raise ConfigError(f"spool_bytes ({self.spool_bytes}) must hold at least one chunk ({self.chunk_bytes})")
        if self.watch and not Path(self.watch).is_dir():
            raise ConfigError(f"watch: {self.watch} is not a folder")
        if len(self.resolved_source()) > 256:
            raise ConfigError("source must be at most 256 characters")
        check_address("http_listen", self.http_listen, allow_empty=True)
        check_address("ingest_listen", self.ingest_listen, allow_empty=True)
        if self.http_listen and self.ingest_listen and same_port(self.http_listen, self.ingest_listen):
            raise ConfigError(f"http_listen {self.http_listen} takes ingest_listen's port: choose another")


@dataclasses.dataclass(frozen=True)
class SendConfig(GatewayConfig):
    """``hio send FILE...``: send files as tuples and report what became of them."""

    # accepted (one file configures the gateway daemon and hio send), not in --help
    UNLISTED: ClassVar[frozenset[str]] = SERVER_SETTINGS | {
        "watch",
        "done_dir",
        "settle_seconds",
        "poll_seconds",
        "http_listen",
    }
    POSITIONAL: ClassVar[tuple[str, str, str]] = (
        "files",
        "FILE",
        ("files to send (directories are walked); none: finish what an earlier hio send left spooled"),
    )

    files: tuple[str, ...] = setting((), "files to send (directories are walked)", factory=tuple)
    drop_spooled: bool = setting(
        False,
        "drop the tuples earlier hio send runs (same --source) left spooled, naming each, instead of sending anything",
    )
    wait: bool = setting(
        True,
        "wait until stored or enqueued; --no-wait hands the files to the "
        "gateway daemon at --ingest-listen and returns once it spooled them",
    )

    def validate(self) -> None:
        super().validate()
        if self.drop_spooled and self.files:
            raise ConfigError("--drop-spooled drops what is spooled and sends nothing: name no FILE with it")
        if not self.files and not self.wait:
            raise ConfigError("--no-wait hands files to the gateway daemon: name at least one FILE or folder")
        if not self.wait and not self.ingest_listen:
            raise ConfigError("--no-wait hands files to a gateway daemon: give its --ingest-listen address")
