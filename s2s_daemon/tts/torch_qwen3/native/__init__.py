"""Native CPU linear layers: the C++ kernels in ``linear.cpp``, built on first use.

Decoding is a chain of one-row products over every weight of the talker and code predictor, so
its speed is the speed at which weights stream from memory. ``linear.cpp`` reads float32,
bfloat16, int8 (per output channel) or 4-bit (affine, per group) weights once per call and
accumulates in float32 with AVX2/FMA, on torch's own thread pool. It is compiled with
``torch.utils.cpp_extension`` the first time it is needed (with progress lines) into a folder
keyed by everything in the build command (``build_key``), so environments never rebuild over each
other, by one process at a time (``build_lock``: a start killed mid-build leaves no lock that
later starts wait on, and a start waits a bounded time for a live builder, naming it). Without
AVX2/FMA or a compiler, or if the build fails, ``load()`` returns ``None`` with the reason
(``unavailable_reason()``) and the engine keeps torch's own kernels.
``scripts/bench_wide.py`` and ``scripts/bench_torch.py`` measure them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from s2s_daemon.build_lock import BuildLockTimeout, build_lock
from s2s_daemon.progress import Progress

log = structlog.get_logger(__name__)

FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}
"""Weight formats of ``PackedLinear`` and their codes in ``linear.cpp``."""

INT4_GROUP = 64
"""Inputs per 4-bit group (a float32 scale and min each): 5 bits a weight (MLX's 4bit, with float16 scales: 4.5)."""

PACK_LAYOUT = 1
"""Version of what ``_pack`` writes (row pairing, nibble order, scale and min layout); bump it with
any change there. Prepared weights (``prepared.py``) are keyed by it and by ``linear.cpp``'s digest."""

EXTENSION_NAME = "s2s_qwen3_linear"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_EXPECTED_S = 70
"""Seconds a first build is expected to take on a small machine (for the progress line only)."""
LOCK_NAME = "s2s-build.lock"
"""The build folder's ``build_lock``: one build at a time, released when its holder exits."""
TORCH_BATON = "lock"
"""The file torch's ``cpp_extension`` keeps while it builds (and leaves when it is killed)."""

_SOURCE = Path(__file__).with_name("linear.cpp")
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def why_not_this_cpu() -> str | None:
    """Why this machine cannot run the kernels (built or not), or None when it can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are AVX2 code and this CPU is {platform.machine()}"
    if platform.system() != "Linux":
        return "the kernels are built on Linux only"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    return None


def why_not_here() -> str | None:
    """Why this machine cannot build or run the kernels, or None when it can."""
    reason = why_not_this_cpu()
    if reason is not None:
        return reason
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    if shutil.which("ninja") is None:
        # The pip package (a dependency of the torch extra) lives in the environment's bin folder,
        # which is not on PATH when the daemon runs as .venv/bin/s2s-daemon.
        try:
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        except ImportError:
            pass
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def build_dir() -> Path:
    """The root the keyed build folders live in (``TORCH_EXTENSIONS_DIR`` when set)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "s2s-daemon" / "torch_extensions"


def build_key() -> dict[str, str]:
    """Everything that changes the command torch writes into the folder's ``build.ninja``.

    ninja rebuilds when that command changes, so a folder shared by two torch installations (two
    virtual environments), Pythons, compilers or checkouts would be rebuilt on every alternation.
    """
    compiler = os.environ.get("CXX", "c++")  # what cpp_extension compiles with
    return {
        "source_sha256": hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
        "source": os.path.abspath(_SOURCE),  # as the ninja file names it
        "torch": torch.__version__,
        "torch_path": os.path.dirname(os.path.abspath(torch.__file__)),  # its include and lib folders
        "cxx11_abi": str(bool(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "python": f"{sys.implementation.cache_tag} {platform.python_version()}",
        "python_include": sysconfig.get_paths()["include"],
        "compiler": f"{compiler} {shutil.which(compiler) or ''}".strip(),
        "cflags": " ".join(CFLAGS),
        "ldflags": " ".join(LDFLAGS),
        "machine": platform.machine(),
    }


def layout_key() -> str:
    """What packed weights depend on besides their source: ``PACK_LAYOUT`` and the kernels' source."""
    return f"{PACK_LAYOUT}-{hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]}"


def build_folder(key: dict[str, str] | None = None) -> Path:
    """The folder of this environment's build: readable prefix, digest of ``build_key()``."""
    key = build_key() if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return build_dir() / f"torch{key['torch'].split('+')[0]}-{sys.implementation.cache_tag}-{digest}"


def is_built(folder: Path | None = None) -> bool:
    """True when this environment's build folder holds a built extension (loading it compiles nothing)."""
    return ((build_folder() if folder is None else folder) / f"{EXTENSION_NAME}.so").is_file()


def load() -> Any:
    """The compiled extension, building it once per environment if needed; None when unavailable."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = _import_built() if why_not_this_cpu() is None else None
        if module is not None:
            log.debug("native_kernels_cached", folder=str(build_folder()))
            _state["module"] = module
            _state["reason"] = None
            return module
        reason = why_not_here()
        if reason is None:
            key = build_key()
            folder = build_folder(key)
            try:
                with build_lock(folder / LOCK_NAME, "the native kernels"):
                    module, reason = _build_locked(key, folder)
            except BuildLockTimeout as exc:
                reason = f"not built: {exc}"
            except OSError as exc:  # the lock file cannot be made: an unwritable cache
                reason = f"building the kernels failed: {exc}"
        if module is None:
            log.warning("native_kernels_unavailable", reason=reason)
        _state["module"] = module
        _state["reason"] = reason
        return module


def _build_locked(key: dict[str, str], folder: Path) -> tuple[Any, str | None]:
    """(module, None) or (None, reason): the build, under this folder's ``build_lock``.

    torch's own ``lock`` file (its ``FileBaton``) is left behind by a build that was killed, and
    torch then waits for it for ever; under our lock nobody else builds here, so one found is stale.
    """
    from torch.utils.cpp_extension import load as build

    cached = is_built(folder)
    if cached:  # another process built it while this one waited for the lock
        module = _import_built()
        if module is not None:
            log.debug("native_kernels_cached", folder=str(folder))
            return module, None
    stale = folder / TORCH_BATON
    if stale.exists():
        log.warning("native_kernels_stale_lock_removed", lock=str(stale), reason="left by a build that was stopped")
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    if not cached:
        log.info("native_kernels_building", expected_s=BUILD_EXPECTED_S, cached_in=str(folder))
    started = time.perf_counter()
    try:
        if not (folder / "key.json").is_file():  # what the folder was built for, for people
            (folder / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n", "utf-8")
        building = Progress("building_native_kernels", expected_s=BUILD_EXPECTED_S, started=None, done=None)
        with building if not cached else contextlib.nullcontext():
            module = build(
                name=EXTENSION_NAME,
                sources=[str(_SOURCE)],
                build_directory=str(folder),
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError) as exc:  # compiler errors arrive as RuntimeError
        return None, f"building the kernels failed: {str(exc).strip().splitlines()[-1] if str(exc) else exc}"
    elapsed_s = round(time.perf_counter() - started, 1)
    if not cached:
        log.info("native_kernels_built", build_s=elapsed_s, folder=str(folder))
    else:
        log.debug("native_kernels_cached", load_s=elapsed_s, folder=str(folder))
    return module, None


def _import_built() -> Any:
    """This environment's built extension, imported directly; None when there is none or it does
    not import (``load`` then takes torch's route, which rebuilds it where needed).

    What ``cpp_extension.load`` does for an up-to-date build, without importing cpp_extension
    (and setuptools) and running ninja to check it, which would cost every start. The
    folder is keyed by the source, flags and toolchain (``build_key``), so a build in it is current.
    """
    import importlib.util

    path = build_folder() / f"{EXTENSION_NAME}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    return module


def unavailable_reason() -> str | None:
    """After ``load()``: why it returned None (None when it did not)."""
    return _state.get("reason")


def _interleave_pairs(t: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows of ``t`` [N, C] in pairs, ``unit`` columns at a time: row 2p's first unit, row 2p + 1's,
    row 2p's second, ... (an odd last row stays as it is); flat, as ``linear.cpp``'s ``pair_offset``."""
    n, c = t.shape
    even = n - n % 2
    pairs = t[:even].reshape(even // 2, 2, c // unit, unit).transpose(1, 2).reshape(-1)
    return torch.cat([pairs, t[even:].reshape(-1)]).contiguous()


def _pack(
    weight: torch.Tensor, fmt: str, group: int, ext: Any
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A float ``[out, in]`` weight in ``fmt``: (data, scales, mins) as ``linear.cpp`` reads them.

    The integer formats are packed by the extension in one pass (``_pack_reference``, six passes
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
    """The integer formats in torch ops: what ``ext.pack`` must produce, bit for bit (tests)."""
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
    """Drop-in for a CPU ``nn.Linear`` whose weight is stored in ``fmt`` and read by ``linear.cpp``.

    Activations are float32 in and out. Up to ``MAX_STREAM_ROWS`` rows stream the weight once;
    up to ``MAX_BLOCKED_ROWS`` (a prompt) run a register-blocked product; more rows take torch's
    GEMM (float32 weights) or widen blocks of weight rows for it inside the extension.
    """

    def __init__(self, linear: nn.Linear, fmt: str, ext: Any, group: int = INT4_GROUP) -> None:
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
        ext: Any,
        group: int = INT4_GROUP,
    ) -> PackedLinear:
        """A layer over tensors already in ``fmt`` (as ``_pack`` makes them; e.g. memory-mapped
        prepared weights, which it shares, not copies); the extension checks their sizes."""
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
        ext: Any,
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
        self.handle = ext.Packed(self._code, data, scales, mins, self.bias, self.out_features, self.in_features,
                                 self.group)  # fmt: skip
        """The same weight for ``Stack`` (shares the tensors)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._code == 0 and x.numel() > self.max_rows * self.in_features:
            return F.linear(x, self.data, self.bias)
        return self._ext.linear(  # type: ignore[no-any-return]
            x, self._code, self.data, self.scales, self.mins, self.out_features, self.group, self.bias
        )

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight itself (shared with the kernels); packed formats have none."""
        if self.fmt != "float32":
            raise AttributeError(f"a {self.fmt} PackedLinear has no float weight; see dequantized()")
        return self.data

    def dequantized(self) -> torch.Tensor:
        """The weight as this layer computes with it, float32 ``[out, in]``."""
        return self._ext.dequantize(  # type: ignore[no-any-return]
            self._code, self.data, self.scales, self.mins, self.out_features, self.in_features, self.group
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def packable(in_features: int, fmt: str, group: int = INT4_GROUP) -> bool:
    """Whether the kernels take a linear of ``in_features`` inputs in ``fmt`` (blocks of 32, int4 groups)."""
    return in_features % (group if fmt == "int4" else 32) == 0


def pack_linears(root: nn.Module, fmt: str, ext: Any, group: int = INT4_GROUP) -> int:
    """Replace every ``nn.Linear`` under ``root`` whose input width the kernels take; returns how many."""
    count = 0
    for module in list(root.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and packable(child.in_features, fmt, group):
                setattr(module, child_name, PackedLinear(child, fmt, ext, group))
                count += 1
    log.info("native_linears", fmt=fmt, linears=count)
    return count


def fuse_stacks(root: nn.Module, ext: Any) -> int:
    """Give every decoder stack under ``root`` a native one-position path; returns how many.

    A stack qualifies when each layer's q/k/v and gate/up projections are fused and every linear is a
    ``PackedLinear``; ``DecoderStack.run`` then hands single-position steps to ``ext.Stack``.
    """
    from s2s_daemon.tts.torch_qwen3.layers import DecoderStack

    count = 0
    for module in root.modules():
        if not isinstance(module, DecoderStack) or not len(module.layers):
            continue
        layers = []
        formats: set[str] = set()
        for layer in module.layers:
            attn: Any = layer.self_attn
            mlp: Any = layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(lin, PackedLinear) for lin in linears):
                break
            formats.update(lin.fmt for lin in linears)
            norms: tuple[Any, ...] = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
            weights = [n.weight.detach().float().contiguous() for n in norms]
            layers.append(ext.Layer(*(lin.handle for lin in linears), *weights))
        else:
            first: Any = module.layers[0]
            # Integer weights: a prompt in blocks of NATIVE_STACK_ROWS through the Stack (its
            # activations quantized per block of 32, as in decoding) is faster than the float path
            # at logits within the quality guard; float weights read 4 rows at a time are slower
            # (``scripts/bench_torch.py``'s prefill figures measure both).
            module.native_prompt = formats <= {"int8", "int4"}
            module.native = ext.Stack(
                layers,
                module.norm.weight.detach().float().contiguous(),
                first.self_attn.o_proj.out_features,
                first.self_attn.num_heads,
                first.self_attn.num_kv_heads,
                first.self_attn.head_dim,
                first.mlp.intermediate,
                float(module.norm.eps),
            )
            count += 1
    log.info("native_stacks", stacks=count)
    return count
