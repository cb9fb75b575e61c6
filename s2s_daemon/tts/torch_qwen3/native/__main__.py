"""``python -m s2s_daemon.tts.torch_qwen3.native``: build (or find) the kernels and say where.

Exit status 0 when they load, or when this machine cannot run them (no C++ compiler, no ninja, no
AVX2: the reason is printed and the engine uses torch's kernels); 1 when it could but the build
failed (the compiler's last line is printed).
"""

from __future__ import annotations

import sys
import time

from s2s_daemon.logs import configure_logging
from s2s_daemon.tts.torch_qwen3 import native


def main() -> int:
    configure_logging("auto", "warning")  # this command prints its own lines
    reason = native.why_not_here()
    if reason is not None:
        print(f"native kernels: not used here ({reason}); the torch engine uses torch's own kernels")
        return 0
    folder = native.build_folder()
    if not native.is_built(folder):
        print(f"native kernels: building once, about {native.BUILD_EXPECTED_S} s, into {folder}", flush=True)
    started = time.perf_counter()
    module = native.load()
    if module is None:
        print(f"native kernels: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"native kernels: {module.__file__} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
