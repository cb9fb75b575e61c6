"""What names a clone prompt, for both engines' caches: the recording's content (SHA-256,
re-read only when its size, mtime or inode change), the model it was made for, and whether it
carries reference codes (a transcript: in-context cloning) or the speaker embedding alone."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict

DIGESTS_KEPT = 256
"""Recordings whose digest is remembered (each request speaking a library voice reads a private copy)."""


def file_digest(path: str) -> str:
    """SHA-256 of the file at ``path``, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class PromptKeys:
    """Cache keys of the clone prompts of one loaded model (``model_key``: the model and its
    weight format, part of every key; ``version``: the layout of what is stored)."""

    def __init__(self, version: str, model_key: str) -> None:
        self.version = version
        self.model_key = model_key
        self._digests: OrderedDict[str, tuple[tuple[int, int, int], str]] = OrderedDict()

    def digest(self, path: str) -> str:
        """The recording's SHA-256, remembered while its size, mtime and inode stay the same."""
        st = os.stat(path)
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        known = self._digests.get(path)
        if known is not None and known[0] == stamp:
            self._digests.move_to_end(path)
            return known[1]
        digest = file_digest(path)
        self._digests[path] = (stamp, digest)
        self._digests.move_to_end(path)
        while len(self._digests) > DIGESTS_KEPT:
            self._digests.popitem(last=False)
        return digest

    def key(self, path: str, with_codes: bool) -> str:
        parts = (self.version, self.model_key, self.digest(path), "icl" if with_codes else "xvec")
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]
