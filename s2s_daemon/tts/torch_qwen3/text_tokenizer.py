"""The text tokenizer of a checkpoint, through the ``tokenizers`` library alone where it can be.

A Qwen2 tokenizer is wholly described by its ``tokenizer.json`` (normalizer, pre-tokenizer, BPE,
added tokens, post-processor): transformers' fast tokenizer loads that file into a
``tokenizers.Tokenizer`` and, for encoding, adds nothing that the prompt uses (no BOS or EOS for
Qwen2, special tokens in the text matched as added tokens). So the engine loads it directly and
a start neither imports transformers nor keeps its modules resident (``scripts/bench_load.py
--phases``: the ``_load_tokenizer`` step's time and RSS). A checkpoint without
``tokenizer.json`` or naming another tokenizer class still goes through transformers'
``AutoTokenizer``. ``tests/test_text_tokenizer.py`` holds the routes to the same ids.

The ``tokenizers`` library keeps the whole vocabulary twice (token to id and back, 151,643 strings
each; ``scripts/bench_memory.py`` measures what the daemon holds, docs/performance.md has its
figures). Encoding needs neither map: a byte-level BPE starts from one id per byte and merges pairs of ids by rank. So a
``tokenizer.json`` of the Qwen2 kind (NFC, the Split regex then ByteLevel, BPE without dropout or
byte fallback) is loaded into ``LeanBPETokenizer``: the 256 bytes' ids and, per merge, its pair of
ids, rank and result, in sorted arrays (a few MiB); anything else takes ``tokenizers``.
"""

from __future__ import annotations

import itertools
import json
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

QWEN2_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast", "")
"""``tokenizer_class`` values whose ``tokenizer.json`` is loaded without transformers (none named: Qwen2)."""


class FastTextTokenizer:
    """A ``tokenizers.Tokenizer`` called like a transformers tokenizer on one text: ``tok(text)["input_ids"]``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(self.tokenizer.encode(text, add_special_tokens=True).ids)}


def _byte_alphabet() -> list[str]:
    """The ByteLevel pre-tokenizer's character for each byte (GPT-2's ``bytes_to_unicode``): the
    printable Latin-1 bytes as themselves, the others from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    chars: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


class LeanBPETokenizer:
    """A Qwen2 ``tokenizer.json`` encoded without its vocabulary: text to ids as ``tokenizers``
    encodes it (added tokens matched first, leftmost and longest; NFC; the Split regex's pieces;
    each piece's UTF-8 bytes merged by rank, lowest first), called like ``FastTextTokenizer``.

    Raises ``ValueError`` for a ``tokenizer.json`` it does not describe exactly (``load_text_tokenizer``
    then takes ``tokenizers``)."""

    CACHE_WORDS = 4096
    """Pieces whose ids are kept (a daemon says the same words again)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import regex

        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
            raise ValueError("not a plain BPE model")
        if model.get("ignore_merges") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise ValueError("a BPE option the lean tokenizer does not take")
        normalizer = spec.get("normalizer")
        if normalizer not in (None, {"type": "NFC"}):
            raise ValueError(f"normalizer {normalizer!r}")
        self._nfc = normalizer is not None
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if not steps or len(steps) != 2:
            raise ValueError("not the Split + ByteLevel pre-tokenizer")
        split, level = steps
        pattern = (split.get("pattern") or {}).get("Regex")
        if split.get("type") != "Split" or not pattern or split.get("behavior") != "Isolated" or split.get("invert"):
            raise ValueError("not an isolating regex Split")
        if level.get("type") != "ByteLevel" or level.get("add_prefix_space") or level.get("use_regex"):
            raise ValueError("not a plain ByteLevel step")
        self._pieces = regex.compile(pattern)
        vocab: dict[str, int] = model["vocab"]
        self._bytes = [vocab[c] for c in _byte_alphabet()]
        merges = model["merges"]
        keys = np.empty(len(merges), dtype=np.int64)
        values = np.empty(len(merges), dtype=np.int64)
        for rank, merge in enumerate(merges):
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            keys[rank] = (vocab[left] << 32) | vocab[right]
            values[rank] = (rank << 32) | vocab[left + right]
        order = np.argsort(keys, kind="stable")
        keys, values = keys[order], values[order]
        first = np.ones(len(keys), dtype=bool)  # a pair listed twice keeps its first (lowest) rank
        first[1:] = keys[1:] != keys[:-1]
        self._keys, self._values = keys[first], values[first]
        added: dict[str, int] = {}
        for token in spec.get("added_tokens") or []:
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word") or token.get("normalized"):
                raise ValueError(f"added token {token.get('content')!r} with matching options")
            added[token["content"]] = int(token["id"])
        self._added = added
        longest_first = sorted(added, key=len, reverse=True)
        self._specials = regex.compile("(" + "|".join(regex.escape(t) for t in longest_first) + ")") if added else None
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_file(cls, path: Path) -> LeanBPETokenizer:
        return cls(json.loads(path.read_text(encoding="utf-8")))

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        parts = self._specials.split(text) if self._specials is not None else [text]
        for i, part in enumerate(parts):
            if i % 2:  # the split's captured added tokens, every other part
                ids.append(self._added[part])
                continue
            if self._nfc:
                part = unicodedata.normalize("NFC", part)
            at = 0
            for match in self._pieces.finditer(part):  # isolated: the matches and what lies between
                if match.start() > at:
                    ids.extend(self._word(part[at : match.start()]))
                if match.end() > match.start():
                    ids.extend(self._word(match.group()))
                at = match.end()
            if at < len(part):
                ids.extend(self._word(part[at:]))
        return ids

    def _word(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        symbols = [self._bytes[b] for b in piece.encode("utf-8")]
        keys, values = self._keys, self._values
        while len(symbols) > 1:
            pairs = np.array([(a << 32) | b for a, b in itertools.pairwise(symbols)], dtype=np.int64)
            at = np.minimum(np.searchsorted(keys, pairs), len(keys) - 1)
            found = keys[at] == pairs
            if not found.any():
                break
            ranks = np.where(found, values[at] >> 32, np.iinfo(np.int64).max)
            best = int(np.argmin(ranks))
            left, right, merged = symbols[best], symbols[best + 1], int(values[at[best]] & 0xFFFFFFFF)
            out: list[int] = []
            i = 0
            while i < len(symbols):  # every occurrence of the pair, left to right
                if i + 1 < len(symbols) and symbols[i] == left and symbols[i + 1] == right:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            symbols = out
        if len(self._cache) >= self.CACHE_WORDS:
            self._cache.clear()
        self._cache[piece] = symbols
        return symbols


def tokenizer_class(folder: Path) -> str:
    """``tokenizer_class`` of ``tokenizer_config.json`` ("" when the file or the key is absent)."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return ""
    return str(json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") or "")


def load_text_tokenizer(folder: Path, use_transformers: bool = False) -> Any:
    """The checkpoint's tokenizer: a ``LeanBPETokenizer`` over a Qwen2 ``tokenizer.json`` it
    describes, else a ``FastTextTokenizer`` over it, else (or with ``use_transformers``)
    transformers'. Raises OSError, ValueError, TypeError or KeyError
    when the files are missing or unreadable."""
    name = tokenizer_class(folder)
    if not use_transformers and name in QWEN2_CLASSES and (folder / "tokenizer.json").is_file():
        try:
            return LeanBPETokenizer.from_file(folder / "tokenizer.json")
        except (ValueError, KeyError, TypeError, AttributeError, ImportError):
            pass  # not one it describes (or no regex module): tokenizers' route
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
