"""Home Assistant MQTT discovery: one device per site, its entities, and their removal.

Single-component discovery as Home Assistant documents it: one retained QoS 1 config per
entity on ``<ha.prefix>/<component>/<node_id>/<object_id>/config``, full key names, every
entity tied to one device (``unique_id`` + ``device.identifiers``) and available while our
retained ``<p>/<site>/status`` says ``online``. The entities read and write the daemon's
own topics, so Home Assistant goes through the same paths as every other client:

- ``notify`` (Say): Home Assistant publishes the message to ``<p>/<site>/tts/say`` as
  ``{"text": ...}`` (a command template, so a message that starts with ``{`` is still text);
- ``button`` (Stop): publishes ``{}`` to ``<p>/<site>/tts/stop`` (stop the current utterance);
- ``sensor`` State, Queue (the retained ``state`` topic), First audio latency
  (``firstAudioOutMs`` of ``metrics/latency``: receipt to the first sample played, ms) and
  Memory (``rssMiB`` of ``metrics/memory``).

With ``ha.discovery: false`` the same config topics get zero-length retained payloads on
connect: that deletes the broker's retained copies and tells Home Assistant to remove the
entities, and creates nothing where there were none.
"""

from __future__ import annotations

import asyncio
import re
import secrets

import structlog

from s2s_daemon import __version__
from s2s_daemon.config import DaemonConfig, HaConfig
from s2s_daemon.errors import UnavailableError
from s2s_daemon.events.publisher import dumps
from s2s_daemon.mqtt.connection import ConnectOptions, MqttError, MqttProtocol, publish_all, read_password, tls_context
from s2s_daemon.mqtt.packets import OutMessage
from s2s_daemon.mqtt.topics import Topics, ha_birth, ha_config
from s2s_daemon.pipeline.vocabulary import EngineInfo, model_name

log = structlog.get_logger(__name__)

ENTITIES: tuple[tuple[str, str], ...] = (
    ("notify", "say"),
    ("button", "stop"),
    ("sensor", "state"),
    ("sensor", "queue"),
    ("sensor", "latency"),
    ("sensor", "memory"),
)
"""(component, object id) of every entity; the removal clears exactly these config topics."""
STATES = ("idle", "synthesizing", "speaking")
"""The values of ``state`` in the retained state topic: the enum sensor's options."""
NOTIFY_TEMPLATE = "{{ {'text': value} | tojson }}"
LATENCY_TEMPLATE = (
    "{{ value_json.firstAudioOutMs if value_json.output == 'speaker'"
    " else (this.state if this.state | is_number else 'None') }}"
)
"""The room's first-audio latency: a caller's request (HTTP, Wyoming: audio streamed back, not played
here) keeps the sensor's value (``this``, Home Assistant 2022.9+); 'None' is Home Assistant's unknown."""
"""Home Assistant renders the notify message (``value``) into a say request."""
MANUFACTURER = "s2s-daemon"
BIRTH_ONLINE = b"online"
REMOVE_TIMEOUT_S = 10.0


def node_id(topics: Topics) -> str:
    """``<p>_<site>`` with what discovery topics do not allow (``[^a-zA-Z0-9_-]``) turned into ``_``."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", f"{topics.prefix}_{topics.site_id}")


def config_topics(ha_prefix: str, topics: Topics) -> list[str]:
    node = node_id(topics)
    return [ha_config(ha_prefix, component, node, object_id) for component, object_id in ENTITIES]


def removal_messages(ha_prefix: str, topics: Topics) -> list[OutMessage]:
    """Zero-length retained payloads on every config topic: Home Assistant removes the entities."""
    return [OutMessage(topic, b"", 1, True) for topic in config_topics(ha_prefix, topics)]


def config_payloads(config: HaConfig, topics: Topics, info: EngineInfo) -> dict[str, dict[str, object]]:
    """Config topic -> discovery payload, for every entity in ``ENTITIES`` order."""
    node = node_id(topics)
    device = {
        "identifiers": [node],
        "name": config.name or f"s2s {topics.site_id}",
        "manufacturer": MANUFACTURER,
        "model": f"{model_name(info.model)} ({info.engine})",
        "hw_version": info.device,
        "sw_version": __version__,
    }
    origin = {"name": MANUFACTURER, "sw_version": __version__}
    availability = [{"topic": topics.status, "payload_available": "online", "payload_not_available": "offline"}]

    def entity(object_id: str, name: str, **keys: object) -> dict[str, object]:
        return {
            "unique_id": f"{node}_{object_id}",
            "name": name,
            "availability": availability,
            "device": device,
            "origin": origin,
            **keys,
        }

    payloads = {
        "say": entity(
            "say",
            "Say",
            command_topic=topics.say,
            command_template=NOTIFY_TEMPLATE,
            qos=1,
            icon="mdi:account-voice",
        ),
        "stop": entity("stop", "Stop", command_topic=topics.stop, payload_press="{}", qos=1, icon="mdi:stop"),
        "state": entity(
            "state",
            "State",
            state_topic=topics.state,
            value_template="{{ value_json.state }}",
            device_class="enum",
            options=list(STATES),
            icon="mdi:account-voice",
        ),
        "queue": entity(
            "queue",
            "Queue",
            state_topic=topics.state,
            value_template="{{ value_json.queue }}",
            state_class="measurement",
            icon="mdi:tray-full",
        ),
        "latency": entity(
            "latency",
            "First audio latency",
            state_topic=topics.latency,
            value_template=LATENCY_TEMPLATE,
            device_class="duration",
            unit_of_measurement="ms",
            state_class="measurement",
            suggested_display_precision=0,
            entity_category="diagnostic",
        ),
        "memory": entity(
            "memory",
            "Memory",
            state_topic=topics.memory,
            value_template="{{ value_json.rssMiB }}",
            device_class="data_size",
            unit_of_measurement="MiB",
            state_class="measurement",
            suggested_display_precision=0,
            entity_category="diagnostic",
        ),
    }
    return {
        ha_config(config.prefix, component, node, object_id): payloads[object_id] for component, object_id in ENTITIES
    }


class HaDiscovery:
    """What the daemon publishes for Home Assistant on connect and on its birth message."""

    def __init__(self, config: HaConfig, topics: Topics, info: EngineInfo) -> None:
        self.config = config
        self.topics = topics
        self.info = info
        self.birth_topic = ha_birth(config.prefix)

    @property
    def enabled(self) -> bool:
        return self.config.discovery

    def subscriptions(self) -> list[str]:
        """Home Assistant's birth topic, only while discovery is on."""
        return [self.birth_topic] if self.enabled else []

    def config_messages(self) -> list[OutMessage]:
        payloads = config_payloads(self.config, self.topics, self.info)
        return [OutMessage(topic, dumps(payload), 1, True) for topic, payload in payloads.items()]

    def connect_messages(self) -> list[OutMessage]:
        """On every connect: the configs when on, their removal when off."""
        if self.enabled:
            return self.config_messages()
        return removal_messages(self.config.prefix, self.topics)

    def on_birth(self, payload: bytes) -> list[OutMessage]:
        """Home Assistant (re)started: the configs again, as its documentation recommends."""
        if not self.enabled or payload.strip() != BIRTH_ONLINE:
            return []
        log.info("ha_birth_republish", topic=self.birth_topic)
        return self.config_messages()


# -- removal from the command line ---------------------------------------------------------


async def remove_discovery(config: DaemonConfig, timeout_s: float = REMOVE_TIMEOUT_S) -> list[str]:
    """Clear this site's retained discovery configs on the configured broker; the topics cleared.

    A clean MQTT 3.1.1 session with a random client id and no Will: it never disturbs a
    running daemon's session or its ``status``.
    """
    mqtt = config.mqtt
    topics = Topics(mqtt.topic_prefix, config.site_id)
    messages = removal_messages(config.ha.prefix, topics)
    options = ConnectOptions(
        mqtt.host,
        mqtt.port,
        f"s2s-ha-remove-{secrets.token_hex(4)}",
        MqttProtocol.V311,
        username=mqtt.username,
        password=read_password(mqtt),
        tls=tls_context(mqtt.tls),
    )
    try:
        async with asyncio.timeout(timeout_s):
            await publish_all(options, messages)
    except (MqttError, TimeoutError) as exc:
        raise UnavailableError(
            f"mqtt {mqtt.host}:{mqtt.port}: cannot remove the Home Assistant entities: {exc or 'timed out'}"
        ) from exc
    return [message.topic for message in messages]
