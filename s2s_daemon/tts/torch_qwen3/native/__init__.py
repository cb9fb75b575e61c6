"""Native CPU linear layers: the C kernels in this folder, built at install and driven by ctypes.

Decoding is a chain of one-row products over every weight of the talker and code predictor, so
its speed is the speed at which weights stream from memory. The kernels read float32, bfloat16,
int8 (per output channel) or 4-bit (affine, per group) weights once per call and accumulate in
float32; a whole decoder stack runs one position per call (``Stack``), and the code predictor a
whole frame's codebooks (``Predictor``).

``pip install`` compiles them (``setup.py``) into ``_kernels.so``, a plain C library: no torch
headers, so any torch version loads it and pip builds it without torch. It carries every
instruction-set path of its architecture (``kernels.h``) and runs the one ``tts.torch.isa`` picks
(``auto``: the widest this CPU has; ``s2s_daemon/tts/isa.py``). Calls hand it tensors'
``data_ptr()``s; Python allocates the outputs and keeps the weights alive as long as the layers
and stacks that point at them. Its threads are OpenMP's, linked by soname to the ``libgomp.so.1``
torch loaded first: one runtime and one pool (``tts/threads.py``'s waits apply), and ctypes lets go
of the GIL for every call. Nothing compiles at run time: without the library (installed without a
compiler), or with one built from other sources, ``load()`` returns None with the reason
(``unavailable_reason()``) and the engine keeps torch's own kernels.
``scripts/bench_wide.py``, ``scripts/bench_torch.py`` and ``scripts/bench_isa.py`` measure them.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from s2s_daemon.tts import isa as isa_paths

log = structlog.get_logger(__name__)

FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}
"""Weight formats of ``PackedLinear`` and their codes in ``kernels.h``."""

INT4_GROUP = 64
"""Inputs per 4-bit group (a float32 scale and min each): 5 bits a weight (MLX's 4bit, with float16 scales: 4.5)."""

PACK_LAYOUT = 1
"""Version of what ``_pack`` writes (row pairing, nibble order, scale and min layout); bump it with
any change there. Prepared weights (``prepared.py``) are keyed by it and by the kernels' sources."""

ABI_VERSION = 3
"""``kernels.h``'s ``kAbiVersion``: the structures and functions this module calls."""

LIBRARY = Path(__file__).with_name("_kernels.so")
SOURCE_SUFFIXES = (".cpp", ".h", ".inc")
_FOLDER = Path(__file__).parent
_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)
"""The data tensor's dtype per format code."""

_lock = threading.Lock()
_state: dict[str, Any] = {}


class _Weight(ctypes.Structure):
    """``s2s::Weight``: a packed weight's format, shape and tensors."""

    _fields_ = [
        ("fmt", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    """``s2s::Layer``: one decoder layer of a ``Stack``."""

    _fields_ = [
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        ("qn", ctypes.c_void_p),
        ("kn", ctypes.c_void_p),
    ]


class _Row(ctypes.Structure):
    """``s2s::Row``: where one row of a ``Stack`` call writes and what it attends to."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("max_len", ctypes.c_int64), ("pos", ctypes.c_int64)]


class _Table(ctypes.Structure):
    """``s2s::Table``: an embedding table a ``Predictor`` looks codes up in (memory, or a file)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("offset", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
        ("fd", ctypes.c_int32),
    ]


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_F32 = ctypes.c_float
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "s2s_error": (ctypes.c_char_p, []),
    "s2s_abi_version": (ctypes.c_int, []),
    "s2s_max_rows": (_I64, []),
    "s2s_max_blocked_rows": (_I64, []),
    "s2s_source_digest": (ctypes.c_char_p, []),
    "s2s_openmp": (ctypes.c_int, []),
    "s2s_paths": (ctypes.c_char_p, []),
    "s2s_cpu_has": (ctypes.c_int, [ctypes.c_char_p]),
    "s2s_ops": (_P, [ctypes.c_char_p]),
    "s2s_check_weight": (ctypes.c_int, [_P]),
    "s2s_linear": (ctypes.c_int, [_P, _P, _P, _I64, _P, ctypes.c_int]),
    "s2s_widen": (ctypes.c_int, [_P, _P, _I64, _I64, _P, ctypes.c_int]),
    "s2s_snake": (ctypes.c_int, [_P, _P, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int]),
    "s2s_pack": (ctypes.c_int, [ctypes.c_int, _P, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int]),
    "s2s_stack_new": (_P, [_P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, ctypes.c_float]),
    "s2s_stack_free": (None, [_P]),
    "s2s_stack_run": (ctypes.c_int, [_P, _P, _I64, _P, _P, _I64, _I64, _P, _P, _P, ctypes.c_int]),
    "s2s_stack_run_rows": (ctypes.c_int, [_P, _P, _I64, _P, _P, _P, _P, ctypes.c_int]),
    "s2s_sample": (ctypes.c_int, [_P, _I64, ctypes.c_float, _I64, ctypes.c_float, ctypes.c_double, _P]),
    "s2s_predictor_new": (_P, [_P, _P, _P, _P, _I64, _I64, _I64]),
    "s2s_predictor_free": (None, [_P]),
    # predictor, n, hidden, first, caches, cos, sin, greedy, temperature, top_k, top_p, u, codes,
    # embeds, threads
    "s2s_predictor_run": (_INT, [_P, _I64, _P, _P, _P, _P, _P, _P, _F32, _I64, _F32, _P, _P, _P, _INT]),
}


def source_digest(folder: Path | None = None) -> str:
    """sha256 over the kernels' source files (names and contents, sorted by name): what the library
    was built from (``setup.py``'s ``source_digest``, compiled into it) and the prepared weights' key."""
    digest = hashlib.sha256()
    for path in sorted(p for p in (folder or _FOLDER).iterdir() if p.suffix in SOURCE_SUFFIXES):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def layout_key() -> str:
    """What packed weights depend on besides their source: ``PACK_LAYOUT`` and the kernels' sources
    (those beside this module, else the ones the library says it was built from)."""
    if "digest" not in _state:
        lib = library()
        shipped = any(_FOLDER.glob("*.cpp"))
        _state["digest"] = source_digest() if shipped or lib is None else lib.s2s_source_digest().decode()
    return f"{PACK_LAYOUT}-{_state['digest'][:16]}"


def _open_library() -> tuple[Any, str | None]:
    """(the loaded library, None) or (None, why it cannot be used)."""
    if not LIBRARY.is_file():
        return None, (
            f"the native kernels were not built at install ({LIBRARY.name} is missing: install again with a C++"
            " compiler, e.g. g++, present)"
        )
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
    except (OSError, AttributeError) as exc:
        return None, f"the native kernels do not load: {exc}"
    if lib.s2s_abi_version() != ABI_VERSION:
        return None, f"{LIBRARY} is of another version (ABI {lib.s2s_abi_version()}, expected {ABI_VERSION}): reinstall"
    built_from = lib.s2s_source_digest().decode()
    if any(_FOLDER.glob("*.cpp")) and built_from != source_digest():
        return None, (
            f"{LIBRARY} was built from other sources than the ones beside it: rebuild it (pip install -e ., or"
            " python setup.py build_ext --inplace)"
        )
    return lib, None


def library() -> Any:
    """The loaded library (once per process), or None; ``library_reason()`` says why not."""
    with _lock:
        if "library" not in _state:
            _state["library"], _state["library_reason"] = _open_library()
        return _state["library"]


def library_reason() -> str | None:
    """After ``library()``: why it returned None (None when it did not)."""
    library()
    return _state.get("library_reason")


def why_not_here() -> str | None:
    """Why this installation cannot run the native kernels at all (None: it can; loads the library)."""
    return None if library() is not None else library_reason()


def carried_paths() -> tuple[str, ...]:
    """The instruction-set paths the library carries, narrowest first (empty without it)."""
    lib = library()
    return tuple(lib.s2s_paths().decode().split()) if lib is not None else ()


def runnable_paths() -> tuple[str, ...]:
    """The paths (of ``isa.paths_of`` this architecture) this CPU can run, as the library checks
    them (cpuid, HWCAPs); ``isa.cpu_paths()`` without the library."""
    lib = library()
    if lib is None:
        return isa_paths.cpu_paths()
    arch = isa_paths.architecture()
    return tuple(name for name in isa_paths.paths_of(arch) if lib.s2s_cpu_has(name.encode()))


def load(isa: str = "auto") -> Kernels | None:
    """The kernels of the path ``isa`` (``tts.torch.isa``) picks; None when there is no library
    (``unavailable_reason(isa)`` says why). ValueError when a configured path cannot run here."""
    with _lock:
        if f"kernels:{isa}" in _state:
            return _state[f"kernels:{isa}"]  # type: ignore[no-any-return]
    lib = library()
    kernels = None
    if lib is not None:
        path, reason = isa_paths.choose(isa, carried_paths(), runnable_paths())
        kernels = Kernels(lib, path, reason)
    with _lock:
        _state[f"kernels:{isa}"] = kernels
    return kernels


def unavailable_reason(isa: str = "auto") -> str | None:
    """After ``load(isa)``: why it returned None (None when it did not)."""
    return None if _state.get(f"kernels:{isa}") is not None else library_reason()


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _check_float(t: torch.Tensor | None, numel: int, what: str) -> None:
    if t is None or t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(what)


def _weight(
    fmt: int,
    data: torch.Tensor,
    scales: torch.Tensor | None,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
    in_features: int,
    group: int,
) -> _Weight:
    """The ``s2s::Weight`` over these tensors, after checking that they hold what it says (the
    library reads as much memory as the shape promises)."""
    n, k = out_features, in_features
    if fmt not in range(len(_DTYPES)):
        raise ValueError(f"unknown weight format {fmt}")
    if k % 32 != 0 or k < 32:
        raise ValueError(f"in_features must be a multiple of 32, got {k}")
    if data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError("weight must be a contiguous CPU tensor")
    if data.dtype != _DTYPES[fmt]:
        raise ValueError(f"weight dtype {data.dtype} does not match format {fmt}")
    if data.numel() != (n * k // 2 if fmt == 3 else n * k):
        raise ValueError(f"weight has {data.numel()} elements for {n}x{k}")
    if fmt == 2:
        _check_float(scales, n, "int8 weights need float32 scales [out_features]")
    if fmt == 3:
        if group < 32 or group % 32 or k % group:
            raise ValueError(f"group size must be a multiple of 32 dividing {k}, got {group}")
        for t in (scales, mins):
            _check_float(
                t, n * (k // group), "4-bit weights need float32 scales and mins [out_features, in_features / group]"
            )
    if bias is not None:
        _check_float(bias, n, "bias must be float32 [out_features]")
    weight = _Weight(fmt, group if fmt == 3 else 0, n, k, data.data_ptr(), _ptr(scales), _ptr(mins), _ptr(bias))
    weight.tensors = (data, scales, mins)  # alive as long as the structure that points at them
    weight.bias_tensor = bias
    return weight


class Kernels:
    """One instruction-set path of the library: products, packing, SnakeBeta and ``Stack``s."""

    def __init__(self, lib: Any, isa: str, reason: str) -> None:
        self._lib = lib
        self.isa = isa
        """The path that runs: ``generic``, ``avx2``, ``avx512`` (x86-64), ``neon``... (aarch64)."""
        self.isa_reason = reason
        """Why (``auto: cpu has avx512_vnni``, ``configured``...)."""
        self._ops = lib.s2s_ops(isa.encode())
        if not self._ops:
            raise ValueError(f"tts.torch.isa: {lib.s2s_error().decode()}")
        self.MAX_STREAM_ROWS = int(lib.s2s_max_rows())
        """Input rows up to which a product streams each weight once (decoding, a batch's step)."""
        self.MAX_BLOCKED_ROWS = int(lib.s2s_max_blocked_rows())
        """Input rows up to which a product runs in the library (a register-blocked one beyond
        ``MAX_STREAM_ROWS``); beyond, blocks of widened weight rows go to ``torch.mm``."""
        self.PROMPT_ROWS = self.MAX_STREAM_ROWS + 1 if isa == "amx" else 0
        """Where a prompt's products of integer weights give other numbers than a lone row's (amx:
        bfloat16 tiles, not int8 ones), the fewest rows that take the prompt's products; 0 where
        the numbers are the same (``Stack.prompt_rows``)."""
        self._linear = lib.s2s_linear
        self._sample = lib.s2s_sample
        self._widen = lib.s2s_widen

    def __repr__(self) -> str:
        return f"Kernels(isa={self.isa!r}, library={str(LIBRARY)!r})"

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(self._lib.s2s_error().decode())

    def apply(self, weight: _Weight, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K] W^T (+ bias)`` for a checked weight (``_weight``); float32 ``[..., N]``.
        Called once per product while decoding: only cheap checks here (the weight's were made),
        and no view or reshape (a contiguous ``x`` is ``[M, K]`` in memory whatever its shape)."""
        k, n = weight.k, weight.n
        if x.dtype is not torch.float32 or not x.is_cpu:
            raise ValueError("input must be float32 on the CPU")
        if x.shape[-1] != k:
            raise ValueError(f"input has {x.shape[-1]} features, the weight takes {k}")
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.numel() // k
        if m > self.MAX_BLOCKED_ROWS:
            return self._widened_mm(weight, x.view(m, k)).view(*x.shape[:-1], n)
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        if m:
            rc = self._linear(self._ops, ctypes.addressof(weight), x.data_ptr(), m, y.data_ptr(),
                              torch.get_num_threads())  # fmt: skip
            if rc:
                self._check(rc)
        return y

    def sample(self, logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float) -> int:
        """One id drawn from float32 ``logits`` (one row, contiguous, on the CPU) as HF's sampling
        draws it: temperature, top-k (ties at the k-th kept), top-p, softmax, then ``u`` (uniform in
        [0, 1), from the caller's generator) picks it (``sampling.choose``). One call in place of the
        dozen torch operators of the same steps, each slow between the kernels' passes (their
        caches gone); ValueError where torch's draw would refuse (NaN, no finite score)."""
        if logits.dtype is not torch.float32 or not logits.is_cpu or not logits.is_contiguous():
            raise ValueError("logits must be contiguous float32 on the CPU")
        out = ctypes.c_int64()
        rc = self._sample(logits.data_ptr(), logits.numel(), temperature, top_k, top_p, u, ctypes.byref(out))
        if rc:
            raise ValueError(self._lib.s2s_error().decode())
        return out.value

    def _widened_mm(self, weight: _Weight, rows: torch.Tensor) -> torch.Tensor:
        """Longer inputs: a block of weight rows (4 MiB) widened into a float32 buffer by the library,
        multiplied by ``torch.mm`` into the transposed output (a contiguous slice), and again."""
        n, k, m = weight.n, weight.k, rows.shape[0]
        block = min(n, max(16, (1 << 20) // k))
        buf = torch.empty((block, k), dtype=torch.float32)
        out_t = torch.empty((n, m), dtype=torch.float32)
        xt = rows.t()
        for b0 in range(0, n, block):
            nb = min(block, n - b0)
            self._check(
                self._widen(self._ops, ctypes.addressof(weight), b0, b0 + nb, buf.data_ptr(), torch.get_num_threads())
            )
            torch.mm(buf[:nb], xt, out=out_t[b0 : b0 + nb])
        out = out_t.t().contiguous()
        if weight.bias_tensor is not None:
            out.add_(weight.bias_tensor)
        return out

    def linear(
        self,
        x: torch.Tensor,
        fmt: int,
        weight: torch.Tensor,
        scales: torch.Tensor | None,
        mins: torch.Tensor | None,
        out_features: int,
        group: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x W^T (+ bias)`` for a weight in format code ``fmt`` (``FORMATS``), checked per call."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError("input must be float32 on the CPU")
        w = _weight(fmt, weight, scales, mins, bias, out_features, x.shape[-1], group)
        return self.apply(w, x)

    def widen(self, weight: _Weight) -> torch.Tensor:
        """The whole weight as float32 ``[out, in]``, as the kernels compute with it."""
        out = torch.empty((weight.n, weight.k), dtype=torch.float32)
        self._check(
            self._widen(self._ops, ctypes.addressof(weight), 0, weight.n, out.data_ptr(), torch.get_num_threads())
        )
        return out

    def dequantize(
        self,
        fmt: int,
        weight: torch.Tensor,
        scales: torch.Tensor | None,
        mins: torch.Tensor | None,
        out_features: int,
        in_features: int,
        group: int,
    ) -> torch.Tensor:
        """A packed weight as float32 ``[out, in]`` (tests and diagnostics)."""
        return self.widen(_weight(fmt, weight, scales, mins, None, out_features, in_features, group))

    def pack(self, fmt: int, w: torch.Tensor, group: int) -> list[torch.Tensor]:
        """A float32 weight ``[N, K]`` in an integer format, in one pass: int8 ``[data, scales]``,
        int4 ``[data, scales, mins]``, as ``_pack_reference`` makes them (``PACK_LAYOUT``)."""
        if fmt not in (2, 3):
            raise ValueError("pack makes the integer formats (2, 3)")
        if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
            raise ValueError("weight must be float32 [out_features, in_features] on the CPU")
        w = w.contiguous()
        n, k = w.shape
        if k % 32:
            raise ValueError(f"in_features must be a multiple of 32, got {k}")
        if fmt == 2:
            parts = [torch.empty(n * k, dtype=torch.int8), torch.empty(n, dtype=torch.float32)]
        else:
            if group < 32 or group % 32 or k % group:
                raise ValueError(f"group size must be a multiple of 32 dividing {k}, got {group}")
            groups = n * (k // group)
            parts = [torch.empty(n * k // 2, dtype=torch.uint8), torch.empty(groups), torch.empty(groups)]
        self._check(
            self._lib.s2s_pack(
                fmt,
                w.data_ptr(),
                n,
                k,
                group,
                *(p.data_ptr() for p in parts),
                *([None] if fmt == 2 else []),
                torch.get_num_threads(),
            )
        )
        return parts

    def snake(self, x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
        """SnakeBeta over float32 ``x [B, C, T]``: ``x + inv_beta[c] * sin(x * alpha[c])^2``."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 3:
            raise ValueError("x must be float32 [batch, channels, time] on the CPU")
        b, c, t = x.shape
        _check_float(alpha, c, "alpha and inv_beta must be float32 [channels]")
        _check_float(inv_beta, c, "alpha and inv_beta must be float32 [channels]")
        x = x.contiguous()
        y = torch.empty_like(x)
        self._check(
            self._lib.s2s_snake(
                self._ops,
                x.data_ptr(),
                b,
                c,
                t,
                alpha.data_ptr(),
                inv_beta.data_ptr(),
                y.data_ptr(),
                torch.get_num_threads(),
            )
        )
        return y

    def stack(
        self,
        layers: Sequence[tuple[PackedLinear, PackedLinear, PackedLinear, PackedLinear, Sequence[torch.Tensor]]],
        norm: torch.Tensor,
        dims: StackDims,
    ) -> Stack:
        """A ``Stack`` over these layers: (qkv, o, gate_up, down, [input, post-attention, q, k norms])."""
        return Stack(self, layers, norm, dims)


class StackDims:
    """A decoder stack's shape."""

    __slots__ = ("eps", "head_dim", "heads", "hidden", "intermediate", "kv_heads")

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float) -> None:
        self.hidden, self.heads, self.kv_heads = hidden, heads, kv_heads
        self.head_dim, self.intermediate, self.eps = head_dim, intermediate, eps


class Stack:
    """A whole decoder stack in one library call per position (``stack.inc``): its layers' packed
    weights, kept alive here, and an opaque handle the library made from their pointers."""

    def __init__(
        self,
        kernels: Kernels,
        layers: Sequence[tuple[PackedLinear, PackedLinear, PackedLinear, PackedLinear, Sequence[torch.Tensor]]],
        norm: torch.Tensor,
        dims: StackDims,
    ) -> None:
        lib = kernels._lib
        self._lib = lib
        self.dims = dims
        self.layers = len(layers)
        keep: list[Any] = [norm]
        table = (_Layer * len(layers))()
        for i, (qkv, o, gate_up, down, norms) in enumerate(layers):
            if len(norms) != 4:
                raise ValueError("each layer needs its input, post-attention, q and k norms")
            for t in norms:
                if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                    raise ValueError("norm weights must be float32")
            _check_float(norms[0], dims.hidden, "norm weights must be float32 [hidden]")
            _check_float(norms[1], dims.hidden, "norm weights must be float32 [hidden]")
            _check_float(norms[2], dims.head_dim, "norm weights must be float32 [head_dim]")
            _check_float(norms[3], dims.head_dim, "norm weights must be float32 [head_dim]")
            table[i] = _Layer(
                qkv.weight_struct,
                o.weight_struct,
                gate_up.weight_struct,
                down.weight_struct,
                *(t.data_ptr() for t in norms),
            )
            keep.extend([qkv, o, gate_up, down, *norms])
        _check_float(norm, dims.hidden, "the final norm must be float32 [hidden]")
        handle = lib.s2s_stack_new(
            kernels._ops,
            ctypes.addressof(table),
            len(layers),
            norm.data_ptr(),
            dims.hidden,
            dims.heads,
            dims.kv_heads,
            dims.head_dim,
            dims.intermediate,
            dims.eps,
        )
        if not handle:
            raise ValueError(lib.s2s_error().decode())
        self._handle = handle
        self._keep = keep
        self._hidden, self._kv_heads, self._head_dim = dims.hidden, dims.kv_heads, dims.head_dim
        self.prompt_rows = kernels.PROMPT_ROWS if any(layer[0].fmt in ("int8", "int4") for layer in layers) else 0
        """Positions of a prompt that run together at least (``runtime``'s ``_run_prompt``): where the
        prompt's products give other numbers than a lone row's (``Kernels.PROMPT_ROWS``), a
        position's numbers would otherwise depend on how much of its prompt was kept, and the same
        request said again would not give the same codes; 0 where they do not."""
        self.max_rows = kernels.MAX_BLOCKED_ROWS
        """Positions a call takes: up to ``kernels.MAX_STREAM_ROWS`` stream each weight once, more (a
        prompt) run the register-blocked products (integer weights: the same kernels on tiles of
        weight rows held in cache)."""
        self._run = lib.s2s_stack_run
        self._run_rows = lib.s2s_stack_run_rows
        weakref.finalize(self, lib.s2s_stack_free, handle)

    def _check_x(self, x: torch.Tensor) -> int:
        shape = x.shape
        if x.dtype is not torch.float32 or not x.is_cpu or len(shape) != 3 or shape[0] != 1 or shape[2] != self._hidden:
            raise ValueError(f"x must be float32 [1, T <= {self.max_rows}, {self._hidden}] on the CPU")
        return int(shape[1])

    def _check_cache(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A cache's shape, dtype and layout (the library writes into it at the rows' positions)."""
        shape = k.shape
        if (
            len(shape) != 5
            or shape[0] < self.layers
            or shape[2] != self._kv_heads
            or shape[4] != self._head_dim
            or v.shape != shape
            or k.dtype is not torch.float32
            or v.dtype is not torch.float32
            or not (k.is_cpu and v.is_cpu and k.is_contiguous() and v.is_contiguous())
        ):
            raise ValueError("KV cache must be float32 [layers, 1, kv_heads, max_len, head_dim]")

    def _check_rope(self, cos: torch.Tensor, sin: torch.Tensor, t: int) -> None:
        n = t * self.dims.head_dim
        _check_float(cos, n, "cos/sin must be float32 [T, head_dim]")
        _check_float(sin, n, "cos/sin must be float32 [T, head_dim]")

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(self._lib.s2s_error().decode())

    def run(
        self,
        x: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        """x ``[1, T, hidden]`` at positions start..start+T-1 (T <= ``max_rows``, causal within the block) of
        one cache (``[layers, 1, kv_heads, max_len, head_dim]``); cos/sin ``[T, head_dim]``."""
        t = self._check_x(x)
        self._check_cache(k_all, v_all)
        self._check_rope(cos, sin, t)
        x = x.contiguous()
        out = torch.empty((1, t, self.dims.hidden), dtype=torch.float32)
        self._check(
            self._run(
                self._handle,
                x.data_ptr(),
                t,
                k_all.data_ptr(),
                v_all.data_ptr(),
                k_all.shape[3],
                start,
                cos.data_ptr(),
                sin.data_ptr(),
                out.data_ptr(),
                torch.get_num_threads(),
            )
        )
        return out

    def run_rows(
        self,
        x: torch.Tensor,
        k_list: Sequence[torch.Tensor],
        v_list: Sequence[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: Sequence[int],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """Rows of several sequences in one pass (a decoding step of several requests): row r of x
        ``[1, T, hidden]`` at position ``positions[r]`` of cache ``caches[r]`` (an index into
        ``k_list``/``v_list``), attending to that cache's positions 0..positions[r]. The weights are
        read once for all rows."""
        t = self._check_x(x)
        if len(k_list) != len(v_list) or not k_list:
            raise ValueError("one v cache per k cache")
        if len(caches) != t or len(positions) != t:
            raise ValueError("one cache index and one position per row")
        for k, v in zip(k_list, v_list, strict=True):
            self._check_cache(k, v)
        self._check_rope(cos, sin, t)
        rows = (_Row * t)()
        for r, (c, pos) in enumerate(zip(caches, positions, strict=True)):
            if not 0 <= c < len(k_list):
                raise ValueError(f"row {r}: no cache {c}")
            rows[r] = _Row(k_list[c].data_ptr(), v_list[c].data_ptr(), k_list[c].shape[3], pos)
        x = x.contiguous()
        out = torch.empty((1, t, self.dims.hidden), dtype=torch.float32)
        self._check(
            self._run_rows(
                self._handle,
                x.data_ptr(),
                t,
                ctypes.addressof(rows),
                cos.data_ptr(),
                sin.data_ptr(),
                out.data_ptr(),
                torch.get_num_threads(),
            )
        )
        return out


_TABLE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The dtypes a ``Predictor``'s tables may hold, by their code in ``kernels.h``."""


def _table(source: Any) -> _Table:
    """The ``s2s::Table`` over an embedding table: a CPU tensor ``[rows, cols]``, or rows read from
    a file (``checkpoint.FileRows``: ``fd``, ``start``, ``rows``, ``cols``, ``dtype``)."""
    if isinstance(source, torch.Tensor):
        if source.dim() != 2 or not source.is_cpu or not source.is_contiguous() or source.dtype not in _TABLE_DTYPES:
            raise ValueError("a table in memory must be a contiguous float32 or bfloat16 CPU tensor [rows, cols]")
        rows, cols = source.shape
        return _Table(source.data_ptr(), 0, rows, cols, _TABLE_DTYPES[source.dtype], -1)
    if source.dtype not in _TABLE_DTYPES:
        raise ValueError(f"a table of {source.dtype} (the library reads float32 and bfloat16 rows)")
    return _Table(None, source.start, source.rows, source.cols, _TABLE_DTYPES[source.dtype], source.fd)


class Predictor:
    """The code predictor's frame in one library call (``s2s_predictor_run``): codebooks 1..G-1 of
    one sequence or of a batch's (up to ``Kernels.MAX_STREAM_ROWS``), each step its stack's pass,
    its head, the codes (argmax, or drawn as ``Kernels.sample`` draws them) and their embeddings'
    rows, as ``runtime.predict_frame`` and ``_predict_rows`` make them a torch call at a time, with
    the same kernels in the same order, and so the same numbers. Per frame that is one call in
    place of about 15 x 8 Python calls, each slow right after a pass of the weights has emptied the
    caches.

    Holds its ``Stack``, the projection from the talker's width (None where the widths are equal),
    the heads and the tables (tensors or ``checkpoint.FileRows``) alive as long as itself.
    """

    def __init__(
        self,
        kernels: Kernels,
        stack: Stack,
        project: PackedLinear | None,
        heads: Sequence[PackedLinear],
        tables: Sequence[Any],
        width: int,
        rows_per_call: int,
    ) -> None:
        """``rows_per_call``: the first step's rows (2 a sequence) a stack call takes, as
        ``DecoderStack.run_rows`` splits them (its stack's ``max_rows`` for integer weights, else 4)."""
        lib = kernels._lib
        self._lib = lib
        self.steps = len(heads)
        if len(tables) != self.steps:
            raise ValueError("one table per head")
        self.width = width
        self.max_sequences = kernels.MAX_STREAM_ROWS
        self._stack = stack
        self._keep: list[Any] = [stack, project, *heads, *tables]
        head_table = (_Weight * self.steps)(*(h.weight_struct for h in heads))
        table_table = (_Table * self.steps)(*(_table(t) for t in tables))
        handle = lib.s2s_predictor_new(
            stack._handle,
            ctypes.addressof(project.weight_struct) if project is not None else None,
            ctypes.addressof(head_table),
            ctypes.addressof(table_table),
            self.steps,
            width,
            rows_per_call,
        )
        if not handle:
            raise ValueError(lib.s2s_error().decode())
        self._handle = handle
        self._run = lib.s2s_predictor_run
        weakref.finalize(self, lib.s2s_predictor_free, handle)

    def run(
        self,
        hidden: torch.Tensor,
        first: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        cos: torch.Tensor,
        sin: torch.Tensor,
        greedy: Sequence[bool],
        u: torch.Tensor | None,
        sampling: tuple[float, int, float],
        codes: torch.Tensor,
        embeds: torch.Tensor,
    ) -> None:
        """n sequences' frames: ``hidden`` (the talker's normed states) and ``first`` (codebook 0's
        embeddings), float32 ``[n, width]``, at positions 0 and 1 of each sequence's predictor cache
        (``caches``: its (k, v)); writes the codes into ``codes`` (int64 ``[n, steps]``) and their
        embeddings into ``embeds`` (float32 ``[n, steps, width]``). A sequence takes the argmax where
        ``greedy`` says so, else its row of ``u`` (float64 ``[n, steps]``, uniform numbers, one per
        draw; None when every sequence is greedy); ``sampling``: (temperature, top_k, top_p).
        cos/sin: the predictor's rope tables, ``[>= steps + 1, head_dim]``. RuntimeError (naming
        the step and the sequence) on a NaN logit or a code outside a table."""
        w, steps, n = self.width, self.steps, len(caches)
        if not 1 <= n <= self.max_sequences or len(greedy) != n:
            raise ValueError(f"1 to {self.max_sequences} sequences, a greedy flag and a cache each")
        _check_float(hidden, n * w, f"hidden must be float32 [{n}, {w}], contiguous, on the CPU")
        _check_float(first, n * w, f"first must be float32 [{n}, {w}], contiguous, on the CPU")
        for k, v in caches:
            self._stack._check_cache(k, v)
        rope_size = (steps + 1) * self._stack.dims.head_dim
        for t in (cos, sin):
            if t.dtype is not torch.float32 or not (t.is_cpu and t.is_contiguous()) or t.numel() < rope_size:
                raise ValueError(f"cos/sin must be float32 [>= {steps + 1}, {self._stack.dims.head_dim}]")
        if codes.dtype is not torch.int64 or not (codes.is_cpu and codes.is_contiguous()) or codes.numel() != n * steps:
            raise ValueError(f"codes must be int64 [{n}, {steps}], contiguous, on the CPU")
        _check_float(embeds, n * steps * w, f"embeds must be float32 [{n}, {steps}, {w}], contiguous, on the CPU")
        if u is not None and (u.dtype is not torch.float64 or not u.is_contiguous() or u.numel() != n * steps):
            raise ValueError(f"u must be float64 [{n}, {steps}]")
        if u is None and not all(greedy):
            raise ValueError("a sampled sequence needs its uniform numbers (u)")
        rows = (_Row * n)(*(_Row(k.data_ptr(), v.data_ptr(), k.shape[3], 0) for k, v in caches))
        flags = (ctypes.c_int32 * n)(*(int(g) for g in greedy))
        temperature, top_k, top_p = sampling
        rc = self._run(
            self._handle,
            n,
            hidden.data_ptr(),
            first.data_ptr(),
            ctypes.addressof(rows),
            cos.data_ptr(),
            sin.data_ptr(),
            ctypes.addressof(flags),
            temperature,
            top_k,
            top_p,
            u.data_ptr() if u is not None else None,
            codes.data_ptr(),
            embeds.data_ptr(),
            torch.get_num_threads(),
        )
        if rc:
            raise RuntimeError(self._lib.s2s_error().decode())


def _interleave_pairs(t: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows of ``t`` [N, C] in pairs, ``unit`` columns at a time: row 2p's first unit, row 2p + 1's,
    row 2p's second, ... (an odd last row stays as it is); flat, as ``kernels.h``'s ``pair_offset``."""
    n, c = t.shape
    even = n - n % 2
    pairs = t[:even].reshape(even // 2, 2, c // unit, unit).transpose(1, 2).reshape(-1)
    return torch.cat([pairs, t[even:].reshape(-1)]).contiguous()


def _pack(
    weight: torch.Tensor, fmt: str, group: int, ext: Kernels
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A float ``[out, in]`` weight in ``fmt``: (data, scales, mins) as the kernels read them.

    The integer formats are packed by the library in one pass (``_pack_reference``, six passes
    of torch ops, was most of an int8 model's load time).
    """
    w = weight.detach().to(torch.float32).contiguous()
    if fmt == "float32":
        return w, None, None
    if fmt == "bfloat16":
        return w.to(torch.bfloat16).contiguous(), None, None
    parts = ext.pack(FORMATS[fmt], w, group)
    return parts[0], parts[1], parts[2] if len(parts) > 2 else None


def _pack_reference(
    weight: torch.Tensor, fmt: str, group: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The integer formats in torch ops: what ``Kernels.pack`` must produce, bit for bit (tests)."""
    w = weight.detach().to(torch.float32).contiguous()
    if fmt == "int8":
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return _interleave_pairs(q, 32), scale.contiguous(), None
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    lo = g.amin(dim=2)
    hi = g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    # Each 32-weight block as 16 bytes: weight j in the low nibble, weight j + 16 in the high one.
    blocks = q.reshape(out_f, in_f // 32, 2, 16)
    packed = (blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)).reshape(out_f, in_f // 2)
    return _interleave_pairs(packed, 16), _interleave_pairs(scale, 1), _interleave_pairs(lo, 1)


class PackedLinear(nn.Module):
    """Drop-in for a CPU ``nn.Linear`` whose weight is stored in ``fmt`` and read by the kernels.

    Activations are float32 in and out. Up to ``MAX_STREAM_ROWS`` rows stream the weight once;
    up to ``MAX_BLOCKED_ROWS`` (a prompt) run a register-blocked product; more rows take torch's
    GEMM (float32 weights) or blocks of weight rows widened by the library for it.
    """

    def __init__(self, linear: nn.Linear, fmt: str, ext: Kernels, group: int = INT4_GROUP) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}")
        data, scales, mins = _pack(linear.weight, fmt, group, ext)
        bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None
        self._setup(fmt, data, scales, mins, bias, linear.in_features, linear.out_features, ext, group)

    @classmethod
    def from_parts(
        cls,
        fmt: str,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
        ext: Kernels,
        group: int = INT4_GROUP,
    ) -> PackedLinear:
        """A layer over tensors already in ``fmt`` (as ``_pack`` makes them; e.g. memory-mapped
        prepared weights, which it shares, not copies); ValueError when their sizes do not fit."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(fmt, data, scales, mins, bias, in_features, out_features, ext, group)
        return self

    def _setup(
        self,
        fmt: str,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
        ext: Kernels,
        group: int,
    ) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.group = group if fmt == "int4" else 0
        self.data, self.scales, self.mins = data, scales, mins
        self.bias = bias
        self._code = FORMATS[fmt]
        self._ext = ext
        self.max_rows = int(ext.MAX_BLOCKED_ROWS)
        """Rows of input up to which the kernels run; a float32 weight takes torch's BLAS beyond
        (``CodecDecoder.use_native`` lowers it where the BLAS is the faster one)."""
        self.weight_bytes = sum(t.numel() * t.element_size() for t in (data, scales, mins) if t is not None)
        self.weight_struct = _weight(self._code, data, scales, mins, bias, out_features, in_features, self.group)
        """The weight as the library takes it (checked once; ``Stack`` copies it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._code == 0 and x.numel() > self.max_rows * self.in_features:
            return F.linear(x, self.data, self.bias)
        return self._ext.apply(self.weight_struct, x)

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight itself (shared with the kernels); packed formats have none."""
        if self.fmt != "float32":
            raise AttributeError(f"a {self.fmt} PackedLinear has no float weight; see dequantized()")
        return self.data

    def dequantized(self) -> torch.Tensor:
        """The weight as this layer computes with it, float32 ``[out, in]``."""
        return self._ext.widen(self.weight_struct)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def packable(in_features: int, fmt: str, group: int = INT4_GROUP) -> bool:
    """Whether the kernels take a linear of ``in_features`` inputs in ``fmt`` (blocks of 32, int4 groups)."""
    return in_features % (group if fmt == "int4" else 32) == 0


def pack_linears(root: nn.Module, fmt: str, ext: Kernels, group: int = INT4_GROUP) -> int:
    """Replace every ``nn.Linear`` under ``root`` whose input width the kernels take; returns how many."""
    count = 0
    for module in list(root.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and packable(child.in_features, fmt, group):
                setattr(module, child_name, PackedLinear(child, fmt, ext, group))
                count += 1
    log.info("native_linears", fmt=fmt, linears=count)
    return count


def fuse_stacks(root: nn.Module, ext: Kernels) -> int:
    """Give every decoder stack under ``root`` a native one-position path; returns how many.

    A stack qualifies when each layer's q/k/v and gate/up projections are fused and every linear is a
    ``PackedLinear``; ``DecoderStack.run`` then hands single-position steps to its ``Stack``.
    """
    from s2s_daemon.tts.torch_qwen3.layers import DecoderStack

    count = 0
    for module in root.modules():
        if not isinstance(module, DecoderStack) or not len(module.layers):
            continue
        layers: list[tuple[PackedLinear, PackedLinear, PackedLinear, PackedLinear, list[torch.Tensor]]] = []
        formats: set[str] = set()
        for layer in module.layers:
            attn: Any = layer.self_attn
            mlp: Any = layer.mlp
            qkv, o, gate_up, down = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(lin, PackedLinear) for lin in (qkv, o, gate_up, down)):
                break
            formats.update(lin.fmt for lin in (qkv, o, gate_up, down))
            norms: tuple[Any, ...] = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
            weights = [n.weight.detach().float().contiguous() for n in norms]
            layers.append((qkv, o, gate_up, down, weights))
        else:
            first: Any = module.layers[0]
            # Integer weights: a prompt through the Stack, up to max_rows positions a call (its
            # activations quantized per block of 32, as in decoding; the products on tiles of
            # weight rows held in cache) is faster than the Python layers at logits within the
            # quality guard; float weights there would gain nothing (``scripts/bench_torch.py``'s
            # prefill figures, ``scripts/bench_prefill.py``).
            module.native_prompt = formats <= {"int8", "int4"}
            dims = StackDims(
                first.self_attn.o_proj.out_features,
                first.self_attn.num_heads,
                first.self_attn.num_kv_heads,
                first.self_attn.head_dim,
                first.mlp.intermediate,
                float(module.norm.eps),
            )
            module.native = ext.stack(layers, module.norm.weight.detach().float().contiguous(), dims)
            count += 1
    log.info("native_stacks", stacks=count)
    return count


def fuse_predictor(code_predictor: nn.Module, ext: Kernels) -> bool:
    """Give the code predictor its frame in one library call (``Predictor``, set as
    ``code_predictor.native``) where everything it runs is the library's: its stack fused
    (``fuse_stacks``), its heads and its projection (or none) ``PackedLinear``s, its embedding tables
    handing out float32 rows of float32 or bfloat16 tables, in memory or read from the checkpoint
    (``talker.rows_by_reads``); returns whether it did."""
    from s2s_daemon.tts.torch_qwen3.talker import LookupTable

    cp: Any = code_predictor
    stack = cp.model.native
    project = cp.small_to_mtp_projection
    heads = list(cp.lm_head)
    tables: list[Any] = []
    for table in cp.model.codec_embedding:
        if not isinstance(table, LookupTable) or table.out_dtype is not torch.float32:
            return False
        source = table.rows_from if table.rows_from is not None else table.weight.detach()
        if isinstance(source, torch.Tensor) and not (source.is_cpu and source.is_contiguous()):
            return False
        if source.dtype not in _TABLE_DTYPES:
            return False
        tables.append(source)
    if stack is None or not all(isinstance(h, PackedLinear) for h in heads):
        return False
    if not isinstance(project, (PackedLinear, nn.Identity)):
        return False
    from s2s_daemon.tts.torch_qwen3.layers import NATIVE_STACK_ROWS

    width = project.in_features if isinstance(project, PackedLinear) else stack.dims.hidden
    rows_per_call = stack.max_rows if cp.model.native_prompt else NATIVE_STACK_ROWS
    fused = project if isinstance(project, PackedLinear) else None
    cp.native = Predictor(ext, stack, fused, heads, tables, width, rows_per_call)
    return True
