"""Settings of the feature repository (``hio repository``).

Kept free of heavy imports: the CLI loads this module to build its flags.
"""

from __future__ import annotations

import dataclasses

from hio.config import FSYNC_POLICIES, ConfigError, between, check_address, one_of, positive, same_port, setting
from hio.settings import FEATURE_RECORD_DECOMPRESSED_BYTES, RECORD_HEADROOM, ClusterSettings, MiB, record_limit

# Group commit under load: with no least gap an fsync covers only what arrived during the one
# before it, and every fsync wakes the waiting puts' threads here and their engines'; a few
# milliseconds let one round gather the puts of every channel.
FSYNC_INTERVAL_MS = 3

HTTP_LISTEN = "127.0.0.1:7180"  # where the role's HTTP endpoint listens by default


@dataclasses.dataclass(frozen=True)
class RepositoryConfig(ClusterSettings):
    listen: str = setting("127.0.0.1:7100", "host:port the repository's gRPC service listens on")
    http_listen: str = setting(
        HTTP_LISTEN,
        "host:port of the HTTP endpoint: the preview page, /metrics, /healthz (docs/monitoring.md); empty = none",
    )
    segment_bytes: int = setting(64 * MiB, "size at which a feature segment file is sealed and a new one begun")
    fsync: str = setting(
        "batch",
        "durability of PutFeatures: 'batch' = fsync before answering, concurrent puts share one "
        "fsync (group commit); 'always' = one fsync per request, serialised; 'never' = leave "
        "flushing to the OS (survives a process crash, not a power loss)",
    )
    fsync_interval_ms: int = setting(
        FSYNC_INTERVAL_MS,
        "batch mode: least milliseconds between two fsyncs; puts arriving meanwhile share the "
        "next one (more throughput under load, at most this much more latency per put; a put "
        "after a quiet spell syncs at once). 0 = every put syncs as soon as the last fsync ends",
    )
    max_record_bytes: int = setting(
        16 * MiB - RECORD_HEADROOM, "largest compressed feature record accepted (must fit one gRPC message)"
    )
    max_decompressed_bytes: int = setting(
        FEATURE_RECORD_DECOMPRESSED_BYTES, "largest decompressed feature record accepted"
    )
    read_batch_records: int = setting(1000, "most records per ReadFeatures response message")
    read_batch_bytes: int = setting(
        8 * MiB, "most record bytes per ReadFeatures response message (one larger record goes alone)"
    )
    max_consumers: int = setting(1024, "most named consumers whose offsets are kept")
    max_workers: int = setting(
        128,
        "gRPC server threads: each engine storing features holds one for its open StoreFeatures stream "
        "(three quarters of them may be streams; threads start as calls need them)",
    )

    def validate(self) -> None:
        """Refuse settings the repository cannot honour; messages name the setting."""
        self.validate_cluster()
        self.validate_serving()
        check_address("listen", self.listen)
        check_address("http_listen", self.http_listen, allow_empty=True)
        if self.http_listen and same_port(self.http_listen, self.listen):
            raise ConfigError(f"http_listen {self.http_listen} takes listen's port: choose another")
        one_of("fsync", self.fsync, FSYNC_POLICIES)
        between("fsync_interval_ms", self.fsync_interval_ms, 0, 10_000)
        between("segment_bytes", self.segment_bytes, 64 * 1024, unit=" bytes")
        for name in ("max_record_bytes", "max_decompressed_bytes", "read_batch_bytes", "max_consumers", "max_workers"):
            positive(name, getattr(self, name))
        between("read_batch_records", self.read_batch_records, 1, 100_000)
        limit = record_limit(self)
        if self.max_record_bytes > limit:
            raise ConfigError(
                f"max_record_bytes ({self.max_record_bytes}) must leave room in one gRPC message "
                f"(at most {limit} with chunk_bytes={self.chunk_bytes})"
            )
        if self.read_batch_bytes > limit:
            raise ConfigError(f"read_batch_bytes ({self.read_batch_bytes}) must be at most {limit}")
