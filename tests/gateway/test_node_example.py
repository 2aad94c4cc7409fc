"""The worked Node.js client (examples/node, docs/ingest.md) against a real cluster and a real
gateway's ingest API, with a token: what it prints is what the repository stored."""

from __future__ import annotations

import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest
import zstandard

from hio.proto import features_pb2, repository_pb2, repository_pb2_grpc
from hio.settings import ClusterSettings
from hio.transport.net import create_channel
from hio.worker.pipelines.samples import generate_microscopy
from tests.harness import free_port, hio_env, local_cluster, stop_cleanly

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node"
NODE = shutil.which("node")


def _missing() -> str:
    """Why the example cannot run here, '' when it can."""
    if NODE is None:
        return "node (Node.js 20.15 or later) is not on PATH"
    if not (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return f"the example's modules are not installed: run `npm ci --prefix {EXAMPLE}` (.ci/run does)"
    return ""


pytestmark = pytest.mark.skipif(bool(_missing()), reason=_missing() or "node and the modules are there")


def _stored(settings: ClusterSettings) -> dict[int, features_pb2.FeatureRecord]:
    with create_channel(settings.repository_address, settings) as channel:
        stub = repository_pb2_grpc.RepositoryStub(channel)
        return {
            stored.tuple_id: features_pb2.FeatureRecord.FromString(
                zstandard.ZstdDecompressor().decompressobj().decompress(stored.record_zstd)
            )
            for batch in stub.ReadFeatures(repository_pb2.ReadFeaturesRequest(after=0), timeout=10)
            for stored in batch.records
        }


def test_the_node_example_submits_files_and_prints_the_ids_the_repository_stored(tmp_path: Path) -> None:
    files = generate_microscopy(tmp_path / "images", count=2, size=128)
    settings = ClusterSettings(token="node-example-token", chunk_bytes=16 * 1024)  # several chunks a file
    cluster = local_cluster(tmp_path / "cluster", settings=settings, workers={"": ["hio/microscopy=1"]}).start()
    try:
        ingest = f"127.0.0.1:{free_port()}"
        cluster.add("gateway", ["--ingest-listen", ingest, "--source", "node-example"], health=ingest)
        run = subprocess.run(
            [
                NODE or "node",
                str(EXAMPLE / "submit.js"),
                "--address",
                ingest,
                "--image",
                "hio/microscopy",
                *map(str, files),
            ],
            capture_output=True,
            text=True,
            env=hio_env({"HIO_TOKEN": "node-example-token"}),  # sent as "authorization: Bearer ..."
            timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        lines = run.stdout.splitlines()
        assert lines[0] == f"gateway {ingest}: chunk_bytes {16 * 1024}, max_tuple_bytes {256 * 1024 * 1024}"
        printed = {}
        for line in lines[1:]:
            match = re.fullmatch(r"(\S+): STORED tuple (\d+)", line)
            assert match, line
            printed[match[1]] = int(match[2])
        assert sorted(printed) == sorted(path.name for path in files)
        stored = _stored(cluster.settings)
        for path in files:
            meta = stored[printed[path.name]].meta
            data = path.read_bytes()
            assert (meta.name, meta.image, meta.source) == (path.name, "hio/microscopy", "node-example")
            assert (meta.size, meta.crc32) == (len(data), zlib.crc32(data))
            assert "hio.wait" not in meta.attributes
        assert stored[printed[files[0].name]].features  # processed by the microscopy pipeline

        denied = subprocess.run(
            [
                NODE or "node",
                str(EXAMPLE / "submit.js"),
                "--address",
                ingest,
                "--image",
                "hio/microscopy",
                str(files[0]),
            ],
            capture_output=True,
            text=True,
            env=hio_env(),  # no token
            timeout=60,
        )
        assert denied.returncode == 1 and "UNAUTHENTICATED: missing token" in denied.stderr, denied.stderr

        unserved = subprocess.run(  # an image no engine serves: no outcome, so --wait-seconds ends the call
            [
                NODE or "node",
                str(EXAMPLE / "submit.js"),
                "--address",
                ingest,
                "--image",
                "hio/served-by-nobody",
                "--wait-seconds",
                "3",
                str(files[0]),
            ],
            capture_output=True,
            text=True,
            env=hio_env({"HIO_TOKEN": "node-example-token"}),
            timeout=60,
        )
        assert unserved.returncode == 1, unserved.stdout + unserved.stderr
        assert unserved.stdout.splitlines()[1] == (
            f"{files[0].name}: ACCEPTED, no outcome within --wait-seconds 3 (kept in the gateway's spool)"
        )
        assert "the gateway says: no engine serves image 'hio/served-by-nobody'" in unserved.stderr, unserved.stderr
    finally:
        stop_cleanly(cluster)
