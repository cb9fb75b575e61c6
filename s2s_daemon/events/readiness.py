"""What ``GET /health`` and ``GET /ready`` answer: the daemon's lifecycle phase, and what it waits for.

``/health`` is liveness: the process answers (200 in every phase). ``/ready`` is readiness: 200
only once the model is loaded and warmed up, the intakes take requests, the MQTT link is connected
(the daemon always has one: to the embedded broker or an external one) and it is not draining;
503 otherwise, naming what is missing. The listeners that serve them start before the model loads,
so that a probe sees "loading" rather than a refused connection.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any


class LifecyclePhase(enum.StrEnum):
    """Where the daemon is in its lifecycle (app.py), in order."""

    STARTING = "starting"
    """Before the model loads (extras checked, the journal opened)."""
    LOADING = "loading"
    WARMING = "warming"
    OPENING = "opening"
    """The sink, the embedded broker, the intakes."""
    SERVING = "serving"
    DRAINING = "draining"
    """Taking no more requests: finishing what it has, then stopping."""


_ORDER = list(LifecyclePhase)
_WAITING = {
    "model_loaded": "the model is loading",
    "warmed_up": "the model is warming up",
    "accepting": "the intakes are not open yet",
    "broker_connected": "the MQTT link is not connected",
}


class Readiness:
    """The phase, set by the daemon as it moves on; read by the probes (and ``s2s_ready``)."""

    def __init__(self, broker_connected: Callable[[], bool] = lambda: False) -> None:
        self.phase = LifecyclePhase.STARTING
        self.broker_connected = broker_connected
        """Whether the MQTT link is connected now (False while there is none)."""

    def enter(self, phase: LifecyclePhase) -> None:
        self.phase = phase

    def checks(self) -> dict[str, bool]:
        """Each condition of readiness, True when it holds."""
        at = _ORDER.index(self.phase)
        return {
            "model_loaded": at > _ORDER.index(LifecyclePhase.LOADING),
            "warmed_up": at > _ORDER.index(LifecyclePhase.WARMING),
            "accepting": self.phase is LifecyclePhase.SERVING,
            "broker_connected": self.broker_connected(),
        }

    def ready(self) -> bool:
        return all(self.checks().values())

    def health(self) -> dict[str, Any]:
        """``/health``'s body (always 200)."""
        return {"status": "ok", "phase": str(self.phase)}

    def report(self) -> tuple[bool, dict[str, Any]]:
        """Whether ready, and ``/ready``'s body: the phase, every check, and what is missing in words."""
        checks = self.checks()
        missing = [name for name, ok in checks.items() if not ok]
        body: dict[str, Any] = {"ready": not missing, "phase": str(self.phase), "checks": checks}
        if missing:
            body["not_ready"] = missing
            if self.phase is LifecyclePhase.DRAINING:
                body["reason"] = "the daemon is draining: it takes no more requests and stops"
            else:
                body["reason"] = "; ".join(_WAITING[name] for name in missing)
        return not missing, body
