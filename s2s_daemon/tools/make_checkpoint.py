"""Write a random-weight Qwen3-TTS-12Hz checkpoint in the official hub layout.

    python -m s2s_daemon.tools.make_checkpoint OUT --size tiny|0.6b|1.7b \\
        --kind custom_voice|voice_design|base [--seed N]

OUT gets config.json, generation_config.json, model.safetensors (bfloat16), the text tokenizer
(vocab.json, merges.txt, tokenizer.json, tokenizer_config.json, special_tokens_map.json),
preprocessor_config.json and speech_tokenizer/{config.json, model.safetensors (float32; bfloat16
for tiny), preprocessor_config.json}. Needs torch, safetensors and tokenizers; not the official qwen-tts package.

Every tensor is drawn from its own generator, seeded by (seed, tensor name), so the output is
byte-identical for a seed whatever the order of generation. The init is chosen so that the codec
decoder makes audible, non-clipping noise (codebooks are non-zero, convs keep unit variance) and so
that forgetting a norm weight, a bias, a layer scale or the codebook's usage division changes results.
Random weights almost never emit the end-of-speech code: consumers must cap the number of frames.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from s2s_daemon.tools import checkpoint_layout as layout
from s2s_daemon.tools.text_tokenizer import build_text_tokenizer_files

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

_TRANSPOSED_CONV = re.compile(
    r"(^decoder\.upsample\.\d+\.0\.conv\.weight$)|(^decoder\.decoder\.\d+\.block\.1\.conv\.weight$)"
)
_CONV_GAIN = 1.0
_RESIDUAL_CONV2 = re.compile(r"^decoder\.decoder\.\d+\.block\.\d+\.conv2\.conv\.weight$")
# Gains of the codec decoder's last conv and of its residual units' second conv, by number of decoder
# blocks, chosen so that random codes decode to noise at an RMS of about 0.2 without much clipping.
# Each residual unit adds a branch to its input; at full gain the variance grows ~8x per block, which
# one block (tiny) tolerates and four (the released decoder) do not.
_DECODER_GAINS: dict[int, tuple[float, float]] = {1: (0.25, 1.0)}
_DEFAULT_DECODER_GAINS = (0.09, 0.3)


def _generator(seed: int, name: str) -> torch.Generator:
    import torch

    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


def _uniform(shape: tuple[int, ...], lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=torch.float32).uniform_(lo, hi, generator=gen)


def init_tensor(
    name: str, shape: tuple[int, ...], seed: int, n_final_conv: str | None = None, decoder_blocks: int = 1
) -> torch.Tensor:
    """The float32 initial value of one tensor, chosen from its name and shape."""
    import torch

    gen = _generator(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("codebook.initialized"):
        return torch.ones(shape)
    if leaf == "cluster_usage":
        return _uniform(shape, 1.0, 4.0, gen)
    if leaf in ("embedding_sum", "embed_sum"):
        usage_name = name.rsplit(".", 1)[0] + ".cluster_usage"
        usage = init_tensor(usage_name, (shape[0],), seed)
        return _normal(shape, 1.0, gen) * usage[:, None]
    if re.search(r"(norm|layernorm)\.weight$", name):
        return 1.0 + _normal(shape, 0.05, gen)
    if re.search(r"(norm|layernorm)\.bias$", name):
        return _normal(shape, 0.02, gen)
    if leaf == "scale" or leaf == "gamma":
        return _uniform(shape, 0.05, 0.15, gen)
    if leaf in ("alpha", "beta"):
        return _normal(shape, 0.1, gen)
    if len(shape) == 3 and leaf == "weight":
        if _TRANSPOSED_CONV.match(name):
            c_in, _, kernel = shape
            # Each output sample of a transposed conv with stride s sums c_in * kernel / s taps;
            # the kernel is 2s (decoder blocks) or s (ConvNeXt upsamplers).
            stride = kernel // 2 if name.startswith("decoder.decoder.") else kernel
            fan_in = c_in * kernel / stride
        else:
            fan_in = shape[1] * shape[2]
        final_gain, residual_gain = _DECODER_GAINS.get(decoder_blocks, _DEFAULT_DECODER_GAINS)
        if name == n_final_conv:
            gain = final_gain
        elif _RESIDUAL_CONV2.match(name):
            gain = residual_gain
        else:
            gain = _CONV_GAIN
        return _normal(shape, gain / math.sqrt(fan_in), gen)
    if leaf == "bias":
        return _normal(shape, 0.02, gen)
    return _normal(shape, 0.02, gen)


def _tensors(
    shapes: dict[str, tuple[int, ...]],
    seed: int,
    dtype: torch.dtype,
    final_conv: str | None = None,
    decoder_blocks: int = 1,
) -> dict[str, torch.Tensor]:
    return {
        name: init_tensor(name, shape, seed, final_conv, decoder_blocks).to(dtype).contiguous()
        for name, shape in shapes.items()
    }


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_checkpoint(out: Path, size: str, kind: str, seed: int = 0) -> None:
    """Write the whole checkpoint folder (created if missing; existing files are overwritten)."""
    import torch
    from safetensors.torch import save_file

    if size not in layout.SIZES:
        raise ValueError(f"size must be one of {layout.SIZES}, not {size!r}")
    if kind not in layout.KINDS:
        raise ValueError(f"kind must be one of {layout.KINDS}, not {kind!r}")
    spec = layout.SIZE_SPECS[size]
    out.mkdir(parents=True, exist_ok=True)
    (out / "speech_tokenizer").mkdir(exist_ok=True)

    config = layout.model_config(size, kind)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", layout.generation_config())
    _write_json(out / "preprocessor_config.json", layout.PREPROCESSOR_CONFIG)
    special = build_text_tokenizer_files(out, spec.text_base_vocab, layout.TEXT_SPECIAL_TOKENS)
    if special["<|im_start|>"] != config["im_start_token_id"]:
        raise AssertionError("tokenizer and config disagree on <|im_start|>")

    model = _tensors(layout.model_param_shapes(size, kind), seed, torch.bfloat16)
    save_file(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    del model
    log.info("model_written", path=str(out / "model.safetensors"), size=size, kind=kind, seed=seed)

    st_shapes = layout.speech_tokenizer_param_shapes(size)
    final_conv = f"decoder.decoder.{len(spec.dec_upsample_rates) + 2}.conv.weight"
    codec = _tensors(
        st_shapes, seed, getattr(torch, spec.speech_tokenizer_dtype), final_conv, len(spec.dec_upsample_rates)
    )
    save_file(codec, str(out / "speech_tokenizer" / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "speech_tokenizer" / "config.json", layout.speech_tokenizer_config(size))
    _write_json(out / "speech_tokenizer" / "preprocessor_config.json", layout.PREPROCESSOR_CONFIG)
    log.info("speech_tokenizer_written", path=str(out / "speech_tokenizer"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m s2s_daemon.tools.make_checkpoint", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out", type=Path, help="checkpoint folder to write")
    parser.add_argument("--size", choices=layout.SIZES, default="tiny")
    parser.add_argument("--kind", choices=layout.KINDS, default="custom_voice")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_checkpoint(args.out, args.size, args.kind, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
