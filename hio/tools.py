"""Small user commands that talk to running roles: status, knowledge, dead letters."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterable
from typing import ClassVar

import grpc
from google.protobuf import json_format

from hio.config import ConfigError, between, setting
from hio.proto import features_pb2, master_pb2, master_pb2_grpc, repository_pb2, repository_pb2_grpc
from hio.settings import SERVER_SETTINGS, ClusterSettings
from hio.transport.net import create_channel, rpc_error_text


class _ToolSettings(ClusterSettings):
    # A tool only calls a role: the settings of servers and of tuple streams are not its own.
    UNLISTED: ClassVar[frozenset[str]] = SERVER_SETTINGS | {"data_dir", "chunk_bytes", "max_tuple_bytes"}


@dataclasses.dataclass(frozen=True)
class StatusConfig(_ToolSettings):
    json: bool = setting(False, "print the status as JSON")
    watch: float = setting(0.0, "refresh every N seconds (0 = once)")

    def validate(self) -> None:
        self.validate_cluster()
        between("watch", self.watch, 0, unit=" s")


@dataclasses.dataclass(frozen=True)
class ScaleConfig(_ToolSettings):
    # set_*: not min_workers / max_workers, which a [cluster] table or HIO_MAX_WORKERS gives the
    # master: a tool reading them would change the bounds on every call
    set_min_workers: int = setting(-1, "set the fewest workers the provisioner keeps (-1 = unchanged)")
    set_max_workers: int = setting(-1, "set the most workers the provisioner asks for (-1 = unchanged)")
    reset_bounds: bool = setting(False, "go back to the master's min_workers and max_workers settings")
    pin: tuple[str, ...] = setting((), "fix an image's engine count, IMAGE=COUNT (0: none of it)")
    unpin: tuple[str, ...] = setting((), "let the predictor decide an image's engine count again")
    decisions: int = setting(15, "how many of the latest decisions to show")
    json: bool = setting(False, "print the scaling as JSON")

    def validate(self) -> None:
        self.validate_cluster()
        for name in ("set_min_workers", "set_max_workers"):
            if getattr(self, name) < -1:
                raise ConfigError(f"{name} must be -1 (unchanged) or zero or more, got {getattr(self, name)}")
        between("decisions", self.decisions, 0)
        self.pins()

    def pins(self) -> dict[str, int]:
        """``pin`` as image -> count."""
        pins = {}
        for item in self.pin:
            image, sep, count = item.rpartition("=")
            if not sep or not image.strip() or not count.strip().isdigit():
                raise ConfigError(f"pin {item!r} must look like IMAGE=COUNT")
            pins[image.strip()] = int(count)
        return pins

    def changes(self) -> bool:
        return (
            self.set_min_workers >= 0 or self.set_max_workers >= 0 or self.reset_bounds or bool(self.pin or self.unpin)
        )


@dataclasses.dataclass(frozen=True)
class KnowledgeConfig(_ToolSettings):
    json: bool = setting(False, "print the knowledge as JSON (assignments included)")


@dataclasses.dataclass(frozen=True)
class DeadLettersConfig(_ToolSettings):
    retry: int = setting(0, "send the dead letter with this tuple id again (ids: hio dead-letters)")
    json: bool = setting(False, "print as JSON")

    def validate(self) -> None:
        self.validate_cluster()
        between("retry", self.retry, 0, 2**64 - 1)  # a tuple id (0: list them)


_STATE = {master_pb2.FREE: "free", master_pb2.DIRECT: "direct", master_pb2.QUEUE: "queue", master_pb2.DOWN: "DOWN"}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def format_status(s: master_pb2.GetStatusResponse) -> str:
    """A status report for people: throughput, channels, queues, warnings."""
    lines = [
        f"master up {s.uptime_seconds:,.0f}s   last tuple id {s.last_tuple_id}",
        f"throughput  {s.tuples_per_second:,.1f} tuples/s   {s.bytes_per_second / 1e6:,.1f} MB/s (last minute)",
        (
            f"tuples      done {s.tuples_done:,}   failed {s.tuples_failed:,}   dead letters {s.dead_letters:,}"
            f"   routed direct {s.routed_direct:,} / queue {s.routed_queue:,}"
        ),
        (
            f"payload     routed direct {_mb(s.bytes_routed_direct)} (sender to engine)"
            f"   received into the queue {_mb(s.bytes_enqueued)}"
        ),
        f"channels    free {s.channels_free}   busy {s.channels_busy}   down {s.channels_down}",
    ]
    for w in s.workers:
        lines.append(f"  worker {w.worker_id} ({w.host}), heartbeat {w.last_heartbeat_age_seconds:.1f}s ago")
        for c in w.channels:
            detail = f"  {c.detail}" if c.detail else ""
            state = "busy" if c.state == master_pb2.FREE and c.processing else _STATE.get(c.state, "?")
            if c.retiring:
                state = f"{state}, retiring"
            lane = f"  lane {c.lane_address}" if c.lane_address else ""
            payload = f" ({_mb(c.bytes_direct)} direct, {_mb(c.bytes_pulled)} pulled)" if c.tuples_done else ""
            lines.append(
                f"    {c.channel_id:<24} {c.image:<18} {state:<7} {c.address:<22} "
                f"done {c.tuples_done:,}{payload}{lane}{detail}"
            )
    if s.engines:
        lines.append("engines")
        lines += [f"  {format_engines(e)}" for e in s.engines]
    if s.queues:
        lines.append(f"queues (limit {_mb(s.queue_bytes_limit)})")
        for q in s.queues:
            lines.append(f"  {q.image:<20} {q.length:,} tuples  {_mb(q.bytes)}  leased {q.leased}")
    for warning in s.warnings:
        lines.append(f"WARNING: {warning}")
    return "\n".join(lines)


def format_engines(e: master_pb2.ImageEngines) -> str:
    """One image's engines: running against wanted, and what one of them costs."""
    wanted = f" of {e.wanted} wanted" + (" (pinned)" if e.pinned else "")
    share = f"{e.cpu_share:.2f} cores each" if e.cpu_share else "cpu not measured yet"
    rate = f"{e.seconds_per_tuple:.3f} s/tuple, {e.tuples_per_second:,.1f} tuples/s" if e.seconds_per_tuple else ""
    return f"{e.image:<20} {e.running} running{wanted}   {share}" + (f"   {rate}" if rate else "")


def _counts(items: Iterable[master_pb2.ImageCount]) -> str:
    return ", ".join(f"{c.image}={c.count}" for c in items) or "-"


def format_scaling(s: master_pb2.Scaling, decisions: int = 15) -> str:
    """The plan for people: workers wanted and present, engines per image and per worker, and
    the latest decisions with their reasons."""
    engines = [f"  {format_engines(e)}" for e in s.images]
    if s.mode != "elastic":
        fixed = "scaling fixed: each worker runs the engines it was started with (scaling = elastic changes that)"
        return "\n".join([fixed, *engines])
    bounds = f"min {s.min_workers}, max {s.max_workers}" + (" (set with hio scale)" if s.bounds_set else "")
    lines = [
        f"scaling elastic, provisioner {s.provisioner or 'none (workers started by hand)'}",
        f"workers     {s.workers_wanted} wanted, {s.workers_present} present ({bounds})",
        "engines",
        *engines,
    ]
    if s.unplaced:
        lines.append(f"  waiting for room on a worker: {_counts(s.unplaced)}")
    lines.append("workers (rank order: the lowest are filled first)")
    for w in s.workers:
        kind = "provisioned" if w.provisioned else ("elastic" if w.elastic else "fixed engines")
        retiring = f"  retiring {w.retiring}" if w.retiring else ""
        lines.append(
            f"  {w.rank:>3} {w.worker_id:<20} {w.state:<9} {kind:<13} {w.cpus} vCPUs  load {w.load:.2f}"
            f"  planned {_counts(w.planned)}  running {_counts(w.running)}{retiring}"
        )
    shown = list(s.decisions)[-decisions:] if decisions > 0 else []
    if shown:
        lines.append(f"decisions (latest {len(shown)} of {len(s.decisions)})")
    for d in shown:
        when = time.strftime("%H:%M:%S", time.localtime(d.unix))
        lines.append(f"  {when}  {d.subject:<20} {d.action:<24} {d.reason}")
    return "\n".join(lines)


def run_scale(config: ScaleConfig) -> int:
    with create_channel(config.master_address, config) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        try:
            if config.changes():
                request = master_pb2.SetScalingRequest(
                    min_workers=config.set_min_workers if config.set_min_workers >= 0 else None,  # -1: unset
                    max_workers=config.set_max_workers if config.set_max_workers >= 0 else None,
                    pin=[master_pb2.ImageCount(image=i, count=n) for i, n in config.pins().items()],
                    unpin=list(config.unpin),
                    reset_bounds=config.reset_bounds,
                )
                scaling = stub.SetScaling(request, timeout=30).scaling
            else:
                scaling = stub.GetScaling(master_pb2.GetScalingRequest(), timeout=10).scaling
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                print(f"hio scale: {exc.details()}", file=sys.stderr)
                return 2
            return _fail(
                "change the scaling" if config.changes() else "get the scaling", config.master_address, exc, config
            )
    if config.json:
        print(json_format.MessageToJson(scaling, always_print_fields_with_no_presence=True))
    else:
        print(format_scaling(scaling, config.decisions))
    return 0


def _fail(what: str, address: str, exc: grpc.RpcError, settings: ClusterSettings) -> int:
    print(f"hio: cannot {what} at {address}: {rpc_error_text(exc, settings)}", file=sys.stderr)
    return 1


def run_status(config: StatusConfig) -> int:
    with create_channel(config.master_address, config) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        while True:
            try:
                status = stub.GetStatus(master_pb2.GetStatusRequest(), timeout=10)
            except grpc.RpcError as exc:
                return _fail("get status from the master", config.master_address, exc, config)
            if config.json:
                print(json_format.MessageToJson(status, always_print_fields_with_no_presence=True))
            else:
                if config.watch and sys.stdout.isatty():  # a pipe or a file gets the reports one after another
                    print("\033[2J\033[H", end="")
                print(format_status(status))
            if not config.watch:
                return 0
            time.sleep(config.watch)


def fetch_knowledge(config: ClusterSettings) -> features_pb2.Knowledge | None:
    """The knowledge stored in the repository, or None when KD has not written any."""
    with create_channel(config.repository_address, config) as channel:
        reply = repository_pb2_grpc.RepositoryStub(channel).GetKnowledge(
            repository_pb2.GetKnowledgeRequest(), timeout=30
        )
    if not reply.knowledge:
        return None
    knowledge = features_pb2.Knowledge()
    knowledge.ParseFromString(reply.knowledge)
    return knowledge


def run_knowledge(config: KnowledgeConfig) -> int:
    try:
        knowledge = fetch_knowledge(config)
    except grpc.RpcError as exc:
        return _fail("read knowledge from the repository", config.repository_address, exc, config)
    if knowledge is None:
        print("no knowledge yet: run `hio kd --once` (or keep `hio kd` running) after tuples are stored")
        return 1
    if config.json:
        print(json_format.MessageToJson(knowledge))
        return 0
    from hio.kd.report import format_knowledge

    print(format_knowledge(knowledge))
    return 0


def run_dead_letters(config: DeadLettersConfig) -> int:
    with create_channel(config.master_address, config) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        if config.retry:
            try:
                stub.RetryDeadLetter(master_pb2.RetryDeadLetterRequest(tuple_id=config.retry), timeout=30)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    print(f"hio dead-letters: {exc.details()} (hio dead-letters lists them)", file=sys.stderr)
                    return 1
                return _fail(f"send dead letter {config.retry} again", config.master_address, exc, config)
            print(f"tuple {config.retry} is back in its queue")
            return 0
        try:
            reply = stub.ListDeadLetters(master_pb2.ListDeadLettersRequest(), timeout=30)
        except grpc.RpcError as exc:
            return _fail("list dead letters at the master", config.master_address, exc, config)
    if config.json:
        print(json.dumps([json_format.MessageToDict(d) for d in reply.dead_letters], indent=2))
        return 0
    if not reply.dead_letters:
        print("no dead letters")
        return 0
    for d in reply.dead_letters:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.failed_unix))
        name = d.meta.name or "-"
        print(f"{d.meta.tuple_id:>12}  {d.meta.image:<18} {name:<24} attempts {d.attempts}  {when}  {d.reason}")
    print(f"{len(reply.dead_letters)} dead letters; send one again with: hio dead-letters --retry TUPLE_ID")
    return 0
