"""glibc's thresholds once a model is loaded (``memory.loading``): temporaries of a few MiB freed
and made again, step after step, keep their pages (no page faults), on the main thread and on
another thread's arena (the engine's, the codec's)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,  # a child process: the thresholds are process-wide
    pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"),
]

CHILD = r"""
import ctypes, resource, sys, threading
from s2s_daemon.tts.torch_qwen3 import memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "loaded":
    with memory.loading():
        pass
else:  # as before: the mmap threshold fixed at 32 MiB, the trim threshold glibc's own
    libc.mallopt(memory.M_MMAP_THRESHOLD, memory.RUN_THRESHOLD)
SIZE = 8 << 20  # a step's temporary: under the mmap threshold, from the heap
def cycle():
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)
def faults(out):
    cycle()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(10):
        cycle()
    out.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 10)
main, other = [], []
faults(main)
thread = threading.Thread(target=faults, args=(other,))
thread.start()
thread.join()
print(main[0], other[0])
"""


def _faults_a_cycle(mode: str) -> tuple[float, float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    main, other = done.stdout.split()
    return float(main), float(other)


def test_after_loading_a_freed_temporary_keeps_its_pages() -> None:
    main, other = _faults_a_cycle("loaded")
    assert main < 16 and other < 16, (main, other)  # 8 MiB is 2,048 pages
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[always]" in thp.read_text():
        return  # huge pages: too few faults either way for the contrast below
    # The control: with the trim threshold as glibc leaves it, every cycle faults its pages in again.
    before_main, before_other = _faults_a_cycle("before")
    assert before_main > 1000 and before_other > 1000, (before_main, before_other)
