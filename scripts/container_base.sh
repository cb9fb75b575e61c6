#!/usr/bin/env bash
# Podman set up for the container checks, and a Debian base image made without a registry.
#
#   source scripts/container_base.sh    (scripts/container_check.sh and scripts/addon_check.sh do)
#   bash scripts/container_base.sh      only make sure the base image exists, and print its name
#
# Installs podman, runc and debootstrap when missing (root or sudo). Podman reads a
# containers.conf of this script's own (CONTAINERS_CONF; the system's file is left alone) that
# selects runc and sets no default ulimits: crun, and runc with the default ulimits, fail in
# VMs without CAP_SYS_RESOURCE or with hybrid cgroups. The base, S2S_BASE_IMAGE (default
# localhost/debian:bookworm), is `debootstrap --variant=minbase bookworm` from the Debian archive
# apt already uses, imported once (about a minute, 200 MB): it stands in for debian:bookworm-slim
# and Home Assistant's base-debian:bookworm where no registry image can be pulled. With a
# registry, set S2S_BASE_IMAGE=docker.io/library/debian:bookworm-slim and nothing is made.
set -euo pipefail

S2S_BASE_IMAGE=${S2S_BASE_IMAGE:-localhost/debian:bookworm}
S2S_CONTAINER_STATE=${S2S_CONTAINER_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/s2s-daemon/container}

_s2s_sudo() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

s2s_container_tools() {
  local missing=() pkg
  for pkg in podman runc debootstrap; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    echo "container: installing ${missing[*]}" >&2
    _s2s_sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive _s2s_sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  mkdir -p "$S2S_CONTAINER_STATE"
  CONTAINERS_CONF="$S2S_CONTAINER_STATE/containers.conf"
  printf '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n' >"$CONTAINERS_CONF"
  export CONTAINERS_CONF
}

s2s_base_image() {
  if podman image exists "$S2S_BASE_IMAGE"; then
    return 0
  fi
  case "$S2S_BASE_IMAGE" in
    localhost/*) ;;
    *) podman pull "$S2S_BASE_IMAGE" >&2; return 0 ;;
  esac
  local mirror rootfs
  # The Debian archive apt uses here (deb822 sources first, then the one-line format).
  mirror=$(grep -rhs '^URIs:.*/debian/\?$' /etc/apt/sources.list.d/ | awk '{print $2}' | head -1)
  [ -n "$mirror" ] || mirror=$(grep -hs '^deb .*/debian/\? ' /etc/apt/sources.list | awk '{print $2}' | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d "${TMPDIR:-/tmp}/s2s-rootfs.XXXXXX")
  echo "container: making $S2S_BASE_IMAGE with debootstrap from $mirror (about a minute)" >&2
  _s2s_sudo debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$S2S_CONTAINER_STATE/debootstrap.log" 2>&1 || {
    tail -5 "$S2S_CONTAINER_STATE/debootstrap.log" >&2
    return 1
  }
  _s2s_sudo tar -C "$rootfs" -c . | podman import --quiet - "$S2S_BASE_IMAGE" >/dev/null
  _s2s_sudo rm -rf "$rootfs"
}

s2s_container_tools
s2s_base_image

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "$S2S_BASE_IMAGE"
fi
