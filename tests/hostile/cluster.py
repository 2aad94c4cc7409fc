"""Every role in this process on port 0, with tokens and route tickets on, for hostile tests.

One :class:`HostileCluster` holds a repository, a master, one engine (image
``hio/synthetic``, not registered at the master, so it never pulls) and a
gateway's ingest service. Each presents and accepts tokens from one tokens
file; master and engine share a ticket key. Helpers read back what each role
stored so a test can check that a refusal left nothing behind.

Images: ``hostile/q`` is a master-only image (``images`` setting) for backlog
tests; :meth:`HostileCluster.drain_queue` pulls it empty through a probe
channel and verifies every payload. The gateway's tuples use ``hio/simulation``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import zstandard
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hio.proto import (
    engine_pb2_grpc,
    features_pb2,
    ingest_pb2,
    ingest_pb2_grpc,
    master_pb2,
    master_pb2_grpc,
    repository_pb2,
    repository_pb2_grpc,
)
from hio.settings import ClusterSettings
from hio.transport.frames import (
    TupleFrame,
    TupleMeta,
    TupleReceipt,
    crc32,
    frames_for_bytes,
)
from hio.transport.net import AUTH_HEADER, LIVENESS, create_channel, create_server

KiB = 1024
MiB = 1024 * KiB
CHUNK = 64 * KiB
MAX_TUPLE = 4 * MiB
MAX_RECORD = 256 * KiB
MAX_DECOMPRESSED = 1 * MiB
ENGINE_IMAGE = "hio/synthetic"
QUEUE_IMAGE = "hostile/q"
GATEWAY_IMAGE = "hio/simulation"

TOKENS = {
    "gateway": "tok-gateway",
    "worker": "tok-worker",
    "kd": "tok-kd",
    "admin": "tok-admin",
    "viewer": "tok-viewer",
}
TICKET_KEY = b"hostile-ticket-key-0123456789abcdef"


def write_secrets(folder: Path) -> tuple[str, str]:
    """(tokens file, ticket key file) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = folder / "tokens"
    tokens.write_text("".join(f"{token} {role} {role}-1\n" for role, token in TOKENS.items()))
    key = folder / "ticket.key"
    key.write_bytes(TICKET_KEY)
    os.chmod(key, 0o600)
    return str(tokens), str(key)


def cluster_settings(root: Path) -> dict[str, Any]:
    tokens, key = write_secrets(root / "secrets")
    return {"tokens_file": tokens, "ticket_key_file": key, "chunk_bytes": CHUNK, "max_tuple_bytes": MAX_TUPLE}


def meta_for(tuple_id: int, data: bytes, image: str = ENGINE_IMAGE, **fields: Any) -> TupleMeta:
    """Metadata matching ``data`` (size and CRC-32)."""
    base: dict[str, Any] = {
        "tuple_id": tuple_id,
        "image": image,
        "size": len(data),
        "crc32": crc32(data),
        "source": "hostile",
        "name": f"t{tuple_id}",
        "attempt": 1,
    }
    base.update(fields)
    return TupleMeta(**base)


def frames(meta: TupleMeta, data: bytes, chunk: int = CHUNK) -> list[TupleFrame]:
    return list(frames_for_bytes(meta, data, chunk))


def auth(role: str) -> tuple[tuple[str, str], ...]:
    """Call metadata presenting ``role``'s token (for raw channels without the interceptor)."""
    return ((AUTH_HEADER, f"Bearer {TOKENS[role]}"),)


def wide_channel(address: str) -> grpc.Channel:
    """A channel that sends messages up to 64 MiB: to prove the *server* refuses oversized ones."""
    return grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]
    )


def serving(address: str) -> bool:
    """True when the standard health service (it needs no token) answers SERVING for liveness:
    the server survived (a master without workers is alive, though not ready)."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def decode_record(record_zstd: bytes) -> features_pb2.FeatureRecord:
    record = features_pb2.FeatureRecord()
    record.ParseFromString(zstandard.ZstdDecompressor().decompress(record_zstd))
    return record


def upload(tuple_id: int, *, inner_id: int | None = None, value: float = 1.0) -> repository_pb2.FeaturesUpload:
    """A well-formed FeaturesUpload as an engine builds it (``inner_id`` forges the id inside)."""
    record = features_pb2.FeatureRecord(tuple_id=tuple_id if inner_id is None else inner_id, engine="hostile/x")
    record.meta.tuple_id = record.tuple_id
    record.meta.image = ENGINE_IMAGE
    record.features["v"].number = value
    blob = zstandard.ZstdCompressor(level=1).compress(record.SerializeToString())
    return repository_pb2.FeaturesUpload(tuple_id=tuple_id, record_zstd=blob, crc32=crc32(blob))


@dataclasses.dataclass
class Server:
    """One in-process gRPC server and how to stop it."""

    name: str
    address: str
    stop: Any


class HostileCluster:
    """Repository, master, engine and gateway ingest in this process; see the module doc."""

    def __init__(self, root: Path, **master_overrides: Any) -> None:
        self.root = root
        self.shared = cluster_settings(root)
        self._channels: dict[tuple[str, str | None], grpc.Channel] = {}
        self._stops: list[Any] = []
        self.servers: dict[str, Server] = {}
        self.engine_exits: list[int] = []
        try:
            self._start_repository()
            self._start_master(master_overrides)
            self.engine_address = self.start_engine("hostile/0")
            self._start_gateway()
        except BaseException:
            self.close()
            raise
        self.master = master_pb2_grpc.MasterStub(self.channel(self.master_address, "admin"))
        self.repository = repository_pb2_grpc.RepositoryStub(self.channel(self.repository_address, "admin"))
        self.engine = engine_pb2_grpc.EngineStub(self.channel(self.engine_address, "gateway"))
        self.ingest = ingest_pb2_grpc.IngestStub(self.channel(self.gateway_address, "gateway"))
        self._probe_lock = threading.Lock()

    # ---- starting the roles

    def _start_repository(self) -> None:
        from hio.repository import RepositoryConfig, create_repository_server

        config = RepositoryConfig(
            listen="127.0.0.1:0",
            http_listen="",
            data_dir=str(self.root / "repo"),
            fsync="never",
            max_record_bytes=MAX_RECORD,
            max_decompressed_bytes=MAX_DECOMPRESSED,
            **self.shared,
        )
        config.validate()
        server, port, store = create_repository_server(config)
        server.start()
        self.repository_address = f"127.0.0.1:{port}"
        self._add("repository", self.repository_address, lambda: (server.stop(0).wait(5), store.close()))

    def _start_master(self, overrides: dict[str, Any]) -> None:
        from hio.master import MasterConfig, create_master_server

        values: dict[str, Any] = {
            "listen": "127.0.0.1:0",
            "data_dir": str(self.root / "master"),
            "fsync": "never",
            "queue_bytes": 64 * MiB,
            "segment_bytes": MiB,
            "images": (ENGINE_IMAGE, QUEUE_IMAGE, GATEWAY_IMAGE),
            **self.shared,
        }
        values.update(overrides)
        config = MasterConfig(**values)
        config.validate()
        server, port, master = create_master_server(config)
        server.start()
        self.master_config = config
        self.master_address = f"127.0.0.1:{port}"

        def stop() -> None:
            master.begin_shutdown()
            server.stop(0).wait(5)
            master.close()

        self._add("master", self.master_address, stop)

    def start_engine(self, channel_id: str, **overrides: Any) -> str:
        """An engine of ``hio/synthetic`` presenting the worker token; its address."""
        from hio.worker.config import EngineConfig
        from hio.worker.engine import create_engine_server

        values: dict[str, Any] = {
            "channel_id": channel_id,
            "image": ENGINE_IMAGE,
            "listen": "127.0.0.1:0",
            "master_address": self.master_address,
            "repository_address": self.repository_address,
            "token": TOKENS["worker"],
            "pull_wait": 1.0,
            "rpc_deadline": 5.0,
            "grace_seconds": 1.0,
            **self.shared,
        }
        values.update({k: v for k, v in overrides.items() if k in {f.name for f in dataclasses.fields(EngineConfig)}})
        config = EngineConfig(**values)
        config.validate()
        server, port, _health, engine = create_engine_server(config, exit_process=self.engine_exits.append)
        server.start()
        engine.start()
        address = f"127.0.0.1:{port}"

        def stop() -> None:
            stopper = threading.Thread(target=engine.stop, args=(1.0,), daemon=True)
            stopper.start()
            stopper.join(5)
            server.stop(0).wait(5)

        self._add(f"engine {channel_id}", address, stop)
        return address

    def _start_gateway(self) -> None:
        self.gateway, self.gateway_address = self.start_gateway("gateway")

    def start_gateway(self, name: str, **overrides: Any) -> tuple[Any, str]:
        """A Gateway library object serving the ingest API on port 0: (gateway, address)."""
        from hio.gateway.client import Gateway
        from hio.gateway.config import GatewayConfig
        from hio.gateway.ingest import POLICY as INGEST_POLICY
        from hio.gateway.ingest import IngestServicer

        values: dict[str, Any] = {
            "master_address": self.master_address,
            "repository_address": self.repository_address,
            "data_dir": str(self.root / name),
            "source": name,
            "token": TOKENS["gateway"],
            "ingest_listen": "127.0.0.1:0",
            "progress": False,
            "spool_bytes": 32 * MiB,
            "grace_seconds": 1.0,
            "route_wait_seconds": 0.5,  # no engine serves GATEWAY_IMAGE: its tuples queue after this
            **self.shared,
        }
        values.update({k: v for k, v in overrides.items() if k in {f.name for f in dataclasses.fields(GatewayConfig)}})
        config = GatewayConfig(**values)
        config.validate()
        gateway = Gateway(config)
        servicer = IngestServicer(gateway)
        server, port, health = create_server(
            config,
            "127.0.0.1:0",
            policy=INGEST_POLICY,
            register=[lambda s: ingest_pb2_grpc.add_IngestServicer_to_server(servicer, s)],
        )
        server.start()
        health.start()
        address = f"127.0.0.1:{port}"

        def stop() -> None:
            servicer.stop_accepting()
            server.stop(0).wait(5)
            gateway.close(1.0, drain=False)

        self._add(f"gateway {name}", address, stop)
        return gateway, address

    def _add(self, name: str, address: str, stop: Any) -> None:
        self.servers[name] = Server(name, address, stop)
        self._stops.append(stop)

    def channel(self, address: str, role: str | None) -> grpc.Channel:
        """A channel presenting ``role``'s token (None: no token), shared; closed with the cluster."""
        key = (address, role)
        if key not in self._channels:
            self._channels[key] = create_channel(
                address, ClusterSettings(chunk_bytes=CHUNK), token=TOKENS[role] if role else ""
            )
        return self._channels[key]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        for stop in reversed(self._stops):
            stop()
        self._stops.clear()

    # ---- driving and reading back

    def route(self, count: int, image: str = ENGINE_IMAGE, size: int = 100) -> master_pb2.RouteTuplesResponse:
        """Ids and tickets for ``count`` tuples, always via the queue (no channel is reserved)."""
        items = [master_pb2.RouteItem(size=size) for _ in range(count)]
        return self.master.RouteTuples(
            master_pb2.RouteTuplesRequest(source="hostile", image=image, items=items, force_queue=True), timeout=5
        )

    def routed_tuple(self, data: bytes, image: str = ENGINE_IMAGE, **fields: Any) -> TupleMeta:
        """Metadata of a tuple the master routed (id and ticket filled in)."""
        routed = self.route(1, image, len(data))
        return meta_for(routed.tuple_ids[0], data, image, ticket=routed.tickets[0], **fields)

    def queue(self, image: str = QUEUE_IMAGE) -> tuple[int, int, int]:
        """(length, bytes, leased) of ``image``'s backlog."""
        for q in self.master.GetStatus(master_pb2.GetStatusRequest(), timeout=5).queues:
            if q.image == image:
                return q.length, q.bytes, q.leased
        return 0, 0, 0

    def enqueue(self, stream: Iterable[TupleFrame], role: str = "gateway") -> list[TupleReceipt]:
        stub = master_pb2_grpc.MasterStub(self.channel(self.master_address, role))
        return list(stub.Enqueue(iter(stream), timeout=10))

    def drain_queue(self, image: str = QUEUE_IMAGE) -> dict[int, bytes]:
        """Pull every tuple of ``image`` through a probe channel; verify and acknowledge each.

        Returns {tuple id: payload}. Raises AssertionError on a payload whose
        size or CRC-32 differs from its metadata: that would be stored corruption.
        """
        probe = f"probe-{image.replace('/', '-')}"
        channel_id = f"{probe}/0"
        worker = master_pb2_grpc.MasterStub(self.channel(self.master_address, "worker"))
        pulled: dict[int, bytes] = {}
        with self._probe_lock:
            worker.RegisterWorker(
                master_pb2.RegisterWorkerRequest(
                    worker_id=probe,
                    host="probe",
                    cpus=1,
                    channels=[master_pb2.ChannelInfo(channel_id=channel_id, image=image, address="127.0.0.1:9")],
                ),
                timeout=5,
            )
            while True:
                meta, data = self._pull_one(worker, channel_id)
                if meta is None:
                    return pulled
                assert len(data) == meta.size and crc32(data) == meta.crc32, f"queued tuple {meta.tuple_id} is damaged"
                assert meta.tuple_id not in pulled, f"tuple {meta.tuple_id} pulled twice"
                pulled[meta.tuple_id] = data
                outcome = master_pb2.TupleOutcome(tuple_id=meta.tuple_id, ok=True, from_queue=True, size=meta.size)
                worker.ReportTuples(
                    master_pb2.ReportTuplesRequest(channel_id=channel_id, outcomes=[outcome], release=True), timeout=5
                )

    @staticmethod
    def _pull_one(stub: master_pb2_grpc.MasterStub, channel_id: str) -> tuple[TupleMeta | None, bytes]:
        meta, chunks = None, []
        for frame in stub.PullTuple(master_pb2.PullTupleRequest(channel_id=channel_id, wait_seconds=0), timeout=10):
            if frame.HasField("meta"):
                meta = frame.meta
            chunks.append(frame.data)
        return meta, b"".join(chunks)

    def stored(self) -> dict[int, features_pb2.FeatureRecord]:
        """Every record in the repository, decoded; asserts each names the id it is stored under."""
        records: dict[int, features_pb2.FeatureRecord] = {}
        offsets: list[int] = []
        for batch in self.repository.ReadFeatures(repository_pb2.ReadFeaturesRequest(after=0), timeout=10):
            for stored in batch.records:
                record = decode_record(stored.record_zstd)
                assert record.tuple_id == stored.tuple_id, f"offset {stored.offset} holds the wrong id"
                assert stored.tuple_id not in records, f"tuple {stored.tuple_id} stored twice"
                records[stored.tuple_id] = record
                offsets.append(stored.offset)
        assert offsets == list(range(1, len(offsets) + 1)), "repository offsets are not dense"
        latest = self.repository.GetOffsets(repository_pb2.GetOffsetsRequest(), timeout=5)
        assert latest.records == latest.latest == len(records)
        return records

    def deliver(self, tuples: Sequence[tuple[TupleMeta, bytes]], role: str = "gateway") -> list[TupleReceipt]:
        stub = engine_pb2_grpc.EngineStub(self.channel(self.engine_address, role)) if role != "gateway" else self.engine
        stream = (f for meta, data in tuples for f in frames_for_bytes(meta, data, CHUNK))
        return list(stub.Deliver(stream, timeout=15))

    def submit(self, stream: Iterable[TupleFrame]) -> list[TupleReceipt]:
        return list(self.ingest.Submit(iter(stream), timeout=15))

    def gateway_status(self) -> ingest_pb2.GetGatewayStatusResponse:
        return self.ingest.GetGatewayStatus(ingest_pb2.GetGatewayStatusRequest(), timeout=5)


def stall_after(
    first: Iterator[TupleFrame] | Sequence[TupleFrame], release: threading.Event, limit: float = 30.0
) -> Iterator[TupleFrame]:
    """Send ``first`` frames, then nothing until ``release`` is set (a stalled client)."""
    yield from first
    release.wait(limit)
