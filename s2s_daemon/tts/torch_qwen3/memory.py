"""glibc malloc settings around loading: keep a model's transient copies from staying resident.

glibc serves an allocation from the heap when it is smaller than the mmap threshold, and raises
that threshold (up to 32 MiB) every time a large mmapped block is freed. Loading frees hundreds
of tensors of a few MiB (checkpoint copies, float32 weights replaced by packed ones), so after the
first few the rest land in the heap, where freed memory stays resident: loading peaks and stays
near twice what a fixed threshold keeps (``scripts/bench_memory.py`` measures it).

``loading()`` fixes the threshold at 1 MiB while the model loads, then sets it to 32 MiB (the
dynamic maximum, so per-step temporaries of a few MiB keep coming from the heap without page
faults) and returns free heap pages to the system with ``malloc_trim``. Elsewhere than glibc
it does nothing.

A fixed mmap threshold also fixes the trim threshold, at 128 KiB unless set: each free that left
more than that at the top of a heap (the main one, and each thread's arena: the engine's, the
codec's) gave those pages back, and the next step's temporaries faulted them in again, hundreds
to thousands of page faults a frame. So the trim threshold goes to 32 MiB too: up to that much
free memory stays at the top of each heap between steps (the peak RSS is the same), and a frame
takes a tenth of the faults or fewer (``scripts/bench_trim.py`` measures both thresholds' frames,
docs/performance.md has its figures).
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog

log = structlog.get_logger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LOAD_THRESHOLD = 1 << 20
RUN_THRESHOLD = 32 << 20
"""The mmap threshold, and the trim threshold, once the model is loaded."""


def _libc() -> Any:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@contextmanager
def loading() -> Iterator[None]:
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LOAD_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, RUN_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, RUN_THRESHOLD)
            libc.malloc_trim(0)
