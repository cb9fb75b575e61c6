"""Turns job transitions into the MQTT contract's events (and the Hermes bridge's)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable

import structlog

from s2s_daemon import __version__
from s2s_daemon.mqtt.packets import OutMessage
from s2s_daemon.mqtt.topics import HERMES_ERROR, HERMES_SAY_FINISHED, Topics, hermes_vad
from s2s_daemon.pipeline.jobs import Job
from s2s_daemon.pipeline.messages import ErrorCode, Status
from s2s_daemon.pipeline.outbox import Outbox
from s2s_daemon.pipeline.vocabulary import EngineInfo

log = structlog.get_logger(__name__)

STATE_MIN_INTERVAL_S = 0.05
"""A change of the queue's length alone is published at most this often (the latest wins); a
change of ``state`` or ``currentId`` is published every time, in order."""

Snapshot = tuple[str, str | None, int]
"""(idle|synthesizing|speaking, current id, queue length)."""


INFO_RESCAN_S = 1.0
"""Least seconds between scans of the voice library after requests naming a voice (``info`` refresh)."""


def _transient(snapshot: Snapshot) -> bool:
    """Nothing in flight but something queued: the TTS stage takes it next. Not ``idle`` (it would
    read as a redundant ``idle`` between two requests): the next state is published instead."""
    return snapshot[0] == "idle" and snapshot[2] > 0


def now_ms() -> int:
    return int(time.time() * 1000)


def _ms(later: float | None, earlier: float | None) -> float | None:
    if later is None or earlier is None:
        return None
    return round((later - earlier) * 1000.0, 1)


def dumps(payload: dict[str, object]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def finished_payload(job: Job) -> dict[str, object]:
    req = job.request
    tl = job.timeline
    # Audio heard: what the sink reported (or estimated when stopped); none before the first sample.
    if tl.played_ms is not None:
        audio_ms = tl.played_ms
    else:
        audio_ms = tl.audio_s * 1000.0 if tl.first_sample_out is not None else 0.0
    payload: dict[str, object] = {
        "id": req.id,
        "siteId": req.site_id,
        "sessionId": req.session_id,
        "origin": req.origin,
        "status": str(job.status),
        "ts": now_ms(),
        "audioMs": round(audio_ms, 1),
    }
    if job.error is not None:
        payload["error"] = {"code": str(job.error.code), "message": job.error.message}
    if job.truncated is not None:
        payload["truncated"] = job.truncated
    return payload


def latency_payload(job: Job, info: EngineInfo) -> dict[str, object]:
    req = job.request
    tl = job.timeline
    synth_ms = _ms(tl.synth_done, tl.synth_started)
    audio_ms = round(tl.audio_s * 1000.0, 1)
    return {
        "id": req.id,
        "siteId": req.site_id,
        "origin": req.origin,
        "output": "speaker" if req.output is None else "caller",
        "engine": info.engine,
        "model": info.model,
        "queuedMs": _ms(tl.dequeued, tl.received),
        "ttfaMs": _ms(tl.first_chunk, tl.received),
        "firstAudioOutMs": _ms(tl.first_sample_out, tl.received),
        "synthMs": synth_ms,
        "audioMs": audio_ms,
        "rtf": round(synth_ms / audio_ms, 4) if synth_ms is not None and audio_ms > 0 else None,
        "e2eMs": _ms(tl.last_sample_played, tl.received),
        "chunks": tl.chunks,
        "underruns": tl.underruns,
        "underrunMs": round(tl.underrun_ms, 1),
        "prebufferMs": round(tl.prebuffer_s * 1000.0, 1),
        "streamed": req.feed is not None,
        "firstTextMs": _ms(tl.first_text, tl.received),
        "firstChunkAfterTextMs": _ms(tl.first_chunk, tl.first_text),
    }


LiveListener = Callable[[str, dict[str, object]], None]
"""Hears each event ``MqttEvents`` publishes (the web page's live view: ``LiveFeed.add``): its kind
(``state``, ``started``, ``finished``, ``latency``, ``memory``, ``info``) and its payload, the object
the MQTT message encodes, as it is built (never decoded back from the message)."""


class MqttEvents:
    """The daemon's ``JobEvents``: turns a job's events into messages, never blocks. A terminal
    event's messages go to the ``outbox`` (journaled, published once committed); without one,
    and every other event, they are published at once. ``live`` hears each event's payload as it
    is published (a terminal event's when the job ends)."""

    def __init__(
        self,
        publish: Callable[[OutMessage], None],
        topics: Topics,
        info: EngineInfo,
        qos: int,
        hermes: bool,
        on_utterance_end: Callable[[], None],
        voice_kinds: Callable[[], dict[str, str]] | None = None,
        outbox: Outbox[OutMessage] | None = None,
        live: LiveListener | None = None,
    ) -> None:
        self._publish = publish
        self._live = live
        self.topics = topics
        self.info = info
        self.qos = qos
        self.hermes = hermes
        self.outbox = outbox
        self._on_utterance_end = on_utterance_end
        self._voice_kinds = voice_kinds
        """Every voice a request may name with its kind (presets and the library, scanned now)."""
        self._published_kinds: dict[str, str] | None = None
        self._kinds_checked = -math.inf
        self._state_dirty = asyncio.Event()
        self._last_state: Snapshot | None = None
        """The state last published."""
        self._state: Callable[[], Snapshot] | None = None
        """The pipeline's snapshot (``run_state``); None until it runs."""

    def _message(self, topic: str, payload: dict[str, object], qos: int | None = None) -> OutMessage:
        return OutMessage(topic, dumps(payload), self.qos if qos is None else qos)

    def _send(self, topic: str, payload: dict[str, object], qos: int | None = None) -> None:
        self._publish(self._message(topic, payload, qos))

    def _tell(self, kind: str, payload: dict[str, object]) -> None:
        if self._live is not None:
            self._live(kind, payload)

    # -- JobEvents ---------------------------------------------------------------------

    def started(self, job: Job) -> None:
        req = job.request
        payload: dict[str, object] = {
            "id": req.id,
            "siteId": req.site_id,
            "sessionId": req.session_id,
            "origin": req.origin,
            "ts": now_ms(),
            "queuedMs": _ms(job.timeline.dequeued, job.timeline.received),
            # What the text stage made of the text (null for a streamed text, still being written).
            "spokenChars": req.chars if req.feed is None else None,
            "textChanged": req.text_changed,
        }
        self._send(self.topics.started, payload)
        self._tell("started", payload)

    def finished(self, job: Job) -> None:
        messages, payload, latency = self._finished(job)
        self._tell("finished", payload)
        if latency is not None:
            self._tell("latency", latency)
        if self.outbox is not None:
            self.outbox.answer(job, messages)
        else:
            for message in messages:
                self._publish(message)
        if job.timeline.synth_started is not None:
            self._on_utterance_end()
        self._refresh_info(job)

    def finished_messages(self, job: Job) -> list[OutMessage]:
        """The terminal event's messages: ``tts/finished``, the v5 reply, Hermes', the latency."""
        return self._finished(job)[0]

    def _finished(self, job: Job) -> tuple[list[OutMessage], dict[str, object], dict[str, object] | None]:
        """The terminal event's messages, and the payloads of its ``tts/finished`` and latency event."""
        payload = finished_payload(job)
        log.info("request_finished", request_id=job.request.id, status=payload["status"], error=payload.get("error"))
        messages = [self._message(self.topics.finished, payload)]
        reply = job.request.reply_to
        if reply is not None:
            messages.append(OutMessage(reply.topic, dumps(payload), self.qos, False, reply.correlation_data or b""))
        if job.request.origin == "hermes":
            messages.extend(self._hermes_finished(job))
        latency = None
        if job.timeline.first_sample_out is not None:  # latency of what was heard; none for a silent end
            latency = latency_payload(job, self.info)
            messages.append(self._message(self.topics.latency, latency, qos=0))
        return messages, payload, latency

    def _refresh_info(self, job: Job) -> None:
        """Re-publish ``info`` when a request named a library voice, or an unknown one, and the library
        changed since ``info`` was published (scanned at most every ``INFO_RESCAN_S``)."""
        if self._voice_kinds is None or self._published_kinds is None:
            return
        voice = job.request.voice
        named = voice is not None and voice not in self.info.voices
        unknown = job.error is not None and job.error.code is ErrorCode.UNKNOWN_VOICE
        now = time.monotonic()
        if not (named or unknown) or now - self._kinds_checked < INFO_RESCAN_S:
            return
        self._kinds_checked = now
        if self._voice_kinds() != self._published_kinds:
            self._publish_info()

    def state_changed(self) -> None:
        """The ledger moved a job: a change of state or current id is published now (a state that
        lasts less than the publishing interval, a quick synthesis, is still published); a change
        of the queue's length alone is left to ``run_state``."""
        if self._state is not None:
            snapshot = self._state()
            last = self._last_state
            if not _transient(snapshot) and (last is None or snapshot[:2] != last[:2]):
                self._publish_state(snapshot)
        self._state_dirty.set()

    # -- Hermes ------------------------------------------------------------------------

    def _hermes_finished(self, job: Job) -> list[OutMessage]:
        req = job.request
        ids: dict[str, object] = {"id": req.id, "siteId": req.site_id, "sessionId": req.session_id}
        if job.status is Status.COMPLETED or job.status is Status.INTERRUPTED:
            return [self._message(HERMES_SAY_FINISHED, ids)]
        message = job.error.message if job.error is not None else str(job.status)
        error: dict[str, object] = {
            "error": message,
            "context": "tts",
            "siteId": req.site_id,
            "sessionId": req.session_id,
        }
        return [self._message(HERMES_ERROR, error), self._message(HERMES_SAY_FINISHED, ids)]

    # -- other events ------------------------------------------------------------------

    def vad(self, speaking: bool, signal_ms: float) -> None:
        payload: dict[str, object] = {"siteId": self.topics.site_id, "ts": now_ms(), "signalMs": round(signal_ms, 1)}
        self._send(self.topics.speech_started if speaking else self.topics.speech_stopped, payload, qos=0)
        if self.hermes:
            self._send(
                hermes_vad(self.topics.site_id, speaking),
                {"siteId": self.topics.site_id, "signalMs": round(signal_ms, 1)},
                qos=0,
            )

    def memory(self, payload: dict[str, object]) -> None:
        self._send(self.topics.memory, payload, qos=0)
        self._tell("memory", payload)

    def state_message(self, snapshot: Snapshot) -> OutMessage:
        """The retained state topic for (state, current id, queue length), published by the caller."""
        return self._state_message(snapshot)[0]

    def _state_message(self, snapshot: Snapshot) -> tuple[OutMessage, dict[str, object]]:
        self._last_state = snapshot
        state, current, queued = snapshot
        payload: dict[str, object] = {"state": state, "queue": queued, "currentId": current, "ts": now_ms()}
        return OutMessage(self.topics.state, dumps(payload), 1, True), payload

    def _publish_state(self, snapshot: Snapshot) -> None:
        message, payload = self._state_message(snapshot)
        self._publish(message)
        self._tell("state", payload)

    def info_message(self) -> OutMessage:
        """The retained info topic (the engine, its voices and languages), published by the caller."""
        return self._info_message()[0]

    def _publish_info(self) -> None:
        message, payload = self._info_message()
        self._publish(message)
        self._tell("info", payload)

    def _info_message(self) -> tuple[OutMessage, dict[str, object]]:
        info = self.info
        kinds = self._voice_kinds() if self._voice_kinds is not None else dict.fromkeys(info.voices, "preset")
        self._published_kinds = kinds
        payload = {
            "version": __version__,
            "siteId": self.topics.site_id,
            "engine": info.engine,
            "model": info.model,
            "device": info.device,
            "voices": list(info.voices),
            "voiceKinds": kinds,
            "languages": list(info.languages),
            "sampleRate": info.sample_rate,
        }
        if info.dtype:  # the weight format in use, and why (an engine that says)
            payload["format"] = info.dtype
            if info.format_reason:
                payload["formatReason"] = info.format_reason
        if info.isa:  # the native CPU kernels' instruction-set path, and why
            payload["isa"] = info.isa
        return OutMessage(self.topics.info, dumps(payload), 1, True), payload

    def status_message(self, online: bool) -> OutMessage:
        return OutMessage(self.topics.status, b"online" if online else b"offline", 1, True)

    async def run_state(self, state: Callable[[], Snapshot]) -> None:
        """Publish the retained state whenever it changed: every change of state or current id at
        once, in order (``state_changed``: idle, synthesizing, speaking, idle, none skipped, none
        repeated), and a change of the queue's length alone at most every ``STATE_MIN_INTERVAL_S``;
        ``state`` returns a ``Snapshot``."""
        self._state = state
        while True:
            await self._state_dirty.wait()
            self._state_dirty.clear()
            snapshot = state()
            if snapshot != self._last_state and not _transient(snapshot):
                self._publish_state(snapshot)
            await asyncio.sleep(STATE_MIN_INTERVAL_S)
