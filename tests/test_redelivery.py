"""A broker redelivery (DUP) of a request already received is acknowledged without a second
answer; a client's own repeat of an id is answered ``rejected`` / ``duplicate``."""

from __future__ import annotations

import json

from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.intake.mqtt import MqttIntake
from s2s_daemon.mqtt.packets import InMessage
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.pipeline.jobs import Job, Ledger
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.voice_policy import VoicePolicy

TOPICS = Topics("s2s", "kitchen")
RULES = IntakeRules("kitchen", 2000, VoicePolicy(("Ryan",), "Ryan"), ("auto", "english"), "auto")


class Events:
    def __init__(self) -> None:
        self.finished_ids: list[str] = []

    def started(self, job: Job) -> None:
        return None

    def finished(self, job: Job) -> None:
        self.finished_ids.append(job.request.id)

    def state_changed(self) -> None:
        return None


def message(rid: str, redelivered: bool) -> InMessage:
    payload = json.dumps({"id": rid, "text": "Hello."}).encode()
    return InMessage(TOPICS.say, payload, None, 0.0, None, redelivered=redelivered)


def test_a_redelivery_is_not_answered_twice_but_a_repeat_is() -> None:
    events = Events()
    queue = RequestQueue(8)
    ledger = Ledger(queue, events, 64)
    intake = MqttIntake(ledger, RULES, TOPICS, hermes=False)
    intake.handle(message("r1", redelivered=False))
    assert len(queue) == 1
    intake.handle(message("r1", redelivered=True))  # the broker's copy: nothing new
    assert len(queue) == 1 and events.finished_ids == []
    intake.handle(message("r1", redelivered=False))  # the client sent the id again
    assert events.finished_ids == ["r1"] and ledger.jobs["r1"].request.id == "r1"  # the original goes on
    intake.handle(message("new", redelivered=True))  # a first delivery may carry DUP too
    assert len(queue) == 2


def test_a_retained_stop_stops_nothing() -> None:
    """A stop kept by the broker comes again at every subscription (every reconnect): it must not cut
    what is speaking then; a stop sent now does."""
    events = Events()
    queue = RequestQueue(8)
    ledger = Ledger(queue, events, 64)
    intake = MqttIntake(ledger, RULES, TOPICS, hermes=False)
    intake.handle(message("r1", redelivered=False))
    intake.handle(InMessage(TOPICS.stop, b'{"all": true}', None, 0.0, None, retained=True))
    assert len(queue) == 1 and events.finished_ids == []
    intake.handle(InMessage(TOPICS.stop, b'{"all": true}', None, 0.0, None))
    assert events.finished_ids == ["r1"]
