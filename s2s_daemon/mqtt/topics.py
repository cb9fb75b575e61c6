"""Every topic the daemon uses, derived from ``mqtt.topic_prefix`` and ``site_id``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Topics:
    prefix: str
    site_id: str
    shared_group: str | None = None

    @property
    def base(self) -> str:
        return f"{self.prefix}/{self.site_id}"

    @property
    def say(self) -> str:
        return f"{self.base}/tts/say"

    @property
    def stream(self) -> str:
        """A text still being written, piece by piece (``intake/schemas.py StreamPayload``)."""
        return f"{self.base}/tts/stream"

    @property
    def stop(self) -> str:
        return f"{self.base}/tts/stop"

    @property
    def pool_say(self) -> str:
        return f"{self.prefix}/pool/tts/say"

    @property
    def pool_subscription(self) -> str | None:
        """``$share/<group>/<p>/pool/tts/say`` when a shared group is configured."""
        if self.shared_group is None:
            return None
        return f"$share/{self.shared_group}/{self.pool_say}"

    @property
    def pool_taken(self) -> str:
        """``<p>/pool/tts/taken``: a member's receipt for a request another member handed back."""
        return f"{self.prefix}/pool/tts/taken"

    @property
    def status(self) -> str:
        return f"{self.base}/status"

    @property
    def info(self) -> str:
        return f"{self.base}/info"

    @property
    def state(self) -> str:
        return f"{self.base}/state"

    @property
    def started(self) -> str:
        return f"{self.base}/tts/started"

    @property
    def finished(self) -> str:
        return f"{self.base}/tts/finished"

    @property
    def speech_started(self) -> str:
        return f"{self.base}/vad/speech_started"

    @property
    def speech_stopped(self) -> str:
        return f"{self.base}/vad/speech_stopped"

    @property
    def latency(self) -> str:
        return f"{self.base}/metrics/latency"

    @property
    def memory(self) -> str:
        return f"{self.base}/metrics/memory"


HERMES_SAY = "hermes/tts/say"
HERMES_SAY_FINISHED = "hermes/tts/sayFinished"
HERMES_ERROR = "hermes/error/tts"


def hermes_vad(site_id: str, up: bool) -> str:
    return f"hermes/voiceActivity/{site_id}/{'vadUp' if up else 'vadDown'}"


def ha_config(ha_prefix: str, component: str, node_id: str, object_id: str) -> str:
    """Home Assistant's discovery topic ``<ha_prefix>/<component>/<node_id>/<object_id>/config``."""
    return f"{ha_prefix}/{component}/{node_id}/{object_id}/config"


def ha_birth(ha_prefix: str) -> str:
    """Home Assistant's birth message (``online`` when it starts): discovery is published again."""
    return f"{ha_prefix}/status"
