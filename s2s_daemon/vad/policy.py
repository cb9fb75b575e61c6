"""What the daemon does when someone starts speaking (``vad.policy``).

``ignore``: nothing. ``wait``: the next utterance is held while someone speaks, at most
``vad.max_wait_s``. ``interrupt``: the utterance playing on the speaker is stopped
(``interrupted``) when someone starts speaking; nothing is held.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal, Protocol

import structlog

log = structlog.get_logger(__name__)


class Speaker(Protocol):
    """The part of the ledger the policy needs."""

    def stop_speaking(self) -> str | None: ...


class VadGate:
    """Policy ``wait``: holds the next utterance while someone speaks, at most ``max_wait_s``."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self._quiet = asyncio.Event()
        self._quiet.set()

    def speaking(self, active: bool) -> None:
        if active:
            self._quiet.clear()
        else:
            self._quiet.set()

    def hold(self) -> asyncio.Future[None] | None:
        if self._quiet.is_set():
            return None
        return asyncio.ensure_future(self._wait())

    async def _wait(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.max_wait_s):
                await self._quiet.wait()


class BargeIn:
    """Applies ``vad.policy`` to each speech start and stop the VAD reports."""

    def __init__(self, policy: Literal["ignore", "wait", "interrupt"], gate: VadGate, speaker: Speaker) -> None:
        self.policy = policy
        self.gate = gate
        self.speaker = speaker

    def on_speech(self, speaking: bool) -> None:
        self.gate.speaking(speaking if self.policy == "wait" else False)
        if speaking and self.policy == "interrupt":
            stopped = self.speaker.stop_speaking()
            if stopped is not None:
                log.info("barge_in", request_id=stopped)
