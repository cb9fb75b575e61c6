#!/usr/bin/env bash
# One-shot check of the torch engine on a CUDA GPU: correctness against the CPU on the tiny
# fixtures, then speed (first audio, real-time factor, memory) on a random 0.6B checkpoint per
# dtype, with and without CUDA graphs. Needs no network and no install; see scripts/gpu_check.py.
#
#   bash scripts/gpu_check.sh [--quick]                      on the GPU machine (under 10 minutes)
#   S2S_GPU_DEVICE=cpu bash scripts/gpu_check.sh [--quick]   dry run on a CPU-only machine
#
# Environment:
#   S2S_GPU_DEVICE         cuda (default), cuda:N or cpu (dry run: tiny fixture for step 3 too)
#   S2S_GPU_CHECK_BIG=1    dry run with the 0.6B checkpoint for step 3 (always on with cuda)
#   S2S_GPU_PYTHON         interpreter to try first (else .venv/bin/python, python3, ...)
#   S2S_GPU_CHECK_TIMEOUT  overall limit in seconds (default 570); the driver's budget is 40 s less
#   S2S_GPU_CHECK_FRAMES, S2S_GPU_CHECK_RUNS   frames per speed run (75) and timed runs (3)
#   S2S_GPU_CHECK_CONFIGS  speed configs to run, e.g. bf16_graphs,fp32_eager (default: all six)
#   --quick                correctness on custom_voice in fp32 only; 16 frames, 1 timed run
#   OUT                    if set, results go to $OUT/gpu_check/ (summary.json, run.log, steps.log,
#                          nvidia-smi.txt); else to S2S_GPU_CHECK_RESULTS or a new /tmp folder.
# Exit status: 0 all steps ran, 1 some step failed or timed out, 2 no usable interpreter,
# 124 the overall limit was hit (partial results are still written).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

DEVICE=${S2S_GPU_DEVICE:-cuda}
TOTAL=${S2S_GPU_CHECK_TIMEOUT:-570}
if [ -n "${OUT:-}" ]; then
  RESULTS="$OUT/gpu_check"
elif [ -n "${S2S_GPU_CHECK_RESULTS:-}" ]; then
  RESULTS=$S2S_GPU_CHECK_RESULTS
else
  RESULTS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_results.XXXXXX")
fi
mkdir -p "$RESULTS"
export S2S_GPU_DEVICE=$DEVICE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Prints "torch=V cuda=V available=B gpu=NAME missing=LIST" and exits 0 when the interpreter has
# torch, every package the engine needs, and (for a cuda device) a GPU torch can use.
PROBE='
import importlib.util, sys
device = sys.argv[1]
if sys.version_info < (3, 11):
    print(f"python {sys.version.split()[0]} is older than 3.11"); raise SystemExit(1)
try:
    import torch
except Exception as exc:
    print(f"no torch ({type(exc).__name__}: {exc})"); raise SystemExit(1)
missing = [m for m in ("numpy", "safetensors", "tokenizers", "transformers") if importlib.util.find_spec(m) is None]
avail = torch.cuda.is_available()
gpu = torch.cuda.get_device_name(0).replace(" ", "_") if avail else "none"
extra = "" if importlib.util.find_spec("structlog") else " (structlog missing: stand-in used)"
miss = ",".join(missing) or "none"
cudnn = torch.backends.cudnn.version() if avail else None
print(f"python={sys.version.split()[0]} torch={torch.__version__} cuda={torch.version.cuda} "
      f"cudnn={cudnn} available={avail} gpu={gpu} missing={miss}{extra}")
ok = not missing and (avail or not device.startswith("cuda"))
raise SystemExit(0 if ok else 1)
'

main() {
  local start=$SECONDS
  echo "gpu_check.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n) ($(uname -m)), $(nproc) cores, device $DEVICE"
  echo "gpu_check.sh: repository $ROOT at $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "gpu_check.sh: results in $RESULTS"
  if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 30 nvidia-smi 2>&1 | tee "$RESULTS/nvidia-smi.txt" || echo "nvidia-smi failed (rc $?)"
  else
    echo "nvidia-smi: not found" | tee "$RESULTS/nvidia-smi.txt"
  fi

  local py="" cand line tried=()
  for cand in "${S2S_GPU_PYTHON:-}" .venv/bin/python python3 /opt/torch/.venv/bin/python3 python; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || continue
    if line=$(timeout 120 "$cand" -c "$PROBE" "$DEVICE" 2>&1 | tail -n 1); then
      echo "interpreter $cand: $line"
      py=$cand
      break
    fi
    echo "interpreter $cand: not usable: $line"
    tried+=("$cand")
  done
  if [ -z "$py" ]; then
    echo "gpu_check.sh: no interpreter with torch${DEVICE:+ for $DEVICE} and numpy, safetensors, tokenizers," \
      "transformers (tried: ${tried[*]:-none})."
    echo "  Set S2S_GPU_PYTHON to one that has them, or carry wheels (this machine has no network)."
    return 2
  fi

  local left=$((TOTAL - (SECONDS - start)))
  local budget=$((left - 40))
  if [ "$budget" -lt 60 ]; then
    echo "gpu_check.sh: only $left s left of $TOTAL s; not starting"
    return 1
  fi
  local rc=0 work
  work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")
  # shellcheck disable=SC2064  # expand $work now: the trap runs after main's locals are gone
  trap "rm -rf '$work'" EXIT
  # The driver keeps its own budget (per step and overall) and ends its children; timeout is the backstop.
  timeout --signal=TERM --kill-after=15 "$((left - 10))" \
    "$py" scripts/gpu_check.py --results "$RESULTS" --workdir "$work" --budget "$budget" "$@" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu_check.sh: the driver hit the overall limit ($TOTAL s); partial results in $RESULTS/summary.json"
  fi
  echo "gpu_check.sh: finished in $((SECONDS - start)) s, exit $rc"
  return "$rc"
}

set +e
main "$@" 2>&1 | tee "$RESULTS/run.log"
status=${PIPESTATUS[0]}
set -e
exit "$status"
