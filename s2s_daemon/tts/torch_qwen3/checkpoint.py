"""Finding a checkpoint (local folder or hub id) and loading its safetensors with strict checks."""

from __future__ import annotations

import hashlib
import io
import json
import math
import mmap
import os
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

from s2s_daemon.tts.engine import CheckpointError
from s2s_daemon.tts.hub import hub_failure

log = structlog.get_logger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
REQUIRED_FILES = ("config.json", "speech_tokenizer/config.json")
IGNORED_PREFIXES = ("speaker_encoder.",)
"""Tensors the talker does not own: the speaker encoder (Base) is loaded by ``SpeakerEncoder``."""


def resolve_checkpoint(model: str, revision: str | None) -> Path:
    """A local folder as is; otherwise a hub id through ``snapshot_download`` (honours HF_HUB_OFFLINE).

    A folder that is not a checkpoint, or a hub id the hub says does not exist, is a
    ``CheckpointError`` (the configuration is wrong); a hub that cannot be reached, or offline mode
    without a cached copy, is a ``ModelUnavailableError`` (the same configuration works later).
    """
    expanded = Path(os.path.expanduser(model))
    looks_local = model.startswith(("/", ".", "~")) or expanded.exists() or not _HUB_ID.match(model)
    if looks_local:
        if not expanded.is_dir():
            raise CheckpointError(f"checkpoint folder {model!r} does not exist")
        folder = expanded
    else:
        try:
            from huggingface_hub import constants, snapshot_download
        except ImportError as exc:  # the torch extra brings it
            raise CheckpointError(f"{model!r} is a hub id but huggingface_hub is not installed") from exc
        offline = bool(constants.HF_HUB_OFFLINE)
        try:
            folder = Path(snapshot_download(model, revision=revision, local_files_only=offline))
        except Exception as exc:  # hub errors come in many classes (OSError, ValueError, httpx's): sorted here
            raise hub_failure(model, revision, exc, offline=offline, cache=str(constants.HF_HUB_CACHE)) from exc
        log.info("checkpoint_resolved", model=model, folder=str(folder), offline=offline)
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise CheckpointError(f"checkpoint {model!r} lacks {name}")
    return folder


def weight_files(folder: Path) -> list[Path]:
    """``model.safetensors`` or the shards named by ``model.safetensors.index.json``."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{index} is unreadable: {exc}") from exc
        shards = sorted({folder / str(name) for name in mapping.values()})
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"checkpoint shard missing: {shard}")
        return shards
    raise CheckpointError(f"checkpoint {folder} has no model.safetensors")


def safetensors_header(path: Path) -> tuple[dict[str, Any], int, str]:
    """(header, offset of the data, sha256 of the header bytes) of a safetensors file.

    The header's byte ranges are checked against the file size, so a partial download fails
    clearly here, not at read time.
    """
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated (no header)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > 100_000_000:
                raise CheckpointError(f"{path} has an invalid header length {n}")
            raw = fh.read(n)
            header = json.loads(raw)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"{path} has an unreadable header: {exc}") from exc
    size = path.stat().st_size
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: header needs {8 + n + end} bytes, file has {size}")
    return header, 8 + n, hashlib.sha256(raw).hexdigest()


def safetensors_complete(path: Path) -> None:
    """Check the header's byte ranges fit the file, so a partial download fails clearly, not at read time."""
    safetensors_header(path)


# --------------------------------------------------------------------------- reading without keeping

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names."""
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def map_file(path: Path) -> torch.Tensor:
    """The whole file as a uint8 tensor over a private mapping: pages are read when touched, and
    the mapping lives as long as a tensor viewing it. Nothing writes through it."""
    with path.open("rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mm, dtype=torch.uint8)


def tensor_view(
    base: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """``nbytes`` of ``base`` from ``offset`` as a ``dtype`` tensor of ``shape`` (no copy)."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return base[offset : offset + nbytes].view(dtype).reshape(shape)


@dataclass(frozen=True, slots=True)
class Stored:
    """Where a tensor's bytes are in a safetensors file."""

    file: int
    """Index in ``TensorFiles.files``."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Offset of the data from the start of the file."""
    nbytes: int


class TensorFiles:
    """The tensors of safetensors files, known from their headers; nothing is read until asked.

    ``read`` copies a tensor into a buffer of its own with plain file reads; ``view`` maps it.
    A tensor that is converted (cast, fused, packed, relaid) should be read: the pages a mapping
    has touched stay in the process's RSS while any tensor views that mapping, although nothing
    uses them again. A tensor used as stored should be viewed: only the pages touched are resident
    (a lookup table's looked-up rows), and they are page cache, shared and dropped under pressure.
    safetensors' own ``get_tensor`` is such a view of one whole-file mapping (0.8), which is why
    loading through it kept every page read resident.
    """

    def __init__(self, files: list[Path], keep: Callable[[str], bool] = lambda name: True) -> None:
        self.files = files
        self.digests: list[str] = []
        """sha256 of each file's header."""
        self.tensors: dict[str, Stored] = {}
        for i, path in enumerate(files):
            header, base, digest = safetensors_header(path)
            self.digests.append(digest)
            size = path.stat().st_size
            for name, entry in header.items():
                if name == "__metadata__" or not keep(name):
                    continue
                bad = f"{path} is corrupt or incomplete ({size} bytes): tensor {name}"
                try:
                    dtype = DTYPES[str(entry["dtype"])]
                    shape = tuple(int(d) for d in entry["shape"])
                    begin, end = (int(o) for o in entry["data_offsets"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise CheckpointError(f"{bad}: {exc!r}") from exc
                nbytes = math.prod(shape) * itemsize(dtype)
                if begin < 0 or end - begin != nbytes or base + end > size:
                    raise CheckpointError(f"{bad} {shape} {entry['dtype']} has bytes {begin}..{end}")
                self.tensors[name] = Stored(i, name, dtype, shape, base + begin, nbytes)
        self._readers: dict[int, io.FileIO] = {}
        self._maps: dict[int, torch.Tensor] = {}

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor in a buffer of its own (or in ``into``, uint8 of its size), by plain reads:
        no mapping keeps its pages resident."""
        s = self.tensors[name]
        buf = torch.empty(s.nbytes, dtype=torch.uint8) if into is None else into
        if buf.dtype != torch.uint8 or buf.numel() != s.nbytes or not buf.is_contiguous():
            raise ValueError(f"{name} needs a contiguous uint8 buffer of {s.nbytes} bytes")
        if s.nbytes:
            path = self.files[s.file]
            try:
                fh = self._readers.get(s.file)
                if fh is None:
                    fh = self._readers[s.file] = path.open("rb", buffering=0)
                fh.seek(s.start)
                view = buf.numpy().data
                done = 0
                while done < s.nbytes:
                    got = fh.readinto(view[done:])
                    if not got:
                        raise CheckpointError(f"{path} ended inside tensor {name}")
                    done += got
            except OSError as exc:
                raise CheckpointError(f"{path} cannot be read: {exc}") from exc
        return buf.view(s.dtype).reshape(s.shape)

    def view(self, name: str) -> torch.Tensor:
        """The tensor as a view of a private mapping of its file: its pages are read when touched."""
        s = self.tensors[name]
        if s.start % itemsize(s.dtype):  # not at an aligned offset: a view of another dtype is refused
            return self.read(name)
        base = self._maps.get(s.file)
        if base is None:
            try:
                base = self._maps[s.file] = map_file(self.files[s.file])
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{self.files[s.file]} cannot be mapped: {exc}") from exc
        return tensor_view(base, s.start, s.nbytes, s.dtype, s.shape)

    def rows(self, name: str) -> FileRows:
        """The 2-D tensor ``name`` as rows read when looked up (``FileRows``)."""
        s = self.tensors[name]
        return FileRows(self.files[s.file], s.start, s.shape, s.dtype)

    def close(self) -> None:
        """Close the files ``read`` opened and forget the mappings (views keep theirs)."""
        for fh in self._readers.values():
            fh.close()
        self._readers.clear()
        self._maps.clear()


class FileRows:
    """Rows of a 2-D table in a file, read with ``pread`` when looked up: nothing of the file is
    mapped, so nothing of it counts in the process's RSS.

    A mapped table looked up row by row kept far more than its rows resident: the kernel maps the
    cached pages around each fault (``fault_around_bytes``, 64 KiB: 16 rows of the talker's tables,
    32 of the predictor's), and over a daemon's life the rows of every token and code it ever
    looked up. A lookup reads each row with one ``preadv`` (a frame looks up 16 rows).
    """

    __slots__ = ("__weakref__", "cols", "dtype", "fd", "path", "row_bytes", "rows", "start")

    def __init__(self, path: Path, start: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if len(shape) != 2:
            raise ValueError(f"a table has two dimensions, not {shape}")
        self.path = path
        self.start = start
        self.rows, self.cols = shape
        self.dtype = dtype
        self.row_bytes = self.cols * itemsize(dtype)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise CheckpointError(f"{path} cannot be opened: {exc}") from exc
        weakref.finalize(self, os.close, self.fd)

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (integers of any shape) as ``[*ids.shape, cols]``, as ``F.embedding`` gives them."""
        flat = ids.reshape(-1).tolist()
        out = torch.empty(len(flat), self.cols, dtype=self.dtype)
        raw = out.view(torch.uint8).numpy()
        for i, row in enumerate(flat):
            if not 0 <= row < self.rows:
                raise IndexError(f"row {row} is out of range for a table of {self.rows} rows")
            got = os.preadv(self.fd, [raw[i]], self.start + row * self.row_bytes)
            if got != self.row_bytes:
                raise CheckpointError(f"{self.path} ended inside row {row} of a table")
        return out.reshape(*ids.shape, self.cols)


STORED_DTYPE_TABLES = re.compile(
    r"talker\.(model\.(text|codec)_embedding|code_predictor\.model\.codec_embedding\.\d+)\.weight"
)
"""Kept in the checkpoint's dtype whatever the model dtype: the lookup tables (``talker.LookupTable``),
whose rows are cast when looked up, which is exact. The text table is 151936 x 2048 in the released
models (1.2 GB as float32); the codec tables (3072 + 15 x 2048 rows of 1024) would double in float32."""


def keeps_stored_dtype(name: str) -> bool:
    """Whether the tensor ``name`` stays in the checkpoint's dtype (``STORED_DTYPE_TABLES``)."""
    return STORED_DTYPE_TABLES.fullmatch(name) is not None


def check_tensors(weights: nn.Module, ck: TensorFiles) -> None:
    """The checkpoint's tensor names and shapes against the (unfused) model's; a CheckpointError if not equal."""
    expected = {name: tuple(t.shape) for name, t in weights.state_dict().items()}
    missing = sorted(set(expected) - set(ck.tensors))
    unexpected = sorted(set(ck.tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint tensors do not match the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''}"
            f" ({len(missing)}), unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )
    for name, shape in expected.items():
        if ck.tensors[name].shape != shape:
            raise CheckpointError(f"tensor {name} has shape {ck.tensors[name].shape}, config implies {shape}")


def load_weights(module: nn.Module, folder: Path, device: torch.device, dtype: torch.dtype | None) -> TensorFiles:
    """Load the talker tensors into ``module`` (built on the meta device) with exact name and shape checks.

    ``dtype`` None keeps every tensor in the checkpoint's dtype. Tensors are read one at a time
    into buffers of their own (``TensorFiles.read``) and converted, so the peak holds one copy of
    the model plus one tensor; only ``STORED_DTYPE_TABLES`` stay views of the file (on the CPU).
    The native CPU path does not come here: ``prepared.load_talker`` packs linear by linear.
    Returns the files read (their headers: ``talker.rows_by_reads`` reads the tables' rows from them).
    """
    files = TensorFiles(weight_files(folder), lambda name: not name.startswith(IGNORED_PREFIXES))
    check_tensors(module, files)
    expected = {name: tuple(p.shape) for name, p in module.state_dict().items()}
    state = {}
    try:
        for name in expected:
            stored = keeps_stored_dtype(name)
            t = files.view(name) if stored and device.type == "cpu" else files.read(name)
            state[name] = t.to(device=device) if dtype is None or stored else t.to(device=device, dtype=dtype)
    finally:
        files.close()
    module.load_state_dict(state, strict=True, assign=True)
    return files


def cast_floating(module: nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter and buffer of ``module`` in ``dtype``, except ``STORED_DTYPE_TABLES``."""
    for name, param in module.named_parameters():
        if not keeps_stored_dtype(name) and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    for name, buf in module.named_buffers():
        if not keeps_stored_dtype(name) and buf.is_floating_point() and buf.dtype != dtype:
            buf.data = buf.data.to(dtype)
