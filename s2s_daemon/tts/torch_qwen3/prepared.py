"""Prepared talker weights: converted once per checkpoint and format, memory-mapped afterwards.

``load_talker`` packs the talker's linears for the native kernels one at a time (read into a
buffer of their own, fused, packed, freed), so neither a float32 copy of the model nor the
checkpoint's pages stay resident, and writes the result to a cache entry
``<root>/<format>-<digest>/`` (``key.json``, ``tensors.bin``, ``index.json``). Later starts map it
and convert nothing; tensors used as stored (embedding tables, norms) are mapped from the
checkpoint itself. An entry is written by one process at a time (``build_lock``; another start
waits, bounded, and maps it), whole or not at all (temporary folder, rename); one that
fails its checks is rebuilt, one that cannot be written leaves the weights in memory: the cache
never makes loading fail. ``cache_root`` says where (``tts.options.prepared_cache``, else
``S2S_PREPARED_CACHE``); ``scripts/bench_memory.py`` measures what stays resident.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch
from torch import nn

from s2s_daemon.build_lock import BuildLockTimeout, build_lock
from s2s_daemon.progress import Progress
from s2s_daemon.tts.torch_qwen3 import native
from s2s_daemon.tts.torch_qwen3.checkpoint import (
    DTYPE_NAMES,
    DTYPES,
    IGNORED_PREFIXES,
    Stored,
    TensorFiles,
    check_tensors,
    itemsize,
    keeps_stored_dtype,
    map_file,
    tensor_view,
    weight_files,
)
from s2s_daemon.tts.torch_qwen3.config import ModelConfig
from s2s_daemon.tts.torch_qwen3.layers import fuse_projections, no_weight_init
from s2s_daemon.tts.torch_qwen3.talker import Qwen3TtsWeights, rows_by_reads, rows_in

log = structlog.get_logger(__name__)

PREPARED_VERSION = 2
"""Version of the entry layout and of what ``_prepare`` puts in it; bump with any change to either."""
ALIGN = 64
"""Byte alignment of every tensor in ``tensors.bin`` (a cache line; the kernels' loads are unaligned)."""
ENV = "S2S_PREPARED_CACHE"
OFF = ("0", "off", "false", "no", "none")
DEFAULT = ("", "1", "on", "true", "yes", "auto")
LOCK_PREFIX = ".lock-"
"""An entry's ``build_lock`` (``<root>/.lock-<entry>``): one process prepares it, a second start
waits for it and maps it; a writer killed midway leaves no lock (the kernel releases it)."""
STALE_TMP_S = 3600.0
"""Age after which a temporary folder is taken for a crashed writer's and removed."""
SUPERSEDED_UNUSED_S = 7 * 24 * 3600.0
"""An entry of the same checkpoint, format and dtype as the one a start uses, made for other
kernels or another torch (an upgrade), is removed once no start has used it for this long: an
upgrade does not leave the old entry (669 MB for the 0.6B at int8) behind for good, and two
installations that share the cache and both run keep theirs."""

_FMT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
"""Fused projections (``layers.fuse_projections``) and their parts, in ``fused_linear``'s order."""
_PARTS = ("data", "scales", "mins", "bias")


class PreparedError(Exception):
    """An entry that cannot be used (incomplete, corrupt, stale): removed and rebuilt."""


def cache_root(option: str | None) -> Path | None:
    """The cache's root folder from the option (else ``S2S_PREPARED_CACHE``); None when it is off."""
    value = (option if option is not None and option.strip() else os.environ.get(ENV, "")).strip()
    if value.lower() in OFF:
        return None
    if value.lower() in DEFAULT:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(cache) / "s2s-daemon" / "prepared"
    return Path(os.path.expanduser(value))


# --------------------------------------------------------------------------- the plan


def _sources(name: str) -> list[str]:
    """The checkpoint tensors a tensor of the fused model is made of (the parts of a fused projection)."""
    module, _, leaf = name.rpartition(".")
    for fused, parts in _FUSED.items():
        if module == fused or module.endswith("." + fused):
            base = module[: len(module) - len(fused)]
            return [f"{base}{part}.{leaf}" for part in parts]
    return [name]


def skeleton(cfg: ModelConfig) -> Qwen3TtsWeights:
    """The talker on the meta device (no memory), projections not fused yet."""
    with no_weight_init(), torch.device("meta"):
        return Qwen3TtsWeights(cfg.talker)


def _plan(weights: nn.Module, fmt: str, group: int) -> tuple[dict[str, nn.Linear], dict[str, tuple[int, ...]]]:
    """(linears to pack by path, every other tensor's name and shape) of the fused meta model."""
    linears = {
        path: m
        for path, m in weights.named_modules()
        if isinstance(m, nn.Linear) and native.packable(m.in_features, fmt, group)
    }
    owned = {f"{path}.{leaf}" for path in linears for leaf in ("weight", "bias")}
    others = {name: tuple(t.shape) for name, t in weights.state_dict().items() if name not in owned}
    return linears, others


def _target_dtype(name: str, stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """``checkpoint.cast_floating``'s rule: floating tensors in ``dtype``, except ``STORED_DTYPE_TABLES``."""
    return stored if keeps_stored_dtype(name) or not stored.is_floating_point else dtype


class _Sink(Protocol):
    def add(self, name: str, tensor: torch.Tensor) -> None: ...

    def ref(self, name: str, stored: Stored) -> None: ...


class _Scratch:
    """One growing buffer for tensors that are converted as soon as read (packing copies them)."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(0, dtype=torch.uint8)  # freed before the larger one is made
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
        return self.buf[:nbytes]


def _joined(ck: TensorFiles, names: list[str], scratch: _Scratch | None = None) -> torch.Tensor:
    """The tensors ``names`` concatenated along dim 0 (``torch.cat``), read straight into one buffer:
    ``scratch``'s when the result is consumed before the next read, else a buffer of its own."""
    parts = [ck.tensors[n] for n in names]
    first = parts[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in parts):
        return torch.cat([ck.read(n) for n in names], dim=0)
    nbytes = sum(p.nbytes for p in parts)
    buf = scratch.take(nbytes) if scratch is not None else torch.empty(nbytes, dtype=torch.uint8)
    offset = 0
    for p in parts:
        ck.read(p.name, buf[offset : offset + p.nbytes])
        offset += p.nbytes
    rows = sum(p.shape[0] for p in parts) if first.shape else 1
    return tensor_view(buf, 0, nbytes, first.dtype, (rows, *first.shape[1:]) if first.shape else ())


def _prepare(
    ck: TensorFiles, weights: nn.Module, fmt: str, group: int, dtype: torch.dtype, ext: Any, sink: _Sink
) -> dict[str, dict[str, Any]]:
    """Every tensor of the prepared talker into ``sink``, one linear at a time; returns the linears' specs.

    The same arithmetic as ``fuse_projections`` + ``native.pack_linears`` + ``cast_floating`` on a
    loaded model (concatenate in the stored dtype, then ``native._pack``; biases as float32), so the
    packed bytes are the same.
    """
    linears, others = _plan(weights, fmt, group)
    specs: dict[str, dict[str, Any]] = {}
    scratch = _Scratch()
    with Progress("preparing_weights", total=len(linears), unit="linears", fmt=fmt) as progress:
        for path, lin in linears.items():
            _prepare_linear(ck, path, lin, fmt, group, ext, sink, scratch, specs)
            progress.advance()
    for name in others:
        names = _sources(name)
        first = ck.tensors[names[0]]
        target = _target_dtype(name, first.dtype, dtype)
        if len(names) == 1 and first.dtype == target:
            sink.ref(name, first)
        else:
            sink.add(name, _joined(ck, names).to(target).contiguous())
    return specs


def _prepare_linear(
    ck: TensorFiles, path: str, lin: nn.Linear, fmt: str, group: int, ext: Any, sink: _Sink, scratch: _Scratch,
    specs: dict[str, dict[str, Any]],
) -> None:  # fmt: skip
    """One linear of ``_prepare`` into ``sink``, its spec into ``specs``."""
    names = _sources(f"{path}.weight")
    first = ck.tensors[names[0]]
    if len(names) == 1 and _FMT_DTYPES.get(fmt) == first.dtype:
        sink.ref(f"{path}.data", first)  # what _pack would return, value for value
        parts = ["data"]
    else:
        # float32 from float32 keeps the very buffer it reads (``_pack`` returns it): not the scratch
        keeps = fmt == "float32" and first.dtype == torch.float32
        w = _joined(ck, names, None if keeps else scratch)
        data, scales, mins = native._pack(w, fmt, group, ext)
        del w
        parts = []
        for part, tensor in (("data", data), ("scales", scales), ("mins", mins)):
            if tensor is not None:
                sink.add(f"{path}.{part}", tensor)
                parts.append(part)
        del data, scales, mins
    if lin.bias is not None:
        names = _sources(f"{path}.bias")
        if len(names) == 1 and ck.tensors[names[0]].dtype == torch.float32:
            sink.ref(f"{path}.bias", ck.tensors[names[0]])
        else:
            sink.add(f"{path}.bias", _joined(ck, names).float().contiguous())
        parts.append("bias")
    specs[path] = {
        "fmt": fmt,
        "group": group if fmt == "int4" else 0,
        "in": lin.in_features,
        "out": lin.out_features,
        "parts": parts,
    }


class _MemorySink:
    """Prepared tensors kept in memory (the cache is off or cannot be written)."""

    def __init__(self, ck: TensorFiles) -> None:
        self.ck = ck
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor

    def ref(self, name: str, stored: Stored) -> None:
        self.tensors[name] = self.ck.view(stored.name)


class _FileSink:
    """Prepared tensors appended to ``tensors.bin`` as they come; ``finish`` writes the index."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fh = (folder / "tensors.bin").open("wb")
        self.offset = 0
        self.entries: dict[str, dict[str, Any]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.contiguous()
        pad = -self.offset % ALIGN
        if pad:
            self.fh.write(bytes(pad))
            self.offset += pad
        nbytes = t.numel() * t.element_size()
        if nbytes:
            self.fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self.entries[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "offset": self.offset,
                              "nbytes": nbytes}  # fmt: skip
        self.offset += nbytes

    def ref(self, name: str, stored: Stored) -> None:
        shape = list(stored.shape)
        self.entries[name] = {"checkpoint": stored.name, "dtype": DTYPE_NAMES[stored.dtype], "shape": shape}

    def finish(self, specs: dict[str, dict[str, Any]], key: dict[str, Any]) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        index = {"prepared": PREPARED_VERSION, "bytes": self.offset, "tensors": self.entries, "linears": specs}
        for name, data in (("index.json", index), ("key.json", key)):
            with (self.folder / name).open("w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=None if name == "index.json" else 1, sort_keys=True)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())

    def abort(self) -> None:
        self.fh.close()


# --------------------------------------------------------------------------- entries


def cache_key(ck: TensorFiles, folder: Path, fmt: str, group: int, dtype: torch.dtype) -> dict[str, Any]:
    """What an entry depends on (see the module docstring)."""
    files = []
    for path, digest in zip(ck.files, ck.digests, strict=True):
        real = path.resolve()
        st = real.stat()
        files.append({"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": digest})
    config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    return {
        "prepared": PREPARED_VERSION,
        "files": files,
        "config_sha256": config,
        "format": fmt,
        "group": group if fmt == "int4" else 0,
        "dtype": str(dtype).removeprefix("torch."),
        "layout": native.layout_key(),
        "torch": torch.__version__,
        "device": "cpu",
    }


def entry_folder(root: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / f"{key['format']}-{digest}"


def _open_entry(folder: Path, key: dict[str, Any], ck: TensorFiles) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors mapped from the entry or the checkpoint, linear specs); PreparedError when unusable."""
    try:
        stored_key = json.loads((folder / "key.json").read_text(encoding="utf-8"))
        index = json.loads((folder / "index.json").read_text(encoding="utf-8"))
        bin_path = folder / "tensors.bin"
        size = bin_path.stat().st_size
    except (OSError, ValueError) as exc:
        raise PreparedError(f"unreadable: {exc}") from exc
    if stored_key != key:
        raise PreparedError("its key.json is not what the entry's name stands for")
    try:
        if index["prepared"] != PREPARED_VERSION:
            raise PreparedError(f"version {index['prepared']}, not {PREPARED_VERSION}")
        if int(index["bytes"]) != size:
            raise PreparedError(f"tensors.bin has {size} bytes, its index says {index['bytes']}")
        base = map_file(bin_path) if size else torch.empty(0, dtype=torch.uint8)
        tensors: dict[str, torch.Tensor] = {}
        for name, e in index["tensors"].items():
            dtype = DTYPES[e["dtype"]]
            shape = tuple(int(d) for d in e["shape"])
            if "checkpoint" in e:
                stored = ck.tensors.get(e["checkpoint"])
                if stored is None or stored.dtype != dtype or stored.shape != shape:
                    raise PreparedError(f"{name}: the checkpoint has no {e['checkpoint']} {shape} {e['dtype']}")
                tensors[name] = ck.view(stored.name)
                continue
            offset, nbytes = int(e["offset"]), int(e["nbytes"])
            item = itemsize(dtype)
            if nbytes != math.prod(shape) * item or offset < 0 or offset + nbytes > size or offset % item:
                raise PreparedError(f"{name}: {nbytes} bytes at {offset} do not hold {shape} {e['dtype']}")
            tensors[name] = tensor_view(base, offset, nbytes, dtype, shape)
        linears: dict[str, Any] = index["linears"]
    except (KeyError, TypeError, ValueError) as exc:
        raise PreparedError(f"index.json is malformed: {exc!r}") from exc
    return tensors, linears


def _assemble(
    weights: nn.Module,
    tensors: dict[str, torch.Tensor],
    specs: dict[str, Any],
    fmt: str,
    group: int,
    dtype: torch.dtype,
    ext: Any,
) -> None:
    """Put the prepared tensors into the fused meta model: ``PackedLinear``s for the linears, the
    rest assigned (not copied); PreparedError when they do not fit it."""
    linears, others = _plan(weights, fmt, group)
    if set(specs) != set(linears):
        raise PreparedError(f"{len(specs)} packed linears, the model has {len(linears)}")
    modules = dict(weights.named_modules())
    for path, lin in linears.items():
        spec = specs[path]
        want = {"fmt": fmt, "group": group if fmt == "int4" else 0, "in": lin.in_features, "out": lin.out_features}
        if any(spec.get(k) != v for k, v in want.items()):
            raise PreparedError(f"{path}: made as {spec}, the model needs {want}")
        parts = {part: tensors.get(f"{path}.{part}") for part in _PARTS}
        if (parts["bias"] is None) != (lin.bias is None) or parts["data"] is None:
            raise PreparedError(f"{path}: its tensors are missing")
        try:
            packed = native.PackedLinear.from_parts(
                fmt, parts["data"], parts["scales"], parts["mins"], parts["bias"], lin.in_features,
                lin.out_features, ext, group,
            )  # fmt: skip
        except (RuntimeError, ValueError) as exc:  # the extension's size and dtype checks
            raise PreparedError(f"{path}: {str(exc).splitlines()[0]}") from exc
        parent, _, child = path.rpartition(".")
        setattr(modules[parent], child, packed)
    state = {}
    for name, shape in others.items():
        t = tensors.get(name)
        if t is None or tuple(t.shape) != shape:
            raise PreparedError(f"{name}: {'missing' if t is None else tuple(t.shape)}, the model needs {shape}")
        if t.is_floating_point() and not keeps_stored_dtype(name) and t.dtype != dtype:
            raise PreparedError(f"{name} is {t.dtype}, the model runs in {dtype}")
        state[name] = t
    weights.load_state_dict(state, strict=True, assign=True)


def _write_entry(
    root: Path, folder: Path, key: dict[str, Any], ck: TensorFiles, cfg: ModelConfig, fmt: str, group: int,
    dtype: torch.dtype, ext: Any,
) -> None:  # fmt: skip
    """Prepare the talker into a temporary folder and rename it to ``folder`` (OSError when it cannot)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        sink = _FileSink(tmp)
        try:
            weights = skeleton(cfg)
            fuse_projections(weights)
            specs = _prepare(ck, weights, fmt, group, dtype, ext, sink)
            sink.finish(specs, key)
        except BaseException:
            sink.abort()
            raise
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "index.json").is_file():
                raise
            log.info("prepared_weights_raced", entry=str(folder))  # another process wrote it first
        else:
            _fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unchanged(files: Iterable[dict[str, Any]]) -> bool:
    for f in files:
        try:
            st = Path(f["path"]).stat()
        except OSError:
            return False
        if st.st_size != f["size"] or st.st_mtime_ns != f["mtime_ns"]:
            return False
    return True


def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two entries' keys are of the same checkpoint files, format, group, dtype and device."""
    fields = ("format", "group", "dtype", "device")
    return a.get("files") == b.get("files") and all(a.get(f) == b.get(f) for f in fields)


def touch(entry: Path) -> None:
    """Mark an entry used now (its key.json's mtime), for ``prune``'s superseded rule."""
    try:
        os.utime(entry / "key.json")
    except OSError:
        pass  # a read-only cache: its entries are never superseded by this process's


def prune(root: Path, keep: Path | None = None, key: dict[str, Any] | None = None) -> int:
    """Remove entries whose checkpoint files are gone or changed, entries that ``key`` (the entry a
    start uses, ``keep``) supersedes and that no start used for ``SUPERSEDED_UNUSED_S``, and stale
    temporary folders; returns how many."""
    removed = 0
    try:
        children = list(root.iterdir())
    except OSError:
        return 0
    now = time.time()
    for child in children:
        if child == keep or not child.is_dir():
            continue
        if child.name.startswith(".tmp-"):
            try:
                old = now - child.stat().st_mtime > STALE_TMP_S
            except OSError:
                continue
            if old:
                shutil.rmtree(child, ignore_errors=True)
                removed += 1
            continue
        try:
            stored = json.loads((child / "key.json").read_text(encoding="utf-8"))
            files = stored["files"]
            unused_s = now - (child / "key.json").stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not an entry of ours (or one being removed): left alone
        if not _unchanged(files):
            reason = "checkpoint_changed"
        elif key is not None and stored != key and _same_weights(stored, key) and unused_s > SUPERSEDED_UNUSED_S:
            reason = "superseded"
        else:
            continue
        shutil.rmtree(child, ignore_errors=True)
        log.info("prepared_weights_pruned", entry=str(child), reason=reason, unused_days=round(unused_s / 86400, 1))
        removed += 1
    return removed


def remove_entry(folder: Path) -> None:
    """Remove an entry (a process that maps it keeps its pages; the files go when it unmaps them)."""
    shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------- loading


def load_talker(
    cfg: ModelConfig, folder: Path, fmt: str, ext: Any, dtype: torch.dtype, option: str | None,
    group: int = native.INT4_GROUP,
) -> Qwen3TtsWeights:  # fmt: skip
    """The talker with packed linears in ``fmt`` and fused stacks, from the prepared cache when it
    has the entry, else prepared from the checkpoint (and written to the cache when it is on)."""
    started = time.perf_counter()
    ck = TensorFiles(weight_files(folder), lambda name: not name.startswith(IGNORED_PREFIXES))
    base = skeleton(cfg)
    check_tensors(base, ck)
    root = cache_root(option)
    weights: Qwen3TtsWeights | None = None
    source = "memory"
    entry: Path | None = None
    try:
        if root is not None:
            key = cache_key(ck, folder, fmt, group, dtype)
            entry = entry_folder(root, key)
            for attempt in ("mapped", "written"):
                if attempt == "written":
                    try:
                        with build_lock(root / f"{LOCK_PREFIX}{entry.name}", "the prepared weights") as waited:
                            if waited and entry.is_dir():
                                attempt = "mapped"  # the holder wrote it meanwhile
                            else:
                                _write_entry(root, entry, key, ck, cfg, fmt, group, dtype, ext)
                    except (OSError, BuildLockTimeout) as exc:
                        log.warning("prepared_cache_not_written", entry=str(entry), reason=str(exc))
                        break
                    if attempt == "written":
                        prune(root, keep=entry, key=key)
                elif not entry.is_dir():
                    continue
                try:
                    tensors, specs = _open_entry(entry, key, ck)
                    candidate = skeleton(cfg)
                    fuse_projections(candidate)
                    _assemble(candidate, tensors, specs, fmt, group, dtype, ext)
                except PreparedError as exc:
                    log.warning("prepared_cache_unusable", entry=str(entry), reason=str(exc), action="rebuilt")
                    remove_entry(entry)
                    continue
                weights, source = candidate, attempt
                if attempt == "mapped":
                    touch(entry)
                    prune(root, keep=entry, key=key)
                break
        if weights is None:
            weights = skeleton(cfg)
            fuse_projections(weights)
            sink = _MemorySink(ck)
            specs = _prepare(ck, weights, fmt, group, dtype, ext, sink)
            _assemble(weights, sink.tensors, specs, fmt, group, dtype, ext)
            del sink
    finally:
        ck.close()
    weights.eval()
    weights.requires_grad_(False)
    rows_in(weights, dtype)
    rows_by_reads(weights, ck)
    native.fuse_stacks(weights.talker, ext)
    native.fuse_predictor(weights.talker.code_predictor, ext)
    log.info(
        "talker_weights_ready",
        fmt=fmt,
        source=source,
        entry=str(entry) if entry is not None and source != "memory" else None,
        load_s=round(time.perf_counter() - started, 2),
    )
    return weights
