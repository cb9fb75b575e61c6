"""Routes incoming MQTT messages: say, stop, pool, Hermes. Never raises on bad input."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from s2s_daemon.intake.schemas import IntakeRules, StopPayload, decode_json_object, parse_say
from s2s_daemon.mqtt.messages import InMessage
from s2s_daemon.mqtt.topics import HERMES_SAY, Topics
from s2s_daemon.pipeline.jobs import Dispatcher
from s2s_daemon.pipeline.messages import SayRequest

log = structlog.get_logger(__name__)

HERMES_DEFAULT_SITE = "default"


class MqttIntake:
    def __init__(
        self,
        dispatcher: Dispatcher,
        rules: IntakeRules,
        topics: Topics,
        hermes: bool,
        ha_birth: tuple[str, Callable[[bytes], None]] | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.rules = rules
        self.topics = topics
        self.hermes = hermes
        self.ha_birth = ha_birth
        """Home Assistant's birth topic and what to do with its payload (discovery on)."""

    def handle(self, message: InMessage) -> None:
        topic = message.topic
        if topic == self.topics.say:
            self.say(message, "mqtt")
        elif topic == self.topics.pool_say:
            self.say(message, "pool")
        elif topic == self.topics.stop:
            self.stop(message.payload)
        elif self.hermes and topic == HERMES_SAY:
            self.hermes_say(message)
        elif self.ha_birth is not None and topic == self.ha_birth[0]:
            self.ha_birth[1](message.payload)
        else:
            log.debug("message_ignored", topic=topic)

    def say(self, message: InMessage, origin: str) -> SayRequest:
        # Latency counts from the moment the message came off the socket, not from here.
        parsed = parse_say(
            message.payload, self.rules, origin=origin, reply_to=message.reply_to, received_at=message.received_at
        )
        if parsed.error is not None:
            log.debug(
                "request_rejected",
                request_id=parsed.request.id,
                code=str(parsed.error.code),
                reason=parsed.error.message,
            )
            self.dispatcher.reject(parsed.request, parsed.error.code, parsed.error.message)
        else:
            self.dispatcher.submit(parsed.request)
        return parsed.request

    def hermes_say(self, message: InMessage) -> None:
        data, _ = decode_json_object(message.payload)
        site = data.get("siteId", HERMES_DEFAULT_SITE) if data is not None else None
        if data is not None and site != self.rules.site_id:
            return  # another site's request
        self.say(message, "hermes")

    def stop(self, payload: bytes) -> None:
        data, why = decode_json_object(payload)
        if data is None:
            log.warning("stop_rejected", reason=why)
            return
        try:
            stop = StopPayload.model_validate(data)
        except ValueError as exc:
            log.warning("stop_rejected", reason=str(exc))
            return
        if stop.all:
            count = self.dispatcher.stop_all()
            log.info("stop_all", stopped=count)
        elif stop.id is not None:
            found = self.dispatcher.stop_id(stop.id)
            log.info("stop_id", target=stop.id, found=found)
        else:
            found = self.dispatcher.stop_current()
            log.info("stop_current", found=found)
