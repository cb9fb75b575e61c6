"""``python -m s2s_daemon.tts.torch_qwen3.native``: build (or find) the kernels and say where.

Exit status 0 when they load, or when this machine cannot run them (the reason is printed and the
engine uses torch's kernels); 1 when it could but the build failed.
"""

from __future__ import annotations

import sys
import time

from s2s_daemon.tts.torch_qwen3 import native


def main() -> int:
    reason = native.why_not_here()
    if reason is not None:
        print(f"native kernels: not used here: {reason}")
        return 0
    started = time.perf_counter()
    module = native.load()
    if module is None:
        print(f"native kernels: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"native kernels: {module.__file__} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
