"""`hio master` as a real process: health, SIGTERM, and a queue that survives kill -9."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hio.proto import master_pb2, master_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.frames import TupleFrame, TupleReceipt
from hio.transport.net import create_channel
from tests.harness import HioProcess, error_after_stop, free_port
from tests.master.helpers import CHUNK, frames, pull, register, route


def test_master_process_survives_kill_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    args = ["--listen", address, "--data-dir", str(tmp_path / "data")]  # default fsync: batch
    first = HioProcess("master", args, tmp_path, name="master-1").start()
    try:
        first.wait_started(address)
        with create_channel(address, ClusterSettings()) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            ids = list(route(stub, [5, 5], force_queue=True).tuple_ids)
            stream = frames(ids[0], b"first") + frames(ids[1], b"again")
            assert len(list(stub.Enqueue(iter(stream), timeout=10))) == 2
    finally:
        first.kill()  # kill -9: no chance to flush anything
    assert first.proc is not None and first.proc.returncode == -signal.SIGKILL

    with HioProcess("master", args, tmp_path, name="master-2") as second:
        second.wait_started(address)
        with create_channel(address, ClusterSettings()) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            status = stub.GetStatus(master_pb2.GetStatusRequest(), timeout=5)
            assert [(q.length, q.bytes) for q in status.queues] == [(2, 10)]
            assert status.last_tuple_id >= max(ids)
            assert min(route(stub, [1], force_queue=True).tuple_ids) > max(ids)  # ids never reused
            ch = register(stub, "w1")[0]
            assert [pull(stub, ch)[1] for _ in range(2)] == [b"first", b"again"]
    assert second.proc is not None and second.proc.returncode == 0


def test_a_port_in_use_is_named_not_a_traceback(tmp_path: Path) -> None:
    """Another master's gRPC port, or its payload lane (listen + 1), as this one's listen port."""
    import subprocess
    import sys

    from tests.harness import hio_env

    port = free_port()
    address = f"127.0.0.1:{port}"
    with HioProcess("master", ["--listen", address, "--data-dir", str(tmp_path / "first")], tmp_path) as first:
        first.wait_started(address)
        for listen in (address, f"127.0.0.1:{port + 1}"):
            second = subprocess.run(
                [sys.executable, "-m", "hio.cli", "master", "--listen", listen, "--data-dir", str(tmp_path / "second")],
                capture_output=True,
                text=True,
                env=hio_env(),
                timeout=60,
                cwd=tmp_path,
            )
            assert second.returncode == 2, second.stderr
            assert f"cannot listen on {listen}" in second.stderr and "Traceback" not in second.stderr, second.stderr


def test_a_master_told_a_port_another_role_holds_is_not_taken_for_healthy(tmp_path: Path) -> None:
    """The repository answers health on the port too; the wait names the master's own
    service, so it reports the master's refusal instead of passing."""
    address = f"127.0.0.1:{free_port()}"
    with HioProcess(
        "repository", ["--listen", address, "--http-listen", "", "--data-dir", str(tmp_path / "repo")], tmp_path
    ) as repository:
        repository.wait_started(address)
        master = HioProcess("master", ["--listen", address, "--data-dir", str(tmp_path / "data")], tmp_path).start()
        try:
            with pytest.raises(AssertionError, match="cannot listen on"):
                master.wait_started(address, timeout=30)
        finally:
            master.kill()
        assert master.proc is not None and master.proc.returncode == 2  # a configuration error


def test_a_tuple_still_arriving_when_the_master_stops_is_cut_off_with_the_reason(tmp_path: Path) -> None:
    """A gRPC Enqueue stalled in the middle of its second tuple has grace_seconds - 1 s to finish
    once the master stops; then the master ends the stream itself (UNAVAILABLE, saying what to
    send again), not the server's stop with CANCELLED. The first tuple, ENQUEUED, is kept; the
    one cut off is not."""
    address = f"127.0.0.1:{free_port()}"
    args = ["--listen", address, "--data-dir", str(tmp_path / "data"), "--grace-seconds", "2"]
    release = threading.Event()
    with HioProcess("master", args, tmp_path, name="master-1") as first:
        first.wait_started(address)
        with create_channel(address, ClusterSettings()) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            ids = list(route(stub, [5, 3 * CHUNK], force_queue=True).tuple_ids)
            second = frames(ids[1], os.urandom(3 * CHUNK))

            def stalled_sender() -> Iterator[TupleFrame]:
                yield from frames(ids[0], b"first")
                yield second[0]  # the second tuple's metadata and first chunk of three
                release.wait(60)

            stream = stub.Enqueue(stalled_sender(), timeout=60)
            assert next(stream).state == TupleReceipt.ENQUEUED
            assert first.proc is not None
            error, took = error_after_stop(lambda: first.proc.send_signal(signal.SIGTERM), stream)
        release.set()
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert error.details() == (
        "the master is stopping; send the tuples it did not answer ENQUEUED again once it is back"
    )
    assert 0.8 < took < 2.5, f"cut off {took:.1f} s after the stop; the tuple had 1 s to finish"
    with HioProcess("master", args, tmp_path, name="master-2") as again:
        again.wait_started(address)
        with create_channel(address, ClusterSettings()) as channel:
            status = master_pb2_grpc.MasterStub(channel).GetStatus(master_pb2.GetStatusRequest(), timeout=5)
    assert [(q.length, q.bytes) for q in status.queues] == [(1, 5)], "the ENQUEUED tuple only"
