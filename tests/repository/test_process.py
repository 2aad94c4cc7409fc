"""`hio repository` as a real process: healthy, serves, stops cleanly on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

from hio.proto import repository_pb2 as pb
from hio.proto import repository_pb2_grpc
from hio.repository.store import FeatureStore, StoreOptions
from hio.settings import ClusterSettings
from hio.transport.net import create_channel
from tests.harness import HioProcess, free_port, hio_env
from tests.repository.records import upload


def test_repository_process_serves_and_keeps_data(tmp_path: Path) -> None:
    port, http_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    args = [
        "--listen",
        address,
        "--http-listen",
        f"127.0.0.1:{http_port}",
        "--data-dir",
        str(tmp_path / "data"),
        "--log-level",
        "info",
    ]  # a stop that hangs then shows how far it got
    with HioProcess("repository", args, tmp_path) as proc:
        proc.wait_started(address)
        with create_channel(address, ClusterSettings()) as channel:
            stub = repository_pb2_grpc.RepositoryStub(channel)
            tid, data, crc = upload(42)
            reply = stub.PutFeatures(
                pb.PutFeaturesRequest(records=[pb.FeaturesUpload(tuple_id=tid, record_zstd=data, crc32=crc)]),
                timeout=10,
            )
            assert list(reply.offsets) == [1]
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=10) as page:
            assert page.read() == b"ok\n"
    assert proc.proc is not None and proc.proc.returncode == 0

    with HioProcess("repository", args, tmp_path, name="repository-again") as again:
        again.wait_started(address)
        with create_channel(address, ClusterSettings()) as channel:
            offsets = repository_pb2_grpc.RepositoryStub(channel).GetOffsets(pb.GetOffsetsRequest(), timeout=10)
            assert offsets.latest == 1
    assert again.proc is not None and again.proc.returncode == 0


def run_hio(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hio.cli", "repository", *args],
        cwd=tmp_path,
        env=hio_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_setting_exits_2(tmp_path: Path) -> None:
    result = run_hio(tmp_path, "--fsync", "sometimes")
    assert result.returncode == 2 and "fsync" in result.stderr


def test_damaged_store_exits_1_and_says_why(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with FeatureStore(data / "repository", StoreOptions(segment_bytes=4096)) as store:
        store.put([upload(i) for i in range(1, 200)])
    first = sorted((data / "repository" / "features").glob("*.seg"))[0]
    raw = bytearray(first.read_bytes())
    raw[40] ^= 0xFF
    first.write_bytes(bytes(raw))
    result = run_hio(tmp_path, "--listen", f"127.0.0.1:{free_port()}", "--http-listen", "", "--data-dir", str(data))
    assert result.returncode == 1
    assert "cannot start" in result.stderr and first.name in result.stderr
