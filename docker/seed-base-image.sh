#!/usr/bin/env bash
# Build the Dockerfile's Debian base image locally, for a machine that cannot pull it from
# Docker Hub: debootstrap the same release (minbase, trimmed like Docker's slim images), then
# `docker import` it under the base's own name, so the Dockerfile builds unchanged.
#
#   docker/seed-base-image.sh debian:bookworm-slim      (make seed-base-image runs this)
#
# The root filesystem is cached as a tarball under $KVSERVE_DOCKER_CACHE (default
# ~/.cache/kvserve/docker); delete it to seed from a fresh debootstrap. Needs root (debootstrap),
# and Debian's archive ($DEBIAN_MIRROR, default http://deb.debian.org/debian).
set -euo pipefail

image=${1:?usage: $0 debian:<release>-slim}
case "$image" in
    debian:*-slim) release=${image#debian:}; release=${release%-slim} ;;
    *) echo "seed-base-image: can only seed debian:<release>-slim images, not $image" >&2; exit 2 ;;
esac
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${KVSERVE_DOCKER_CACHE:-$HOME/.cache/kvserve/docker}
tarball=$cache/debian-$release-slim-$(dpkg --print-architecture).tar

if docker image inspect "$image" >/dev/null 2>&1; then
    echo "seed-base-image: $image is already in the local image store"
    exit 0
fi

if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || {
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
    }
    mkdir -p "$cache"
    rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT
    echo "seed-base-image: debootstrap $release from $mirror (about 30 s)"
    debootstrap --variant=minbase "$release" "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 || {
        tail -20 "$cache/debootstrap.log" >&2
        exit 1
    }
    # What Docker's debian:*-slim images carry: the release's three suites, no package lists
    # or caches, apt told to keep none, and dpkg told to skip documentation and translations.
    rm -f "$rootfs/etc/apt/sources.list"
    cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: http://deb.debian.org/debian
Suites: $release $release-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: $release-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
    printf '%s\n' 'Dir::Cache::pkgcache "";' 'Dir::Cache::srcpkgcache "";' \
        >"$rootfs/etc/apt/apt.conf.d/docker-clean"
    echo 'Acquire::GzipIndexes "true";' >"$rootfs/etc/apt/apt.conf.d/docker-gzip-indexes"
    echo 'Acquire::Languages "none";' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
    echo 'Apt::AutoRemove::SuggestsImportant "false";' \
        >"$rootfs/etc/apt/apt.conf.d/docker-autoremove-suggests"
    cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'DPKG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
DPKG
    find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    rm -rf "$rootfs"/usr/share/{man,info,locale}/* "$rootfs"/var/cache/apt/archives/*.deb \
        "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log
    tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
fi

docker import --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --message "debootstrap --variant=minbase $release (docker/seed-base-image.sh)" \
    "$tarball" "$image" >/dev/null
echo "seed-base-image: $image imported from $tarball"
