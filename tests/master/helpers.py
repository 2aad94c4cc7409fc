"""Shared test helpers for the master: tuples as frames, a master on port 0, stubs."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc

from hio.master import create_master_server
from hio.master.config import MasterConfig
from hio.proto import master_pb2, master_pb2_grpc
from hio.transport.frames import TupleFrame, TupleMeta, crc32, frames_for_bytes
from hio.transport.net import create_channel

CHUNK = 64 * 1024


def meta_for(tuple_id: int, data: bytes, image: str = "hio/synthetic", **fields: object) -> TupleMeta:
    """Metadata matching ``data`` (size and CRC-32)."""
    return TupleMeta(
        tuple_id=tuple_id,
        image=image,
        size=len(data),
        crc32=crc32(data),
        source="test",
        name=f"t{tuple_id}",
        attempt=1,
        **fields,
    )  # type: ignore[arg-type]


def frames(
    tuple_id: int, data: bytes, image: str = "hio/synthetic", chunk: int = CHUNK, **fields: object
) -> list[TupleFrame]:
    return list(frames_for_bytes(meta_for(tuple_id, data, image, **fields), data, chunk))


def big_frames(
    tuple_id: int, size: int, image: str = "hio/synthetic", chunk: int = 1024 * 1024
) -> tuple[TupleMeta, Iterator[TupleFrame]]:
    """A large tuple generated chunk by chunk (never whole in memory): its meta and a frame iterator."""
    block = (bytes(range(251)) * (chunk // 251 + 1))[:chunk]
    value, remaining = 0, size
    while remaining:
        n = min(chunk, remaining)
        value = crc32(block[:n], value)
        remaining -= n
    meta = TupleMeta(tuple_id=tuple_id, image=image, size=size, crc32=value, source="test", attempt=1)

    def gen() -> Iterator[TupleFrame]:
        left = size
        first = True
        while left:
            n = min(chunk, left)
            left -= n
            yield TupleFrame(meta=meta if first else None, data=block[:n], last=left == 0)
            first = False

    return meta, gen()


def config(tmp_path: Path, **overrides: object) -> MasterConfig:
    base = {"listen": "127.0.0.1:0", "data_dir": str(tmp_path / "data"), "chunk_bytes": CHUNK, "fsync": "never"}
    base.update(overrides)
    cfg = MasterConfig(**base)  # type: ignore[arg-type]
    cfg.validate()
    return cfg


@dataclasses.dataclass
class Running:
    stub: master_pb2_grpc.MasterStub
    master: object
    port: int
    channel: grpc.Channel
    config: MasterConfig


@contextlib.contextmanager
def running_master(tmp_path: Path, **overrides: object) -> Iterator[Running]:
    """A real master server in-process on port 0 and a stub to it."""
    cfg = config(tmp_path, **overrides)
    server, port, master = create_master_server(cfg)
    server.start()
    channel = create_channel(f"127.0.0.1:{port}", cfg)
    try:
        yield Running(master_pb2_grpc.MasterStub(channel), master, port, channel, cfg)
    finally:
        channel.close()
        master.begin_shutdown()
        server.stop(None).wait(5)
        master.close()


def register(
    stub: master_pb2_grpc.MasterStub, worker_id: str, image: str = "hio/synthetic", n: int = 1, port_base: int = 50000
) -> list[str]:
    """Register a worker with ``n`` channels of ``image``; their ids."""
    channels = [
        master_pb2.ChannelInfo(channel_id=f"{worker_id}/{i}", image=image, address=f"127.0.0.1:{port_base + i}")
        for i in range(n)
    ]
    stub.RegisterWorker(
        master_pb2.RegisterWorkerRequest(worker_id=worker_id, host="localhost", cpus=n, channels=channels), timeout=5
    )
    return [c.channel_id for c in channels]


def route(
    stub: master_pb2_grpc.MasterStub,
    sizes: list[int],
    image: str = "hio/synthetic",
    force_queue: bool = False,
    ids: list[int] | None = None,
) -> master_pb2.RouteTuplesResponse:
    items = [master_pb2.RouteItem(size=s, tuple_id=(ids[i] if ids else 0)) for i, s in enumerate(sizes)]
    return stub.RouteTuples(
        master_pb2.RouteTuplesRequest(source="test", image=image, items=items, force_queue=force_queue), timeout=5
    )


def pull(stub: master_pb2_grpc.MasterStub, channel_id: str, wait: float = 0.0) -> tuple[TupleMeta | None, bytes]:
    """PullTuple: (meta, payload), or (None, b'') when the stream is empty."""
    meta, chunks = None, []
    for frame in stub.PullTuple(
        master_pb2.PullTupleRequest(channel_id=channel_id, wait_seconds=wait), timeout=wait + 10
    ):
        if frame.HasField("meta"):
            meta = frame.meta
        chunks.append(frame.data)
    return meta, b"".join(chunks)


def report(
    stub: master_pb2_grpc.MasterStub,
    channel_id: str,
    tuple_id: int,
    ok: bool = True,
    from_queue: bool = True,
    release: bool = True,
    message: str = "",
    size: int = 0,
) -> bool:
    outcome = master_pb2.TupleOutcome(tuple_id=tuple_id, ok=ok, from_queue=from_queue, message=message, size=size)
    reply = stub.ReportTuples(
        master_pb2.ReportTuplesRequest(channel_id=channel_id, outcomes=[outcome], release=release), timeout=5
    )
    return reply.pull_queue
