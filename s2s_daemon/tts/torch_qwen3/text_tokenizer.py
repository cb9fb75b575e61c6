"""The text tokenizer of a checkpoint, through the ``tokenizers`` library alone where it can be.

A Qwen2 tokenizer is wholly described by its ``tokenizer.json`` (normalizer, pre-tokenizer, BPE,
added tokens, post-processor): transformers' fast tokenizer loads that file into a
``tokenizers.Tokenizer`` and, for encoding, adds nothing that the prompt uses (no BOS or EOS for
Qwen2, special tokens in the text matched as added tokens). So the engine loads it directly and
a start neither imports transformers nor keeps its modules resident (``scripts/bench_load.py
--phases``: the ``_load_tokenizer`` step's time and RSS). A checkpoint without
``tokenizer.json`` or naming another tokenizer class still goes through transformers'
``AutoTokenizer``. ``tests/test_text_tokenizer.py`` holds both routes to the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN2_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast", "")
"""``tokenizer_class`` values whose ``tokenizer.json`` is loaded without transformers (none named: Qwen2)."""


class FastTextTokenizer:
    """A ``tokenizers.Tokenizer`` called like a transformers tokenizer on one text: ``tok(text)["input_ids"]``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(self.tokenizer.encode(text, add_special_tokens=True).ids)}


def tokenizer_class(folder: Path) -> str:
    """``tokenizer_class`` of ``tokenizer_config.json`` ("" when the file or the key is absent)."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return ""
    return str(json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") or "")


def load_text_tokenizer(folder: Path, use_transformers: bool = False) -> Any:
    """The checkpoint's tokenizer: a ``FastTextTokenizer`` over ``tokenizer.json`` for Qwen2, else
    (or with ``use_transformers``) transformers'. Raises OSError, ValueError, TypeError or KeyError
    when the files are missing or unreadable."""
    name = tokenizer_class(folder)
    if not use_transformers and name in QWEN2_CLASSES and (folder / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            pass  # transformers' route below (it needs tokenizers too, and says so)
        else:
            try:
                return FastTextTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")))
            except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
                raise ValueError(f"tokenizer.json: {exc}") from exc
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(f"it needs transformers (pip install 's2s-daemon[torch]'): {exc}") from exc

    fast = getattr(transformers, "Qwen2TokenizerFast", None)  # an alias of Qwen2Tokenizer in 5.x
    if fast is not None and name in QWEN2_CLASSES:
        return fast.from_pretrained(str(folder))
    return transformers.AutoTokenizer.from_pretrained(str(folder))
