"""The fsync policy the master's durable stores share (the backlog's segment log and
journal, the dead letters)."""

from __future__ import annotations

import dataclasses

from hio.storage.files import DiskFailure
from hio.storage.segmentlog import UNSYNCED_BYTES


@dataclasses.dataclass(frozen=True)
class Durability:
    """The master's fsync policy: 'always', 'batch' or 'never' (see :mod:`hio.storage.segmentlog`,
    which refuses others; 'batch' rounds every ``interval`` seconds, with at most
    ``unsynced_limit`` bytes waiting for one), and its :class:`DiskFailure`: the final refusal
    after a failed fsync of any of them."""

    policy: str
    interval: float = 0.1
    unsynced_limit: int = UNSYNCED_BYTES
    disk: DiskFailure = dataclasses.field(
        default_factory=lambda: DiskFailure(disk="the backlog's disk", owner="master")
    )

    @property
    def syncs(self) -> bool:
        return self.policy != "never"
