#!/usr/bin/env bash
# Prepare the peers that scripts/bench_peers.py runs beside our torch engine, into a scratch folder.
#
#   scripts/peers_prep.sh SCRATCH CKPT [QWENTTS_GIT GGML_GIT]
#
# SCRATCH: a work folder of its own (about 8 GB for a 0.6B checkpoint). CKPT: a Qwen3-TTS-12Hz
# CustomVoice checkpoint in the official layout (bfloat16 or float32; a random one from
# `python -m s2s_daemon.tools.make_checkpoint DIR --size 0.6b --kind custom_voice` will do), only read.
# QWENTTS_GIT, GGML_GIT (arguments or environment; needed until SCRATCH holds the sources): bare
# git copies of ServeurpersoCom/qwentts.cpp (its convert.py and tools/quantize.cpp at QWENTTS_COMMIT)
# and ggml-org/ggml (its headers at GGML_COMMIT, ggml 0.17.0, the wheel's).
#
# What it makes, each step skipped when its result is there (rerun it after a failure):
#   SCRATCH/venv               realtimetts-qwen-native-cpu 0.4.2 (qwentts.cpp, GGML) and vox-tts 0.19.5,
#                              with numpy, gguf, safetensors; no torch
#   SCRATCH/qbuild/quantize    qwentts.cpp's tools/quantize, built against the wheel's libggml-base
#   SCRATCH/models/*.gguf      talker and codec: F32 (convert.py through scripts/peers_convert.py),
#                              Q8_0 and Q4_K_M (tools/quantize)
#   SCRATCH/vox/model.tmod     vox-tts's own conversion: python -m vox build --dtype bf16 --quant q8
#   SCRATCH/ckpt               a link to CKPT: bench_peers.py runs every side from it
# Heavy steps run under `nice -n 10`.
set -euo pipefail

QWENTTS_COMMIT=a8a7716
GGML_COMMIT=9be31331
GGML_WHEEL=realtimetts-qwen-native-cpu==0.4.2
VOX_WHEEL=vox-tts==0.19.5
FORMATS=(Q8_0 Q4_K_M)

usage() { sed -n 2,22p "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
SCRATCH=$(realpath -m "$1")
CKPT=$(realpath "$2")
QWENTTS_GIT=${3:-${QWENTTS_GIT:-}}
GGML_GIT=${4:-${GGML_GIT:-}}
HERE=$(cd "$(dirname "$0")" && pwd)

missing=""
[ -f "$SCRATCH/qwentts-src/convert.py" ] && [ -f "$SCRATCH/ggml-include/include/ggml.h" ] && QWENTTS_GIT=- GGML_GIT=-
for pair in "QWENTTS_GIT:$QWENTTS_GIT:ServeurpersoCom/qwentts.cpp:$QWENTTS_COMMIT" "GGML_GIT:$GGML_GIT:ggml-org/ggml:$GGML_COMMIT"; do
  IFS=: read -r name path repo commit <<< "$pair"
  if [ "$path" = - ]; then continue; fi  # the sources are in SCRATCH already
  if [ -z "$path" ] || ! git --git-dir="$path" cat-file -e "$commit^{commit}" 2>/dev/null; then
    missing+="  $name='${path}': not a git directory holding $repo at $commit. Get one (in an agent session:"
    missing+=" the fetch tool with github:$repo, which answers /work/.mirror/${repo/\//+}/repo; elsewhere:"
    missing+=" git clone --bare https://github.com/$repo) and pass it as an argument or in \$$name.\n"
  fi
done
if [ -n "$missing" ]; then printf 'peers_prep.sh: the sources are missing:\n%b' "$missing" >&2; exit 2; fi
[ -f "$CKPT/config.json" ] && [ -f "$CKPT/speech_tokenizer/model.safetensors" ] \
  || { echo "peers_prep.sh: $CKPT is not a checkpoint in the official layout (config.json, speech_tokenizer/)" >&2; exit 2; }
kind=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("tts_model_type", ""))' "$CKPT/config.json")
[ "$kind" = custom_voice ] || { echo "peers_prep.sh: $CKPT is a '$kind' checkpoint; the comparison uses CustomVoice" >&2; exit 2; }
size=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("tts_model_size", "0b6"))' "$CKPT/config.json")

step() { printf '\n== %s\n' "$*"; }
mkdir -p "$SCRATCH"/{wheels,models,vox,logs}
cd "$SCRATCH"
ln -sfn "$CKPT" ckpt

step "virtual environment: $GGML_WHEEL, $VOX_WHEEL"
[ -x venv/bin/python ] || python3 -m venv venv
if ! venv/bin/python -c 'import qwentts_cpp_cpu, vox, gguf, safetensors, numpy' 2>/dev/null; then
  venv/bin/pip download --no-deps "$GGML_WHEEL" "$VOX_WHEEL" -d wheels
  venv/bin/pip install wheels/realtimetts_qwen_native_cpu-*.whl wheels/vox_tts-*.whl numpy gguf safetensors
fi
SITE=$(venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LIB=$SITE/qwentts_cpp_cpu/lib

step "sources: qwentts.cpp $QWENTTS_COMMIT, ggml $GGML_COMMIT headers"
if [ ! -f qwentts-src/convert.py ]; then
  rm -rf qwentts-src.tmp && mkdir qwentts-src.tmp
  git --git-dir="$QWENTTS_GIT" archive "$QWENTTS_COMMIT" | tar -x -C qwentts-src.tmp && mv qwentts-src.tmp qwentts-src
fi
if [ ! -f ggml-include/include/ggml.h ]; then
  rm -rf ggml-include.tmp && mkdir ggml-include.tmp
  git --git-dir="$GGML_GIT" archive "$GGML_COMMIT" include | tar -x -C ggml-include.tmp && mv ggml-include.tmp ggml-include
fi

step "tools/quantize against the wheel's libggml-base"
if [ ! -x qbuild/quantize ]; then
  mkdir -p qbuild
  printf '#pragma once\n#define QWEN_VERSION "%s"\n' "$QWENTTS_COMMIT" > qbuild/version.h
  ln -sf "$LIB/libggml-base.so.0" qbuild/libggml-base.so
  nice -n 10 g++ -O2 -std=c++17 -DGGML_MAX_NAME=128 -I qbuild -I qwentts-src/src -I ggml-include/include \
    qwentts-src/tools/quantize.cpp -L qbuild -lggml-base -Wl,-rpath,"$LIB" -o qbuild/quantize.tmp
  mv qbuild/quantize.tmp qbuild/quantize
fi

step "GGUF F32 from $CKPT (convert.py through peers_convert.py)"
talker=qwen-talker-$( [ "$size" = 1b7 ] && echo 1.7b || echo 0.6b )-customvoice
hub_size=$( [ "$size" = 1b7 ] && echo 1.7B || echo 0.6B )
mkdir -p convert/checkpoints
ln -sfn "$CKPT" "convert/checkpoints/Qwen3-TTS-12Hz-$hub_size-CustomVoice"
ln -sfn "$CKPT/speech_tokenizer" convert/checkpoints/Qwen3-TTS-Tokenizer-12Hz
if [ ! -f "models/$talker-F32.gguf" ] || [ ! -f models/qwen-tokenizer-12hz-F32.gguf ]; then
  rm -rf convert/models  # convert.py writes here and skips what it finds: a crashed run's half file goes
  (cd convert && nice -n 10 ../venv/bin/python "$HERE/peers_convert.py" ../qwentts-src/convert.py) 2>&1 | tee logs/convert.log
  mv convert/models/*-F32.gguf models/
fi

step "GGUF ${FORMATS[*]} (tools/quantize)"
for fmt in "${FORMATS[@]}"; do
  for model in "$talker" qwen-tokenizer-12hz; do
    if [ ! -f "models/$model-$fmt.gguf" ]; then
      nice -n 10 qbuild/quantize "models/$model-F32.gguf" "models/$model-$fmt.gguf.tmp" "$fmt" > "logs/quantize-$model-$fmt.log" 2>&1 \
        || { tail -5 "logs/quantize-$model-$fmt.log" >&2; exit 1; }
      mv "models/$model-$fmt.gguf.tmp" "models/$model-$fmt.gguf"
    fi
  done
done

step "vox-tts model (python -m vox build --dtype bf16 --quant q8)"
if [ ! -f vox/model.tmod ]; then
  nice -n 10 venv/bin/python -m vox build --model "$CKPT" --dtype bf16 --quant q8 -o vox/model.tmod.tmp 2>&1 | tee logs/vox_build.log
  mv vox/model.tmod.tmp vox/model.tmod
fi

step "done"
ls -l models/ vox/
du -sh "$SCRATCH"
echo "next: python scripts/bench_peers.py --scratch $SCRATCH [--frames 100 --rounds 2] [--doc]"
