"""Record the tensor names and shapes the official qwen-tts classes expect (run with /work/refenv/bin/python).

    /work/refenv/bin/python scripts/golden/record_expected_keys.py CKPT_ROOT OUT_JSON[.gz]

CKPT_ROOT holds one folder per `<size>_<kind>` (e.g. tiny_custom_voice, 0.6b_base) with config.json and
speech_tokenizer/config.json; only those are read, so `scripts/golden/write_configs.py CKPT_ROOT` (main
venv) is enough to prepare it, without writing any weights. For each,
the official Qwen3TTSForConditionalGeneration and Qwen3TTSTokenizerV2Model are built from those configs
on the meta device and their state_dict names and shapes written to OUT_JSON, so that CI can check the
generator without the reference environment.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch
from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model


def _shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in module.state_dict().items()}


def main() -> int:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    result: dict[str, dict[str, dict[str, list[int]]]] = {}
    for ckpt in sorted(p for p in root.iterdir() if (p / "config.json").exists()):
        with torch.device("meta"):
            model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig.from_pretrained(ckpt))
            codec = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config.from_pretrained(ckpt / "speech_tokenizer"))
        result[ckpt.name] = {"model": _shapes(model), "speech_tokenizer": _shapes(codec)}
    text = json.dumps(result, indent=0, sort_keys=True) + "\n"
    if out.suffix == ".gz":
        # mtime=0 keeps the file byte-identical between runs.
        with gzip.GzipFile(filename="", fileobj=out.open("wb"), mode="wb", mtime=0) as f:
            f.write(text.encode())
    else:
        out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
