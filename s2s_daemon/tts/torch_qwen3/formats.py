"""``tts.torch.quantization: auto`` and ``dtype: auto``: the fastest weight format that keeps the
model's numbers, per device, with the reason (logged once as ``engine_format``, published in
``info``, printed by ``check-config --print``).

- CPU with the native kernels: int8 weights (one scale per output channel): decoding is bound by
  reading the weights, and int8 reads a quarter of float32's bytes while the prompt's logits stay
  close to float32's (``tests/test_torch_engine.py``'s ``test_quantized_engine`` holds them);
  int4 reads less still but puts each weight on one of 16 levels, so it stays a choice.
- CPU without them: float32 (torch's own int8 linear rounds a whole row of activations with one
  scale, too coarse).
- CUDA: bfloat16 (the checkpoints' own dtype; float32 range, tensor cores).
- MPS: float32 (float16 overflows in the talker, bfloat16 needs macOS 14); on Apple Silicon the
  ``mlx`` engine is the fast choice.

``s2s-daemon bench`` measures the formats on a machine and names the fastest (``bench/report.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FormatChoice:
    """The format the engine loads, and why."""

    dtype: str
    """Requested runtime dtype: ``float32``, ``bfloat16``, ``float16`` or as configured (``bf16``...)."""
    quantization: str
    """``none``, ``int8`` or ``int4``."""
    auto: bool
    """Chosen here (``auto``) rather than configured."""
    reason: str


def choose_format(
    device: str, dtype: str, quantization: str, kernels: str, native_reason: Callable[[], str | None]
) -> FormatChoice:
    """Resolve ``auto`` in ``dtype`` and ``quantization`` for a ``device`` type (``cpu``, ``cuda``,
    ``mps``). ``native_reason()`` says why the native CPU kernels cannot run here (None: they can);
    it is called only when the answer matters (it loads their library)."""
    dtype = (dtype or "auto").lower()
    quantization = (quantization or "auto").lower()
    auto_q, auto_d = quantization == "auto", dtype == "auto"
    if not (auto_q or auto_d):
        return FormatChoice(dtype, quantization, False, "configured")
    if device == "cuda":
        return FormatChoice(
            "bfloat16" if auto_d else dtype,
            "none" if auto_q else quantization,
            True,
            "CUDA: bfloat16, the checkpoints' own dtype (float32's range, tensor cores)",
        )
    if device == "mps":
        return FormatChoice(
            "float32" if auto_d else dtype,
            "none" if auto_q else quantization,
            True,
            "MPS: float32 (not measured: float16 can overflow in the talker, bfloat16 needs macOS 14;"
            " the mlx engine is the fast one on Apple Silicon)",
        )
    if not auto_q:  # a CPU, quantization configured, dtype auto
        return FormatChoice("float32", quantization, True, "CPU: float32 activations")
    if not auto_d:
        return FormatChoice(dtype, "none", True, f"dtype {dtype} configured: unquantized weights")
    if kernels == "torch":
        return FormatChoice("float32", "none", True, "CPU with torch's kernels (tts.torch.kernels: torch): float32")
    why = native_reason()
    if why is not None:
        return FormatChoice("float32", "none", True, f"CPU without the native kernels ({why}): float32")
    return FormatChoice(
        "float32",
        "int8",
        True,
        "CPU with the native kernels: int8 weights, one scale per output channel (a quarter of"
        " float32's bytes a frame; logits within 1 % of float32's)",
    )


def resolved(
    device: str, dtype: str, quantization: str, kernels: str, threads: int | str, isa: str = "auto"
) -> dict[str, object]:
    """What the engine would load with these ``tts.torch`` settings on this machine, without loading
    the model (``check-config --print``); the native kernels' library is opened to ask it."""
    import torch

    from s2s_daemon.tts.threads import CpuShare, affinity_cpus, ceiling_threads, cgroup_quota, wait_policy
    from s2s_daemon.tts.torch_qwen3 import native
    from s2s_daemon.tts.torch_qwen3.device import pick_device

    where = pick_device(device).type
    choice = choose_format(where, dtype, quantization, kernels, native.why_not_here)
    out: dict[str, object] = {
        "device": where,
        "dtype": choice.dtype,
        "quantization": choice.quantization,
        "chosen": "auto" if choice.auto else "configured",
        "reason": choice.reason,
    }
    if where == "cpu" and kernels != "torch":
        why = native.why_not_here()
        try:
            here = native.load(isa) if why is None else None
        except ValueError as exc:  # a configured path this build does not carry
            why = str(exc)
            here = None
        out["native_kernels"] = (
            {"isa": here.isa, "reason": here.isa_reason, "paths": " ".join(native.carried_paths())}
            if here is not None
            else {"unavailable": why}
        )
    if where == "cpu":
        share = CpuShare(affinity_cpus(), cgroup_quota())
        out["threads"] = {
            "chosen": "configured" if isinstance(threads, int) else "auto",
            "at_most": threads if isinstance(threads, int) else ceiling_threads(share, torch.get_num_threads()),
            "cpus": share.cpus,
            "cpu_quota": share.quota,
            "wait": wait_policy(),
        }
    return out
