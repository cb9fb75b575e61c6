"""Home Assistant MQTT discovery against a real mosquitto, with the daemon in this process.

Every payload is checked against the keys Home Assistant's documentation lists for its
component (required and allowed, for the entity, its device, origin and availability),
and every template is rendered the way Home Assistant renders it (a sandboxed Jinja
environment) on what the daemon really publishes.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from s2s_daemon import cli
from s2s_daemon.config import HaConfig, load_config
from s2s_daemon.errors import ConfigError
from s2s_daemon.events.discovery import config_payloads, node_id
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.pipeline.vocabulary import EngineInfo
from s2s_daemon.service import ServiceCommand
from tests.support.broker import Mosquitto
from tests.support.daemon import daemon_in_process, write_config
from tests.support.mqtt import Recorder, recorder

pytestmark = pytest.mark.timeout(60)

HA = "homeassistant"
BARRIER = "test/barrier"
SLOW = {"speed": "1", "ms_per_char": "100"}

# -- Home Assistant's discovery schema, from its documentation (home-assistant.io/integrations/
# mqtt, notify.mqtt, button.mqtt, sensor.mqtt), full key names -------------------------------

TOPIC_RE = re.compile(r"^homeassistant/(?P<component>\w+)/(?:(?P<node_id>[a-zA-Z0-9_-]+)/)?[a-zA-Z0-9_-]+/config$")
COMMON = {
    "availability",
    "availability_mode",
    "availability_template",
    "availability_topic",
    "default_entity_id",
    "device",
    "enabled_by_default",
    "encoding",
    "entity_category",
    "entity_picture",
    "icon",
    "json_attributes_template",
    "json_attributes_topic",
    "name",
    "object_id",
    "origin",
    "payload_available",
    "payload_not_available",
    "platform",
    "qos",
    "unique_id",
}
SCHEMA: dict[str, tuple[set[str], set[str]]] = {
    # component: (required, allowed besides COMMON)
    "notify": ({"command_topic"}, {"command_template", "command_topic", "retain"}),
    "button": ({"command_topic"}, {"command_template", "command_topic", "device_class", "payload_press", "retain"}),
    "sensor": (
        {"state_topic"},
        {
            "device_class",
            "expire_after",
            "force_update",
            "last_reset_value_template",
            "options",
            "state_class",
            "state_topic",
            "suggested_display_precision",
            "unit_of_measurement",
            "value_template",
        },
    ),
}
DEVICE_KEYS = {
    "configuration_url",
    "connections",
    "hw_version",
    "identifiers",
    "manufacturer",
    "model",
    "model_id",
    "name",
    "serial_number",
    "suggested_area",
    "sw_version",
    "via_device",
}
ORIGIN_KEYS = {"name", "sw_version", "support_url"}
AVAILABILITY_KEYS = {"topic", "payload_available", "payload_not_available", "value_template"}
STATE_CLASSES = {"measurement", "measurement_angle", "total", "total_increasing"}
UNITS = {"duration": {"d", "h", "min", "s", "ms", "µs"}, "data_size": {"B", "kB", "KiB", "MB", "MiB", "GB", "GiB"}}


def _is_number(value: object) -> bool:
    """Home Assistant's ``is_number`` filter."""
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


JINJA = ImmutableSandboxedEnvironment()
JINJA.filters["is_number"] = _is_number


@dataclass
class State:
    """Home Assistant's state object, as ``this`` in an MQTT template (2022.9+)."""

    state: str = "unknown"


def render(template: str, payload: bytes, this: State | None = None) -> str:
    """As Home Assistant renders ``value_template`` / ``command_template``."""
    try:
        value_json = json.loads(payload)
    except ValueError:
        value_json = None
    return JINJA.from_string(template).render(value=payload.decode(), value_json=value_json, this=this or State())


def check_ha_schema(topic: str, config: dict[str, Any]) -> str:
    """Assert ``config`` is a valid discovery payload for the component in ``topic``; return that."""
    match = TOPIC_RE.match(topic)
    assert match, f"not a discovery topic: {topic}"
    component = match["component"]
    required, allowed = SCHEMA[component]
    assert required <= config.keys(), (topic, required - config.keys())
    assert config.keys() <= COMMON | allowed, (topic, config.keys() - COMMON - allowed)
    # an entity of a device needs a unique id; the device one identifier at least
    assert isinstance(config["unique_id"], str) and config["unique_id"]
    device = config["device"]
    assert device.keys() <= DEVICE_KEYS, device.keys() - DEVICE_KEYS
    assert device.get("identifiers") or device.get("connections")
    assert all(isinstance(v, str) for k, v in device.items() if k != "identifiers")
    assert "name" in config["origin"] and config["origin"].keys() <= ORIGIN_KEYS
    # availability: a list of {topic, ...}, never together with availability_topic
    assert "availability_topic" not in config
    for entry in config["availability"]:
        assert "topic" in entry and entry.keys() <= AVAILABILITY_KEYS
    assert config.get("qos", 0) in (0, 1, 2)
    assert config.get("entity_category") in (None, "config", "diagnostic")
    for key in ("command_topic", "state_topic"):
        if key in config:
            assert isinstance(config[key], str) and not set(config[key]) & set("+#")
    if component == "sensor":
        device_class = config.get("device_class")
        assert config.get("state_class") in STATE_CLASSES | {None}
        if device_class == "enum":
            assert config["options"] and "unit_of_measurement" not in config and "state_class" not in config
        if device_class in UNITS:
            assert config["unit_of_measurement"] in UNITS[device_class]
    return component


async def retained_configs(port: int) -> dict[str, bytes]:
    """What a client joining now gets under ``homeassistant/#`` (retained messages only)."""
    async with recorder(port, subscribe=(f"{HA}/#", BARRIER)) as rec:
        # the broker sends a subscription's retained messages before it reads our next packet
        await rec.client.publish(BARRIER, b"x", qos=1)
        await rec.wait_for(lambda: rec.on(BARRIER))
        return {m.topic: m.payload for m in rec.messages if m.topic.startswith(f"{HA}/")}


async def online(rec: Recorder) -> None:
    await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")))


def cfg(tmp_path: Path, broker: Mosquitto, discovery: bool, **sections: Any) -> Path:
    return write_config(tmp_path / "daemon.yaml", broker.port, ha={"discovery": discovery}, **sections)


def configs_of(rec: Recorder) -> dict[str, dict[str, Any]]:
    return {m.topic: m.json() for m in rec.messages if m.topic.endswith("/config") and m.payload}


def entity(configs: dict[str, dict[str, Any]], component: str, object_id: str) -> dict[str, Any]:
    return configs[f"{HA}/{component}/s2s_kitchen/{object_id}/config"]


# -- tests -------------------------------------------------------------------------------


@pytest.mark.integration
async def test_configs_are_retained_valid_and_read_our_topics(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto, True)):
        await online(rec)
        await rec.say("s2s/kitchen/tts/say", {"id": "m1", "text": "Measure me"})
        await rec.wait_for(lambda: rec.on("/metrics/latency") and rec.on("/metrics/memory"))
        retained = await retained_configs(mosquitto.port)
    assert len(retained) == 6
    configs = {topic: json.loads(payload) for topic, payload in retained.items()}
    components = sorted(check_ha_schema(topic, config) for topic, config in configs.items())
    assert components == ["button", "notify", "sensor", "sensor", "sensor", "sensor"]
    # one device, every entity available while our retained status says online
    assert len({json.dumps(c["device"], sort_keys=True) for c in configs.values()}) == 1
    assert len({c["unique_id"] for c in configs.values()}) == 6
    device = next(iter(configs.values()))["device"]
    assert device["identifiers"] == ["s2s_kitchen"] and device["name"] == "s2s kitchen" and device["sw_version"]
    assert device["model"].endswith(" (tone)") and device["hw_version"] == "cpu"
    for config in configs.values():
        assert config["availability"] == [
            {"topic": "s2s/kitchen/status", "payload_available": "online", "payload_not_available": "offline"}
        ]
    assert entity(configs, "notify", "say")["command_topic"] == "s2s/kitchen/tts/say"
    button = entity(configs, "button", "stop")
    assert button["command_topic"] == "s2s/kitchen/tts/stop" and button["payload_press"] == "{}"
    # each sensor's template, on what the daemon published
    last = {suffix: rec.on(suffix)[-1].payload for suffix in ("/state", "/metrics/latency", "/metrics/memory")}
    state = entity(configs, "sensor", "state")
    assert state["state_topic"] == "s2s/kitchen/state"
    assert render(state["value_template"], last["/state"]) in state["options"]
    queue = entity(configs, "sensor", "queue")
    assert queue["state_topic"] == "s2s/kitchen/state" and render(queue["value_template"], last["/state"]) == "0"
    latency = entity(configs, "sensor", "latency")
    assert latency["state_topic"] == "s2s/kitchen/metrics/latency" and latency["unit_of_measurement"] == "ms"
    first_audio = json.loads(last["/metrics/latency"])["firstAudioOutMs"]
    assert float(render(latency["value_template"], last["/metrics/latency"])) == first_audio
    # a caller's request (HTTP, Wyoming) is not the room's: the sensor keeps its value, or stays unknown
    caller = json.dumps({**json.loads(last["/metrics/latency"]), "output": "caller", "firstAudioOutMs": 1.0})
    assert render(latency["value_template"], caller.encode(), State("312.5")) == "312.5"
    assert render(latency["value_template"], caller.encode(), State("unknown")) == "None"
    memory = entity(configs, "sensor", "memory")
    assert memory["state_topic"] == "s2s/kitchen/metrics/memory" and memory["unit_of_measurement"] == "MiB"
    assert float(render(memory["value_template"], last["/metrics/memory"])) > 10


@pytest.mark.integration
async def test_notify_speaks_and_the_button_stops(tmp_path: Path, mosquitto: Mosquitto) -> None:
    path = cfg(tmp_path, mosquitto, True, tts={"options": SLOW})
    async with recorder(mosquitto.port, subscribe=("s2s/#", f"{HA}/#")) as rec, daemon_in_process(path):
        await online(rec)
        await rec.wait_for(lambda: len(configs_of(rec)) == 6)
        notify = entity(configs_of(rec), "notify", "say")
        button = entity(configs_of(rec), "button", "stop")

        async def send_message(message: str) -> None:  # what HA's notify.send_message publishes
            payload = render(notify["command_template"], message.encode())
            await rec.client.publish(notify["command_topic"], payload, qos=notify.get("qos", 0))

        await send_message("{Braces} are text too")
        await rec.wait_for(lambda: rec.finished(), 15)
        assert [p["status"] for p in rec.finished().values()] == ["completed"]
        await send_message("a long message that takes several seconds to speak at real time")
        await rec.wait_for(lambda: len(rec.payloads("/tts/started")) == 2, 15)
        await rec.client.publish(button["command_topic"], button["payload_press"], qos=button.get("qos", 0))
        await rec.wait_for(lambda: len(rec.finished()) == 2, 15)
        statuses = [p["status"] for p in rec.finished().values()]
        assert statuses == ["completed", "interrupted"]
        assert list(rec.finished().values())[1]["audioMs"] < 4000


@pytest.mark.integration
async def test_home_assistant_birth_republishes(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with (
        recorder(mosquitto.port, subscribe=("s2s/#", f"{HA}/#")) as rec,
        daemon_in_process(cfg(tmp_path, mosquitto, True)),
    ):
        await online(rec)
        await rec.wait_for(lambda: len(configs_of(rec)) == 6)

        announced = len(rec.messages)  # the recorder was there first: the configs came live

        def republished() -> list[str]:
            return [m.topic for m in rec.messages[announced:] if m.topic.endswith("/config") and m.payload]

        await rec.client.publish(f"{HA}/status", b"offline", qos=1)  # HA going away: nothing
        await rec.say("s2s/kitchen/tts/say", {"id": "barrier", "text": "after the offline"})
        await rec.wait_finished(["barrier"])
        assert republished() == []
        await rec.client.publish(f"{HA}/status", b"online", qos=1)  # HA (re)started
        await rec.wait_for(lambda: len(republished()) == 6)
        assert sorted(republished()) == sorted(configs_of(rec))


@pytest.mark.integration
async def test_turning_it_off_removes_the_entities(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto, True)):
        await online(rec)
    assert len(await retained_configs(mosquitto.port)) == 6
    async with (
        recorder(mosquitto.port, subscribe=("s2s/#", f"{HA}/#")) as rec,
        daemon_in_process(cfg(tmp_path, mosquitto, False)),
    ):
        await online(rec)
        # the leftovers (delivered retained on subscribe) are cleared: empty payloads on each
        await rec.wait_for(lambda: len([m for m in rec.messages if m.topic.endswith("/config") and not m.retain]) == 6)
        cleared = [m for m in rec.messages if m.topic.endswith("/config") and not m.retain]
        assert all(m.payload == b"" for m in cleared)
        assert await retained_configs(mosquitto.port) == {}


@pytest.mark.integration
async def test_off_by_default_announces_nothing(tmp_path: Path, mosquitto: Mosquitto) -> None:
    path = write_config(tmp_path / "daemon.yaml", mosquitto.port)
    async with (
        recorder(mosquitto.port, subscribe=("s2s/#", f"{HA}/#")) as rec,
        daemon_in_process(path) as daemon,
    ):
        assert daemon.config.ha.discovery is False
        await online(rec)
        await rec.client.publish(f"{HA}/status", b"online", qos=1)
        await rec.say("s2s/kitchen/tts/say", {"id": "barrier", "text": "after the birth"})
        await rec.wait_finished(["barrier"])
        configs = [m for m in rec.messages if m.topic.endswith("/config")]
        assert len(configs) == 6 and all(m.payload == b"" for m in configs)  # cleared, never announced
    assert await retained_configs(mosquitto.port) == {}


@pytest.mark.integration
async def test_ha_remove_command_and_service_uninstall(tmp_path: Path, mosquitto: Mosquitto) -> None:
    path = cfg(tmp_path, mosquitto, True)
    for remove in ("cli", "service"):
        async with recorder(mosquitto.port) as rec, daemon_in_process(path):
            await online(rec)
        assert len(await retained_configs(mosquitto.port)) == 6
        if remove == "cli":
            assert await asyncio.to_thread(cli.main, ["ha", "remove", "-c", str(path)]) == 0
        else:
            out = io.StringIO()
            uninstall = ServiceCommand(
                action="uninstall",
                scope="user",
                manager="systemd",
                config=path,
                runner=lambda argv: 0,
                query=lambda argv: (0, ""),
                env={},
                home=tmp_path / "home",
                out=out,
                err=io.StringIO(),
            )
            assert await asyncio.to_thread(uninstall.uninstall) == 0  # the service manager faked
            assert "removed the Home Assistant entities (6 discovery configs cleared)" in out.getvalue()
        assert await retained_configs(mosquitto.port) == {}


def test_ha_remove_without_a_broker_is_unavailable(tmp_path: Path) -> None:
    from tests.support.broker import free_port

    path = write_config(tmp_path / "daemon.yaml", free_port(), ha={"discovery": True})
    assert cli.main(["ha", "remove", "-c", str(path)]) == 69


def test_ha_remove_with_the_embedded_broker_and_no_daemon_says_the_configs_ended_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 69, "Connection refused" (issue 41, item 12)."""
    from tests.support.broker import free_port

    port = free_port()
    path = write_config(tmp_path / "daemon.yaml", port, mqtt={"broker": "embedded", "port": port})
    assert cli.main(["ha", "remove", "-c", str(path)]) == 0
    said = capsys.readouterr().out
    assert f"nothing to clear on 127.0.0.1:{port}: the embedded broker" in said
    assert "the discovery configs ended with the daemon" in said and "ha.discovery: false" in said


def test_ha_config_is_validated(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("ha: {discovery: true, prefx: ha}\n")
    with pytest.raises(ConfigError, match=r"ha\.prefx: unknown key; did you mean ha\.prefix\?"):
        load_config(path, environ={})
    path.write_text("ha: {prefix: 'home/#'}\n")
    with pytest.raises(ConfigError, match=r"ha\.prefix"):
        load_config(path, environ={})
    config = load_config(None, environ={"S2S_HA__DISCOVERY": "true", "S2S_HA__NAME": "Kitchen voice"})
    assert config.ha.discovery and config.ha.prefix == HA and config.ha.name == "Kitchen voice"


def test_the_device_model_is_a_name_not_a_path() -> None:
    topics = Topics("s2s", "kitchen")
    for model, shown in [
        ("/home/ann/models/my-tiny", "my-tiny (torch)"),
        ("/root/.cache/huggingface/hub/models--Qwen--Qwen3-TTS-12Hz-0.6B-Base/snapshots/abc", None),
        ("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice (torch)"),
    ]:
        payloads = config_payloads(HaConfig(discovery=True), topics, EngineInfo("torch", model, "cpu", 24000))
        device = next(iter(payloads.values()))["device"]
        assert isinstance(device, dict)
        assert device["model"] == (shown or "Qwen/Qwen3-TTS-12Hz-0.6B-Base (torch)"), device
        assert "/home" not in str(device) and "/root" not in str(device)


def test_topics_stay_valid_for_any_site_and_prefix() -> None:
    info = EngineInfo(engine="torch", model="/models/my tts", device="cuda:0", sample_rate=24000)
    config = load_config(None, environ={"S2S_HA__PREFIX": "ha/test", "S2S_HA__NAME": "Living room"}).ha
    topics = Topics("voice.home", "living room")
    assert node_id(topics) == "voice_home_living_room"
    payloads = config_payloads(config, topics, info)
    for topic, payload in payloads.items():
        assert check_ha_schema(topic.replace("ha/test/", f"{HA}/", 1), payload)
        device = payload["device"]
        assert isinstance(device, dict) and device["name"] == "Living room"
        assert device["model"] == "my tts (torch)" and device["hw_version"] == "cuda:0"
    assert set(payloads) == {
        "ha/test/notify/voice_home_living_room/say/config",
        "ha/test/button/voice_home_living_room/stop/config",
        "ha/test/sensor/voice_home_living_room/state/config",
        "ha/test/sensor/voice_home_living_room/queue/config",
        "ha/test/sensor/voice_home_living_room/latency/config",
        "ha/test/sensor/voice_home_living_room/memory/config",
    }
