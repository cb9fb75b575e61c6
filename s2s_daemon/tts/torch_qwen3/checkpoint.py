"""Finding a checkpoint (local folder or hub id) and loading its safetensors with strict checks."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from torch import nn

from s2s_daemon.tts.engine import CheckpointError, EngineError, ModelUnavailableError

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


def hub_failure(model: str, revision: str | None, exc: Exception, *, offline: bool, cache: str) -> EngineError:
    """What a failed ``snapshot_download`` means: wrong settings (``CheckpointError``) or not now."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # The hub answers 401/404 for an id that does not exist (or that is private and no token is
    # set): retrying cannot fix a typo, so that is configuration, like a folder that is no checkpoint.
    if isinstance(exc, GatedRepoError):
        return CheckpointError(f"{model!r} is gated on the hub: accept its terms on huggingface.co and set HF_TOKEN")
    if isinstance(exc, RevisionNotFoundError):
        return CheckpointError(f"the hub has no revision {revision!r} of {model!r}")
    if isinstance(exc, RepositoryNotFoundError):
        return CheckpointError(f"the hub has no model {model!r} (or it is private and HF_TOKEN is not set)")
    if isinstance(exc, HFValidationError):
        return CheckpointError(f"{model!r} is not a valid hub id: {exc}")
    if offline:
        return ModelUnavailableError(model, "offline mode is on (HF_HUB_OFFLINE=1)", offline=True, cache=cache)
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
    status = getattr(getattr(cause, "response", None), "status_code", None)
    if isinstance(cause, HfHubHTTPError) and status is not None:
        return ModelUnavailableError(model, f"the hub answered HTTP {status}", cache=cache)
    detail = (str(cause).strip().splitlines() or [""])[0]
    return ModelUnavailableError(model, f"the hub cannot be reached ({type(cause).__name__}: {detail})", cache=cache)


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


def read_tensors(files: Iterable[Path], keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Every tensor whose name passes ``keep``; a truncated or corrupt file is a CheckpointError."""
    out: dict[str, torch.Tensor] = {}
    for path in files:
        size = path.stat().st_size
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if keep(name):
                        out[name] = f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path} is corrupt or incomplete ({size} bytes): {exc}") from exc
    return out


def safetensors_complete(path: Path) -> None:
    """Check the header's byte ranges fit the file, so a partial download fails clearly, not at read time."""
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated (no header)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > 100_000_000:
                raise CheckpointError(f"{path} has an invalid header length {n}")
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} has an unreadable header: {exc}") from exc
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > path.stat().st_size:
        raise CheckpointError(f"{path} is truncated: header needs {8 + n + end} bytes, file has {path.stat().st_size}")


STORED_DTYPE_TENSORS = ("talker.model.text_embedding.weight",)
"""Kept in the checkpoint's dtype whatever the model dtype: a lookup table (151936 x 2048 in the
released models, 1.2 GB as float32) whose rows are cast when looked up, which is exact."""


def load_weights(module: nn.Module, folder: Path, device: torch.device, dtype: torch.dtype | None) -> None:
    """Load the talker tensors into ``module`` (built on the meta device) with exact name and shape checks.

    ``dtype`` None keeps every tensor in the checkpoint's dtype (the caller packs and casts after).
    Tensors are converted one at a time, so the peak holds one copy of the model plus one tensor.
    """
    files = weight_files(folder)
    for path in files:
        safetensors_complete(path)
    tensors = read_tensors(files, lambda name: not name.startswith(IGNORED_PREFIXES))
    expected = {name: p.shape for name, p in module.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint tensors do not match the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''}"
            f" ({len(missing)}), unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name} has shape {tuple(tensors[name].shape)}, config implies {tuple(shape)}"
            )
    state = {}
    for name in list(tensors):
        t = tensors.pop(name)
        keep = dtype is None or name in STORED_DTYPE_TENSORS
        state[name] = t.to(device=device) if keep else t.to(device=device, dtype=dtype)
    module.load_state_dict(state, strict=True, assign=True)


def cast_floating(module: nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter and buffer of ``module`` in ``dtype``, except ``STORED_DTYPE_TENSORS``."""
    for name, param in module.named_parameters():
        if name not in STORED_DTYPE_TENSORS and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    for name, buf in module.named_buffers():
        if name not in STORED_DTYPE_TENSORS and buf.is_floating_point() and buf.dtype != dtype:
            buf.data = buf.data.to(dtype)
