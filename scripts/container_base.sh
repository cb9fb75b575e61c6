#!/usr/bin/env bash
# Podman set up for the container checks, and a Debian base image made without a registry.
#
#   source scripts/container_base.sh    (scripts/container_check.sh and scripts/addon_check.sh do)
#   bash scripts/container_base.sh      only make sure the base image exists, and print its name
#
# Sourcing also defines s2s_build_inputs (how pip inside a build reaches the index here),
# s2s_free_ports and s2s_client_python.
#
# Installs podman, runc and debootstrap when missing (root or sudo). Podman reads a
# containers.conf of this script's own (CONTAINERS_CONF; the system's file is left alone) that
# selects runc and sets no default ulimits: crun, and runc with the default ulimits, fail in
# VMs without CAP_SYS_RESOURCE or with hybrid cgroups. The base, S2S_CONTAINER_BASE (default
# localhost/debian:bookworm), is `debootstrap --variant=minbase bookworm` from the Debian archive
# apt already uses, imported once (about a minute, 200 MB): it stands in for debian:bookworm-slim
# and Home Assistant's base-debian:bookworm where no registry image can be pulled. With a
# registry, set S2S_CONTAINER_BASE=docker.io/library/debian:bookworm-slim and nothing is made.
set -euo pipefail

S2S_CONTAINER_BASE=${S2S_CONTAINER_BASE:-localhost/debian:bookworm}
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
  if podman image exists "$S2S_CONTAINER_BASE"; then
    return 0
  fi
  case "$S2S_CONTAINER_BASE" in
    localhost/*) ;;
    *) podman pull "$S2S_CONTAINER_BASE" >&2; return 0 ;;
  esac
  local mirror rootfs
  # The Debian archive apt uses here (deb822 sources first, then the one-line format).
  mirror=$(grep -rhs '^URIs:.*/debian/\?$' /etc/apt/sources.list.d/ | awk '{print $2}' | head -1)
  [ -n "$mirror" ] || mirror=$(grep -hs '^deb .*/debian/\? ' /etc/apt/sources.list | awk '{print $2}' | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d "${TMPDIR:-/tmp}/s2s-rootfs.XXXXXX")
  echo "container: making $S2S_CONTAINER_BASE with debootstrap from $mirror (about a minute)" >&2
  _s2s_sudo debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$S2S_CONTAINER_STATE/debootstrap.log" 2>&1 || {
    tail -5 "$S2S_CONTAINER_STATE/debootstrap.log" >&2
    return 1
  }
  _s2s_sudo tar -C "$rootfs" -c . | podman import --quiet - "$S2S_CONTAINER_BASE" >/dev/null
  _s2s_sudo rm -rf "$rootfs"
}

_s2s_host_pip() {  # one of this machine's pip settings: the environment first, then pip config
  local value=${!1:-}
  [ -n "$value" ] || value=$(python3 -m pip config get "global.$2" 2>/dev/null || true)
  printf '%s' "$value"
}

# s2s_build_inputs DIR: fill S2S_BUILD_FLAGS with what a build here needs for pip inside it to reach
# the package index as this machine's pip does: the folder holding the torch CPU wheel
# (S2S_CONTAINER_TORCH_WHEELS, else the one of pip's find-links that holds torch-2.13.0+cpu) bound in and
# named in TORCH_PIP_ARGS, and pip's certificate bundle (a TLS-intercepting proxy's CA) bound in
# with a pip.conf, written into DIR, that names it. Without either, the build uses its defaults
# (the PyTorch CPU index, PyPI with the image's own certificates).
s2s_build_inputs() {
  local dir wheels=${S2S_CONTAINER_TORCH_WHEELS:-} cert
  S2S_BUILD_FLAGS=()
  S2S_BUILD_SOURCES="torch: the PyTorch CPU index"
  if [ -z "$wheels" ]; then
    for dir in $(_s2s_host_pip PIP_FIND_LINKS find-links); do
      dir=${dir#file://}
      if compgen -G "$dir/torch-2.13.0+cpu-*.whl" >/dev/null; then wheels=$dir; break; fi
    done
  fi
  if [ -n "$wheels" ]; then
    S2S_BUILD_FLAGS+=(-v "$wheels:/run/s2s-build/wheels:ro" --build-arg "TORCH_PIP_ARGS=--find-links /run/s2s-build/wheels")
    S2S_BUILD_SOURCES="torch: $wheels"
  fi
  cert=$(_s2s_host_pip PIP_CERT cert)
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    printf '[global]\ncert = /run/s2s-build/ca.crt\n' >"$1/pip.conf"
    S2S_BUILD_FLAGS+=(-v "$cert:/run/s2s-build/ca.crt:ro" -v "$1/pip.conf:/etc/pip.conf:ro")
    S2S_BUILD_SOURCES+="; pip certificates: $cert"
  fi
}

# s2s_free_ports N: N loopback TCP ports free now, on one line.
s2s_free_ports() {
  python3 -c '
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
' "$1"
}

# s2s_client_python: prints a Python that has the wyoming client library and PyYAML (the repository's
# .venv when it has them, else a small virtual environment of its own in S2S_CONTAINER_STATE).
s2s_client_python() {
  local py=.venv/bin/python
  if ! { [ -x "$py" ] && "$py" -c 'import wyoming, yaml' 2>/dev/null; }; then
    py=$S2S_CONTAINER_STATE/client-venv/bin/python
    if ! { [ -x "$py" ] && "$py" -c 'import wyoming, yaml' 2>/dev/null; }; then
      python3 -m venv "$S2S_CONTAINER_STATE/client-venv"
      "$py" -m pip install -q --disable-pip-version-check 'wyoming>=1.7,<2' pyyaml \
        >"$S2S_CONTAINER_STATE/client-venv.log" 2>&1 || { cat "$S2S_CONTAINER_STATE/client-venv.log" >&2; return 1; }
    fi
  fi
  printf '%s' "$py"
}

s2s_container_tools
s2s_base_image

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "$S2S_CONTAINER_BASE"
fi
