"""How close the integer weight formats come to float32 on one checkpoint, in one process: the
prompt's codebook-0 logits and the first frame's code-predictor logits of each format against
float32's (correlation, RMS error as a share of float32's RMS), and the greedy codes of a whole
utterance (frames made, share of (frame, codebook) positions equal to float32's). The error of one
product, the talker's first layer's four (QKV, O, gate+up, down) on a random input with the weights
as each format stores them, is the unit the logits' error compounds from, layer after layer.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv17 --size 1.7b --kind custom_voice
    .venv/bin/python scripts/bench_quant_agreement.py ./cv17 [--formats int8,int4] [--frames 24] [--doc]

Float32 itself is checked against the official package by ``tests/test_torch_parity.py``
(``S2S_PARITY_FIXTURES``, scripts/golden/README.md). Random weights make flat logits: a near-tie
flips one code and greedy decoding follows another path from there, so the codes' share says where
they part, and the logits are the measure of the arithmetic. The frame count is the budget's
(random weights never end an utterance).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (CustomVoice)")
    parser.add_argument("--formats", default="int8,int4")
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    add_doc_arguments(parser, "quant-agreement")
    args = parser.parse_args()
    doc = doc_target(args)

    import torch

    from s2s_daemon.bench.torch_cpu import cpu_engine, sentence_request
    from s2s_daemon.tts.torch_qwen3.native import PackedLinear
    from s2s_daemon.tts.torch_qwen3.runtime import DecodeProbe

    class FirstLogits(DecodeProbe):
        def __init__(self) -> None:
            self.talker: torch.Tensor | None = None
            self.predictor: list[torch.Tensor] = []

        def talker_logits(self, step: int, logits: torch.Tensor) -> None:
            if step == 0:
                self.talker = logits[0].float().clone()

        def predictor_logits(self, frame: int, group: int, logits: torch.Tensor) -> None:
            if frame == 0:
                self.predictor.append(logits[0].float().clone())

    def first_layer(runtime: object) -> dict[str, torch.Tensor]:
        """The talker's first layer's weights as the format stores them, in float32."""
        found = {}
        for name, module in runtime.talker.model.layers[0].named_modules():  # type: ignore[attr-defined]
            if isinstance(module, PackedLinear):
                found[name] = module.dequantized().float()
            elif isinstance(module, torch.nn.Linear):
                found[name] = module.weight.detach().float()
        return found

    def run(fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        engine = cpu_engine(args.model, fmt, args.threads, max_frames=str(args.frames))
        try:
            assert engine.info is not None and engine.runtime is not None
            weights = first_layer(engine.runtime)
            request = sentence_request(engine)
            probe = FirstLogits()
            engine.runtime.probe = probe
            codes = engine.codes_blocking(request, max_frames=args.frames)
            engine.runtime.probe = None
            assert probe.talker is not None
            return probe.talker, torch.cat(probe.predictor), codes, weights
        finally:
            engine.close_blocking()

    def agreement(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
        corr = float(torch.corrcoef(torch.stack([got, want]))[0, 1])
        rms = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        return corr, rms

    formats = [f for f in args.formats.split(",") if f]
    print(machine_line(f"{args.threads} threads", f"{args.frames} frames"))

    def product_error(weights: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
        """RMS error of the first layer's products over float32's RMS, the four products pooled."""
        err = norm = 0.0
        for name, want in ref.items():
            x = torch.randn(4, want.shape[1], generator=torch.Generator().manual_seed(want.shape[1]))
            y = x @ want.T
            err += float((x @ weights[name].T - y).pow(2).sum())
            norm += float(y.pow(2).sum())
        return float((err / norm) ** 0.5)

    ref_talker, ref_pred, ref_codes, ref_weights = run("none")
    rows: list[list[object]] = []
    for fmt in formats:
        talker, pred, codes, weights = run(fmt)
        t_corr, t_rms = agreement(talker, ref_talker)
        p_corr, p_rms = agreement(pred, ref_pred)
        n = min(len(codes), len(ref_codes))
        equal = float((codes[:n] == ref_codes[:n]).float().mean()) if n else 0.0
        first = next((i for i in range(n) if not torch.equal(codes[i], ref_codes[i])), n)
        row = [fmt, f"{product_error(weights, ref_weights):.1%}", f"{t_corr:.4f}", f"{t_rms:.1%}"]
        row += [f"{p_corr:.4f}", f"{p_rms:.1%}", len(codes), len(ref_codes), f"{equal:.0%}", first]
        rows.append(row)
        print("  ".join(str(v) for v in row), flush=True)
    header = ["format", "one product RMS err", "prompt logits corr", "prompt logits RMS err"]
    header += ["predictor logits corr", "predictor RMS err"]
    header += ["frames", "float32 frames", "codes equal", "first frame that differs"]
    table = markdown_table(header, rows, align="l" + "r" * (len(header) - 1))
    print(table)
    if doc is not None:
        notes = (
            f"Model `{args.model}`, {args.threads} threads, greedy, one process. Against float32 on the same"
            " checkpoint: the prompt's codebook-0 logits and frame 0's 15 code-predictor logit vectors"
            " (correlation; RMS error over float32's RMS), and the greedy codes of a"
            f" {args.frames}-frame utterance. Random weights: flat logits, so one near-tie sends greedy"
            " decoding down another path; the logits measure the arithmetic. One product: the talker's first"
            " layer's four products on a random input, the weights as stored against float32 (the error each"
            " of the talker's layers adds, the prompt logits' error being it compounded)."
        )
        doc.publish("Integer weights against float32", table, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
