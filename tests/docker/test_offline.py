"""The parts of the docker runtime and image builds that need no Docker
engine: names, the container environment, credential copies, image selection
and the project wheel. Run everywhere (no `docker` marker)."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from hio.config import ConfigError

docker_launcher = pytest.importorskip("hio.worker.docker_launcher")
from hio.images import (
    BUILTIN_IMAGES,
    HOST_EXTRAS,
    ImagesConfig,
    build_project_wheel,
    extra_requirements,
    project_root,
    runtime_requirements,
    selected_folders,
    stage_context,
)

ROOT = Path(__file__).resolve().parents[2]


def test_container_names_are_valid_and_scoped_to_the_worker() -> None:
    name = docker_launcher.container_name
    assert name("w1", "w1/3") == "hio-w1-3"
    assert name("w1", "3") == "hio-w1-3"
    assert name("lab pc", "lab pc/0") == "hio-lab_pc-0"
    assert name("w2", "w1/3") == "hio-w2-w1-3", "another worker's channel id cannot clash with ours"


def test_container_env_passes_settings_and_credentials(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("tok\n")
    key = tmp_path / "key.pem"
    key.write_bytes(b"KEY")
    spec_env = {
        "HIO_ENGINE_CHANNEL_ID": "w/1",
        "HIO_MASTER_ADDRESS": "127.0.0.1:7000",
        "HIO_TOKEN_FILE": str(token),
        "HIO_TLS_KEY": str(key),
        "HIO_DATA_DIR": "/host/var",
        "HIO_ENGINE_PIPELINE": "mine:process",
        "HIO_TLS_CLIENT_AUTH": "false",
    }
    env, files = docker_launcher.DockerLauncher._container_env(spec_env, image_names_pipeline=True)
    assert env == {
        "HIO_ENGINE_CHANNEL_ID": "w/1",
        "HIO_MASTER_ADDRESS": "127.0.0.1:7000",
        "HIO_TOKEN": "tok",
        "HIO_TLS_KEY": "/run/hio/tls_key",
        "HIO_TLS_CLIENT_AUTH": "false",
    }
    assert files == {"/run/hio/tls_key": b"KEY"}
    env, _ = docker_launcher.DockerLauncher._container_env(spec_env, image_names_pipeline=False)
    assert env["HIO_ENGINE_PIPELINE"] == "mine:process", "without HIO_PIPELINE in the image the mapping applies"


def test_a_missing_credential_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        docker_launcher.DockerLauncher._container_env({"HIO_TLS_CA": str(tmp_path / "nope")}, True)


def test_secrets_are_owned_by_the_image_user_and_private() -> None:
    data = docker_launcher._secrets_tar({"/run/hio/tls_key": b"KEY"}, "10001:10002")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        folder, key = tar.getmember("run/hio"), tar.getmember("run/hio/tls_key")
        assert (folder.uid, folder.gid, folder.mode) == (10001, 10002, 0o500)
        assert (key.uid, key.gid, key.mode) == (10001, 10002, 0o400)
        assert tar.extractfile(key).read() == b"KEY"  # type: ignore[union-attr]
    assert docker_launcher._numeric_user("hio") == (0, 0)
    assert docker_launcher._numeric_user("") == (0, 0)


def test_images_config_refuses_bad_actions_and_tags() -> None:
    with pytest.raises(ConfigError, match="action must be one of"):
        ImagesConfig(action=("frob",)).validate()
    with pytest.raises(ConfigError, match="tag"):
        ImagesConfig(tag="bad tag").validate()
    ImagesConfig(action=("list",)).validate()


def test_selection_builds_base_first_and_refuses_unknown_folders() -> None:
    images = ROOT / "images"
    assert selected_folders(ImagesConfig(), images) == list(BUILTIN_IMAGES)
    assert selected_folders(ImagesConfig(images=("synthetic", "base")), images) == ["base", "synthetic"]
    with pytest.raises(ConfigError, match="no Dockerfile"):
        selected_folders(ImagesConfig(images=("nope",)), images)
    assert project_root(ImagesConfig(project_dir=str(ROOT))) == ROOT


def test_base_requirements_are_the_runtime_dependencies_plus_extras() -> None:
    reqs = runtime_requirements(ROOT)
    assert {"grpcio", "protobuf", "zstandard", "numpy", "scipy"} <= set(reqs)
    assert "harmonicio" not in reqs and "pyspark" not in reqs


def test_the_extras_deployed_hosts_install_name_their_requirements() -> None:
    assert set(HOST_EXTRAS) == {"kd", "docker"}
    assert {"pyspark", "pyarrow", "pandas"} <= set(extra_requirements(ROOT, "kd"))
    assert extra_requirements(ROOT, "docker") == ["docker"]


def test_project_wheel_carries_generated_code_and_stages_apart(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wh"
    wheelhouse.mkdir()
    (wheelhouse / "numpy-1-py3-none-any.whl").write_bytes(b"x")
    wheel = build_project_wheel(ROOT, wheelhouse, timeout=300)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert {"hio/proto/master_pb2.py", "hio/proto/engine_pb2_grpc.py", "hio/worker/engine.py"} <= names
    assert not any(n.startswith(("tests/", "images/")) for n in names)
    ctx = stage_context(ROOT / "images" / "base", wheelhouse, ["numpy", "scipy"], tmp_path / "ctx")
    assert sorted(p.name for p in (ctx / "wheelhouse" / "project").iterdir()) == [wheel.name]
    assert (ctx / "wheelhouse" / "deps" / "requirements.txt").read_text() == "numpy\nscipy\n"
    assert (ctx / "Dockerfile").is_file() and (ctx / "healthcheck.py").is_file()


def test_the_route_ticket_key_is_copied_into_the_container(tmp_path: Path) -> None:
    """A host path means nothing inside; without the copy a containerised engine could not start."""
    key = tmp_path / "ticket.key"
    key.write_bytes(b"k" * 32)
    env, files = docker_launcher.DockerLauncher._container_env({"HIO_TICKET_KEY_FILE": str(key)}, True)
    assert env == {"HIO_TICKET_KEY_FILE": "/run/hio/ticket_key_file"}
    assert files == {"/run/hio/ticket_key_file": b"k" * 32}
