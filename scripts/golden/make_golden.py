"""Golden reference outputs of the official qwen-tts package for the committed tiny checkpoints.

Run with the reference environment (see README.md), from the repository root:

    HF_HUB_OFFLINE=1 /work/refenv/bin/python scripts/golden/make_golden.py \
        [--fixtures tests/fixtures/qwen3_tiny] [--frames 24] [--only CASE|ref_audio ...]

For every case it loads the checkpoint with `Qwen3TTSModel.from_pretrained(dtype=float32,
attn_implementation="sdpa")`, runs the official generate_* call greedily (do_sample=False,
subtalker_dosample=False; repetition_penalty stays at generation_config's 1.05), and records what the
official code builds and produces: the prompt token ids, the talker's prefill embeddings, every
talker step's last-position logits, the code predictor's logits for frame 0, the codec codes and the
waveform. It also records, for the reference wav, the speech tokenizer encoder's codes, the speaker
encoder's mel input and the speaker embedding. Output: <fixtures>/golden/<case>.npz and
<fixtures>/golden/<case>.json (settings, texts, shapes, dtypes), plus index.json.
Fails when loading logs missing or unexpected keys.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = "Hello there, this is a test of the speech synthesis system."
REF_TEXT = "Good morning. This is a reference recording for voice cloning."
INSTRUCT = "A cheerful young woman with a bright, clear voice, speaking slowly."
REF_WAV_NAME = "ref_espeak_24k.wav"


@dataclass
class Case:
    name: str
    kind: str
    call: str
    kwargs: dict[str, Any]
    notes: str = ""
    same_as: str | None = None
    """When set, the case must reproduce that case's arrays exactly and only its .json is written."""


def cases(ref_wav: str) -> list[Case]:
    return [
        Case(
            "cv_ryan_english",
            "custom_voice",
            "generate_custom_voice",
            {"text": TEXT, "speaker": "Ryan", "language": "English"},
            "preset speaker, explicit language (think prefix), official default non_streaming_mode=True",
        ),
        Case(
            "cv_ryan_english_streaming",
            "custom_voice",
            "generate_custom_voice",
            {"text": TEXT, "speaker": "Ryan", "language": "English", "non_streaming_mode": False},
            "as cv_ryan_english but non_streaming_mode=False: only the first text token is in the prefill, "
            "the rest is added to the codec stream one token per frame (trailing_text_hidden)",
        ),
        Case(
            "cv_aiden_auto",
            "custom_voice",
            "generate_custom_voice",
            {"text": TEXT, "speaker": "Aiden", "language": "Auto"},
            "language Auto: nothink prefix [nothink, think_bos, think_eos] with no language id",
        ),
        Case(
            "cv_dylan_auto",
            "custom_voice",
            "generate_custom_voice",
            {"text": TEXT, "speaker": "Dylan", "language": "Auto"},
            "dialect speaker with Auto: the language id becomes codec_language_id['beijing_dialect']",
        ),
        Case(
            "cv_ryan_instruct_dropped",
            "custom_voice",
            "generate_custom_voice",
            {"text": TEXT, "speaker": "Ryan", "language": "English", "instruct": INSTRUCT},
            "tts_model_size is '0b6', so the official code DROPS the instruct (0.6B CustomVoice has none): "
            "identical to cv_ryan_english",
            same_as="cv_ryan_english",
        ),
        Case(
            "vd_instruct_english",
            "voice_design",
            "generate_voice_design",
            {"text": TEXT, "instruct": INSTRUCT, "language": "English"},
            "instruct prefix '<|im_start|>user\\n{instruct}<|im_end|>\\n', no speaker, "
            "official default non_streaming_mode=True",
        ),
        Case(
            "base_icl",
            "base",
            "generate_voice_clone",
            {"text": TEXT, "language": "English", "ref_audio": ref_wav, "ref_text": REF_TEXT},
            "voice clone, ICL mode: reference codes + reference transcript in the prompt, speaker embedding "
            "from the reference; official default non_streaming_mode=False; returned wav is the decode of "
            "ref+generated codes with the reference part cut off",
        ),
        Case(
            "base_xvector",
            "base",
            "generate_voice_clone",
            {"text": TEXT, "language": "English", "ref_audio": ref_wav, "x_vector_only_mode": True},
            "voice clone, x-vector-only mode: speaker embedding only, no reference codes or transcript",
        ),
    ]


def make_ref_wav(path: Path) -> None:
    """espeak-ng speech resampled by sox to 24 kHz mono 16-bit."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(raw), REF_TEXT], check=True)
        subprocess.run(["sox", str(raw), "-r", "24000", "-c", "1", "-b", "16", str(path)], check=True)


class LoadLog:
    """Collects transformers warnings while loading (missing/unexpected keys are warnings)."""

    def __init__(self) -> None:
        self.buf = io.StringIO()
        self.handler = logging.StreamHandler(self.buf)
        self.handler.setLevel(logging.WARNING)

    def __enter__(self) -> LoadLog:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_warning()
        logging.getLogger("transformers").addHandler(self.handler)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("transformers").removeHandler(self.handler)

    def check(self) -> str:
        text = self.buf.getvalue()
        for needle in ("were not initialized", "were not used", "missing", "unexpected", "mismatched"):
            if needle in text.lower():
                raise RuntimeError(f"loading logged {needle!r}:\n{text}")
        return text


def load(path: Path) -> Any:
    from qwen_tts import Qwen3TTSModel

    with LoadLog() as log:
        model = Qwen3TTSModel.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    log.check()
    model.model.eval()
    return model


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


def run_case(tts: Any, case: Case, frames: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    model = tts.model
    talker = model.talker
    cap: dict[str, Any] = {"talker_logits": [], "cp_logits": []}

    orig_generate: Callable[..., Any] = model.generate

    def model_generate(**kw: Any) -> Any:
        cap["model_generate"] = kw
        return orig_generate(**kw)

    orig_talker_generate: Callable[..., Any] = talker.generate

    def talker_generate(**kw: Any) -> Any:
        cap["talker_generate"] = kw
        return orig_talker_generate(**kw)

    def talker_hook(_m: torch.nn.Module, _i: Any, out: Any) -> None:
        cap["talker_logits"].append(out.logits[:, -1, :].detach().clone())

    def cp_hook(_m: torch.nn.Module, _i: Any, out: Any) -> None:
        if len(cap["cp_logits"]) < 15:
            cap["cp_logits"].append(out.logits[:, -1, :].detach().clone())

    model.generate = model_generate
    talker.generate = talker_generate
    h1 = talker.register_forward_hook(talker_hook)
    h2 = talker.code_predictor.register_forward_hook(cp_hook)
    settings = {
        "do_sample": False,
        "subtalker_dosample": False,
        "max_new_tokens": frames + 1,
    }
    try:
        t0 = time.perf_counter()
        wavs, sr = getattr(tts, case.call)(**case.kwargs, **settings)
        elapsed = time.perf_counter() - t0
    finally:
        h1.remove()
        h2.remove()
        del model.generate
        del talker.generate

    mg = cap["model_generate"]
    tg = cap["talker_generate"]
    arrays: dict[str, np.ndarray] = {}
    arrays["input_ids"] = _np(mg["input_ids"][0][0])
    if mg.get("instruct_ids") and mg["instruct_ids"][0] is not None:
        arrays["instruct_ids"] = _np(mg["instruct_ids"][0][0])
    if mg.get("ref_ids") and mg["ref_ids"][0] is not None:
        arrays["ref_ids"] = _np(mg["ref_ids"][0][0])
    vcp = mg.get("voice_clone_prompt")
    if vcp is not None:
        if vcp.get("ref_code") is not None and vcp["ref_code"][0] is not None:
            arrays["ref_code"] = _np(vcp["ref_code"][0])
        arrays["ref_spk_embedding"] = _np(vcp["ref_spk_embedding"][0]).astype(np.float32)
    arrays["talker_inputs_embeds"] = _np(tg["inputs_embeds"][0]).astype(np.float32)
    arrays["talker_attention_mask"] = _np(tg["attention_mask"][0])
    arrays["trailing_text_hidden"] = _np(tg["trailing_text_hidden"][0]).astype(np.float32)
    arrays["tts_pad_embed"] = _np(tg["tts_pad_embed"][0, 0]).astype(np.float32)
    logits = torch.cat(cap["talker_logits"], dim=0)
    arrays["talker_logits"] = _np(logits).astype(np.float32)
    arrays["first_step_logits"] = arrays["talker_logits"][0]
    arrays["code_predictor_logits_frame0"] = _np(torch.cat(cap["cp_logits"], dim=0)).astype(np.float32)

    arrays["wav"] = np.asarray(wavs[0], dtype=np.float32)
    meta: dict[str, Any] = {
        "case": case.name,
        "kind": case.kind,
        "call": f"Qwen3TTSModel.{case.call}",
        "kwargs": {k: v for k, v in case.kwargs.items()},
        "generation": {
            **settings,
            "frames": frames,
            "repetition_penalty": mg["repetition_penalty"],
            "top_k": mg["top_k"],
            "top_p": mg["top_p"],
            "temperature": mg["temperature"],
            "non_streaming_mode": mg["non_streaming_mode"],
            "languages": mg["languages"],
            "speakers": mg.get("speakers"),
            "talker_min_new_tokens": tg["min_new_tokens"],
            "talker_eos_token_id": tg["eos_token_id"],
            "talker_suppress_tokens": [min(tg["suppress_tokens"]), max(tg["suppress_tokens"])],
        },
        "notes": case.notes,
        "sample_rate_hz": sr,
        "elapsed_s": round(elapsed, 2),
    }
    return arrays, meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixtures", type=Path, default=Path("tests/fixtures/qwen3_tiny"))
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    out_dir = args.fixtures / "golden"
    out_dir.mkdir(parents=True, exist_ok=True)
    ref_wav = out_dir / REF_WAV_NAME
    if not ref_wav.exists():
        make_ref_wav(ref_wav)
    index: dict[str, Any] = {}
    if (out_dir / "index.json").exists():
        index = json.loads((out_dir / "index.json").read_text())
    loaded: dict[str, Any] = {}
    for case in cases(str(ref_wav)):
        if args.only and case.name not in args.only:
            continue
        if case.kind not in loaded:
            loaded[case.kind] = load(args.fixtures / case.kind)
        tts = loaded[case.kind]
        arrays, meta = run_case_with_codes(tts, case, args.frames)
        meta["arrays"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in arrays.items()}
        if case.same_as is not None:
            other = np.load(out_dir / f"{case.same_as}.npz")
            if set(other.files) != set(arrays) or any(not np.array_equal(other[k], v) for k, v in arrays.items()):
                raise RuntimeError(f"{case.name} differs from {case.same_as}")
            meta["same_as"] = case.same_as
        else:
            np.savez_compressed(out_dir / f"{case.name}.npz", **arrays)
        (out_dir / f"{case.name}.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        index[case.name] = {"kind": case.kind, "notes": case.notes}
        print(f"{case.name}: {meta['elapsed_s']} s, codes {arrays['codes'].shape}", file=sys.stderr)
    if args.only is None or "ref_audio" in args.only:
        tts = loaded.get("base") or load(args.fixtures / "base")
        arrays, meta = reference_audio_goldens(tts, ref_wav)
        np.savez_compressed(out_dir / "ref_audio.npz", **arrays)
        meta["arrays"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in arrays.items()}
        (out_dir / "ref_audio.json").write_text(json.dumps(meta, indent=2) + "\n")
        index["ref_audio"] = {"kind": "base", "notes": meta["notes"]}
    (out_dir / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return 0


def run_case_with_codes(tts: Any, case: Case, frames: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """run_case, plus the generated codes (captured at the speech tokenizer's decode call)."""
    st = tts.model.speech_tokenizer
    orig_decode: Callable[..., Any] = st.decode
    seen: list[Any] = []

    def decode(encoded: Any) -> Any:
        seen.append(encoded)
        return orig_decode(encoded)

    st.decode = decode
    try:
        arrays, meta = run_case(tts, case, frames)
    finally:
        del st.decode
    decoded_codes = _np(seen[0][0]["audio_codes"]).astype(np.int64)
    n_ref = arrays["ref_code"].shape[0] if "ref_code" in arrays else 0
    arrays["codes"] = decoded_codes[n_ref:]
    if n_ref:
        # The official clone decodes ref+generated codes and cuts the reference part off the wav;
        # also keep the plain decode of the generated codes alone.
        wavs, _ = orig_decode([{"audio_codes": torch.from_numpy(arrays["codes"])}])
        arrays["wav_codes_only"] = np.asarray(wavs[0], dtype=np.float32)
        arrays["decoder_input_codes"] = decoded_codes
    return arrays, meta


def reference_audio_goldens(tts: Any, ref_wav: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Speech tokenizer encoder codes, speaker-encoder mel and speaker embedding for the reference wav."""
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    wav, sr = sf.read(str(ref_wav), dtype="float32")
    enc = tts.model.speech_tokenizer.encode(wav, sr=sr)
    codes = _np(enc.audio_codes[0]).astype(np.int64)
    mel = mel_spectrogram(
        torch.from_numpy(wav).unsqueeze(0),
        n_fft=1024,
        num_mels=128,
        sampling_rate=24000,
        hop_size=256,
        win_size=1024,
        fmin=0,
        fmax=12000,
    ).transpose(1, 2)[0]
    emb = tts.model.extract_speaker_embedding(wav, sr)
    arrays = {
        "encoder_codes": codes,
        "speaker_mel": _np(mel).astype(np.float32),
        "speaker_embedding": _np(emb).astype(np.float32),
    }
    meta = {
        "case": "ref_audio",
        "kind": "base",
        "file": ref_wav.name,
        "text": REF_TEXT,
        "sample_rate_hz": sr,
        "samples": int(wav.shape[0]),
        "notes": f"reference wav {ref_wav.name} (espeak-ng -v en-us -s 160, sox -r 24000 -c 1 -b 16), "
        "read with soundfile as float32: "
        "Qwen3TTSTokenizer.encode(wav, sr=24000).audio_codes[0] -> encoder_codes [frames, 16]; "
        "mel_spectrogram(n_fft=1024, num_mels=128, sr=24000, hop=256, win=1024, fmin=0, fmax=12000) "
        "-> speaker_mel [frames, 128]; Qwen3TTSForConditionalGeneration.extract_speaker_embedding "
        "-> speaker_embedding [enc_dim]",
    }
    return arrays, meta


if __name__ == "__main__":
    raise SystemExit(main())
