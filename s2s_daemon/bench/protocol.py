"""The JSON-lines protocol a benchmark worker speaks with its parent, in one place.

Both workers serve it: ``worker.py`` (our engines) and ``reference_worker.py`` (the official
package, run with ITS interpreter). This module uses the standard library only, so that the
reference worker, which imports nothing from s2s_daemon, loads it by its path.

One request per line on stdin, one reply per line on the original stdout (the process's fd 1 is
pointed at stderr first, so a library that prints cannot corrupt the protocol). Ops: ``load``,
``run``, ``close`` (answered, then the worker exits); every reply carries ``ok`` and, on failure,
``error`` and ``error_type``. At the end of stdin the host is closed as by ``close``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any, Protocol


class Host(Protocol):
    """What a worker serves: an engine behind the three ops."""

    def load(self, request: dict[str, Any]) -> dict[str, Any]: ...

    def run(self, request: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> dict[str, Any]: ...


def reply_stream() -> IO[str]:
    """Keep the real stdout for replies; send everything else written to fd 1 to stderr."""
    sys.stdout.flush()
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(reply_fd, "w", encoding="utf-8", buffering=1)


def serve(host: Host, requests: IO[str], replies: IO[str]) -> int:
    """Answer ``requests`` in order until ``close`` or their end; the exit status."""
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        try:
            if op == "load":
                reply = host.load(request)
            elif op == "run":
                reply = host.run(request)
            elif op == "close":
                reply = host.close()
            else:
                msg = f"unknown op {op!r}"
                raise ValueError(msg)  # noqa: TRY301  (answered below like every other failure)
            reply["ok"] = True
        # The parent decides what a failure means (an error row); the worker only reports it.
        except Exception as exc:
            reply = {"ok": False, "error": str(exc) or type(exc).__name__, "error_type": type(exc).__name__}
        replies.write(json.dumps(reply) + "\n")
        if op == "close":
            return 0
    host.close()
    return 0
