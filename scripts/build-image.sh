#!/usr/bin/env bash
# Build epp's image from deploy/Containerfile without a daemon or a registry, and optionally
# smoke-test it (./run image [--smoke]).
#
# The base is a Debian rootfs with python3 made by mmdebstrap (no registry base image can be
# pulled here), imported with buildah; the Containerfile is the one users build with docker
# or podman. buildah runs with the vfs storage driver and chroot isolation (no daemon, no
# overlay mounts), as root. Installs mmdebstrap and buildah from Debian when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
IMAGE=${EPP_IMAGE:-epp:$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}
BASE=localhost/epp-base:bookworm
SUITE=${EPP_IMAGE_SUITE:-bookworm}
B="buildah --storage-driver vfs"

if ! command -v mmdebstrap >/dev/null || ! command -v buildah >/dev/null; then
    if [ "$(id -u)" != 0 ]; then
        echo "build-image: needs mmdebstrap and buildah (Debian: apt-get install mmdebstrap buildah)" >&2
        exit 2
    fi
    echo "installing mmdebstrap and buildah from Debian..." >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap buildah >/dev/null
fi

t0=$(date +%s)
if [ -z "$($B images -q "$BASE" 2>/dev/null)" ]; then
    echo "making the base: Debian $SUITE with python3 (mmdebstrap)..." >&2
    work=$(mktemp -d)
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
        "$SUITE" "$work/rootfs.tar"
    ctr=$($B from scratch)
    mnt=$($B mount "$ctr")
    tar -C "$mnt" -xf "$work/rootfs.tar"
    # the base trusts what this machine trusts (a TLS-intercepting proxy's CA, where there is
    # one), so that pip inside the build reaches PyPI as pip here does
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
        cp /etc/ssl/certs/ca-certificates.crt "$mnt/etc/ssl/certs/ca-certificates.crt"
    fi
    $B umount "$ctr" >/dev/null
    $B commit --quiet "$ctr" "$BASE" >/dev/null
    $B rm "$ctr" >/dev/null
    rm -rf "$work"
fi
echo "building $IMAGE from deploy/Containerfile (buildah, vfs, chroot)..." >&2
$B bud --quiet --isolation chroot --layers=false -f deploy/Containerfile \
    --build-arg BASE="$BASE" --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    -t "$IMAGE" . >/dev/null
size=$($B images --format '{{.Size}}' "$IMAGE" | head -1)
base_size=$($B images --format '{{.Size}}' "$BASE" | head -1)
echo "image $IMAGE built in $(( $(date +%s) - t0 )) s: $size (the base, Debian $SUITE minbase with python3: $base_size)"

if [ "$SMOKE" = 1 ]; then
    ctr=$($B from "$IMAGE")
    trap '$B rm "$ctr" >/dev/null 2>&1 || true' EXIT
    user=$($B inspect --format '{{.OCIv1.Config.User}}' "$ctr")
    echo "the image runs as user $user"
    [ "$user" != "" ] && [ "${user%%:*}" != 0 ] && [ "${user%%:*}" != root ] || { echo "runs as root" >&2; exit 1; }
    # host network (chroot isolation): epp listens on loopback ports the smoke test chose
    ./run python scripts/image_smoke.py -- $B run --isolation chroot "$ctr" -- \
        epp serve --host 127.0.0.1 --grpc-port {grpc} --health-port {health} \
        --metrics-port {metrics} --endpoints {endpoints} --log-format text
fi
