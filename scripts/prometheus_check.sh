#!/usr/bin/env bash
# A real Prometheus scrapes the daemon's /metrics: `scripts/prometheus_check.sh`.
#
# Starts the daemon (the tests' tone engine: no model weights needed; embedded broker, discard
# sink, the monitor listener and the speech API on free loopback ports), sends it one speech
# request with curl, starts `prometheus` (Debian's package: apt-get install prometheus) with a
# scrape config pointing at the monitor listener, waits for a scrape, then asks Prometheus' HTTP
# API for the daemon's series. `promtool check metrics` lints the exposition's names on the way.
# Prints one line per check and `ok`, or `FAIL: why` (exit 1).
#
# PROM_CHECK_TARGET=host:port scrapes a daemon that is already running (its monitor listener, or
# its speech API's port when that has no token) instead of starting one; no request is sent then.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
PROMETHEUS=${PROMETHEUS:-prometheus}
PROMTOOL=${PROMTOOL:-promtool}
WAIT_S=${PROM_CHECK_WAIT_S:-60}
command -v "$PROMETHEUS" >/dev/null || { echo "FAIL: $PROMETHEUS not found (apt-get install prometheus)"; exit 1; }
command -v curl >/dev/null || { echo "FAIL: curl not found"; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/s2s-prometheus-check.XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# free_ports N: N distinct free loopback ports, held open together while chosen (one at a time, two
# calls could be given the same port: the daemon then refused its configuration).
free_ports() {
  "$PY" -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))' "$1"
}
fail() {
  echo "FAIL: $*"
  for log in "$work"/*.log; do [ -f "$log" ] && { echo "--- $log (last lines)"; tail -n 20 "$log"; }; done
  exit 1
}
# until `$@` succeeds, at most WAIT_S seconds
wait_for() {
  local deadline=$((SECONDS + WAIT_S))
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

target=${PROM_CHECK_TARGET:-}
if [ -z "$target" ]; then
  read -r monitor api broker < <(free_ports 3)
  cat >"$work/daemon.yaml" <<EOF
site_id: promcheck
mqtt: {broker: embedded, port: $broker}
tts: {engine: tone, options: {speed: "4"}, warmup: false}
audio: {sink: discard}
journal: {path: $work/journal.sqlite3}
log: {format: json}
http: {enabled: true, port: $api}
monitor: {enabled: true, port: $monitor}
telemetry: {memory_interval_s: 1}
EOF
  "$PY" -m tests.support.tone_daemon run -c "$work/daemon.yaml" >"$work/daemon.log" 2>&1 &
  pids+=($!)
  target="127.0.0.1:$monitor"
  wait_for curl -fs -o /dev/null "http://$target/ready" || fail "the daemon did not become ready within ${WAIT_S}s"
  echo "daemon ready: monitor $target, speech API 127.0.0.1:$api"
  curl -fsS -o "$work/speech.wav" -H 'Content-Type: application/json' \
    -d '{"model": "tts-1", "voice": "alloy", "input": "Prometheus is watching.", "response_format": "wav"}' \
    "http://127.0.0.1:$api/v1/audio/speech" || fail "the speech request failed"
  echo "speech request: $(stat -c %s "$work/speech.wav") bytes of WAV"
  wanted='s2s_requests_total{intake="http",status="completed"}'
else
  wait_for curl -fs -o /dev/null "http://$target/metrics" || fail "nothing answers http://$target/metrics"
  wanted='s2s_ready'
fi

curl -fsS "http://$target/metrics" >"$work/metrics.txt" || fail "GET /metrics failed"
if command -v "$PROMTOOL" >/dev/null; then
  if lint=$("$PROMTOOL" check metrics <"$work/metrics.txt" 2>&1); then
    echo "promtool check metrics: clean"
  else
    echo "$lint"
    fail "promtool check metrics found problems in the exposition"
  fi
fi

prom=$(free_ports 1)  # the daemon's listeners are bound by now: bind(0) cannot give one of theirs
cat >"$work/prometheus.yml" <<EOF
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: s2s
    static_configs: [{targets: ["$target"]}]
EOF
"$PROMETHEUS" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom" >"$work/prometheus.log" 2>&1 &
pids+=($!)
echo "prometheus $("$PROMETHEUS" --version 2>&1 | head -1 | awk '{print $3}') on 127.0.0.1:$prom scraping $target"

# The value of the first sample a PromQL query returns ("" when none, or while Prometheus starts).
query() {
  local answer
  answer=$(curl -fsS --get --data-urlencode "query=$1" "http://127.0.0.1:$prom/api/v1/query" 2>/dev/null) || true
  [ -n "$answer" ] || return 0
  "$PY" -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")' \
    <<<"$answer"
}
scraped() { [ "$(query 'up{job="s2s"}')" = "1" ]; }
has() { [ -n "$(query "$1")" ]; }
wait_for scraped || fail "Prometheus did not scrape $target within ${WAIT_S}s (up{job=\"s2s\"} is not 1)"
echo "up{job=\"s2s\"} = 1"
wait_for has "$wanted" || fail "Prometheus has no $wanted"
for series in "$wanted" s2s_ready s2s_queue_depth s2s_engine_busy_seconds_total \
  's2s_first_audio_seconds_count{intake="http"}' s2s_resident_memory_bytes; do
  echo "$series = $(query "$series")"
done
[ "$(query 's2s_ready')" = "1" ] || fail "s2s_ready is not 1"
echo ok
