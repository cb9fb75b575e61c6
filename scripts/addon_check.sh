#!/usr/bin/env bash
# Build the Home Assistant add-on (homeassistant/s2s_daemon) as Home Assistant's builder would,
# on a Debian base standing in for ghcr.io/home-assistant/<arch>-base-debian, run it with an
# options.json on a tiny random checkpoint, and check what Home Assistant relies on: the image's
# HEALTHCHECK (a Wyoming describe) passes, the Supervisor gets the wyoming discovery message (a
# stand-in Supervisor on loopback records it), the wyoming client's describe and synthesize get
# answers, and SIGTERM stops it with exit 0. One line per check, "ok" or "FAIL"; exit 1 when any
# failed.
#
#   bash scripts/addon_check.sh                            the add-on for this machine (amd64)
#   S2S_CONTAINER_ARCH=arm64 bash scripts/addon_check.sh   for aarch64, under qemu (binfmt)
#
# CI runs it after scripts/container_check.sh (.ci/run): about 6 minutes with the Debian base
# already made, the build most of it; for aarch64 see scripts/container_check.sh.
# The add-on installs s2s-daemon with pip: build.yaml names the release; this script installs the
# working tree instead: a wheel built here (its native kernels built for this machine), or for
# another architecture a source archive, whose kernels pip builds inside the image as it would
# from a source distribution. Environment: S2S_CONTAINER_ARCH, S2S_CONTAINER_BASE,
# S2S_CONTAINER_TORCH_WHEELS as for scripts/container_check.sh (aarch64: PyPI's torch, trimmed, in
# place of build.yaml's torch==...+cpu, which only PyTorch's index has); S2S_CONTAINER_ADDON_IMAGE
# (default localhost/s2s-daemon-addon:<Home Assistant's arch name>); S2S_CONTAINER_KEEP=1 leaves
# the container and its files.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

ADDON=homeassistant/s2s_daemon
NAME=s2s-addon-check
TOKEN=addon-check-token
started_s=$SECONDS

# shellcheck source=scripts/container_base.sh
source scripts/container_base.sh
case "$S2S_CONTAINER_ARCH" in
  arm64) ADDON_ARCH=aarch64 ;;  # Home Assistant's name of the architecture (config.yaml, build.yaml)
  *) ADDON_ARCH=$S2S_CONTAINER_ARCH ;;
esac
IMAGE=${S2S_CONTAINER_ADDON_IMAGE:-localhost/s2s-daemon-addon:$ADDON_ARCH}
# Under emulation everything is slower (starting, loading, speaking): the waits are longer.
WAIT_S=300    # the longest wait for the add-on to be healthy
ANSWER_S=60   # the longest wait for each Wyoming answer
[ "$S2S_CONTAINER_ARCH" = "$S2S_HOST_ARCH" ] || { WAIT_S=1200; ANSWER_S=900; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/s2s-addon-check.XXXXXX")
chmod 755 "$WORK"
pids=()
cleanup() {
  local pid
  if [ "${S2S_CONTAINER_KEEP:-0}" != 1 ]; then
    podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
  else
    echo "addon_check: kept $NAME, stand-in Supervisor pids ${pids[*]}, files in $WORK" >&2
  fi
}
trap cleanup EXIT

failures=0
report() {  # report NAME ok|FAIL|SKIP DETAIL
  printf '%-12s %s%s\n' "$1:" "$2" "${3:+ ($3)}"
  [ "$2" != FAIL ] || failures=$((failures + 1))
}

PY=$(s2s_client_python)

# --- build, as Home Assistant's builder does: build.yaml's args, BUILD_FROM, BUILD_ARCH, the add-on folder ---
# What pip installs goes in a folder named by its digest: the install step's build argument names
# it, so podman's layer cache is used again exactly when the code is the same (SOURCE_DATE_EPOCH,
# and tar's fixed order, times and owners, make the bytes depend on the code only).
mkdir -p "$WORK/wheel"
if [ "$S2S_CONTAINER_ARCH" = "$S2S_HOST_ARCH" ]; then
  SOURCE_DATE_EPOCH=315532800 python3 -m pip wheel -q --no-deps -w "$WORK/wheel" . >"$WORK/wheel.log" 2>&1 \
    || { tail -5 "$WORK/wheel.log"; report wheel FAIL "pip wheel ."; exit 1; }
  package=$(basename "$WORK"/wheel/s2s_daemon-*.whl)
else
  package=s2s_daemon-src.tar.gz
  tar --sort=name --mtime=@315532800 --owner=0 --group=0 --numeric-owner --transform 's,^,s2s_daemon-src/,' \
    --exclude=__pycache__ --exclude='*.pyc' --exclude='*.so' -cf - pyproject.toml README.md setup.py s2s_daemon \
    | gzip -n >"$WORK/wheel/$package"
fi
digest=$(sha256sum "$WORK/wheel/$package" | cut -c1-16)
mkdir -p "$WORK/dist/$digest"
mv "$WORK/wheel/$package" "$WORK/dist/$digest/"
build_args=()
while IFS= read -r arg; do build_args+=(--build-arg "$arg"); done < <("$PY" -c '
import sys, yaml
build = yaml.safe_load(open(sys.argv[1]))
assert sys.argv[2] in build["build_from"], f"build.yaml has no build_from for {sys.argv[2]}"
for key, value in build["args"].items():
    print(f"{key}={value}")
' "$ADDON/build.yaml" "$ADDON_ARCH")
s2s_build_inputs "$WORK"
s2s_emulation "$WORK"
echo "addon_check: building $IMAGE ($ADDON_ARCH) on $S2S_CONTAINER_BASE with $package ($S2S_BUILD_SOURCES)" >&2
build_started=$SECONDS
if podman build --format docker --network host "${S2S_ARCH_FLAGS[@]}" -f "$ADDON/Dockerfile" -t "$IMAGE" \
    --build-arg "BUILD_FROM=$S2S_CONTAINER_BASE" --build-arg "BUILD_ARCH=$ADDON_ARCH" "${build_args[@]}" \
    --build-arg "S2S_DAEMON_SPEC=/run/s2s-build/dist/$digest/${package}[torch,wyoming]" -v "$WORK/dist:/run/s2s-build/dist:ro" \
    "${S2S_BUILD_FLAGS[@]}" "${S2S_EMULATION_FLAGS[@]}" "$ADDON" >"$WORK/build.log" 2>&1; then
  report build ok "$IMAGE, $((SECONDS - build_started)) s"
else
  tail -20 "$WORK/build.log"
  report build FAIL "see the lines above"
  exit 1
fi

# --- what the Supervisor gives an add-on: /data with options.json, /share, a token, its API ---
mkdir -p "$WORK/data" "$WORK/share/s2s_daemon/models"
podman run --rm --network none --entrypoint /opt/s2s/venv/bin/python -v "$WORK/share:/share" \
  "${S2S_EMULATION_FLAGS[@]}" "$IMAGE" \
  -m s2s_daemon.tools.make_checkpoint /share/s2s_daemon/models/tiny --size tiny --kind custom_voice \
  >"$WORK/checkpoint.log" 2>&1 || { tail -5 "$WORK/checkpoint.log"; report checkpoint FAIL "make_checkpoint"; exit 1; }
# The options as the Configuration page saves them: config.yaml's defaults, the model and the
# quantization changed by the user (int8 where the default is auto: a choice must arrive as made).
"$PY" -c '
import json, sys, yaml
options = yaml.safe_load(open(sys.argv[1]))["options"]
options["model"] = "/share/s2s_daemon/models/tiny"
options["quantization"] = "int8"
json.dump(options, open(sys.argv[2], "w"))
' "$ADDON/config.yaml" "$WORK/data/options.json"

read -r SUPERVISOR_PORT WYOMING_PORT < <(s2s_free_ports 2)
python3 - "$SUPERVISOR_PORT" "$WORK/discovery.json" >"$WORK/supervisor.log" 2>&1 <<'EOF' &
import http.server, json, sys

class Supervisor(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(sys.argv[2], "a") as out:
            out.write(json.dumps({"path": self.path, "authorization": self.headers["Authorization"], "body": body}) + "\n")
        answer = json.dumps({"result": "ok", "data": {"uuid": "0123456789abcdef0123456789abcdef"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Supervisor).serve_forever()
EOF
pids+=($!)

# The add-on's Wyoming port is 10200; here it shares this machine's network, so a free one is
# set the way any daemon setting is (an S2S_ variable over the add-on's config file). The frame
# cap keeps random weights from speaking until the engine's limit.
podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
podman run -d --name "$NAME" --network host -v "$WORK/data:/data" -v "$WORK/share:/share:ro" \
  -e SUPERVISOR_TOKEN="$TOKEN" -e ADDON_SUPERVISOR_URL="http://127.0.0.1:$SUPERVISOR_PORT" \
  -e S2S_WYOMING__PORT="$WYOMING_PORT" -e S2S_TTS__OPTIONS__MAX_FRAMES=24 \
  "${S2S_EMULATION_FLAGS[@]}" "${S2S_EMULATION_ENV[@]}" "$IMAGE" >"$WORK/run.log" 2>&1 || { cat "$WORK/run.log"; report run FAIL "podman run"; exit 1; }

run_started=$SECONDS
health=
while [ $((SECONDS - run_started)) -lt "$WAIT_S" ]; do
  if [ "$(podman inspect -f '{{.State.Running}}' "$NAME" 2>/dev/null)" != true ]; then health="exited"; break; fi
  if health=$(podman healthcheck run "$NAME" 2>&1); then health=ok; break; fi
  sleep 2
done
if [ "$health" = ok ]; then
  report healthcheck ok "podman healthcheck run (Wyoming describe) healthy after $((SECONDS - run_started)) s"
else
  podman logs --tail 30 "$NAME" 2>&1
  report healthcheck FAIL "${health:-not healthy within $WAIT_S s}"
  exit 1
fi

discovery=
for _ in $(seq 30); do
  discovery=$(cat "$WORK/discovery.json" 2>/dev/null || true)
  [ -z "$discovery" ] || break
  sleep 0.5
done
hostname=$(podman exec "$NAME" /opt/s2s/venv/bin/python -c 'import socket; print(socket.gethostname())')
if out=$("$PY" -c '
import json, sys
seen = [json.loads(line) for line in sys.stdin.read().splitlines()]
want = {"service": "wyoming", "config": {"uri": f"tcp://{sys.argv[3]}:{sys.argv[1]}"}}
assert len(seen) == 1, f"{len(seen)} messages"
assert seen[0]["path"] == "/discovery", seen[0]["path"]
assert seen[0]["authorization"] == f"Bearer {sys.argv[2]}", seen[0]["authorization"]
assert seen[0]["body"] == want, seen[0]["body"]
print(want["config"]["uri"])
' "$WYOMING_PORT" "$TOKEN" "$hostname" <<<"$discovery" 2>&1); then
  report discovery ok "POST /discovery wyoming $out"
else
  report discovery FAIL "$out"
fi

if out=$("$PY" scripts/wyoming_probe.py 127.0.0.1 "$WYOMING_PORT" --synthesize "Hello from the add-on check." \
    --timeout-s "$ANSWER_S" 2>&1); then
  report wyoming ok "$out"
else
  report wyoming FAIL "$out"
fi

# The log read whole first: under pipefail, `podman logs | grep -q` fails when grep's early exit
# leaves podman writing into a closed pipe (SIGPIPE), which a long log makes likely.
container_log=$(podman logs "$NAME" 2>&1 || true)
if grep -q 'S2S_TTS__TORCH__QUANTIZATION="int8"' <<<"$container_log"; then
  report options ok "options.json became S2S_ variables (quantization int8, model /share/...)"
else
  report options FAIL "the add-on's start line names no S2S_TTS__TORCH__QUANTIZATION"
fi

stop_started=$SECONDS
podman stop -t 30 "$NAME" >/dev/null 2>&1 || true
exit_code=$(podman inspect -f '{{.State.ExitCode}}' "$NAME")
if [ "$exit_code" = 0 ]; then
  report stop ok "SIGTERM passed on by run.py: exit 0 after $((SECONDS - stop_started)) s"
else
  podman logs --tail 15 "$NAME" 2>&1
  report stop FAIL "SIGTERM: exit $exit_code"
fi

echo "addon_check: $failures failed, $((SECONDS - started_s)) s in all"
[ "$failures" -eq 0 ]
