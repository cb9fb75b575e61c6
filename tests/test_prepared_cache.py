"""The prepared-weights cache (``torch_qwen3/prepared.py``): same weights and codes, keyed, never fatal, mapped.

Every test runs the native kernels on the tiny CustomVoice fixture (skipped where they cannot
be built) with the cache in a folder of its own (``prepared_cache`` engine option).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

torch = pytest.importorskip("torch")

from torch import Tensor, nn  # noqa: E402

from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine, native, prepared  # noqa: E402
from s2s_daemon.tts.torch_qwen3.checkpoint import cast_floating, load_weights  # noqa: E402
from s2s_daemon.tts.torch_qwen3.config import load_model_config  # noqa: E402
from s2s_daemon.tts.torch_qwen3.layers import fuse_projections, no_weight_init  # noqa: E402
from s2s_daemon.tts.torch_qwen3.talker import Qwen3TtsWeights  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.timeout(600),  # the first test may build the extension
    pytest.mark.usefixtures("torch_one_thread"),
]

CV = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "custom_voice"
REQUEST = SynthesisRequest(text="Hello there, this is a test.", voice="Ryan", language="english", greedy=True)
FORMATS = {"int8": ("float32", "int8"), "int4": ("float32", "int4"), "bfloat16": ("bfloat16", "none"),
           "float32": ("float32", "none")}  # fmt: skip


@pytest.fixture(scope="module")
def ext() -> Any:
    reason = native.why_not_here()
    if reason is not None:
        pytest.skip(f"native kernels cannot run here: {reason}")
    module = native.load()
    assert module is not None, native.unavailable_reason()
    return module


def _engine(model: Path, fmt: str, cache: str) -> TorchQwen3Engine:
    dtype, quantization = FORMATS[fmt]
    options = EngineOptions(model=str(model), device="cpu", dtype=dtype, quantization=quantization,
                            kernels="native", extra={"prepared_cache": cache})  # fmt: skip
    engine = TorchQwen3Engine(options)
    engine.load_blocking()
    return engine


def _load(model: Path, fmt: str, cache: str) -> tuple[Tensor, list[MutableMapping[str, Any]]]:
    """(greedy codes of 6 frames, the prepared module's log events) of a fresh engine."""
    with structlog.testing.capture_logs() as logs:
        engine = _engine(model, fmt, cache)
    try:
        codes = engine.codes_blocking(REQUEST, max_frames=6)
    finally:
        engine.close_blocking()
    return codes, [e for e in logs if e["event"].startswith(("prepared_", "talker_weights_ready"))]


def _source(events: list[MutableMapping[str, Any]]) -> str:
    return str(next(e["source"] for e in events if e["event"] == "talker_weights_ready"))


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith("."))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_warm_start_gives_the_cold_starts_codes(ext: Any, tmp_path: Path, fmt: str) -> None:
    root = tmp_path / "prepared"
    cold, cold_events = _load(CV, fmt, str(root))
    warm, warm_events = _load(CV, fmt, str(root))
    off, off_events = _load(CV, fmt, "0")
    assert (_source(cold_events), _source(warm_events), _source(off_events)) == ("written", "mapped", "memory")
    assert torch.equal(cold, warm) and torch.equal(cold, off)
    assert len(_entries(root)) == 1
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def _old_pipeline(fmt: str, ext: Any) -> nn.Module:
    """The talker as the engine made it before the cache: loaded whole, fused, packed, cast."""
    cfg = load_model_config(CV)
    with no_weight_init(), torch.device("meta"):
        weights = Qwen3TtsWeights(cfg.talker)
    load_weights(weights, CV, torch.device("cpu"), torch.float32 if fmt == "float32" else None)
    fuse_projections(weights)
    native.pack_linears(weights.talker, fmt, ext)
    cast_floating(weights, torch.float32)
    return weights


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("cache", ["memory", "file"])
def test_prepared_tensors_equal_the_whole_model_pipeline(ext: Any, tmp_path: Path, fmt: str, cache: str) -> None:
    """Byte for byte: every packed linear's data, scales, mins and bias, and every other tensor."""
    cfg = load_model_config(CV)
    option = "0" if cache == "memory" else str(tmp_path / "prepared")
    got = prepared.load_talker(cfg, CV, fmt, ext, torch.float32, option)
    if cache == "file":  # the mapped entry, not the freshly written one's first use
        got = prepared.load_talker(cfg, CV, fmt, ext, torch.float32, option)
    want = _old_pipeline(fmt, ext)
    got_modules, want_modules = dict(got.named_modules()), dict(want.named_modules())
    assert got_modules.keys() == want_modules.keys()
    packed = 0
    for path, module in want_modules.items():
        other = got_modules[path]
        assert type(other) is type(module), path
        if isinstance(module, native.PackedLinear):
            assert isinstance(other, native.PackedLinear)
            packed += 1
            for part in ("data", "scales", "mins", "bias"):
                a, b = getattr(module, part), getattr(other, part)
                assert (a is None) == (b is None), f"{path}.{part}"
                if a is not None:
                    assert a.dtype == b.dtype and torch.equal(a, b), f"{path}.{part}"
    assert packed > 0
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for name, tensor in want_state.items():
        assert got_state[name].dtype == tensor.dtype and torch.equal(got_state[name], tensor), name
    assert got.talker.model.native is not None


@pytest.mark.slow
def test_the_entry_is_keyed_by_format_checkpoint_and_layout(
    ext: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "ckpt"
    shutil.copytree(CV, model)
    root = tmp_path / "prepared"
    _, events = _load(model, "int8", str(root))
    assert _source(events) == "written"
    first = _entries(root)
    assert len(first) == 1 and first[0].name.startswith("int8-")
    key = json.loads((first[0] / "key.json").read_text())
    assert key["files"][0]["path"] == str((model / "model.safetensors").resolve())
    assert key["format"] == "int8" and key["torch"] == torch.__version__ and key["layout"] == native.layout_key()

    _, events = _load(model, "int4", str(root))  # another format: another entry beside it
    assert _source(events) == "written"
    assert len(_entries(root)) == 2

    weights = model / "model.safetensors"  # the checkpoint rewritten: its entries are stale
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    _, events = _load(model, "int8", str(root))
    assert _source(events) == "written"
    entries = _entries(root)
    assert len(entries) == 1 and entries[0] != first[0]  # both stale entries pruned

    monkeypatch.setattr(native, "PACK_LAYOUT", native.PACK_LAYOUT + 1)  # kernels that pack otherwise
    _, events = _load(model, "int8", str(root))
    assert _source(events) == "written"
    assert len(_entries(root)) == 2 and entries[0] in _entries(root)


def _age(entry: Path, days: float) -> None:
    """Make ``entry`` look last used ``days`` ago."""
    when = (entry / "key.json").stat().st_mtime - days * 86400
    os.utime(entry / "key.json", (when, when))


@pytest.mark.slow
def test_an_entry_an_upgrade_superseded_goes_once_unused_for_a_week(
    ext: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "ckpt"
    shutil.copytree(CV, model)
    root = tmp_path / "prepared"
    _load(model, "int8", str(root))
    _load(model, "int4", str(root))
    old_int8, other_format = (next(e for e in _entries(root) if e.name.startswith(f)) for f in ("int8-", "int4-"))
    monkeypatch.setattr(native, "PACK_LAYOUT", native.PACK_LAYOUT + 1)  # an upgrade's kernels
    _, events = _load(model, "int8", str(root))
    assert _source(events) == "written"
    assert len(_entries(root)) == 3  # the old entry was used just now: it stays (another install may run it)
    new_int8 = next(e for e in _entries(root) if e not in (old_int8, other_format))

    _age(old_int8, 6)
    _load(model, "int8", str(root))
    assert old_int8 in _entries(root)  # six days unused: kept

    _age(old_int8, 2)  # eight days
    _age(other_format, 8)  # as old, but another format: not superseded by an int8 start
    _age(new_int8, 3)
    _, events = _load(model, "int8", str(root))
    assert _source(events) == "mapped"
    assert _entries(root) == sorted([new_int8, other_format])
    pruned = [e for e in events if e["event"] == "prepared_weights_pruned"]
    assert [(e["entry"], e["reason"]) for e in pruned] == [(str(old_int8), "superseded")]
    # the start marked the entry it mapped used
    assert (new_int8 / "key.json").stat().st_mtime > os.path.getmtime(other_format / "key.json") + 7 * 86400


def _corrupt_bin(entry: Path) -> None:
    path = entry / "tensors.bin"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _corrupt_index(entry: Path) -> None:
    (entry / "index.json").write_text("{not json")


def _wrong_shapes(entry: Path) -> None:
    index = json.loads((entry / "index.json").read_text())
    name = next(n for n, e in index["tensors"].items() if "offset" in e and len(e["shape"]) == 1)
    index["tensors"][name]["shape"] = [index["tensors"][name]["shape"][0] // 2]
    index["tensors"][name]["nbytes"] //= 2
    (entry / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("damage", [_corrupt_bin, _corrupt_index, _wrong_shapes])
def test_a_damaged_entry_is_rebuilt_with_a_warning(ext: Any, tmp_path: Path, damage: Any) -> None:
    root = tmp_path / "prepared"
    cold, _ = _load(CV, "int4", str(root))
    damage(_entries(root)[0])
    again, events = _load(CV, "int4", str(root))
    warnings = [e for e in events if e["event"] == "prepared_cache_unusable"]
    assert warnings and warnings[0]["log_level"] == "warning"
    assert _source(events) == "written"
    assert torch.equal(cold, again)
    warm, events = _load(CV, "int4", str(root))
    assert _source(events) == "mapped" and torch.equal(cold, warm)


def test_a_cache_that_cannot_be_written_leaves_the_weights_in_memory(ext: Any, tmp_path: Path) -> None:
    root = tmp_path / "not-a-folder"
    root.write_text("a file where the cache folder would be")
    codes, events = _load(CV, "int8", str(root))
    assert [e["event"] for e in events if e["log_level"] == "warning"] == ["prepared_cache_not_written"]
    assert _source(events) == "memory"
    reference, _ = _load(CV, "int8", "off")
    assert torch.equal(codes, reference)


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    real = str(path.resolve())
    with open("/proc/self/maps", encoding="ascii", errors="replace") as fh:
        for line in fh:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps (Linux)")
def test_prepared_tensors_are_mapped_from_the_entry_not_copied(ext: Any, tmp_path: Path) -> None:
    root = tmp_path / "prepared"
    _load(CV, "int8", str(root))
    engine = _engine(CV, "int8", str(root))
    try:
        assert engine.runtime is not None
        talker = engine.runtime.talker
        entry = _entries(root)[0]
        in_entry = _mapped_ranges(entry / "tensors.bin")
        in_checkpoint = _mapped_ranges(CV / "model.safetensors")
        assert in_entry and in_checkpoint

        def mapped(t: Tensor, ranges: list[tuple[int, int]]) -> bool:
            start = t.data_ptr()
            return any(lo <= start and start + t.numel() * t.element_size() <= hi for lo, hi in ranges)

        linears = [m for m in talker.modules() if isinstance(m, native.PackedLinear)]
        assert linears
        for layer in linears:
            assert mapped(layer.data, in_entry) and layer.scales is not None and mapped(layer.scales, in_entry)
        # kept in the checkpoint's dtype: mapped from the checkpoint itself, not copied into the entry
        assert mapped(talker.model.text_embedding.weight, in_checkpoint)
    finally:
        engine.close_blocking()


def test_the_cache_root_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prepared.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = tmp_path / "xdg" / "s2s-daemon" / "prepared"
    assert prepared.cache_root(None) == default
    assert prepared.cache_root("") == default
    assert prepared.cache_root("auto") == default
    for off in ("0", "off", "False", "no"):
        assert prepared.cache_root(off) is None
    assert prepared.cache_root(str(tmp_path / "here")) == tmp_path / "here"
    monkeypatch.setenv(prepared.ENV, "0")
    assert prepared.cache_root(None) is None
    assert prepared.cache_root(str(tmp_path / "here")) == tmp_path / "here"  # the option first
    monkeypatch.setenv(prepared.ENV, str(tmp_path / "env"))
    assert prepared.cache_root("") == tmp_path / "env"


def _with_tables(folder: Path, dtype: Any, rounded_to: Any = None) -> Path:
    """A copy of the tiny CustomVoice checkpoint whose codec tables are stored in ``dtype`` (their
    values first rounded to ``rounded_to``, when given)."""
    from safetensors.torch import load_file, save_file

    from s2s_daemon.tts.torch_qwen3.checkpoint import keeps_stored_dtype

    shutil.copytree(CV, folder)
    state = load_file(str(CV / "model.safetensors"))
    tables = [name for name in state if keeps_stored_dtype(name) and "codec_embedding" in name]
    assert len(tables) == 16  # the talker's and the predictor's 15
    for name in tables:
        t = state[name].to(rounded_to) if rounded_to is not None else state[name]
        state[name] = t.to(dtype).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "float32"])
def test_codec_tables_stay_in_the_stored_dtype_and_give_the_same_codes(ext: Any, tmp_path: Path, fmt: str) -> None:
    """bfloat16 tables stay bfloat16 (mapped from the checkpoint, not widened into the entry) and
    decode exactly as the same values held in float32."""
    stored = _with_tables(tmp_path / "bf16", torch.bfloat16)
    widened = _with_tables(tmp_path / "f32", torch.float32, rounded_to=torch.bfloat16)
    root = str(tmp_path / "prepared")
    _load(stored, fmt, root)  # written; the next load maps it
    engine = _engine(stored, fmt, root)
    try:
        assert engine.runtime is not None
        model = engine.runtime.talker.model
        tables = [model.codec_embedding, *engine.runtime.talker.code_predictor.model.codec_embedding]
        assert {t.weight.dtype for t in tables} == {torch.bfloat16}
        in_checkpoint = _mapped_ranges(stored / "model.safetensors")
        assert all(any(lo <= t.weight.data_ptr() < hi for lo, hi in in_checkpoint) for t in tables), (
            "a table was copied"
        )
        codes = engine.codes_blocking(REQUEST, max_frames=6)
    finally:
        engine.close_blocking()
    index = json.loads(next(p for p in _entries(Path(root))).joinpath("index.json").read_text(encoding="utf-8"))
    assert (
        index["tensors"]["talker.model.codec_embedding.weight"]["checkpoint"] == "talker.model.codec_embedding.weight"
    )
    reference, _ = _load(widened, fmt, "0")
    assert torch.equal(codes, reference)
    if fmt == "float32":  # torch's own kernels load the tables as stored too
        torch_codes = []
        for model_folder in (stored, widened):
            options = EngineOptions(model=str(model_folder), device="cpu", dtype="float32", kernels="torch")
            plain = TorchQwen3Engine(options)
            plain.load_blocking()
            try:
                assert plain.runtime is not None
                table = plain.runtime.talker.model.codec_embedding.weight
                assert table.dtype == (torch.bfloat16 if model_folder == stored else torch.float32)
                torch_codes.append(plain.codes_blocking(REQUEST, max_frames=6))
            finally:
                plain.close_blocking()
        assert torch.equal(torch_codes[0], torch_codes[1])
