"""What an intake is to the daemon: a door requests come in through, opened by the wiring, run as a
task of the daemon's group, drained and closed by its lifecycle in one loop (``app.py``).

An intake reads its clients' requests into a ``SayAsk``, admits it (``admission.admit``) and hands
the request to the ledger (``IntakeContext.ledger``); a caller's audio comes back through the
request's ``CallerStream``. Adding one is one module (the class and its opener), one line in
``wiring.INTAKES`` and its config section (``docs/extending.md``: adding an intake).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from s2s_daemon.config import DaemonConfig
from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.pipeline.jobs import Ledger
from s2s_daemon.pipeline.vocabulary import EngineInfo


class Intake(Protocol):
    """A door the daemon runs beside MQTT's. Built and listening before the daemon is ready (its
    opener: a port that is taken is exit 69); nothing runs until ``run``."""

    @property
    def name(self) -> str:
        """What it is called: its task is ``s2s.<name>``."""
        ...

    @property
    def origins(self) -> frozenset[str]:
        """What it admits: the ``origin`` of the requests it makes (empty: none, as the microphone's
        barge-in, which only stops what plays)."""
        ...

    async def run(self) -> None:
        """Serve until ``close`` (or until cancelled); the daemon's group runs it as ``s2s.<name>``."""
        ...

    def drain(self) -> None:
        """The daemon drains: take no new clients. The ledger refuses new requests already
        (``shutting_down``); what is in hand goes on."""
        ...

    async def close(self) -> None:
        """Every request has ended: give the clients what is left, hang up, stop listening, and let
        ``run`` return; bounded by the intake itself (the daemon cancels ``run`` after it, and gives
        up on a ``close`` after ``CLOSE_TIMEOUT_S``)."""
        ...


CLOSE_TIMEOUT_S = 10.0
"""The longest the daemon waits for one intake's ``close`` (each bounds its own, below this)."""


@dataclass(frozen=True, slots=True)
class IntakeContext:
    """What the wiring hands an intake's opener: where requests go and what they are checked against."""

    ledger: Ledger
    rules: IntakeRules
    info: EngineInfo


IntakeOpener = Callable[[DaemonConfig, IntakeContext], Awaitable[Intake | None]]
"""Builds an intake from its config section and starts it listening; None when the section turns it off."""
