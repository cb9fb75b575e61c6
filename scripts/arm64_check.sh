#!/usr/bin/env bash
# The torch engine on ARM64 (aarch64), emulated on this x86-64 machine: an arm64 Debian 12 userland
# with torch's aarch64 wheel under qemu-user (binfmt), the native kernels built in it by setup.py
# (the x86-hosted cross compiler runs as its c++), then on each emulated CPU (QEMU_CPU):
#   cortex-a72  (Armv8.0, a Raspberry Pi 4: the neon path; dotprod and i8mm refused, never a SIGILL),
#   neoverse-n1 (Armv8.2 with dotprod, as a Pi 5's Cortex-A76: the dotprod path),
#   max,sve=off (i8mm and BF16, as Graviton 3 but for SVE: the i8mm path; with SVE on, torch 2.13's
#               own products are wrong under qemu 7.2, e.g. F.linear with 33 or 40 outputs, which
#               our kernels never use but the tests' references and the engine's prompt do),
# the check command, check-config's refusal of a path the CPU lacks (exit 78), the tests marked
# `arm64` (each path this CPU runs against the portable one, the sampler's draws against HF's
# filters, the code predictor's frame in one call against its loop of torch calls, the greedy codes
# of the tiny checkpoint against x86-64's) and, on one of them, a whole `say` whose audio is the official x86 golden's.
# qemu raises SIGILL on an instruction the emulated CPU lacks, so the run-time choice is tested for
# real; emulation is 100-250x slower than native for the kernels: correctness only, no timing. Also
# checks the objects: no SDOT or SMMLA in the portable and neon ones, nothing exported by the
# dotprod and i8mm ones but their table (kernels.h). One line per check, "ok" or "FAIL"; exit 1
# when any failed.
#
#   bash scripts/arm64_check.sh          # set up (once, cached), build, check
#   bash scripts/arm64_check.sh setup    # only the cached userland
#   bash scripts/arm64_check.sh down     # unmount what a killed run left mounted
#
# Warm (the userland cached) about 8 minutes on 2 busy cores: the build 10-20 s, each CPU 1.5-4
# minutes, the `say` alone about 2. Cold, making the userland first (apt, debootstrap, 2.7 GB of
# wheels, 7.7 GB on disk) adds about 8 minutes. Needs root (binfmt, mounts, chroot; sudo otherwise)
# and the package registries. PyPI's aarch64 torch is the CUDA build: its NVIDIA
# libraries are installed (it depends on them) and never load.
#
# Environment:
#   S2S_ARM64_DIR    the cached userland (default /var/cache/s2s-daemon/arm64; never rm -rf it while
#                    a run has it mounted: /dev is bound inside; `down` first)
#   S2S_ARM64_CPUS   the emulated CPUs (default "cortex-a72 neoverse-n1 max,sve=off"; also
#                    cortex-a76, cortex-a53)
#   S2S_ARM64_SAY_CPU  the CPU a whole `say` runs on (default neoverse-n1, the dotprod path: a
#                    Raspberry Pi 5's kind; the others check the same engine's codes)
#   S2S_ARM64_TORCH  torch's version in the userland (default 2.13.0)
#
# The checkout is copied into the userland (tracked and untracked files, not the ignored ones), so
# the host's own build of the library is left alone. Runs are serialized on a lock beside the folder.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ACTION=${1:-check}
case $ACTION in check | setup | down) ;; *) echo "usage: $0 [check|setup|down]" >&2; exit 2 ;; esac
if [ "$(id -u)" -ne 0 ]; then exec sudo -E bash "$0" "$@"; fi

W=$(realpath -m "${S2S_ARM64_DIR:-/var/cache/s2s-daemon/arm64}")
R=$W/rootfs
SP=$R/opt/venv/lib/python3.11/site-packages
DEPS=/opt/s2s-deps  # inside the userland: the project's own dependencies, beside the venv's torch
SRC=/opt/s2s-src    # inside the userland: the checkout's copy
TORCH_VERSION=${S2S_ARM64_TORCH:-2.13.0}
CPUS=${S2S_ARM64_CPUS:-cortex-a72 neoverse-n1 max,sve=off}
SAY_CPU=${S2S_ARM64_SAY_CPU:-neoverse-n1}
# The project's runtime dependencies the tests and `say` import, read from pyproject.toml (its
# dependencies, and the torch extra's but transformers and huggingface_hub: the tiny checkpoint
# reads tokenizer.json alone; torch and numpy go into the venv below), and the test plugins
# pyproject.toml's pytest settings name (the dev extra's pytest-*).
mapfile -t DEP_PKGS < <(python3 - "$ROOT/pyproject.toml" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
wanted = project["dependencies"] + extras["torch"] + [r for r in extras["dev"] if r.startswith("pytest-")]
for requirement in wanted:
    name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()
    if name not in {"torch", "numpy", "transformers", "huggingface_hub", "huggingface-hub"}:
        print(requirement)
PY
)
((${#DEP_PKGS[@]})) || { echo "arm64_check: no dependencies read from pyproject.toml" >&2; exit 1; }
# Pure-Python packages PyPI has as source only (num2words' docopt): a wheel built here, once, serves
# aarch64 as well (found by the platform download through --find-links).
SOURCE_ONLY=(docopt)
started_s=$SECONDS
failed=0

say() { echo "arm64_check: $*" >&2; }
t() { local s=$SECONDS; "$@"; say "$((SECONDS - s)) s: $*"; }
ok() { echo "ok    $*"; }
fail() {
  echo "FAIL  $*"
  failed=1
}
host_pip() {
  if [ -x "$ROOT/.venv/bin/python" ]; then "$ROOT/.venv/bin/python" -m pip "$@"; else python3 -m pip "$@"; fi
}

host_pkgs() {
  local need=() pkg
  for pkg in qemu-user-static binfmt-support debootstrap gcc-aarch64-linux-gnu g++-aarch64-linux-gnu \
    binutils-aarch64-linux-gnu; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
  done
  ((${#need[@]})) || return 0
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

binfmt() {
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
  grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 # F: the interpreter works inside the chroot
}

rootfs() {
  [ -x "$R/usr/bin/python3.11" ] && return 0
  local mirror
  mirror=$(grep -rh '^URIs:.*debian$' /etc/apt/sources.list.d/ 2>/dev/null | head -1 | awk '{print $2}' || true)
  [ -n "$mirror" ] || mirror=$(awk '/^deb .*debian/ && !/security/ {print $2; exit}' /etc/apt/sources.list)
  debootstrap --arch=arm64 --variant=minbase \
    --include=python3,python3-venv,libpython3.11-dev,ca-certificates bookworm "$R" "$mirror" >/dev/null
}

# The x86 cross compiler, run natively inside the userland as its c++ (and the aarch64-linux-gnu-*
# names Debian's python3.11 builds extensions with): a build in seconds, not minutes of emulated g++.
xtool() {
  install -m755 /usr/bin/aarch64-linux-gnu-g++-12 "$R/usr/bin/xg++"
  install -m755 /usr/bin/aarch64-linux-gnu-gcc-12 "$R/usr/bin/xgcc"
  mkdir -p "$R/opt/xbin" "$W/xbin-binutils" "$R/usr/lib64" "$R/usr/lib/x86_64-linux-gnu" "$R/usr/lib/gcc-cross" \
    "$R/usr/aarch64-linux-gnu"
  [ -e "$R/lib64" ] || ln -s usr/lib64 "$R/lib64"
  local n f
  for n in c++ g++ aarch64-linux-gnu-g++ aarch64-linux-gnu-g++-12; do ln -sf /usr/bin/xg++ "$R/opt/xbin/$n"; done
  for n in cc gcc aarch64-linux-gnu-gcc aarch64-linux-gnu-gcc-12; do ln -sf /usr/bin/xgcc "$R/opt/xbin/$n"; done
  for f in /usr/aarch64-linux-gnu/bin/*; do cp -L "$f" "$W/xbin-binutils/"; done
}

# torch 2.13 segfaults at import under qemu-user if /proc/cpuinfo is the host's x86 one, and the
# daemon reads the CPU's features there (tts/isa.py): a /proc/cpuinfo (and sysfs cpu folder) of the
# emulated CPU, written by a static aarch64 program run under the same QEMU_CPU.
cpuinfo_tool() {
  [ -x "$W/cpuinfo_gen" ] && return 0
  cat >"$W/cpuinfo_gen.c" <<'CEOF'
/* Print a /proc/cpuinfo (aarch64 kernel format) for the CPU this program runs on: features from
 * AT_HWCAP/AT_HWCAP2, ids from MIDR_EL1. Usage: cpuinfo_gen NCPUS [midr] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
static const char *h1[] = {"fp","asimd","evtstrm","aes","pmull","sha1","sha2","crc32","atomics","fphp",
  "asimdhp","cpuid","asimdrdm","jscvt","fcma","lrcpc","dcpop","sha3","sm3","sm4","asimddp","sha512","sve",
  "asimdfhm","dit","uscat","ilrcpc","flagm","ssbs","sb","paca","pacg"};
static const char *h2[] = {"dcpodp","sve2","sveaes","svepmull","svebitperm","svesha3","svesm4","flagm2",
  "frint","svei8mm","svef32mm","svef64mm","svebf16","i8mm","bf16","dgh","rng","bti","mte","ecv","afp",
  "rpres","mte3","sme","smei16i64","smef64f64","smei8i32","smef16f32","smeb16f32","smef32f32","smefa64",
  "wfxt","ebf16","sveebf16","cssc","rprfm","sve2p1","sme2","sme2p1","smei16i32","smebi32i32","smeb16b16",
  "smef16f16","mops","hbc"};
int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 1;
  unsigned long a = getauxval(AT_HWCAP), b = getauxval(AT_HWCAP2), midr = 0;
  if (a & (1UL << 11)) __asm__ volatile("mrs %0, midr_el1" : "=r"(midr)); /* HWCAP_CPUID */
  if (argc > 2 && !strcmp(argv[2], "midr")) { printf("0x%016lx\n", midr); return 0; }
  for (int c = 0; c < n; c++) {
    printf("processor\t: %d\nBogoMIPS\t: 50.00\nFeatures\t:", c);
    for (unsigned i = 0; i < sizeof h1 / sizeof *h1; i++) if (a & (1UL << i)) printf(" %s", h1[i]);
    for (unsigned i = 0; i < sizeof h2 / sizeof *h2; i++) if (b & (1UL << i)) printf(" %s", h2[i]);
    printf("\nCPU implementer\t: 0x%02lx\nCPU architecture: 8\nCPU variant\t: 0x%lx\nCPU part\t: 0x%03lx\n"
           "CPU revision\t: %lu\n\n", (midr >> 24) & 0xff, (midr >> 20) & 0xf, (midr >> 4) & 0xfff, midr & 0xf);
  }
  return 0;
}
CEOF
  aarch64-linux-gnu-gcc -O2 -static "$W/cpuinfo_gen.c" -o "$W/cpuinfo_gen"
}

fake_cpu() { # $1: QEMU_CPU; rewritten in place (same inodes: the bind mounts stay valid)
  local cpu=$1 n i f
  n=$(nproc)
  mkdir -p "$W/fake/cpu"
  touch "$W/fake/cpuinfo"
  QEMU_CPU=$cpu "$W/cpuinfo_gen" "$n" >"$W/fake/cpuinfo"
  for f in possible present online offline kernel_max; do cat "/sys/devices/system/cpu/$f" >"$W/fake/cpu/$f"; done
  for i in $(seq 0 $((n - 1))); do
    mkdir -p "$W/fake/cpu/cpu$i/regs/identification" "$W/fake/cpu/cpu$i/topology"
    QEMU_CPU=$cpu "$W/cpuinfo_gen" 1 midr >"$W/fake/cpu/cpu$i/regs/identification/midr_el1"
    for f in core_id physical_package_id thread_siblings_list core_siblings_list; do
      cat "/sys/devices/system/cpu/cpu$i/topology/$f" >"$W/fake/cpu/cpu$i/topology/$f"
    done
  done
}

mnt() { mountpoint -q "$2" || mount --bind ${3:+-o $3} "$1" "$2"; }
up() {
  binfmt
  fake_cpu "${1:-neoverse-n1}"
  mountpoint -q "$R/proc" || mount -t proc proc "$R/proc"
  mnt /dev "$R/dev"
  mnt /dev/pts "$R/dev/pts"
  mountpoint -q "$R/sys" || mount -t sysfs sys "$R/sys"
  mnt "$W/fake/cpuinfo" "$R/proc/cpuinfo"
  mnt "$W/fake/cpu" "$R/sys/devices/system/cpu"
  mnt /usr/lib64 "$R/usr/lib64" ro
  mnt /usr/lib/x86_64-linux-gnu "$R/usr/lib/x86_64-linux-gnu" ro
  mnt /usr/lib/gcc-cross "$R/usr/lib/gcc-cross" ro
  mnt /usr/aarch64-linux-gnu "$R/usr/aarch64-linux-gnu" ro
  mnt "$W/xbin-binutils" "$R/usr/aarch64-linux-gnu/bin"
}
down() {
  [ -d "$R" ] || return 0
  grep -o " $R/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount "$m" || umount -l "$m"; done
}

# aarch64 wheels, fetched by this machine's own pip (--platform) into $W/wheels (kept: a setup
# again downloads nothing) and unpacked from there (--target): torch and numpy into the userland's
# venv, the project's dependencies into $DEPS (again when DEP_PKGS change).
platform_pip() { # platform_pip download|install ARGS...
  local plat=(--python-version 3.11 --implementation cp --abi cp311 --only-binary=:all:) v
  for v in $(seq 17 36); do plat+=(--platform "manylinux_2_${v}_aarch64"); done
  plat+=(--platform manylinux2014_aarch64 --platform linux_aarch64)
  host_pip "$1" -q --disable-pip-version-check "${plat[@]}" --find-links "$W/wheels" "${@:2}"
}
fetch_and_unpack() { # fetch_and_unpack TARGET REQUIREMENTS...
  platform_pip download -d "$W/wheels" "${@:2}"
  platform_pip install --no-index --find-links "$W/wheels" --target "$1" "${@:2}"
  rm -rf "$1/bin" # console scripts written by --target carry the host's shebang: python -m instead
}
wheels() {
  if [ ! -d "$SP/torch" ]; then
    [ -x "$R/opt/venv/bin/python" ] || chroot "$R" /usr/bin/python3 -m venv --without-pip /opt/venv
    fetch_and_unpack "$SP" "torch==$TORCH_VERSION" numpy pytest setuptools
  fi
  local stamp="$R$DEPS/.requirements" pkg
  if [ "$(cat "$stamp" 2>/dev/null)" != "${DEP_PKGS[*]}" ]; then
    for pkg in "${SOURCE_ONLY[@]}"; do
      compgen -G "$W/wheels/$pkg-*-none-any.whl" >/dev/null ||
        host_pip wheel -q --disable-pip-version-check --no-deps -w "$W/wheels" "$pkg"
    done
    rm -rf "${R:?}$DEPS"
    fetch_and_unpack "$R$DEPS" "${DEP_PKGS[@]}"
    printf '%s' "${DEP_PKGS[*]}" >"$stamp"
  fi
}

setup() {
  mkdir -p "$W"
  t host_pkgs
  t binfmt
  t rootfs
  t xtool
  t cpuinfo_tool
  t wheels
}

inside() { # QEMU_CPU=... inside cmd...: run cmd in the userland, in the checkout's copy
  chroot "$R" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/opt/xbin:/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    QEMU_CPU="${QEMU_CPU:-neoverse-n1}" OMP_NUM_THREADS=1 PYTHONPATH="$SRC:$DEPS" S2S_PREPARED_CACHE=/tmp/prepared \
    sh -c "cd $SRC && exec \"\$@\"" sh "$@"
}

copy_checkout() {
  rm -rf "${R:?}$SRC"
  mkdir -p "$R$SRC"
  git -C "$ROOT" ls-files -z -co --exclude-standard | (cd "$ROOT" && tar --null -T - -cf -) | tar -C "$R$SRC" -xf -
}

build() { # setup.py as pip runs it on an aarch64 machine: its -march per unit comes from setup.py;
  # egg_info writes the package's metadata beside it (the engines are found by their entry points)
  QEMU_CPU=cortex-a72 inside python setup.py -q egg_info build_ext --inplace >"$W/build.log" 2>&1 || {
    cat "$W/build.log" >&2
    return 1
  }
}

# The objects: the portable units and neon hold no instruction beyond Armv8.0 (SDOT, SMMLA, BF16,
# SVE), dotprod holds SDOT and no SMMLA, i8mm holds SMMLA; the ISA units export their table alone.
check_objects() {
  local dir o count newer extra
  dir=$(dirname "$(find "$R$SRC/build" -name arm_neon.o | head -1)")
  newer='\s(sdot|udot|usdot|sudot|smmla|ummla|usmmla|bfdot|bfmmla|bfmlal[bt]|bfcvtn?2?)\s|\sz[0-9]+\.|\sp[0-9]+/'
  for o in api portable arm_neon; do
    count=$(aarch64-linux-gnu-objdump -d "$dir/$o.o" | grep -cE "$newer" || true)
    [ "$count" = 0 ] && ok "objects: $o.o has no instruction beyond Armv8.0" ||
      fail "objects: $o.o has $count instructions beyond Armv8.0"
  done
  count=$(aarch64-linux-gnu-objdump -d "$dir/arm_dotprod.o" | grep -cwE 'sdot' || true)
  [ "$count" -gt 0 ] && ! aarch64-linux-gnu-objdump -d "$dir/arm_dotprod.o" | grep -qwE 'smmla' &&
    ok "objects: arm_dotprod.o has sdot ($count) and no smmla" || fail "objects: arm_dotprod.o: sdot $count, or smmla"
  count=$(aarch64-linux-gnu-objdump -d "$dir/arm_i8mm.o" | grep -cwE 'smmla' || true)
  [ "$count" -gt 0 ] && ok "objects: arm_i8mm.o has smmla ($count)" || fail "objects: arm_i8mm.o has no smmla"
  for o in arm_neon arm_dotprod arm_i8mm; do
    extra=$(aarch64-linux-gnu-nm --defined-only "$dir/$o.o" | awk '$2 !~ /^[tbdr]$/ && $3 != "s2s_ops_'"${o#arm_}"'"')
    [ -z "$extra" ] && ok "objects: $o.o exports its table alone" || fail "objects: $o.o exports $(echo $extra)"
  done
}

# What each emulated CPU runs: the paths, `auto`'s choice, a refused path (exit 1 from the check
# command, exit 78 from check-config naming the key), then the tests and a whole `say`.
expect_paths() {
  case $1 in
    cortex-a35 | cortex-a53 | cortex-a57 | cortex-a72) echo "generic neon" ;;
    cortex-a76 | neoverse-n1) echo "generic neon dotprod" ;;
    max*) echo "generic neon dotprod i8mm" ;;
    *) echo "" ;;
  esac
}
check_cpu() {
  local cpu=$1 want out best refused rc tests
  export QEMU_CPU=$cpu
  fake_cpu "$cpu"
  want=$(expect_paths "$cpu")
  best=${want##* }
  out=$(inside python -m s2s_daemon.tts.torch_qwen3.native 2>&1) || true
  if [ -z "$want" ]; then
    ok "$cpu (no expectation for this CPU): $(grep -E '^(paths|runs):' <<<"$out" | tr '\n' ' ')"
  elif grep -qx "paths: generic neon dotprod i8mm (this CPU runs: $want)" <<<"$out" &&
    grep -q "^runs: $best (auto: cpu has" <<<"$out"; then
    ok "$cpu: carries generic neon dotprod i8mm, runs $want, auto picks $best"
  else
    fail "$cpu: the check command said: $out"
  fi
  if [ -n "$want" ] && [ "$best" != i8mm ]; then
    refused=$([ "$best" = neon ] && echo dotprod || echo i8mm)
    rc=0
    out=$(inside python -m s2s_daemon.tts.torch_qwen3.native --isa "$refused" 2>&1) || rc=$?
    [ "$rc" = 1 ] && grep -q "cannot run the $refused path" <<<"$out" && ok "$cpu: $refused refused, no SIGILL" ||
      fail "$cpu: --isa $refused exited $rc: $out"
    rc=0
    out=$(inside env S2S_TTS__TORCH__ISA="$refused" python -m s2s_daemon check-config 2>&1) || rc=$?
    [ "$rc" = 78 ] && grep -q "tts.torch.isa" <<<"$out" && ok "$cpu: check-config refuses isa $refused (78)" ||
      fail "$cpu: check-config with isa $refused exited $rc: $out"
  fi
  # A whole `say` (a minute and a half emulated) on one CPU: the others run the same engine's codes.
  tests=(tests/test_native_kernels.py tests/test_sampling.py tests/test_native_predictor.py tests/test_arm64_codes.py)
  [ "$cpu" = "$SAY_CPU" ] || tests+=(--deselect tests/test_arm64_codes.py::test_a_whole_say_speaks_the_official_audio)
  rc=0
  inside python -m pytest -q -m arm64 -p no:cacheprovider --durations=5 "${tests[@]}" >"$W/pytest-$cpu.log" 2>&1 ||
    rc=$?
  [ "$rc" = 0 ] && ok "$cpu: tests marked arm64$([ "$cpu" = "$SAY_CPU" ] && echo ", a whole say"): $(tail -1 "$W/pytest-$cpu.log")" || {
    fail "$cpu: tests marked arm64 (exit $rc), $W/pytest-$cpu.log:"
    tail -40 "$W/pytest-$cpu.log"
  }
}

mkdir -p "$(dirname "$W")"
exec 9>>"$W.lock"
flock 9
trap down EXIT
case $ACTION in
  down) exit 0 ;;
  setup)
    t setup
    up
    chroot "$R" /usr/bin/env -i QEMU_CPU=neoverse-n1 /opt/venv/bin/python -c \
      "import platform, torch; print(platform.machine(), torch.__version__)"
    exit 0
    ;;
esac
t setup
t up neoverse-n1
t copy_checkout
if t build; then
  ok "build: setup.py built the library in the arm64 userland"
  check_objects
  for cpu in $CPUS; do t check_cpu "$cpu"; done
else
  fail "build: setup.py in the arm64 userland ($W/build.log)"
fi
say "done in $((SECONDS - started_s)) s"
exit "$failed"
