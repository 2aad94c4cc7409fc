#!/usr/bin/env bash
# Make Docker usable for the docker tests, and build the engine images.
#
# Idempotent; runs as root without a terminal (CI). With --missing-packages it
# only prints the Debian packages it would install; with --engine it stops after
# step 2 (CI builds the images beside other work once an engine answers). Steps,
# each skipped when already done:
#   1. install Debian's docker.io (and debootstrap, for the offline base) if missing;
#   2. start dockerd in the background if no engine answers (log:
#      $HIO_DOCKERD_LOG, default /var/log/hio-dockerd.log), wait until
#      `docker info` works (at most $HIO_DOCKER_WAIT seconds, default 60);
#   3. build the images (`hio images build`): the base comes from
#      python:3.11-slim when present or pullable, else hio/debian-python:bookworm
#      made by images/make-base.sh (debootstrap + docker import; skipped when it
#      exists); Python packages from ./wheelhouse.
#
# Exit status: 0 when the images are built, and also when Docker cannot be
# started here (then it says so clearly and the docker tests skip with the
# reason); non-zero only on a real failure (an install or a build failing).
set -uo pipefail

cd "$(dirname "$0")/.."
LOG="${HIO_DOCKERD_LOG:-/var/log/hio-dockerd.log}"
WAIT="${HIO_DOCKER_WAIT:-60}"
PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3

say() { printf 'setup-docker: %s\n' "$*"; }
fail() { say "FAILED: $*" >&2; exit 1; }
no_docker() {
    say "=================================================================="
    say "Docker cannot be started here: $*"
    say "The docker tests will be skipped (pytest -ra shows the reason)."
    say "=================================================================="
    exit 0
}
engine_answers() { timeout 10 docker info >/dev/null 2>&1; }

# Debian's packages this script needs and this machine lacks, one a line.
missing_packages() {
    { command -v dockerd && command -v docker; } >/dev/null 2>&1 || echo docker.io
    command -v debootstrap >/dev/null 2>&1 || echo debootstrap
}

install_packages() {
    local missing
    mapfile -t missing < <(missing_packages)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    [[ $(id -u) -eq 0 ]] || no_docker "need root to install ${missing[*]}"
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null || fail "apt-get update"
    apt-get install -y -q --no-install-recommends $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null \
        || fail "apt-get install ${missing[*]}"
}

start_engine() {
    engine_answers && { say "a Docker engine answers"; return 0; }
    [[ $(id -u) -eq 0 ]] || no_docker "no engine answers and starting dockerd needs root"
    if ! pgrep -x dockerd >/dev/null 2>&1; then
        say "starting dockerd (log: $LOG)"
        mkdir -p "$(dirname "$LOG")"
        setsid nohup dockerd >>"$LOG" 2>&1 < /dev/null &
    else
        say "dockerd is running but not answering yet; waiting"
    fi
    local deadline=$((SECONDS + WAIT))
    while (( SECONDS < deadline )); do
        engine_answers && { say "Docker engine is up"; return 0; }
        pgrep -x dockerd >/dev/null 2>&1 || break
        sleep 1
    done
    tail -n 20 "$LOG" 2>/dev/null | sed 's/^/  dockerd: /'
    no_docker "dockerd did not answer within ${WAIT}s (see $LOG)"
}

build_images() {
    say "building the engine images (hio images build)"
    "$PY" -m hio.cli images build || fail "hio images build"
    "$PY" -m hio.cli images list || fail "an image is missing after the build"
}

if [[ "${1:-}" == "--missing-packages" ]]; then  # for .ci/run, which installs them with the rest
    missing_packages
    exit 0
fi
install_packages
start_engine
[[ "${1:-}" == "--engine" ]] && exit 0
build_images
say "done"
