#!/bin/sh
# Build the offline base image from Debian packages alone (no registry): debootstrap a minimal root file
# system of this machine's Debian release, with the Python and the libraries the Starling image needs, and
# `docker import` it. Needs root, debootstrap and a reachable Debian mirror (apt's, not Docker Hub).
#   docker/base-image.sh [TAG]        TAG defaults to starling-base:<release>
# Env: DEBIAN_RELEASE (default: this machine's VERSION_CODENAME, else bookworm), DEBIAN_MIRROR
# (default http://deb.debian.org/debian), ROOTFS_DIR (default: a temporary directory, removed after),
# BASE_PACKAGES (comma-separated; default: what the Starling image needs, below). The compose swarm's offline
# Prometheus image is this script with BASE_PACKAGES=prometheus (docker/compose_test.py).
set -eu
release=${DEBIAN_RELEASE:-$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")}
release=${release:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
tag=${1:-starling-base:$release}
# python3 (3.11 on bookworm) with venv and `python`, tini (PID 1), libgmp10 (fastecdsa's runtime library),
# ca-certificates; nothing to compile: the wheelhouse holds built wheels.
pkgs=${BASE_PACKAGES:-python3,python3-venv,python-is-python3,tini,libgmp10,ca-certificates}
[ "$(id -u)" = 0 ] || { echo "base-image.sh: debootstrap needs root" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "base-image.sh: debootstrap is missing (apt-get install debootstrap)" >&2; exit 2; }
if [ -n "${ROOTFS_DIR:-}" ]; then rootfs=$ROOTFS_DIR; mkdir -p "$rootfs"; else rootfs=$(mktemp -d /var/tmp/starling-rootfs.XXXXXX); fi
trap 'rm -rf "$rootfs"' EXIT INT TERM
echo "debootstrap $release ($mirror) into $rootfs with $pkgs"
debootstrap --variant=minbase --include="$pkgs" "$release" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
  || { tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
# What an image does not need: package lists and caches, docs, man pages, locales but C.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/debconf/*-old \
       "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/*.log
find "$rootfs"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
tar --numeric-owner -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase $release + $pkgs" - "$tag" >/dev/null
echo "imported $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
