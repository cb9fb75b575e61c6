#!/usr/bin/env bash
# Podman set up for the container checks, and a Debian base image made without a registry.
#
#   source scripts/container_base.sh    (scripts/container_check.sh and scripts/addon_check.sh do)
#   bash scripts/container_base.sh      only make sure the base image exists, and print its name
#
# Sourcing also defines s2s_build_inputs (how pip inside a build reaches the index here),
# s2s_emulation (what an emulated container needs), s2s_free_ports and s2s_client_python.
#
# S2S_CONTAINER_ARCH (amd64 or arm64, default this machine's) is the images' architecture. Another
# than this machine's runs under qemu-user through binfmt_misc (registered here when missing:
# qemu-user-static and binfmt-support, root): its base is debootstrapped for that architecture
# (its second stage runs under qemu, about 2 minutes) and imported as that architecture,
# localhost/debian:bookworm-<arch> by default, and S2S_ARCH_FLAGS holds podman build's --arch.
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

S2S_HOST_ARCH=$(dpkg --print-architecture)
S2S_CONTAINER_ARCH=${S2S_CONTAINER_ARCH:-$S2S_HOST_ARCH}
case "$S2S_CONTAINER_ARCH" in
  amd64 | arm64) ;;
  *) echo "container: S2S_CONTAINER_ARCH must be amd64 or arm64, not '$S2S_CONTAINER_ARCH'" >&2; exit 64 ;;
esac
if [ "$S2S_CONTAINER_ARCH" = "$S2S_HOST_ARCH" ]; then
  S2S_CONTAINER_BASE=${S2S_CONTAINER_BASE:-localhost/debian:bookworm}
else
  S2S_CONTAINER_BASE=${S2S_CONTAINER_BASE:-localhost/debian:bookworm-$S2S_CONTAINER_ARCH}
fi
S2S_ARCH_FLAGS=(--arch "$S2S_CONTAINER_ARCH")
S2S_TORCH_VERSION=2.13.0  # the release the images install (scripts/test pins it; tests/test_container.py holds them equal)
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
  # Written whole and renamed into place: two checks at once (.ci/run) never read it half written.
  printf '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n' >"$CONTAINERS_CONF.$$"
  mv -f "$CONTAINERS_CONF.$$" "$CONTAINERS_CONF"
  export CONTAINERS_CONF
}

# The qemu binary of an architecture, as binfmt_misc names it.
_s2s_qemu_name() {
  case "$1" in
    arm64) echo aarch64 ;;
    amd64) echo x86_64 ;;
  esac
}

# s2s_binfmt: another architecture than this machine's runs here under qemu-user: binfmt_misc
# must hand its programs to qemu, with the F flag (the interpreter opened at registration, so that
# it works inside containers and chroots).
s2s_binfmt() {
  [ "$S2S_CONTAINER_ARCH" != "$S2S_HOST_ARCH" ] || return 0
  local qemu entry
  qemu=$(_s2s_qemu_name "$S2S_CONTAINER_ARCH")
  entry=/proc/sys/fs/binfmt_misc/qemu-$qemu
  if ! grep -qs '^flags: .*F' "$entry"; then
    echo "container: registering qemu-$qemu with binfmt_misc to run $S2S_CONTAINER_ARCH images" >&2
    dpkg-query -W -f='${Status}' qemu-user-static 2>/dev/null | grep -q "install ok installed" || {
      _s2s_sudo apt-get update -qq
      DEBIAN_FRONTEND=noninteractive _s2s_sudo apt-get install -y -qq --no-install-recommends \
        qemu-user-static binfmt-support >/dev/null
    }
    mountpoint -q /proc/sys/fs/binfmt_misc || _s2s_sudo mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    [ -e "$entry" ] || _s2s_sudo update-binfmts --enable "qemu-$qemu"
  fi
  grep -qs '^flags: .*F' "$entry" || {
    echo "container: $entry is not registered with the F flag: $S2S_CONTAINER_ARCH images cannot run here" >&2
    return 1
  }
}

s2s_base_image() {
  if podman image exists "$S2S_CONTAINER_BASE"; then
    return 0
  fi
  case "$S2S_CONTAINER_BASE" in
    localhost/*) ;;
    *) podman pull --arch "$S2S_CONTAINER_ARCH" "$S2S_CONTAINER_BASE" >&2; return 0 ;;
  esac
  local mirror rootfs
  # The Debian archive apt uses here (deb822 sources first, then the one-line format).
  mirror=$(grep -rhs '^URIs:.*/debian/\?$' /etc/apt/sources.list.d/ | awk '{print $2}' | head -1)
  [ -n "$mirror" ] || mirror=$(grep -hs '^deb .*/debian/\? ' /etc/apt/sources.list | awk '{print $2}' | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d "${TMPDIR:-/tmp}/s2s-rootfs.XXXXXX")
  echo "container: making $S2S_CONTAINER_BASE ($S2S_CONTAINER_ARCH) with debootstrap from $mirror (a minute or two)" >&2
  _s2s_sudo debootstrap --arch="$S2S_CONTAINER_ARCH" --variant=minbase bookworm "$rootfs" "$mirror" \
    >"$S2S_CONTAINER_STATE/debootstrap.log" 2>&1 || {
    tail -5 "$S2S_CONTAINER_STATE/debootstrap.log" >&2
    return 1
  }
  _s2s_sudo tar -C "$rootfs" -c . | podman import --quiet --arch "$S2S_CONTAINER_ARCH" - "$S2S_CONTAINER_BASE" >/dev/null
  _s2s_sudo rm -rf "$rootfs"
}

_s2s_host_pip() {  # one of this machine's pip settings: the environment first, then pip config
  local value=${!1:-}
  [ -n "$value" ] || value=$(python3 -m pip config get "global.$2" 2>/dev/null || true)
  printf '%s' "$value"
}

# s2s_build_inputs DIR: fill S2S_BUILD_FLAGS with what a build here needs for pip inside it to reach
# the package index as this machine's pip does, and torch from a folder on this machine:
# - amd64: the folder holding the torch CPU wheel (S2S_CONTAINER_TORCH_WHEELS, else the one of pip's
#   find-links that holds torch-$S2S_TORCH_VERSION+cpu) bound in and named in TORCH_PIP_ARGS; without
#   one, the build's default (the PyTorch CPU index).
# - arm64: torch and its dependencies for aarch64 from S2S_CONTAINER_TORCH_WHEELS, else from
#   $S2S_CONTAINER_STATE/wheels-arm64, which this machine's pip fills once from PyPI (2.6 GB:
#   PyPI's aarch64 torch is the CUDA build; the CPU build is on PyTorch's own index only), and
#   pip in the build reaches no index for them (--no-index): an emulated pip is slow, and the
#   folder is kept for the next build. The image's container/torch_install.py keeps of the NVIDIA
#   libraries only those torch is linked against.
# - pip's certificate bundle (a TLS-intercepting proxy's CA) bound in with a pip.conf, written into
#   DIR, that names it.
s2s_build_inputs() {
  local dir wheels=${S2S_CONTAINER_TORCH_WHEELS:-} cert
  S2S_BUILD_FLAGS=()
  S2S_BUILD_SOURCES="torch: the PyTorch CPU index"
  if [ "$S2S_CONTAINER_ARCH" = arm64 ]; then
    wheels=${wheels:-$S2S_CONTAINER_STATE/wheels-arm64}
    s2s_arm64_wheels "$wheels" || return 1
    S2S_BUILD_FLAGS+=(-v "$wheels:/run/s2s-build/wheels:ro" --build-arg "TORCH_SPEC=torch==$S2S_TORCH_VERSION"
      --build-arg "TORCH_PIP_ARGS=--no-index --find-links /run/s2s-build/wheels")
    S2S_BUILD_SOURCES="torch: PyPI's torch==$S2S_TORCH_VERSION (aarch64, a CUDA build) from $wheels"
  else
    if [ -z "$wheels" ]; then
      for dir in $(_s2s_host_pip PIP_FIND_LINKS find-links); do
        dir=${dir#file://}
        if compgen -G "$dir/torch-$S2S_TORCH_VERSION+cpu-*.whl" >/dev/null; then wheels=$dir; break; fi
      done
    fi
    if [ -n "$wheels" ]; then
      S2S_BUILD_FLAGS+=(-v "$wheels:/run/s2s-build/wheels:ro" --build-arg "TORCH_PIP_ARGS=--find-links /run/s2s-build/wheels")
      S2S_BUILD_SOURCES="torch: $wheels"
    fi
  fi
  cert=$(_s2s_host_pip PIP_CERT cert)
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    printf '[global]\ncert = /run/s2s-build/ca.crt\n' >"$1/pip.conf"
    S2S_BUILD_FLAGS+=(-v "$cert:/run/s2s-build/ca.crt:ro" -v "$1/pip.conf:/etc/pip.conf:ro")
    S2S_BUILD_SOURCES+="; pip certificates: $cert"
  fi
}

# s2s_arm64_wheels DIR: torch $S2S_TORCH_VERSION and its dependencies for aarch64 (CPython 3.11, as
# Debian bookworm has) in DIR, downloaded by this machine's pip when torch is not there yet.
s2s_arm64_wheels() {
  local platforms=() v
  compgen -G "$1/torch-$S2S_TORCH_VERSION-*aarch64.whl" >/dev/null && return 0
  for v in $(seq 17 39); do platforms+=(--platform "manylinux_2_${v}_aarch64"); done
  echo "container: downloading torch $S2S_TORCH_VERSION for aarch64 into $1 (about 2.6 GB, once)" >&2
  mkdir -p "$1"
  python3 -m pip download -q --disable-pip-version-check -d "$1" --only-binary=:all: "${platforms[@]}" \
    --platform manylinux2014_aarch64 --python-version 3.11 --implementation cp --abi cp311 \
    "torch==$S2S_TORCH_VERSION" >"$S2S_CONTAINER_STATE/wheels-arm64.log" 2>&1 || {
    tail -5 "$S2S_CONTAINER_STATE/wheels-arm64.log" >&2
    return 1
  }
}

# s2s_emulation DIR: fill S2S_EMULATION_FLAGS with what podman build and run need for an image of
# another architecture (none for this machine's). torch reads /proc/cpuinfo at import and crashes
# on an x86 one (qemu-user passes the host's through): a /proc/cpuinfo in the aarch64 kernel's
# format, written into DIR, describes the CPU qemu emulates (below): the features from the
# auxiliary vector the loader shows (LD_SHOW_AUXV), the ids those of qemu's "max".
s2s_emulation() {
  S2S_EMULATION_FLAGS=()
  S2S_EMULATION_ENV=()
  [ "$S2S_CONTAINER_ARCH" != "$S2S_HOST_ARCH" ] || return 0
  # For podman run, not build: under qemu a tiny checkpoint's first chunk takes longer than the
  # daemon's default 30 s without audio (tts.stall_timeout_s), which would end the engine, and a
  # whole say can take longer than the default 300 s of one request (tts.max_utterance_s: the
  # image's say failed so on a cold run beside the add-on's, both emulated on 2 cores).
  # The CPU qemu emulates for podman run: a Neoverse N1 (Graviton 2; a Raspberry Pi 5's Cortex-A76
  # has the same features), whose native kernels' path is dotprod. qemu's default "max" has SVE,
  # which torch's own kernels take and qemu runs slowly, and i8mm, whose SMMLA it runs slowly too
  # (docs/operations.md, "On arm64"; scripts/arm64_check.sh tries every path, i8mm included).
  local cpu=neoverse-n1
  S2S_EMULATION_ENV=(-e QEMU_CPU=$cpu -e S2S_TTS__STALL_TIMEOUT_S=900 -e S2S_TTS__MAX_UTTERANCE_S=1800)
  [ "$S2S_CONTAINER_ARCH" = arm64 ] || { echo "container: no emulated /proc/cpuinfo for $S2S_CONTAINER_ARCH" >&2; return 1; }
  podman run --rm --network none -e QEMU_CPU=$cpu -e LD_SHOW_AUXV=1 "$S2S_CONTAINER_BASE" /bin/true 2>/dev/null \
    | python3 -c '
import os, sys
# The aarch64 kernel'\''s names of the HWCAP and HWCAP2 bits (arch/arm64/kernel/cpuinfo.c), in bit order.
H1 = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 "
      "sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg").split()
H2 = ("dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svef32mm svef64mm svebf16 i8mm "
      "bf16 dgh rng bti mte ecv afp rpres mte3 sme smei16i64 smef64f64 smei8i32 smef16f32 smeb16f32 smef32f32 "
      "smefa64 wfxt ebf16 sveebf16 cssc rprfm sve2p1 sme2 sme2p1 smei16i32 smebi32i32 smeb16b16 smef16f16 mops "
      "hbc").split()
aux = dict(line.split(":", 1) for line in sys.stdin.read().splitlines() if ":" in line)
hwcap, hwcap2 = (int(aux.get(key, "0").strip(), 16) for key in ("AT_HWCAP", "AT_HWCAP2"))
if not hwcap:
    sys.exit("no AT_HWCAP from the emulated loader")
features = [n for i, n in enumerate(H1) if hwcap >> i & 1] + [n for i, n in enumerate(H2) if hwcap2 >> i & 1]
for cpu in range(os.cpu_count() or 1):
    # qemu'\''s "max": implementer 0 (software), architecture 0xf, part 0x051 ("Q").
    print(f"processor\t: {cpu}\nBogoMIPS\t: 50.00\nFeatures\t: {chr(32).join(features)}\nCPU implementer\t: 0x00\n"
          f"CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0x051\nCPU revision\t: 0\n")
' >"$1/cpuinfo" || { echo "container: could not describe the emulated CPU" >&2; return 1; }
  S2S_EMULATION_FLAGS=(-v "$1/cpuinfo:/proc/cpuinfo:ro")
}

# s2s_free_ports N: N loopback TCP ports free now, on one line, drawn below the kernel's ephemeral
# range (ip_local_port_range): a port from that range (what bind to port 0 gives) can be taken
# by any outgoing connection's source port before the check listens on it (a CI run's broker
# failed so: "Address already in use", the arm64 image's and add-on's checks running at once).
s2s_free_ports() {
  python3 -c '
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
ports, tries = [], 0
while len(ports) < int(sys.argv[1]):
    tries += 1
    port = random.randrange(10000, low) if low > 11000 and tries < 1000 else 0
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        port = s.getsockname()[1]
    if port not in ports:
        ports.append(port)
print(*ports)
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
s2s_binfmt
s2s_base_image

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "$S2S_CONTAINER_BASE"
fi
