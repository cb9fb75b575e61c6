"""Run qwentts.cpp's ``convert.py`` without torch, for ``scripts/peers_prep.sh``.

``convert.py`` reads the checkpoint with ``safetensors.safe_open(framework="pt")`` and calls
``.numpy()`` / ``.float()`` on each tensor. This serves the same calls from the file itself with
numpy (a memory map of the safetensors layout: an 8-byte header length, a JSON header, the data),
so the peers' virtual environment needs no torch. bfloat16 tensors are widened to float32 exactly
(the 16 bits are the top half of a float32), so a bfloat16 checkpoint converts to the same F32 GGUF
as its float32 copy would.

    SCRATCH/venv/bin/python scripts/peers_convert.py SCRATCH/qwentts-src/convert.py

The working directory holds ``checkpoints/`` (links named as the hub's folders) and receives
``models/``.
"""

from __future__ import annotations

import json
import runpy
import struct
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import safetensors

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


class TensorArray(np.ndarray):  # type: ignore[type-arg]  # numpy's generic needs no parameters here
    """An array with the two torch methods ``convert.py`` calls."""

    def float(self) -> TensorArray:
        return np.asarray(self, dtype=np.float32).view(TensorArray)

    def numpy(self) -> np.ndarray:  # type: ignore[type-arg]
        return self.view(np.ndarray)


class NumpySafeOpen:
    """``safe_open(path, framework=..., device=...)`` read with numpy, bfloat16 widened to float32."""

    def __init__(self, path: str, framework: str = "pt", device: str = "cpu") -> None:
        self.path = Path(path)
        with self.path.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            self.header: dict[str, Any] = json.loads(fh.read(size))
        self.offset = 8 + size
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")

    def __enter__(self) -> NumpySafeOpen:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        del self.data

    def keys(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def metadata(self) -> dict[str, str] | None:
        return self.header.get("__metadata__")

    def get_tensor(self, name: str) -> TensorArray:
        entry = self.header[name]
        start, end = entry["data_offsets"]
        raw = self.data[self.offset + start : self.offset + end]
        if entry["dtype"] == "BF16":
            wide = raw.view(np.uint16).astype(np.uint32) << 16
            array = wide.view(np.float32)
        else:
            array = np.array(raw.view(_DTYPES[entry["dtype"]]))
        return array.reshape(entry["shape"]).view(TensorArray)


def main() -> int:
    if len(sys.argv) < 2:
        sys.stderr.write("usage: peers_convert.py QWENTTS_SRC/convert.py [its arguments]\n")
        return 2
    script = sys.argv[1]
    safetensors.safe_open = NumpySafeOpen  # convert.py did "from safetensors import safe_open": patched first
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
