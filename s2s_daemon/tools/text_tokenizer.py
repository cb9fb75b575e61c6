"""A small byte-level BPE text tokenizer in the Qwen2 layout, for random-weight checkpoints.

Qwen3-TTS cuts its prompt by position: `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`
must start with three tokens and end with five, and an instruct is `<|im_start|>user\\n...`. So
`assistant`, `user` and the newline are single tokens here. The ordinary vocabulary is padded with
unreachable filler entries up to `base_vocab`, so the special tokens land on fixed ids
(`base_vocab + offset`, the offsets of the released Qwen tokenizer: `<|im_start|>` is +1, `<tts_pad>` +28).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

# The Qwen2 pre-tokenizer pattern.
_QWEN2_PATTERN: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS: Final = (
    "assistant",
    "user",
    "Hello there, this is a test of the speech synthesis system.",
    "The quick brown fox jumps over the lazy dog.",
    "Please speak in a calm and warm voice.",
    "A cheerful young woman with a bright, clear voice.",
    "Speak slowly and clearly, with a friendly tone.",
    "Good morning! The weather today is sunny with a light breeze.",
    "Turn on the kitchen lights and set a timer for ten minutes.",
    "This is a reference recording for voice cloning.",
    "one two three four five six seven eight nine ten",
    "What time is it? It is half past seven in the evening.",
    "Welcome home. Your package arrived this afternoon.",
)


def _filler(i: int) -> str:
    return f"<|unused_{i}|>"


def build_text_tokenizer_files(out_dir: Path, base_vocab: int, special_tokens: tuple[str, ...]) -> dict[str, int]:
    """Write vocab.json, merges.txt, tokenizer.json, tokenizer_config.json; return special token ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    target = min(base_vocab, 480)
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The role words come first and most often, so that their merges complete within the budget.
    corpus = ["assistant user"] * 200 + [line for line in _CORPUS for _ in range(8)]
    tok.train_from_iterator(corpus, trainer)
    model: dict[str, Any] = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges: list[Any] = model["merges"]
    if len(vocab) > base_vocab:
        raise ValueError(f"trained vocab {len(vocab)} exceeds base_vocab {base_vocab}")
    for i in range(len(vocab), base_vocab):
        vocab[_filler(i)] = i
    merge_lines = [" ".join(m) if isinstance(m, list) else str(m) for m in merges]
    special = {t: base_vocab + i for i, t in enumerate(special_tokens)}

    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merge_lines) + "\n", encoding="utf-8")

    merge_pairs: list[tuple[str, str]] = []
    for line in merge_lines:
        left, right = line.split(" ", 1)
        merge_pairs.append((left, right))
    full = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs))
    full.normalizer = tok.normalizer
    full.pre_tokenizer = tok.pre_tokenizer
    full.decoder = tok.decoder
    from tokenizers import AddedToken

    full.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special_tokens])
    for t, i in special.items():
        if full.token_to_id(t) != i:
            raise ValueError(f"special token {t} got id {full.token_to_id(t)}, expected {i}")
    for word in ("assistant", "user", "\n"):
        if len(full.encode(word).ids) != 1:
            raise ValueError(f"{word!r} is not a single token")
    full.save(str(out_dir / "tokenizer.json"))

    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in special.items()
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in special_tokens if t not in ("<|endoftext|>",)],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    special_map = {
        "additional_special_tokens": config["additional_special_tokens"],
        "eos_token": {
            "content": "<|im_end|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "pad_token": {
            "content": "<|endoftext|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2), encoding="utf-8")
    return special
