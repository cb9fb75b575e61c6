#!/usr/bin/env bash
# Build the CPU image (container/Containerfile), run it on a tiny random checkpoint, and try each
# door with its real client: MQTT (mosquitto_pub to a mosquitto on this machine), the OpenAI API
# (curl), Wyoming (the wyoming library's client: describe, then synthesize). Also the image's
# HEALTHCHECK, the volume (request journal, WAV output, written by the non-root user) and a
# graceful stop. One line per check, "ok" or "FAIL"; exit 1 when any failed.
#
#   bash scripts/container_check.sh
#
# CI runs it after the tests (.ci/run); scripts/test does not. From nothing it takes about 7
# minutes on 2 busy cores (the Debian base, apt, pip, the native kernels), from podman's layer
# cache about 2 (the checks). Needs root or sudo for apt (podman, runc, debootstrap, mosquitto,
# curl) and for debootstrap.
#
# Environment:
#   S2S_CONTAINER_IMAGE          the image to build and check (default localhost/s2s-daemon:cpu)
#   S2S_CONTAINER_BASE     the base (default localhost/debian:bookworm, made by scripts/container_base.sh;
#                      docker.io/library/debian:bookworm-slim where a registry can be reached)
#   S2S_CONTAINER_BUILD    0: check the image as it is, without building
#   S2S_CONTAINER_TORCH_WHEELS   a folder holding the torch CPU wheel, bound into the build (default: the one of
#                      this machine's pip find-links that holds torch-2.13.0+cpu; none: the PyTorch index)
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

IMAGE=${S2S_CONTAINER_IMAGE:-localhost/s2s-daemon:cpu}
NAME=s2s-container-check
VOLUME=s2s-container-check-data
started_s=$SECONDS

# shellcheck source=scripts/container_base.sh
source scripts/container_base.sh

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
if [ "${S2S_CONTAINER_BUILD:-1}" != 0 ]; then
  s2s_build_inputs "$WORK"
  echo "container_check: building $IMAGE on $S2S_CONTAINER_BASE ($S2S_BUILD_SOURCES)" >&2
  build_started=$SECONDS
  if podman build --format docker --network host -f container/Containerfile -t "$IMAGE" \
      --build-arg "BASE_IMAGE=$S2S_CONTAINER_BASE" "${S2S_BUILD_FLAGS[@]}" . >"$WORK/build.log" 2>&1; then
    report build ok "$IMAGE, $((SECONDS - build_started)) s"
  else
    tail -20 "$WORK/build.log"
    report build FAIL "see the lines above"
    exit 1
  fi
fi

# --- a checkpoint, a broker, the container --------------------------------------------------
podman run --rm --network none --user 0:0 --entrypoint python -v "$WORK:/work" "$IMAGE" \
  -m s2s_daemon.tools.make_checkpoint /work/tiny --size tiny --kind custom_voice >"$WORK/checkpoint.log" 2>&1 \
  || { tail -5 "$WORK/checkpoint.log"; report checkpoint FAIL "make_checkpoint in the image"; exit 1; }
chmod -R a+rX "$WORK/tiny"

read -r MQTT_PORT HTTP_PORT WYOMING_PORT < <(s2s_free_ports 3)
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\n' "$MQTT_PORT" >"$WORK/mosquitto.conf"
"$MOSQUITTO" -c "$WORK/mosquitto.conf" >"$WORK/mosquitto.log" 2>&1 &
pids+=($!)
broker=
for _ in $(seq 150); do
  if mosquitto_pub -p "$MQTT_PORT" -t s2s-check/ping -n 2>/dev/null; then broker=up; break; fi
  sleep 0.1
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
  "$IMAGE" >"$WORK/run.log" 2>&1 || { cat "$WORK/run.log"; report run FAIL "podman run"; exit 1; }
# (podman's complaint that it cannot reach systemd to schedule the health checks goes to run.log:
# on a machine without systemd, "podman healthcheck run" below runs the check instead.)

http_code() { curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:$HTTP_PORT$1" || true; }
run_started=$SECONDS
probe=/ready
state=
while [ $((SECONDS - run_started)) -lt 300 ]; do
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
  report ready FAIL "${state:-no 200 from $probe within 300 s}"
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

mosquitto_pub -p "$MQTT_PORT" -q 1 -t s2s/default/tts/say \
  -m '{"id": "container-check-mqtt", "text": "Hello from the container check."}' || true
finished=
for _ in $(seq 240); do
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
  report mqtt FAIL "tts/finished: ${finished:-none within 120 s}"
fi

code=$(curl -sS -o "$WORK/openai.wav" -D "$WORK/openai.headers" -w '%{http_code}' --max-time 120 \
  "http://127.0.0.1:$HTTP_PORT/v1/audio/speech" -H 'Content-Type: application/json' \
  -d '{"model": "tts-1", "input": "Hello from the container check.", "voice": "alloy", "response_format": "wav"}' || true)
size=$(stat -c %s "$WORK/openai.wav" 2>/dev/null || echo 0)
if [ "$code" = 200 ] && [ "$(head -c 4 "$WORK/openai.wav")" = RIFF ] && [ "$size" -gt 44 ]; then
  report openai ok "POST /v1/audio/speech 200, WAV $size bytes, $(grep -i '^x-request-id' "$WORK/openai.headers" | tr -d '\r')"
else
  report openai FAIL "POST /v1/audio/speech $code, $size bytes: $(head -c 200 "$WORK/openai.wav" 2>/dev/null | tr -d '\0')"
fi

PY=$(s2s_client_python)
if out=$("$PY" scripts/wyoming_probe.py 127.0.0.1 "$WYOMING_PORT" --synthesize "Hello from the container check." 2>&1); then
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
