#!/usr/bin/env bash
# Create a Python base image locally, without any container registry.
#
# Used when the default base (python:3.11-slim) is not present and cannot be
# pulled: debootstrap a minimal Debian bookworm root file system (its python3
# is 3.11) and `docker import` it. Idempotent: does nothing when the image
# already exists (pass --force to rebuild).
#
#   images/make-base.sh [--force] [--packages P1,P2,...] [IMAGE]
#
# IMAGE defaults to hio/debian-python:bookworm. --packages adds Debian packages
# (and what they depend on) to the root file system: tests/ansible/ makes its
# SSH-and-systemd hosts from such a base.
#
# Environment: HIO_DEBIAN_MIRROR (default: the first Debian mirror in this
# host's apt sources, else http://deb.debian.org/debian), HIO_DEBIAN_SUITE
# (default bookworm). Needs root, debootstrap and a running Docker engine.
set -euo pipefail

FORCE=0
PACKAGES="python3,python3-venv,ca-certificates,tzdata"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) FORCE=1; shift ;;
        --packages) PACKAGES="$PACKAGES,${2:?--packages needs a comma-separated list}"; shift 2 ;;
        -*) printf 'make-base: unknown option %s\n' "$1" >&2; exit 2 ;;
        *) break ;;
    esac
done
IMAGE="${1:-hio/debian-python:bookworm}"
SUITE="${HIO_DEBIAN_SUITE:-bookworm}"

log() { printf 'make-base: %s\n' "$*" >&2; }

host_mirror() {
    # deb822 sources first (URIs: line), then one-line sources.list entries.
    local uri
    uri=$(grep -hE '^URIs:.*debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null \
          | grep -v security | head -n1 | awk '{print $2}') || true
    if [[ -z "$uri" ]]; then
        uri=$(grep -hE '^deb\s+\S*debian/?\s' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
              | grep -v security | head -n1 | awk '{print $2}') || true
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

if [[ $FORCE -eq 0 ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE already exists; nothing to do"
    exit 0
fi
command -v debootstrap >/dev/null || { log "debootstrap is not installed (apt-get install debootstrap)"; exit 1; }
[[ $(id -u) -eq 0 ]] || { log "debootstrap needs root"; exit 1; }

MIRROR="${HIO_DEBIAN_MIRROR:-$(host_mirror)}"
ROOT=$(mktemp -d /tmp/hio-rootfs.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT

log "debootstrap $SUITE from $MIRROR into $ROOT (a few minutes)"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 || {
    tail -n 30 "$ROOT.log" >&2; rm -f "$ROOT.log"; exit 1; }
rm -f "$ROOT.log"

# Slim the root: package caches and lists are not needed at run time.
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* \
       "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/*
ln -sf python3 "$ROOT/usr/bin/python"

log "importing as $IMAGE"
tar -C "$ROOT" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap $SUITE with python3 (HarmonicIO offline base)" \
    - "$IMAGE" >/dev/null
docker run --rm "$IMAGE" python3 -c 'import sys, venv; assert sys.version_info[:2] == (3, 11), sys.version' \
    || { log "$IMAGE has no usable Python 3.11"; exit 1; }
log "built $IMAGE"
