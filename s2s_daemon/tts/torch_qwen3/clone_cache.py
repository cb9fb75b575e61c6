"""Clone prompts computed once: the speaker embedding and reference codes of a recording.

A Base model clones a voice from ``ref.wav`` by running the speaker encoder (an x-vector) and, for
ICL cloning with a transcript, the codec encoder (the reference frames). Both depend only on the
recording's bytes, the transcript's presence, the model and the dtype, so they are kept in memory
and on disk (``$XDG_CACHE_HOME/s2s-daemon/voices/<key>.safetensors``) under the hash of those:
neither a later request nor a restart runs an encoder again, and a changed recording has a new
hash, hence a new key. The file's hash is remembered by (size, mtime, inode), so a request for a
cached voice costs a ``stat`` and a dictionary look-up. Two processes that need the same new
prompt compute it once (``build_lock``).
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from s2s_daemon.build_lock import BuildLockTimeout, build_lock
from s2s_daemon.tts.clone_keys import PromptKeys

log = structlog.get_logger(__name__)

MEMORY_ENTRIES = 64
"""Clone prompts kept in memory (oldest dropped first)."""
LOCK_WAIT_S = 10.0
"""Seconds a request waits for another process computing the same prompt (on the engine thread:
well below ``tts.stall_timeout_s``) before computing it itself."""
FORMAT = "1"
"""Bumped when what is stored changes."""


@dataclass(frozen=True, slots=True)
class ClonePrompt:
    speaker: torch.Tensor
    """Speaker-encoder embedding ``[hidden]`` on the engine's device."""
    ref_codes: torch.Tensor | None
    """Reference frames ``[T, G]`` (long) for ICL cloning; None for speaker-embedding-only."""


Compute = Callable[[str, bool], ClonePrompt]
"""(recording path, with codes) -> the prompt: runs the encoders."""


class ClonePromptCache:
    """Memory and disk cache of clone prompts for one loaded model."""

    def __init__(self, model_key: str, folder: Path | None, device: torch.device) -> None:
        self.model_key = model_key
        """The model and dtype the prompts belong to (part of every key)."""
        self.folder = folder
        """Where prompts are stored; None keeps them in memory only."""
        self.device = device
        self._memory: OrderedDict[str, ClonePrompt] = OrderedDict()
        self._keys = PromptKeys(FORMAT, model_key)
        self.computed = 0
        """Prompts computed by the encoders (tests, logs)."""
        self.loaded = 0
        """Prompts read from disk."""

    def key(self, path: str, with_codes: bool) -> str:
        return self._keys.key(path, with_codes)

    def get(self, path: str, with_codes: bool, compute: Compute) -> ClonePrompt:
        """The prompt for the recording at ``path``: from memory, else disk, else ``compute``."""
        key = self.key(path, with_codes)
        found = self._memory.get(key)
        if found is not None:
            self._memory.move_to_end(key)
            return found
        found = self._load(key)
        if found is None:
            found = self._compute(key, path, with_codes, compute)
        self._memory[key] = found
        while len(self._memory) > MEMORY_ENTRIES:
            self._memory.popitem(last=False)
        return found

    def _compute(self, key: str, path: str, with_codes: bool, compute: Compute) -> ClonePrompt:
        """Run the encoders and store the prompt, one process at a time per prompt (``build_lock``):
        a process that waited reads what the holder stored. Without the lock (a read-only folder,
        a holder that takes longer than ``LOCK_WAIT_S``) it computes anyway."""
        lock = self.folder / f".{key}.lock" if self.folder is not None else None
        if lock is not None:
            try:
                with build_lock(lock, "a voice's clone prompt", timeout_s=LOCK_WAIT_S) as waited:
                    found = self._load(key) if waited else None
                    return found if found is not None else self._compute_and_store(key, path, with_codes, compute)
            except (OSError, BuildLockTimeout) as exc:
                log.info("clone_prompt_unlocked", key=key, reason=str(exc))
        return self._compute_and_store(key, path, with_codes, compute)

    def _compute_and_store(self, key: str, path: str, with_codes: bool, compute: Compute) -> ClonePrompt:
        found = compute(path, with_codes)
        self.computed += 1
        self._store(key, found)
        return found

    def _path(self, key: str) -> Path | None:
        return self.folder / f"{key}.safetensors" if self.folder is not None else None

    def _load(self, key: str) -> ClonePrompt | None:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path), device=str(self.device))
        except (OSError, SafetensorError) as exc:
            log.warning("clone_prompt_unreadable", path=str(path), error=str(exc))
            return None
        if "speaker" not in tensors:
            return None
        self.loaded += 1
        return ClonePrompt(tensors["speaker"], tensors.get("ref_codes"))

    def _store(self, key: str, prompt: ClonePrompt) -> None:
        path = self._path(key)
        if path is None:
            return
        from safetensors.torch import save_file

        tensors = {"speaker": prompt.speaker.detach().contiguous().cpu()}
        if prompt.ref_codes is not None:
            tensors["ref_codes"] = prompt.ref_codes.detach().contiguous().cpu()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
            os.close(fd)
            try:
                save_file(tensors, tmp)
                os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as exc:  # a read-only cache folder costs speed, not the request
            log.warning("clone_prompt_not_stored", path=str(path), error=str(exc))
