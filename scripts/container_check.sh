#!/usr/bin/env bash
# Build the CPU image (container/Containerfile), run it on a tiny random checkpoint, and try each
# door with its real client: MQTT (mosquitto_pub to a mosquitto on this machine), the OpenAI API
# (curl), Wyoming (the wyoming library's client: describe, then synthesize). Also torch in the
# image (it imports; what was left out), a `say` inside it, the image's HEALTHCHECK, the volume
# (request journal, WAV output, written by the non-root user) and a graceful stop. One line per
# check, "ok" or "FAIL"; exit 1 when any failed.
#
#   bash scripts/container_check.sh                            the image for this machine (amd64)
#   S2S_CONTAINER_ARCH=arm64 bash scripts/container_check.sh   the aarch64 image, under qemu (binfmt)
#
# CI runs both after the tests (.ci/run); scripts/test does not. amd64: from nothing about 7
# minutes on 2 busy cores (the Debian base, apt, pip, the native kernels), from podman's layer
# cache about 2 (the checks). arm64: everything in it runs under qemu, 100-250x slower than
# native for the engine's arithmetic: see docs/operations.md for the times, cold and warm. Needs
# root or sudo for apt (podman, runc, debootstrap, mosquitto, curl, qemu-user-static) and for
# debootstrap.
#
# Environment:
#   S2S_CONTAINER_ARCH     amd64 or arm64 (default: this machine's); another than this machine's runs
#                      under qemu-user (scripts/container_base.sh)
#   S2S_CONTAINER_IMAGE          the image to build and check (default localhost/s2s-daemon:cpu, and
#                      localhost/s2s-daemon:cpu-arm64 for an emulated arm64)
#   S2S_CONTAINER_BASE     the base (default localhost/debian:bookworm, or localhost/debian:bookworm-arm64 for
#                      an emulated arm64, made by scripts/container_base.sh;
#                      docker.io/library/debian:bookworm-slim where a registry can be reached)
#   S2S_CONTAINER_BUILD    0: check the image as it is, without building
#   S2S_CONTAINER_TORCH_WHEELS   a folder holding the torch CPU wheel, bound into the build (default: the one of
#                      this machine's pip find-links that holds torch-2.13.0+cpu; none: the PyTorch index);
#                      arm64: torch and its dependencies for aarch64 (default: a folder of
#                      scripts/container_base.sh's, downloaded once)
#   S2S_CONTAINER_DOORS    all: every door synthesizes (the default on this machine's arch); wyoming: only
#                      Wyoming does, MQTT and the OpenAI API are reported SKIP (the default under
#                      emulation, where each request takes a minute or two: the doors are the same
#                      Python on both arches, the amd64 check tries each; the image's say and Wyoming
#                      synthesize on arm64)
#   S2S_CONTAINER_KEEP     1: leave the container, its volume and the broker running afterwards
#
# pip inside the build reaches the package index as this machine's pip does: its certificate
# bundle (PIP_CERT or `pip config get global.cert`, for a TLS-intercepting proxy) is bound in
# with a pip.conf naming it, and the torch wheel comes from the local folder when there is one.
# The containers share this machine's network (--network host) and listen on loopback ports
# chosen free.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

NAME=s2s-container-check
VOLUME=s2s-container-check-data
started_s=$SECONDS

# shellcheck source=scripts/container_base.sh
source scripts/container_base.sh
if [ "$S2S_CONTAINER_ARCH" = "$S2S_HOST_ARCH" ]; then
  IMAGE=${S2S_CONTAINER_IMAGE:-localhost/s2s-daemon:cpu}
  WAIT_S=300    # the longest wait for the daemon to be ready
  ANSWER_S=120  # the longest wait for a request's answer
  DOORS=${S2S_CONTAINER_DOORS:-all}
else
  IMAGE=${S2S_CONTAINER_IMAGE:-localhost/s2s-daemon:cpu-$S2S_CONTAINER_ARCH}
  WAIT_S=1200
  ANSWER_S=900
  DOORS=${S2S_CONTAINER_DOORS:-wyoming}
fi
case "$DOORS" in all | wyoming) ;; *) echo "container_check: S2S_CONTAINER_DOORS is all or wyoming, not '$DOORS'" >&2; exit 2 ;; esac

pkgs=()
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || pkgs+=(mosquitto)
command -v mosquitto_pub >/dev/null || pkgs+=(mosquitto-clients)
command -v curl >/dev/null || pkgs+=(curl)
if ((${#pkgs[@]})); then
  echo "container_check: installing ${pkgs[*]}" >&2
  _s2s_sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive _s2s_sudo apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi
MOSQUITTO=$(command -v mosquitto || echo /usr/sbin/mosquitto)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/s2s-container-check.XXXXXX")
chmod 755 "$WORK"
pids=()
cleanup() {
  local pid
  if [ "${S2S_CONTAINER_KEEP:-0}" != 1 ]; then
    podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
    podman volume rm -f "$VOLUME" >/dev/null 2>&1 || true
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
  else
    echo "container_check: kept $NAME, volume $VOLUME, broker pids ${pids[*]}, files in $WORK" >&2
  fi
}
trap cleanup EXIT

failures=0
report() {  # report NAME ok|FAIL|SKIP DETAIL
  printf '%-12s %s%s\n' "$1:" "$2" "${3:+ ($3)}"
  [ "$2" != FAIL ] || failures=$((failures + 1))
}

# --- build ----------------------------------------------------------------------------------
s2s_emulation "$WORK"
if [ "${S2S_CONTAINER_BUILD:-1}" != 0 ]; then
  s2s_build_inputs "$WORK"
  echo "container_check: building $IMAGE ($S2S_CONTAINER_ARCH) on $S2S_CONTAINER_BASE ($S2S_BUILD_SOURCES)" >&2
  build_started=$SECONDS
  if podman build --format docker --network host "${S2S_ARCH_FLAGS[@]}" -f container/Containerfile -t "$IMAGE" \
      --build-arg "BASE_IMAGE=$S2S_CONTAINER_BASE" "${S2S_BUILD_FLAGS[@]}" "${S2S_EMULATION_FLAGS[@]}" . \
      >"$WORK/build.log" 2>&1; then
    report build ok "$IMAGE, $((SECONDS - build_started)) s"
  else
    tail -20 "$WORK/build.log"
    report build FAIL "see the lines above"
    exit 1
  fi
fi

# --- torch, a checkpoint, a say -------------------------------------------------------------
# torch imports (the NVIDIA libraries a CUDA build of torch is linked against are there) and runs
# on the CPU; what the image left out is not there. The sizes are what docs/operations.md gives.
if out=$(podman run --rm --network none --entrypoint python "${S2S_EMULATION_FLAGS[@]}" "$IMAGE" -c '
import importlib.metadata, pathlib, platform, re, torch
assert not torch.cuda.is_available()
assert (torch.ones(2, 3) @ torch.ones(3, 2)).sum().item() == 12.0
installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in importlib.metadata.distributions()}
present = installed & {"triton", "cuda-bindings", "cuda-pathfinder"}
assert not present, f"left-out packages installed: {sorted(present)}"
site = pathlib.Path(torch.__file__).parents[1]
mb = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e6
torch_mb, nvidia_mb = mb(site / "torch"), mb(site / "nvidia")
print(f"{platform.machine()}, torch {torch.__version__} {torch_mb:.0f} MB, NVIDIA libraries {nvidia_mb:.0f} MB, no triton")
' 2>"$WORK/torch.log"); then
  report torch ok "$out; image $(podman image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')"
else
  report torch FAIL "$(tail -3 "$WORK/torch.log")"
fi

podman run --rm --network none --user 0:0 --entrypoint python -v "$WORK:/work" "${S2S_EMULATION_FLAGS[@]}" "$IMAGE" \
  -m s2s_daemon.tools.make_checkpoint /work/tiny --size tiny --kind custom_voice >"$WORK/checkpoint.log" 2>&1 \
  || { tail -5 "$WORK/checkpoint.log"; report checkpoint FAIL "make_checkpoint in the image"; exit 1; }
chmod -R a+rX "$WORK/tiny"

# `s2s-daemon say` inside the image: the engine on the native kernels (int8), a WAV written.
mkdir -m 777 "$WORK/say"
if out=$(podman run --rm --network none -v "$WORK/tiny:/models/tiny:ro" -v "$WORK/say:/out" \
    -e S2S_TTS__OPTIONS__MAX_FRAMES=24 "${S2S_EMULATION_FLAGS[@]}" "${S2S_EMULATION_ENV[@]}" "$IMAGE" \
    say --model /models/tiny --quantization int8 --kernels native --greedy --out /out/say.wav \
    "Hello from the container check." 2>&1) && [ "$(head -c 4 "$WORK/say/say.wav" 2>/dev/null)" = RIFF ]; then
  isa=$(grep -o '"isa": "[a-z0-9]*"' <<<"$out" | head -1)
  report say ok "s2s-daemon say --kernels native --quantization int8 ($isa): say.wav $(stat -c %s "$WORK/say/say.wav") bytes"
else
  report say FAIL "$(tail -3 <<<"$out")"
fi

# --- a broker, the container ----------------------------------------------------------------

# A port taken between its choice and the broker's start (another process's): a new one, three tries.
broker=
for _ in 1 2 3; do
  read -r MQTT_PORT HTTP_PORT WYOMING_PORT < <(s2s_free_ports 3)
  printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\n' "$MQTT_PORT" >"$WORK/mosquitto.conf"
  "$MOSQUITTO" -c "$WORK/mosquitto.conf" >"$WORK/mosquitto.log" 2>&1 &
  broker_pid=$!
  pids+=("$broker_pid")
  for _ in $(seq 150); do
    if mosquitto_pub -p "$MQTT_PORT" -t s2s-check/ping -n 2>/dev/null; then broker=up; break; fi
    kill -0 "$broker_pid" 2>/dev/null || break  # exited: the port was taken
    sleep 0.1
  done
  [ -z "$broker" ] || break
done
if [ -z "$broker" ]; then
  cat "$WORK/mosquitto.log"
  report broker FAIL "mosquitto did not answer on 127.0.0.1:$MQTT_PORT within 15 s"
  exit 1
fi
mosquitto_sub -p "$MQTT_PORT" -v -t 's2s/#' >"$WORK/mqtt.log" 2>&1 &
pids+=($!)

podman volume rm -f "$VOLUME" >/dev/null 2>&1 || true
podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
podman run -d --name "$NAME" --network host -v "$VOLUME:/data" -v "$WORK/tiny:/models/tiny:ro" \
  -e S2S_TTS__MODEL=/models/tiny -e S2S_TTS__OPTIONS__MAX_FRAMES=24 \
  -e S2S_MQTT__BROKER=external -e S2S_MQTT__PORT="$MQTT_PORT" \
  -e S2S_HTTP__HOST=127.0.0.1 -e S2S_HTTP__PORT="$HTTP_PORT" \
  -e S2S_WYOMING__HOST=127.0.0.1 -e S2S_WYOMING__PORT="$WYOMING_PORT" \
  -e S2S_AUDIO__SINK=wav -e S2S_AUDIO__WAV_DIR=/data/wav \
  "${S2S_EMULATION_FLAGS[@]}" "${S2S_EMULATION_ENV[@]}" "$IMAGE" >"$WORK/run.log" 2>&1 || { cat "$WORK/run.log"; report run FAIL "podman run"; exit 1; }
# (podman's complaint that it cannot reach systemd to schedule the health checks goes to run.log:
# on a machine without systemd, "podman healthcheck run" below runs the check instead.)

http_code() { curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:$HTTP_PORT$1" || true; }
run_started=$SECONDS
probe=/ready
state=
while [ $((SECONDS - run_started)) -lt "$WAIT_S" ]; do
  if [ "$(podman inspect -f '{{.State.Running}}' "$NAME" 2>/dev/null)" != true ]; then state=exited; break; fi
  code=$(http_code /ready)
  if [ "$code" = 404 ]; then probe=/health; code=$(http_code /health); fi  # a build from before /ready
  if [ "$code" = 200 ]; then state=ready; break; fi
  sleep 1
done
if [ "$state" = ready ]; then
  report ready ok "GET $probe 200 after $((SECONDS - run_started)) s"
else
  podman logs --tail 30 "$NAME" 2>&1
  report ready FAIL "${state:-no 200 from $probe within $WAIT_S s}"
  exit 1
fi

# --- the health check, the doors, the volume ------------------------------------------------
if [ "$probe" = /ready ]; then
  if out=$(podman healthcheck run "$NAME" 2>&1); then
    report healthcheck ok "podman healthcheck run: ${out:-healthy}"
  else
    report healthcheck FAIL "podman healthcheck run: $out"
  fi
else
  report healthcheck SKIP "this build answers 404 on /ready; the HEALTHCHECK asks /ready"
fi

if [ "$DOORS" = all ]; then
  mosquitto_pub -p "$MQTT_PORT" -q 1 -t s2s/default/tts/say \
    -m '{"id": "container-check-mqtt", "text": "Hello from the container check."}' || true
  finished=
  for _ in $(seq $((ANSWER_S * 2))); do
    finished=$(grep '^s2s/default/tts/finished .*container-check-mqtt' "$WORK/mqtt.log" || true)
    [ -z "$finished" ] || break
    sleep 0.5
  done
  if [[ $finished == *'"status": "completed"'* || $finished == *'"status":"completed"'* ]]; then
    wav=$(podman exec "$NAME" stat -c %s /data/wav/container-check-mqtt.wav 2>/dev/null || echo 0)
    if [ "$wav" -gt 44 ]; then
      report mqtt ok "tts/finished completed; /data/wav/container-check-mqtt.wav $wav bytes"
    else
      report mqtt FAIL "tts/finished completed but no WAV in the volume"
    fi
  else
    report mqtt FAIL "tts/finished: ${finished:-none within $ANSWER_S s}"
  fi

  code=$(curl -sS -o "$WORK/openai.wav" -D "$WORK/openai.headers" -w '%{http_code}' --max-time "$ANSWER_S" \
    "http://127.0.0.1:$HTTP_PORT/v1/audio/speech" -H 'Content-Type: application/json' \
    -d '{"model": "tts-1", "input": "Hello from the container check.", "voice": "alloy", "response_format": "wav"}' || true)
  size=$(stat -c %s "$WORK/openai.wav" 2>/dev/null || echo 0)
  if [ "$code" = 200 ] && [ "$(head -c 4 "$WORK/openai.wav")" = RIFF ] && [ "$size" -gt 44 ]; then
    report openai ok "POST /v1/audio/speech 200, WAV $size bytes, $(grep -i '^x-request-id' "$WORK/openai.headers" | tr -d '\r')"
  else
    report openai FAIL "POST /v1/audio/speech $code, $size bytes: $(head -c 200 "$WORK/openai.wav" 2>/dev/null | tr -d '\0')"
  fi
else
  report mqtt SKIP "S2S_CONTAINER_DOORS=$DOORS (under emulation: the say above and Wyoming below synthesize)"
  report openai SKIP "S2S_CONTAINER_DOORS=$DOORS"
fi

PY=$(s2s_client_python)
if out=$("$PY" scripts/wyoming_probe.py 127.0.0.1 "$WYOMING_PORT" --synthesize "Hello from the container check." \
    --timeout-s "$ANSWER_S" 2>&1); then
  report wyoming ok "$out"
else
  report wyoming FAIL "$out"
fi

journal=$(podman exec "$NAME" sh -c 'ls /data/state/*.sqlite3' 2>/dev/null || true)
owner=$(podman exec "$NAME" stat -c %U /data/state 2>/dev/null || true)
if [ -n "$journal" ] && [ "$owner" = s2s ] && [ "$(podman exec "$NAME" id -u)" != 0 ]; then
  report volume ok "journal $journal, owned by s2s (uid $(podman exec "$NAME" id -u))"
else
  report volume FAIL "journal '${journal}', owner '${owner}'"
fi

stop_started=$SECONDS
podman stop -t 30 "$NAME" >/dev/null 2>&1 || true
exit_code=$(podman inspect -f '{{.State.ExitCode}}' "$NAME")
if [ "$exit_code" = 0 ]; then
  report stop ok "SIGTERM: exit 0 after $((SECONDS - stop_started)) s"
else
  podman logs --tail 15 "$NAME" 2>&1
  report stop FAIL "SIGTERM: exit $exit_code"
fi

echo "container_check: $failures failed, $((SECONDS - started_s)) s in all"
[ "$failures" -eq 0 ]
