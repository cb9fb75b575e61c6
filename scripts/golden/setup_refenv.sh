#!/usr/bin/env bash
# Build the reference environment for the golden outputs: the official qwen-tts package on CPU torch.
#   scripts/golden/setup_refenv.sh [/work/refenv]
# Needs network access to the package index (pip only); ~2 GB on disk.
set -euo pipefail
ENV_DIR="${1:-/work/refenv}"
python3 -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install --upgrade pip
# CPU wheel of torch first, so that qwen-tts does not pull a CUDA build.
"$ENV_DIR/bin/pip" install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
  || "$ENV_DIR/bin/pip" install torch==2.13.0
"$ENV_DIR/bin/pip" install qwen-tts==0.1.1          # pins transformers 4.57.3, pulls torchaudio
# qwen-tts drags in a torchaudio whose native libraries do not match torch 2.13.0 (the import fails
# with undefined symbols). qwen-tts only uses its pure-Python parts, which import once the .so files
# are gone.
SITE="$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -f "$SITE"/torchaudio/lib/*.so
HF_HUB_OFFLINE=1 "$ENV_DIR/bin/python" -c "import qwen_tts, torch, transformers; print('refenv ok', torch.__version__, transformers.__version__)"
