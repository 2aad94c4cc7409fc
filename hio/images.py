"""`hio images`: build the processing-engine Docker images, offline.

An engine image is named like the tuples it processes ("hio/microscopy"). Each
lives in a folder of ``images/`` with a Dockerfile; ``hio/base`` (Python plus
the engine runtime) comes first and every other image starts FROM it.

Nothing is fetched inside a build (containers here cannot verify the package
index's certificate, and no container registry may be reachable at all):

* the base comes from ``--base-image`` (default ``python:3.11-slim``) when it is
  present locally or can be pulled, else from ``--fallback-base``, which
  ``images/make-base.sh`` creates with debootstrap + ``docker import``;
* Python packages come from a wheelhouse on the host (``pip wheel`` of the
  runtime dependencies, pinned by ``constraints.txt``, plus a wheel of this
  project), copied into the build context; builds run with networking off.
  The same wheelhouse serves hosts deployed offline by ansible/site.yml
  (``hio_wheelhouse``): it also holds the wheels of the extras hosts install.

Actions: ``build`` (default) the images, ``list`` what is present, ``base`` only
make the base, ``wheelhouse`` only fill the wheelhouse.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hio.config import ConfigError, setting

log = logging.getLogger("hio.images")

BUILTIN_IMAGES = ("base", "microscopy", "simulation", "synthetic")
ACTIONS = ("build", "list", "base", "wheelhouse")
PROJECT_WHEEL = "harmonicio"
# Extras deployed hosts install besides the runtime dependencies (ansible/: [kd] on KD
# hosts, [docker] on workers running engines as containers). Each has a folder of the
# wheelhouse, wheelhouse/<extra>/, with the wheels it adds: a host copies the top level
# and its extras' folders; engine images take the top level only.
HOST_EXTRAS = ("kd", "docker")
IMAGE_LABEL = "io.harmonicio.image"
STAGE_LABEL = "io.harmonicio.stage"
# Same sources, same wheel bytes: Docker's layer cache then skips reinstalling.
REPRODUCIBLE_ENV = {"SOURCE_DATE_EPOCH": "315532800"}
# Folders and files never copied when building the project's wheel from a
# clean copy of the checkout (a stale build/ would leak removed modules).
_WHEEL_COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "venv",
    "var",
    "build",
    "dist",
    "wheelhouse",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    "bench-out",
    "spark-warehouse",
    "images",
    "tests",
)


class ImageBuildError(RuntimeError):
    """A step of building an image failed; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class ImagesConfig:
    POSITIONAL = ("action", "ACTION", "build (default), list, base or wheelhouse")

    action: tuple[str, ...] = setting((), "what to do: build, list, base, wheelhouse")
    images: tuple[str, ...] = setting((), "folders of images/ to build (default: base microscopy simulation synthetic)")
    base_image: str = setting("python:3.11-slim", "image hio/base starts FROM (needs python3.11 + venv)")
    fallback_base: str = setting(
        "hio/debian-python:bookworm",
        "base used when --base-image is not available; created by images/make-base.sh if missing",
    )
    pull_base: bool = setting(True, "try to pull --base-image when it is not present locally")
    tag: str = setting("latest", "tag of the images built")
    wheelhouse: str = setting(
        "", "folder of wheels for hio/base and for hosts deployed offline (default: <project>/wheelhouse)"
    )
    project_dir: str = setting("", "checkout holding images/ and pyproject.toml (default: found from hio)")
    no_cache: bool = setting(False, "build every layer again")
    docker_timeout: float = setting(600.0, "seconds one Docker API call may take (a build step)")
    step_timeout: float = setting(1800.0, "seconds pip or make-base.sh may take")
    log_level: str = setting("warning", "debug, info, warning or error")
    log_json: bool = setting(False, "log one JSON object per line")

    def validate(self) -> None:
        unknown = [a for a in self.action if a not in ACTIONS]
        if unknown or len(self.action) > 1:
            raise ConfigError(f"action must be one of {', '.join(ACTIONS)}; got {' '.join(self.action)}")
        if not (self.docker_timeout > 0 and self.step_timeout > 0):  # NaN too
            raise ConfigError("docker_timeout and step_timeout must be positive")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", self.tag):
            raise ConfigError(f"tag is not a valid Docker tag: {self.tag!r}")


def project_root(config: ImagesConfig) -> Path:
    """The checkout: --project-dir, else the folder above the hio package, else cwd."""
    candidates = (
        [Path(config.project_dir)] if config.project_dir else [Path(__file__).resolve().parent.parent, Path.cwd()]
    )
    for path in candidates:
        if (path / "pyproject.toml").is_file() and (path / "images").is_dir():
            return path.resolve()
    raise ConfigError(
        "project_dir: no checkout with pyproject.toml and images/ found "
        f"(looked in {', '.join(str(p) for p in candidates)}); pass --project-dir"
    )


def image_name(folder: str, images_dir: Path) -> str:
    """The Docker name of an images/ folder: its IMAGE file, else hio/<folder>."""
    named = images_dir / folder / "IMAGE"
    if named.is_file():
        return named.read_text().strip()
    return f"hio/{folder}"


def selected_folders(config: ImagesConfig, images_dir: Path) -> list[str]:
    """Folders to build, base first; refuse names without a Dockerfile."""
    folders = list(config.images) or list(BUILTIN_IMAGES)
    missing = [f for f in folders if not (images_dir / f / "Dockerfile").is_file()]
    if missing:
        raise ConfigError(f"images: no Dockerfile in {', '.join(str(images_dir / m) for m in missing)}")
    return sorted(dict.fromkeys(folders), key=lambda f: (f != "base", folders.index(f)))


def runtime_requirements(root: Path, image_dir: Path | None = None) -> list[str]:
    """The project's runtime dependencies (names only) plus an image's extras
    (its requirements.txt; by default the base image's)."""
    names = _names(_project(root)["dependencies"])
    path = (image_dir or root / "images" / "base") / "requirements.txt"
    lines = path.read_text().splitlines() if path.is_file() else []
    extra = [ln.split("#", 1)[0].strip() for ln in lines if ln.split("#", 1)[0].strip()]
    return list(dict.fromkeys(n for n in names + extra if n != PROJECT_WHEEL))


def extra_requirements(root: Path, extra: str) -> list[str]:
    """The requirements (names only) an extra of the project adds, e.g. ``kd``."""
    return _names(_project(root)["optional-dependencies"][extra])


def _project(root: Path) -> dict[str, Any]:
    with open(root / "pyproject.toml", "rb") as fh:
        project: dict[str, Any] = tomllib.load(fh)["project"]
    return project


def _names(specs: list[str]) -> list[str]:
    return [re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0] for spec in specs]


def _run(
    cmd: list[str], what: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    log.debug("run", extra={"cmd": " ".join(cmd)})
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired:
        raise ImageBuildError(f"{what} did not finish within {timeout:.0f}s") from None


def _pip_wheel(args: list[str], wheelhouse: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "-q", "-w", str(wheelhouse), *args]
    return _run(cmd, "pip wheel", timeout, env=REPRODUCIBLE_ENV)


def fill_dependency_wheels(root: Path, wheelhouse: Path, timeout: float) -> None:
    """Wheels of every runtime dependency, and in ``wheelhouse/<extra>/`` those each
    of :data:`HOST_EXTRAS` adds (only the wheels the top level lacks): from the
    wheelhouse alone if it has them all (works offline), else from the package index."""
    _fill_wheels(root, runtime_requirements(root), wheelhouse, [wheelhouse], timeout)
    for extra in HOST_EXTRAS:
        folder = wheelhouse / extra
        folder.mkdir(exist_ok=True)
        _fill_wheels(root, extra_requirements(root, extra), folder, [wheelhouse, folder], timeout)
        for wheel in folder.glob("*.whl"):
            if (wheelhouse / wheel.name).is_file():
                wheel.unlink()


def _fill_wheels(root: Path, reqs: list[str], dest: Path, find_links: list[Path], timeout: float) -> None:
    pins = root / "constraints.txt"
    constraint = ["-c", str(pins)] if pins.is_file() else []
    links = [arg for folder in find_links for arg in ("--find-links", str(folder))]
    offline = _pip_wheel(["--no-index", *links, *constraint, *reqs], dest, timeout)
    if offline.returncode == 0:
        return
    print(f"hio images: fetching wheels for {' '.join(reqs)} into {dest}", flush=True)
    online = _pip_wheel([*links, *constraint, *reqs], dest, timeout)
    if online.returncode != 0:
        raise ImageBuildError(f"pip wheel failed for {' '.join(reqs)}:\n{online.stderr[-3000:]}")


def build_project_wheel(root: Path, wheelhouse: Path, timeout: float) -> Path:
    """A wheel of this project, built from a clean copy so nothing stale leaks in;
    it must carry the generated protobuf code."""
    import hio.proto  # noqa: F401 - imported to regenerate stale *_pb2.py in the checkout

    for old in wheelhouse.glob(f"{PROJECT_WHEEL}-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="hio-wheel-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(root, src, ignore=_WHEEL_COPY_IGNORE, symlinks=True)
        result = _pip_wheel(["--no-deps", "--no-build-isolation", str(src)], wheelhouse, timeout)
    if result.returncode != 0:
        raise ImageBuildError(f"building the {PROJECT_WHEEL} wheel failed:\n{result.stderr[-3000:]}")
    wheels = sorted(wheelhouse.glob(f"{PROJECT_WHEEL}-*.whl"))
    if not wheels:
        raise ImageBuildError(f"pip wheel made no {PROJECT_WHEEL} wheel in {wheelhouse}")
    with zipfile.ZipFile(wheels[-1]) as zf:  # without the generated gRPC code engines could not start
        names = set(zf.namelist())
    needed = ["hio/proto/engine_pb2.py", "hio/proto/engine_pb2_grpc.py", "hio/worker/__init__.py"]
    missing = [n for n in needed if n not in names]
    if missing:
        raise ImageBuildError(f"{wheels[-1].name} lacks {', '.join(missing)}; run `make proto` and build again")
    return wheels[-1]


def ensure_wheelhouse(config: ImagesConfig, root: Path) -> Path:
    """The wheelhouse with all runtime wheels and a fresh project wheel."""
    wheelhouse = Path(config.wheelhouse) if config.wheelhouse else root / "wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    fill_dependency_wheels(root, wheelhouse, config.step_timeout)
    wheel = build_project_wheel(root, wheelhouse, config.step_timeout)
    log.info("wheelhouse ready", extra={"wheelhouse": str(wheelhouse), "project_wheel": wheel.name})
    return wheelhouse.resolve()


def docker_client(timeout: float) -> Any:
    """A Docker client that has answered a ping, or ImageBuildError saying why not."""
    try:
        import docker
    except ImportError:
        raise ImageBuildError("the docker package is not installed (pip install 'harmonicio[docker]')") from None
    try:
        client = docker.from_env(timeout=int(timeout))
        client.ping()
        return client
    except Exception as exc:  # noqa: BLE001 - any failure means the same thing to the user
        raise ImageBuildError(f"no Docker engine answers ({exc}); start dockerd (see .ci/setup-docker.sh)") from None


def has_image(client: Any, name: str) -> bool:
    """Is ``name`` present in the local image store (never asks a registry)?"""
    import docker.errors

    try:
        client.images.get(name)
        return True
    except docker.errors.ImageNotFound:
        return False


def ensure_base(client: Any, config: ImagesConfig, root: Path) -> str:
    """The base image to build FROM: --base-image if local or pullable, else the
    fallback, created with images/make-base.sh when missing."""
    if has_image(client, config.base_image):
        return config.base_image
    if config.pull_base:
        try:
            client.images.pull(config.base_image)
            return config.base_image
        except Exception as exc:  # noqa: BLE001 - an unreachable registry is expected offline
            log.info("pull failed", extra={"image": config.base_image, "error": str(exc)[:200]})
    if not has_image(client, config.fallback_base):
        print(
            f"hio images: {config.base_image} is not available; creating {config.fallback_base} "
            "with debootstrap (images/make-base.sh)",
            flush=True,
        )
        script = root / "images" / "make-base.sh"
        result = _run(["bash", str(script), config.fallback_base], "make-base.sh", config.step_timeout)
        if result.returncode != 0:
            raise ImageBuildError(f"{script} failed:\n{result.stderr[-3000:]}")
    return config.fallback_base


def stage_context(folder: Path, wheelhouse: Path | None, requirements: list[str], dest: Path) -> Path:
    """A build context: the image folder, plus ``wheelhouse/deps`` (every wheel but
    ours, and ``requirements`` as requirements.txt) and ``wheelhouse/project``
    (our wheel). Hard links where possible: wheels are large."""
    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if wheelhouse is None:
        return dest
    deps, project = dest / "wheelhouse" / "deps", dest / "wheelhouse" / "project"
    deps.mkdir(parents=True)
    project.mkdir()
    for wheel in wheelhouse.glob("*.whl"):
        target = project if wheel.name.startswith(f"{PROJECT_WHEEL}-") else deps
        try:
            os.link(wheel, target / wheel.name)
        except OSError:
            shutil.copy2(wheel, target / wheel.name)
    (deps / "requirements.txt").write_text("\n".join(requirements) + "\n")
    return dest


def build_image(
    client: Any, context: Path, name: str, buildargs: dict[str, str], nocache: bool, target: str | None = None
) -> str:
    """Build ``context`` (up to stage ``target``) as ``name`` with networking off; the image id."""
    output: list[str] = []
    image_id = ""
    stream = client.api.build(
        path=str(context),
        tag=name,
        buildargs=buildargs,
        rm=True,
        forcerm=True,
        nocache=nocache,
        pull=False,
        network_mode="none",
        decode=True,
        labels={IMAGE_LABEL: "true"},
        target=target,
    )
    for chunk in stream:
        if "error" in chunk:
            tail = "".join(output[-30:])
            raise ImageBuildError(f"building {name} failed: {chunk['error'].strip()}\n{tail}")
        text = chunk.get("stream", "")
        if text:
            output.append(text)
            log.debug("build", extra={"image": name, "line": text.rstrip()})
        aux = chunk.get("aux") or {}
        image_id = aux.get("ID", image_id)
    if not image_id:
        raise ImageBuildError(f"building {name} produced no image:\n{''.join(output[-30:])}")
    return image_id


def build_all(config: ImagesConfig) -> list[tuple[str, str]]:
    """Build the selected images in order; (name:tag, short id) of each."""
    root = project_root(config)
    images_dir = root / "images"
    folders = selected_folders(config, images_dir)
    client = docker_client(config.docker_timeout)
    base_name = f"{image_name('base', images_dir)}:{config.tag}"
    wheelhouse: Path | None = None
    built: list[tuple[str, str]] = []
    for folder in folders:
        name = f"{image_name(folder, images_dir)}:{config.tag}"
        if folder == "base":
            from_image = ensure_base(client, config, root)
            wheelhouse = wheelhouse or ensure_wheelhouse(config, root)
        elif not has_image(client, base_name):
            raise ImageBuildError(f"{name} starts FROM {base_name}, which is not built; build base first")
        else:
            from_image = base_name
        needs_wheels = (images_dir / folder / "requirements.txt").is_file()
        if needs_wheels and wheelhouse is None:
            wheelhouse = ensure_wheelhouse(config, root)
        print(f"hio images: building {name} FROM {from_image}", flush=True)
        with tempfile.TemporaryDirectory(prefix="hio-image-") as tmp:
            ctx = stage_context(
                images_dir / folder,
                wheelhouse if needs_wheels else None,
                runtime_requirements(root, images_dir / folder),
                Path(tmp) / "ctx",
            )
            buildargs = {"BASE_IMAGE": from_image}
            image_id = build_image(client, ctx, name, buildargs, config.no_cache)
            if folder == "base":
                # the build stage tagged <name>-build: the next build reuses its layers, and older
                # untagged build stages can go (only ours: they carry io.harmonicio.stage=build, see
                # the prune below); all its layers are cached, so this takes a moment
                repo, _, tag = name.rpartition(":")
                build_image(client, ctx, f"{repo}-build:{tag}", buildargs, nocache=False, target="build")
        built.append((name, image_id.split(":")[-1][:12]))
    # untagged images left by earlier builds go: only ours (labelled), only unused ones
    # (Docker keeps images that containers still run)
    for label in (f"{IMAGE_LABEL}=true", f"{STAGE_LABEL}=build"):
        client.images.prune(filters={"dangling": True, "label": label})
    return built


def list_images(config: ImagesConfig) -> list[tuple[str, str]]:
    """(name:tag, short id or 'missing') for each selected image."""
    images_dir = project_root(config) / "images"
    client = docker_client(config.docker_timeout)
    rows = []
    for folder in selected_folders(config, images_dir):
        name = f"{image_name(folder, images_dir)}:{config.tag}"
        try:
            rows.append((name, client.images.get(name).short_id.split(":")[-1]))
        except Exception:  # noqa: BLE001 - ImageNotFound or an API error: not usable
            rows.append((name, "missing"))
    return rows


def _print_rows(rows: Iterable[tuple[str, str]]) -> None:
    for name, ident in rows:
        print(f"{name:<40} {ident}")


def run_images(config: ImagesConfig) -> int:
    action = config.action[0] if config.action else "build"
    try:
        if action == "build":
            _print_rows(build_all(config))
        elif action == "list":
            rows = list_images(config)
            _print_rows(rows)
            return 1 if any(ident == "missing" for _, ident in rows) else 0
        elif action == "base":
            print(ensure_base(docker_client(config.docker_timeout), config, project_root(config)))
        else:
            print(ensure_wheelhouse(config, project_root(config)))
    except ImageBuildError as exc:
        print(f"hio images: {exc}", file=sys.stderr)
        return 1
    return 0
