"""The code predictor's frame in one library call (``native.Predictor``, ``runtime.predict_frame``):
the codes and embeddings the torch-call loop makes, bit for bit, on every path this CPU runs, and
what it refuses.

The tiny fixture's predictor is 48 wide, which the kernels do not take; these tests write tiny
checkpoints whose widths they do: the predictor as wide as the talker (no projection) and half as
wide (the 1.7B's shape: a projection from the talker's width).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tools import checkpoint_layout as layout  # noqa: E402
from s2s_daemon.tools.make_checkpoint import write_checkpoint  # noqa: E402
from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine, native  # noqa: E402
from s2s_daemon.tts.torch_qwen3.config import SamplingSettings  # noqa: E402
from s2s_daemon.tts.torch_qwen3.layers import KVCache  # noqa: E402
from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(180), pytest.mark.usefixtures("torch_one_thread")]

SHAPES = {
    # talker 64 wide, predictor 64 (the 0.6B's shape: no projection)
    "same": {"cp_hidden_size": 64, "cp_intermediate_size": 128, "cp_head_dim": 16},
    # talker 128 wide, predictor 64 (the 1.7B's shape: small_to_mtp_projection)
    "projected": {"hidden_size": 128, "cp_hidden_size": 64, "cp_intermediate_size": 128, "cp_head_dim": 16},
}
FRAMES = 8


def _library_or_skip() -> None:
    if native.why_not_here() is not None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here()}")


def _runnable() -> list[str]:
    return [name for name in native.carried_paths() if name in native.runnable_paths()]


def write_fused_checkpoint(folder: Path, shape: str) -> None:
    """A tiny CustomVoice checkpoint of ``SHAPES[shape]`` in ``folder``: one whose code predictor the
    native kernels take whole (also ``test_bench_scripts``'s)."""
    name = f"tiny-{shape}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(layout.SIZE_SPECS, name, dataclasses.replace(layout.SIZE_SPECS["tiny"], **SHAPES[shape]))
        mp.setattr(layout, "SIZES", (*layout.SIZES, name))
        write_checkpoint(folder, name, "custom_voice")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A tiny CustomVoice checkpoint per shape of ``SHAPES``."""
    folders: dict[str, Path] = {}
    for shape in SHAPES:
        folders[shape] = tmp_path_factory.mktemp(f"tiny-{shape}")
        write_fused_checkpoint(folders[shape], shape)
    yield folders


def _engine(folder: Path, quantization: str, isa: str = "auto") -> TorchQwen3Engine:
    options = EngineOptions(
        model=str(folder),
        device="cpu",
        dtype="float32",
        quantization=quantization,
        kernels="native",
        isa=isa,
        # the prefix cache makes a sentence said again run its last position alone, which the
        # native products round differently from the prompt's (test_prefix_cache): off here, so
        # that both ways of predicting decode the same prompt the same way
        extra={"max_frames": str(FRAMES), "prefix_cache_rows": "0"},
    )
    engine = TorchQwen3Engine(options)
    engine.load_blocking()
    return engine


def _request(engine: TorchQwen3Engine, greedy: bool) -> SynthesisRequest:
    assert engine.info is not None
    return SynthesisRequest(text="The kettle is boiling.", voice=engine.info.voices[0], language="auto",
                            greedy=greedy, seed=11)  # fmt: skip


def _predictor(engine: TorchQwen3Engine) -> Any:
    assert engine.runtime is not None
    return engine.runtime.talker.code_predictor


def _frame_both_ways(engine: TorchQwen3Engine, greedy: bool, seed: int) -> list[tuple[Any, Any]]:
    """(codes, frame embeddings) of one frame from the same talker state and codebook 0, by the
    library's call and by the torch-call loop."""
    runtime, gen = engine.runtime, engine.gen
    assert runtime is not None and gen is not None
    cp = _predictor(engine)
    fused = cp.native
    hidden = torch.randn(1, 1, runtime.hidden, generator=torch.Generator().manual_seed(seed)) * 3
    out = []
    with torch.inference_mode():
        for way in (fused, None):
            cp.native = way
            codes = torch.zeros(runtime.groups, dtype=torch.long)
            codes[0] = seed % 100
            runtime.frame_embeds.zero_()
            generator = torch.Generator().manual_seed(seed)
            runtime.predict_frame(hidden, codes, gen.predictor, greedy, generator)
            out.append((codes, runtime.frame_embeds.clone()))
    cp.native = fused
    return out


@pytest.mark.arm64
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_call_makes_the_loops_frame_on_every_path(
    checkpoints: dict[str, Path], shape: str, quantization: str
) -> None:
    """Each path's fused frame against its own torch-call loop: the same kernels in the same order,
    so the same codes and embeddings exactly, greedy and sampled (the same uniform numbers)."""
    _library_or_skip()
    for isa in _runnable():
        engine = _engine(checkpoints[shape], quantization, isa)
        try:
            cp = _predictor(engine)
            assert cp.native is not None, f"{isa}: the predictor was not fused"
            for greedy in (True, False):
                for seed in (1, 2, 3):
                    (codes, embeds), (want_codes, want_embeds) = _frame_both_ways(engine, greedy, seed)
                    assert torch.equal(codes, want_codes), (isa, greedy, seed, codes, want_codes)
                    assert torch.equal(embeds, want_embeds), (isa, greedy, seed)
                    assert bool((codes[1:] >= 0).all()) and bool((codes[1:] < cp.lm_head[0].out_features).all())
        finally:
            engine.close_blocking()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_an_utterance_decodes_the_same_codes_either_way(checkpoints: dict[str, Path], shape: str) -> None:
    """Whole utterances (the talker fed the fused frames' embeddings), greedy and seeded sampling."""
    _library_or_skip()
    engine = _engine(checkpoints[shape], "int8")
    try:
        cp = _predictor(engine)
        fused = cp.native
        assert fused is not None
        for greedy in (True, False):
            request = _request(engine, greedy)
            got = engine.codes_blocking(request)
            cp.native = None
            want = engine.codes_blocking(request)
            cp.native = fused
            assert got.shape == (FRAMES, 16)
            assert torch.equal(got, want), greedy
        # seeds still choose: another seed, other codes
        other = engine.codes_blocking(dataclasses.replace(_request(engine, False), seed=12))
        assert not torch.equal(other, got)
    finally:
        engine.close_blocking()


def test_tables_read_from_the_checkpoint_give_what_the_tensors_hold(checkpoints: dict[str, Path]) -> None:
    """The engine's tables are read from the file a row at a time (``FileRows``); the same predictor
    over the tables' tensors (bfloat16, in memory) makes the same frame."""
    _library_or_skip()
    engine = _engine(checkpoints["projected"], "int8")
    try:
        cp = _predictor(engine)
        tables = cp.model.codec_embedding
        assert all(t.rows_from is not None for t in tables)
        assert tables[0].weight.dtype == torch.bfloat16
        from_file = cp.native
        kernels = engine.runtime.kernels if engine.runtime is not None else None
        assert kernels is not None
        in_memory = native.Predictor(kernels, from_file._stack, cp.small_to_mtp_projection, list(cp.lm_head),
                                     [t.weight.detach() for t in tables], from_file.width, 64)  # fmt: skip
        results = []
        for predictor in (from_file, in_memory):
            cp.native = predictor
            results.append(_frame_both_ways(engine, greedy=False, seed=5)[0])
        cp.native = from_file
        assert torch.equal(results[0][0], results[1][0])
        assert torch.equal(results[0][1], results[1][1])
    finally:
        engine.close_blocking()


def test_the_predictor_refuses_what_does_not_fit(checkpoints: dict[str, Path]) -> None:
    _library_or_skip()
    engine = _engine(checkpoints["projected"], "none")  # float32: a NaN input reaches the logits
    try:
        runtime = engine.runtime
        assert runtime is not None
        cp = _predictor(engine)
        fused = cp.native
        kernels = runtime.kernels
        heads, stack = list(cp.lm_head), fused._stack
        tables = [t.weight.detach() for t in cp.model.codec_embedding]
        project = cp.small_to_mtp_projection
        width = fused.width

        def build(**change: Any) -> Any:
            parts = {"project": project, "heads": heads, "tables": tables, "width": width, "rows": 4, **change}
            return native.Predictor(
                kernels, stack, parts["project"], parts["heads"], parts["tables"], parts["width"], parts["rows"]
            )

        with pytest.raises(ValueError, match="one table per head"):
            build(tables=tables[:-1])
        with pytest.raises(ValueError, match="no projection from width 128"):
            build(project=None)
        with pytest.raises(ValueError, match="table 0 is 128 x 64"):
            build(tables=[tables[0][:, :64].contiguous(), *tables[1:]])
        with pytest.raises(ValueError, match="table 2 is 100 x 128 for head 2's 128 codes"):
            build(tables=[*tables[:2], tables[2][:100].contiguous(), *tables[3:]])
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            build(tables=[tables[0].half(), *tables[1:]])
        with pytest.raises(ValueError, match="1 rows a stack call"):
            build(rows=1)

        steps, hidden, first = fused.steps, torch.randn(1, width), torch.randn(1, width)
        codes, embeds = torch.zeros(1, steps, dtype=torch.long), torch.zeros(1, steps, width)
        cache = runtime.pred_cache
        caches = [(cache.k, cache.v)]
        cos, sin = runtime.pred_cos, runtime.pred_sin
        sampling = (0.9, 50, 1.0)
        u = torch.rand(1, steps, dtype=torch.float64)

        def run(**change: Any) -> None:
            parts = {"hidden": hidden, "caches": caches, "greedy": [False], "u": u, "codes": codes, **change}
            fused.run(parts["hidden"], first, parts["caches"], cos, sin, parts["greedy"], parts["u"], sampling,
                      parts["codes"], embeds)  # fmt: skip

        with pytest.raises(ValueError, match="u must be float64"):
            run(u=u.float())
        with pytest.raises(ValueError, match="a sampled sequence needs its uniform numbers"):
            run(u=None)
        with pytest.raises(ValueError, match="codes must be int64"):
            run(codes=codes.int())
        with pytest.raises(ValueError, match="hidden must be float32"):
            run(hidden=hidden[:, :-1])
        with pytest.raises(ValueError, match="1 to 4 sequences"):
            run(caches=caches * 5, greedy=[False] * 5)
        with pytest.raises(ValueError, match="1 to 4 sequences"):
            run(greedy=[False, False])
        short = KVCache(engine.cfg.talker.predictor, steps, torch.device("cpu"), torch.float32)  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match=f"sequence 0: a KV cache of {steps} positions for {steps + 1}"):
            run(caches=[(short.k, short.v)])
        nan = torch.full((1, width), float("nan"))
        with pytest.raises(RuntimeError, match="step 0, sequence 0: logit 0 is NaN"):
            run(hidden=nan, greedy=[True], u=None)
        with pytest.raises(RuntimeError, match="step 0, sequence 0: logit 0 is NaN"):
            run(hidden=nan)
        # and then it runs on
        run()
        assert bool((codes >= 0).all()) and bool((codes < heads[0].out_features).all())
    finally:
        engine.close_blocking()


def test_a_batchs_frames_in_one_call_are_the_loops(checkpoints: dict[str, Path]) -> None:
    """Several sequences' frames in one call (``_predict_rows``: greedy and sampled sequences side
    by side, joining at different frames) give the codes the loop gives them, and each sequence's
    codes are those it gets alone."""
    _library_or_skip()
    engine = _engine(checkpoints["projected"], "int8")
    try:
        runtime, gen = engine.runtime, engine.gen
        assert runtime is not None and gen is not None
        cp = _predictor(engine)
        fused = cp.native
        assert fused is not None
        texts = ["The kettle is boiling.", "Someone is at the door.", "Lights off in the hall.", "Good night."]
        results = []
        for way in (fused, None):
            cp.native = way
            with torch.inference_mode():
                seqs, rows = [], []
                for i, text in enumerate(texts):
                    request = dataclasses.replace(_request(engine, greedy=i % 2 == 0), text=text, seed=20 + i)
                    prompt = engine.prepare(request)[0]
                    seqs.append(runtime.start(prompt, DecodeOptions(max_frames=FRAMES, greedy=request.greedy,
                                                                    seed=request.seed)))  # fmt: skip
                    rows.append([])
                for step in range(FRAMES + 2):
                    joined = seqs[: 2 + step]  # two at first, then one more a frame
                    for k, row in enumerate(runtime.step_batch(joined, gen)):
                        if row is not None:
                            rows[k].append(row.clone())
            results.append([torch.stack(r) for r in rows])
        cp.native = fused
        for got, want in zip(*results, strict=True):
            assert got.shape == (FRAMES, 16)
            assert torch.equal(got, want)
        alone = engine.codes_blocking(dataclasses.replace(_request(engine, greedy=False), text=texts[1], seed=21))
        assert torch.equal(results[0][1], alone)
    finally:
        engine.close_blocking()


def test_only_what_the_library_runs_is_fused(checkpoints: dict[str, Path]) -> None:
    """The tiny fixture's 48-wide predictor takes torch's layers: no fused frame, the loop runs;
    tables handing out bfloat16 rows are not fused either."""
    _library_or_skip()
    fixture = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "custom_voice"
    engine = _engine(fixture, "int8")
    try:
        cp = _predictor(engine)
        assert cp.model.native is None and cp.native is None
        assert engine.codes_blocking(_request(engine, True)).shape == (FRAMES, 16)
    finally:
        engine.close_blocking()
    engine = _engine(checkpoints["same"], "int8")
    try:
        cp = _predictor(engine)
        kernels = engine.runtime.kernels if engine.runtime is not None else None
        assert kernels is not None and cp.native is not None
        cp.native = None
        cp.model.codec_embedding[3].rows_dtype = torch.bfloat16
        assert not native.fuse_predictor(cp, kernels)
        assert cp.native is None
        cp.model.codec_embedding[3].rows_dtype = torch.float32
        assert native.fuse_predictor(cp, kernels)
        assert cp.native is not None
    finally:
        engine.close_blocking()


def test_sampling_settings_reach_the_library_as_choose_reads_them() -> None:
    from s2s_daemon.tts.torch_qwen3.sampling import draw_settings

    assert draw_settings(SamplingSettings(do_sample=True, temperature=0.0, top_k=7, top_p=0.5)) == (1.0, 7, 0.5)
    assert draw_settings(SamplingSettings(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)) == (0.7, 0, 1.0)
