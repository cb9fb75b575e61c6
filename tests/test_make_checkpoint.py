"""The random-checkpoint generator writes the official Qwen3-TTS-12Hz layout, deterministically.

The expected tensor names and shapes were recorded from the official qwen-tts 0.1.1 classes
(scripts/golden/record_expected_keys.py, run in the reference environment), so this needs no refenv.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from s2s_daemon.tools import checkpoint_layout as layout

pytestmark = pytest.mark.torch

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tiny"
EXPECTED_KEYS = FIXTURES / "expected_keys.json.gz"


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    with gzip.open(EXPECTED_KEYS, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


@pytest.fixture(scope="module")
def tiny_cv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from s2s_daemon.tools.make_checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny_cv"
    write_checkpoint(out, "tiny", "custom_voice", seed=0)
    return out


def _read(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_every_size_and_kind_has_the_official_layout(expected: dict[str, Any]) -> None:
    assert len(expected) == len(layout.SIZES) * len(layout.KINDS)
    for name, official in expected.items():
        size, kind = name.split("_", 1)
        model = {k: list(v) for k, v in layout.model_param_shapes(size, kind).items()}
        codec = {k: list(v) for k, v in layout.speech_tokenizer_param_shapes(size).items()}
        assert model == official["model"], name
        assert codec == official["speech_tokenizer"], name


def test_tiny_checkpoint_is_complete(tiny_cv: Path, expected: dict[str, Any]) -> None:
    for rel in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "vocab.json",
        "merges.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "preprocessor_config.json",
        "speech_tokenizer/config.json",
        "speech_tokenizer/model.safetensors",
        "speech_tokenizer/preprocessor_config.json",
    ):
        assert (tiny_cv / rel).is_file(), rel
    config = json.loads((tiny_cv / "config.json").read_text())
    assert config["model_type"] == "qwen3_tts"
    assert config["tts_model_type"] == "custom_voice"
    talker = config["talker_config"]
    assert talker["num_code_groups"] == 16
    assert talker["rope_scaling"]["interleaved"] is True
    assert sum(talker["rope_scaling"]["mrope_section"]) * 2 == talker["head_dim"]
    assert talker["vocab_size"] - 1024 == talker["code_predictor_config"]["vocab_size"]
    assert "ryan" in talker["spk_id"]
    st = json.loads((tiny_cv / "speech_tokenizer" / "config.json").read_text())
    dec = st["decoder_config"]
    total = 1
    for r in dec["upsample_rates"] + dec["upsampling_ratios"]:
        total *= r
    assert total == st["decode_upsample_rate"] == 1920
    assert dec["codebook_size"] == talker["code_predictor_config"]["vocab_size"]
    json.loads((tiny_cv / "generation_config.json").read_text())

    model = _read(tiny_cv / "model.safetensors")
    codec = _read(tiny_cv / "speech_tokenizer" / "model.safetensors")
    official = expected["tiny_custom_voice"]
    assert {k: list(v.shape) for k, v in model.items()} == official["model"]
    assert {k: list(v.shape) for k, v in codec.items()} == official["speech_tokenizer"]
    import torch

    assert {v.dtype for v in model.values()} == {torch.bfloat16}


def test_text_tokenizer_builds_the_prompt_the_official_code_cuts(tiny_cv: Path) -> None:
    from tokenizers import Tokenizer

    config = json.loads((tiny_cv / "config.json").read_text())
    tok = Tokenizer.from_file(str(tiny_cv / "tokenizer.json"))
    ids = tok.encode("<|im_start|>assistant\nHello there.<|im_end|>\n<|im_start|>assistant\n").ids
    head = tok.encode("<|im_start|>assistant\n").ids
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n").ids
    assert len(head) == 3
    assert len(tail) == 5
    assert ids[:3] == head
    assert ids[-5:] == tail
    assert ids[0] == config["im_start_token_id"]
    assert tail[0] == config["im_end_token_id"]
    assert len(tok.encode("<|im_start|>user\n").ids) == 3
    for key, token in (
        ("tts_pad_token_id", "<tts_pad>"),
        ("tts_bos_token_id", "<tts_text_bos>"),
        ("tts_eos_token_id", "<tts_text_eod>"),
    ):
        assert tok.token_to_id(token) == config[key]
        assert config[key] < config["talker_config"]["text_vocab_size"]
    vocab = json.loads((tiny_cv / "vocab.json").read_text())
    tokenizer_config = json.loads((tiny_cv / "tokenizer_config.json").read_text())
    assert tokenizer_config["added_tokens_decoder"][str(config["im_start_token_id"])]["content"] == "<|im_start|>"
    assert tok.token_to_id("<|endoftext|>") == len(vocab)  # specials follow the ordinary vocabulary


def test_generation_is_deterministic_for_a_seed(tiny_cv: Path, tmp_path: Path) -> None:
    from s2s_daemon.tools.make_checkpoint import write_checkpoint

    write_checkpoint(tmp_path / "again", "tiny", "custom_voice", seed=0)
    write_checkpoint(tmp_path / "other", "tiny", "custom_voice", seed=1)
    for rel in ("model.safetensors", "speech_tokenizer/model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "again" / rel).read_bytes() == (tiny_cv / rel).read_bytes(), rel
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != (tiny_cv / "model.safetensors").read_bytes()


def test_decoder_codebooks_are_random_and_not_silent(tiny_cv: Path) -> None:
    codec = _read(tiny_cv / "speech_tokenizer" / "model.safetensors")
    sums = [k for k in codec if k.endswith("_codebook.embedding_sum")]
    assert len(sums) == 16
    for key in sums:
        usage = codec[key.replace("embedding_sum", "cluster_usage")].float()
        embedding = codec[key].float() / usage.clamp(min=1e-5)[:, None]
        assert float(embedding.abs().mean()) > 0.5, key
        assert 0.7 < float(embedding.std()) < 1.3, key
        assert float((usage - 1).abs().max()) > 0.1, "the usage division must matter"
        # No two codes decode to the same vector.
        assert len({tuple(row.tolist()) for row in embedding}) == embedding.shape[0]


@pytest.mark.parametrize("kind", layout.KINDS)
def test_committed_tiny_fixtures_match_the_generator(kind: str, tmp_path: Path) -> None:
    from s2s_daemon.tools.make_checkpoint import write_checkpoint

    write_checkpoint(tmp_path / kind, "tiny", kind, seed=0)
    committed = FIXTURES / kind
    written = sorted(p.relative_to(tmp_path / kind) for p in (tmp_path / kind).rglob("*") if p.is_file())
    assert written == sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file())
    for rel in written:
        assert (tmp_path / kind / rel).read_bytes() == (committed / rel).read_bytes(), f"{kind}/{rel} is stale"


def test_real_sizes_use_the_released_ids() -> None:
    config = layout.model_config("0.6b", "custom_voice")
    assert config["im_start_token_id"] == 151644
    assert config["im_end_token_id"] == 151645
    assert (config["tts_pad_token_id"], config["tts_bos_token_id"], config["tts_eos_token_id"]) == (
        151671,
        151672,
        151673,
    )
    talker = config["talker_config"]
    assert talker["codec_eos_token_id"] == 2150
    assert talker["spk_id"]["ryan"] == 3061
    assert talker["codec_language_id"]["english"] == 2050
    tiny = layout.model_config("tiny", "custom_voice")["talker_config"]
    assert tiny["spk_id"]["ryan"] == 3061 - 1920
    assert tiny["codec_eos_token_id"] == 2150 - 1920


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(300)
def test_mlx_audio_loads_the_tiny_checkpoint_and_generates() -> None:
    pytest.importorskip("mlx_audio")
    import mlx.core as mx
    import numpy as np
    from mlx_audio.tts.utils import load_model

    model = load_model(FIXTURES / "custom_voice")
    assert model.speech_tokenizer is not None
    mx.random.seed(0)  # mlx-audio samples: random weights may end after one frame otherwise
    results = list(model.generate(text="Hello there.", voice="Ryan", lang_code="english", max_tokens=3))
    audio = np.concatenate([np.asarray(r.audio, dtype=np.float32) for r in results])
    assert audio.size >= 1920 and audio.size % 1920 == 0
    assert float(np.sqrt(np.mean(audio**2))) > 0.01
