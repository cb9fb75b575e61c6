"""``python -m s2s_daemon.tts.torch_qwen3.native [--isa PATH]``: check the installed kernels.

Prints the library, the instruction-set paths it carries and the ones this CPU runs, and the path
``tts.torch.isa`` (``--isa``, else ``S2S_TTS__TORCH__ISA``, else ``auto``) picks, with the reason.
Compiles nothing (``pip install`` built the library). Exit status 0 when the kernels load; 1 when
they cannot (not built at install, built from other sources, a path this CPU or build lacks: the
reason is printed, and the engine would use torch's own kernels or refuse the path).
"""

from __future__ import annotations

import argparse
import os
import sys

from s2s_daemon.tts import isa as isa_paths
from s2s_daemon.tts.torch_qwen3 import native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m s2s_daemon.tts.torch_qwen3.native", description=__doc__)
    parser.add_argument("--isa", choices=isa_paths.CHOICES, default=os.environ.get("S2S_TTS__TORCH__ISA", "auto"))
    args = parser.parse_args(argv)
    reason = native.why_not_here()
    if reason is not None:
        print(f"native kernels: unavailable: {reason}", file=sys.stderr)
        return 1
    lib = native.library()
    openmp = "OpenMP threads" if lib.s2s_openmp() else "no OpenMP: one thread"
    print(f"native kernels: {native.LIBRARY} ({openmp})")
    print(f"paths: {' '.join(native.carried_paths())} (this CPU runs: {' '.join(native.runnable_paths())})")
    try:
        kernels = native.load(args.isa)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    assert kernels is not None
    print(f"runs: {kernels.isa} ({kernels.isa_reason})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
