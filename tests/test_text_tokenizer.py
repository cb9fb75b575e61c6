"""The text tokenizer without transformers gives transformers' ids; the engine loads it without transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tiny"
TEXTS = (
    "Hello there, this is a test of the speech synthesis system.",
    "<|im_start|>assistant\nGood morning!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSpeak slowly.<|im_end|>\n",
    "  leading and   repeated   spaces\tand tabs\n\n\nand newlines \r\n",
    "Numbers 1234567 and 3.14159, dates 1999-01-31, 50% off!",
    "Accents: café, naïve, Ærøskøbing; decomposed: cafe\u0301 nai\u0308ve",  # NFC folds the second pair
    "CJK: 你好\uff0c世界\u3002こんにちは\u3002안녕하세요.",  # full-width comma and stops
    "Emoji 🙂👍🏽 and symbols ©®™ → ∞ ≠ ≤",
    "Don't, can't, we'll, I'd, they've, she's, I'M",
    "<tts_pad><tts_text_bos> special tokens inside a sentence <|endoftext|>",
    "",
)


def _both(folder: Path) -> tuple[object, object]:
    from s2s_daemon.tts.torch_qwen3.text_tokenizer import LeanBPETokenizer, load_text_tokenizer

    lean = load_text_tokenizer(folder)
    assert isinstance(lean, LeanBPETokenizer)
    return lean, load_text_tokenizer(folder, use_transformers=True)


def _tokenizers_route(folder: Path) -> object:
    from tokenizers import Tokenizer

    from s2s_daemon.tts.torch_qwen3.text_tokenizer import FastTextTokenizer

    return FastTextTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")))


@pytest.mark.parametrize("kind", ["custom_voice", "base"])
def test_the_same_ids_as_transformers(kind: str) -> None:
    lean, reference = _both(FIXTURES / kind)
    fast = _tokenizers_route(FIXTURES / kind)
    for text in TEXTS:
        want = list(reference(text)["input_ids"])  # type: ignore[operator]
        assert lean(text)["input_ids"] == want, text  # type: ignore[operator]
        assert fast(text)["input_ids"] == want, text  # type: ignore[operator]


def _trained(tmp_path: Path, vocab_size: int) -> Path:
    """A byte-level BPE trained here on the repository's documents with the fixture's normalizer,
    pre-tokenizer and specials: thousands of merges (the fixtures have a few hundred), so words
    merge many times over, by ranks no hand-made list would give."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    spec = json.loads((FIXTURES / "custom_voice" / "tokenizer.json").read_text(encoding="utf-8"))
    pattern = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>"],
    )  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    corpus = [p.read_text(encoding="utf-8") for p in sorted((root / "docs").glob("*.md"))] + [*TEXTS] * 20
    tok.train_from_iterator(corpus, trainer)
    folder = tmp_path / "trained"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_the_lean_tokenizer_gives_tokenizers_ids_on_a_trained_vocabulary(tmp_path: Path) -> None:
    import random

    from s2s_daemon.tts.torch_qwen3.text_tokenizer import LeanBPETokenizer

    folder = _trained(tmp_path, 6000)
    lean = LeanBPETokenizer.from_file(folder / "tokenizer.json")
    fast = _tokenizers_route(folder)
    assert len(lean._keys) > 4000  # merges enough that words merge many times
    root = Path(__file__).resolve().parents[1]
    lines = [ln for p in sorted((root / "docs").glob("*.md")) for ln in p.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(7)
    alphabet = "aeioustrnl AEIOU0123456789.,;:!?'\"-()\n\t\r" + "éèüßøñç" + "你好世界こんにちは안녕" + "🙂👍🏽→∞"
    texts = [*TEXTS, *rng.sample(lines, 400), "a" * 50, "ab" * 40, " " * 9 + "x", "1" * 30 + "22",
             *("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(300)),
             "<|im_start|>user\n<|im_end|><|im_start|><|endoftext|>x<tts_pad>"]  # fmt: skip
    for text in texts:
        assert lean(text)["input_ids"] == fast(text)["input_ids"], text  # type: ignore[operator]


def test_a_tokenizer_json_the_lean_tokenizer_does_not_describe_takes_tokenizers(tmp_path: Path) -> None:
    from s2s_daemon.tts.torch_qwen3.text_tokenizer import FastTextTokenizer, load_text_tokenizer

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(FIXTURES / "custom_voice" / name, tmp_path)
    spec = json.loads((FIXTURES / "custom_voice" / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {"type": "NFKC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tok = load_text_tokenizer(tmp_path)
    assert isinstance(tok, FastTextTokenizer)
    assert tok("Hello there.")["input_ids"]


@pytest.mark.slow
def test_the_same_ids_as_transformers_with_the_released_vocabulary_size(tmp_path: Path) -> None:
    """The 0.6B layout's tokenizer (151,643 ordinary entries, specials from 151,643 on)."""
    from s2s_daemon.tools import checkpoint_layout as layout
    from s2s_daemon.tools.text_tokenizer import build_text_tokenizer_files

    shutil.copy(FIXTURES / "custom_voice" / "special_tokens_map.json", tmp_path)
    build_text_tokenizer_files(tmp_path, 151643, layout.TEXT_SPECIAL_TOKENS)
    fast, reference = _both(tmp_path)
    for text in TEXTS:
        ids = fast(text)["input_ids"]  # type: ignore[operator]
        assert ids == list(reference(text)["input_ids"]), text  # type: ignore[operator]
    assert fast("<|im_start|>")["input_ids"] == [151644]  # type: ignore[operator]


def test_without_tokenizer_json_transformers_reads_vocab_and_merges(tmp_path: Path) -> None:
    from s2s_daemon.tts.torch_qwen3.text_tokenizer import FastTextTokenizer, load_text_tokenizer

    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(FIXTURES / "custom_voice" / name, tmp_path)
    slow = load_text_tokenizer(tmp_path)
    assert not isinstance(slow, FastTextTokenizer)
    fast = load_text_tokenizer(FIXTURES / "custom_voice")
    text = "<|im_start|>assistant\nHello there.<|im_end|>\n"
    assert list(slow(text)["input_ids"]) == fast(text)["input_ids"]


def test_a_malformed_tokenizer_json_is_a_checkpoint_error(tmp_path: Path) -> None:
    from s2s_daemon.tts.engine import CheckpointError, EngineOptions
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine

    shutil.copy(FIXTURES / "custom_voice" / "tokenizer_config.json", tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "nonsense"}}), encoding="utf-8")
    engine = TorchQwen3Engine(EngineOptions(model=str(tmp_path)))
    with pytest.raises(CheckpointError, match="text tokenizer"):
        engine._load_tokenizer(tmp_path)


@pytest.mark.integration
def test_the_engine_loads_and_speaks_without_importing_transformers() -> None:
    """Made as the daemon makes it (the registry checks the torch extra's packages)."""
    code = (
        "import sys\n"
        "from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest\n"
        "from s2s_daemon.tts.registry import create_engine\n"
        f"e = create_engine('torch', EngineOptions(model={str(FIXTURES / 'custom_voice')!r}, device='cpu',"
        " extra={'max_frames': '2', 'prepared_cache': '0'}))\n"
        "info = e.load_blocking()\n"
        "r = SynthesisRequest(text='Hello.', voice=info.voices[0], language='english', greedy=True)\n"
        "assert sum(len(c) for c in e.synthesize_blocking(r, lambda: False)) > 0\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
