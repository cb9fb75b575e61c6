"""Property tests: whatever arrives, the say and stop parsers and the config loader answer with a
code or a message naming the key, and never raise anything else."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError
from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.intake.mqtt import MqttIntake
from s2s_daemon.intake.schemas import parse_say
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.pipeline.jobs import Job, Ledger
from s2s_daemon.pipeline.messages import ErrorCode
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.voice_policy import VoicePolicy

RULES = IntakeRules(
    site_id="kitchen",
    max_text_chars=200,
    voices=VoicePolicy(("Ryan", "Vivian"), "Ryan"),
    languages=("auto", "english", "chinese"),
    default_language="auto",
)
FIELDS = ["id", "text", "voice", "language", "lang", "instruct", "sessionId", "siteId", "priority"]
FIELDS += ["interrupt", "ttlMs", "volume", "all", "x"]

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
say_objects = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8)
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_parsed(payload: bytes) -> None:
    parsed = parse_say(payload, RULES)
    if parsed.error is None:
        request = parsed.request
        assert request.text.strip() and len(request.text) <= RULES.max_text_chars
        assert request.voice in RULES.voices.presets and request.language in RULES.languages
        assert 0.0 <= request.volume <= 2.0
    else:
        assert isinstance(parsed.error.code, ErrorCode) and parsed.error.message
    assert parsed.request.id  # every answer carries an id, generated when the payload had none


@PROPERTY
@given(st.binary(max_size=300))
def test_any_bytes_are_a_request_or_a_coded_rejection(payload: bytes) -> None:
    check_parsed(payload)


@pytest.mark.slow
@PROPERTY
@given(say_objects)
def test_any_json_object_is_a_request_or_a_coded_rejection(data: dict[str, Any]) -> None:
    check_parsed(json.dumps(data).encode())


@PROPERTY
@given(st.text(max_size=300))
def test_any_text_is_a_request_or_a_coded_rejection(text: str) -> None:
    check_parsed(text.encode("utf-8", "surrogatepass"))


class _Quiet:
    def started(self, job: Job) -> None:
        return None

    def finished(self, job: Job) -> None:
        return None

    def state_changed(self) -> None:
        return None


@pytest.mark.slow
@PROPERTY
@given(st.binary(max_size=200) | say_objects.map(lambda d: json.dumps(d).encode()))
def test_any_stop_payload_is_handled_or_logged(payload: bytes) -> None:
    intake = MqttIntake(Ledger(RequestQueue(4), _Quiet(), 16), RULES, Topics("s2s", "kitchen", None), False)
    intake.stop(payload)  # never raises; a bad one is logged and ignored


SECTIONS = {
    "mqtt": ["broker", "host", "port", "qos", "topic_prefix", "prot"],
    "tts": ["engine", "model", "voice", "chunk_frames", "max_text_chars", "torch", "mlx", "options"],
    "queue": ["max_pending", "dedup_window"],
    "audio": ["sink", "latency_ms", "wav_dir"],
    "vad": ["enabled", "policy", "frame_ms"],
    "log": ["format", "level"],
    "nonsense": ["a"],
}
KEYS = sorted({key for keys in SECTIONS.values() for key in keys})
config_trees = st.dictionaries(
    st.sampled_from(sorted(SECTIONS)),
    st.one_of(scalars, st.dictionaries(st.sampled_from(KEYS), json_values, max_size=4)),
    max_size=4,
)
ENV_KEYS = ["S2S_MQTT__PORT", "S2S_TTS__CHUNK_FRAMES", "S2S_QUEUE__MAX_PENDING", "S2S_LOG__LEVEL", "S2S_MQTT__PROT"]


@pytest.mark.slow
@PROPERTY
@given(config_trees)
def test_any_config_loads_or_names_the_key(tree: dict[str, Any]) -> None:
    text = yaml.safe_dump(tree)
    try:
        load_config(None, {}) if not tree else _load_text(text)
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith(("invalid configuration", "configuration "))
        named = [line for line in message.splitlines()[1:] if ": " in line]
        assert named or "top level" in message, message


@PROPERTY
@given(st.dictionaries(st.sampled_from(ENV_KEYS), st.text(max_size=12), max_size=3))
def test_any_environment_override_loads_or_names_the_variable(env: dict[str, str]) -> None:
    try:
        load_config(None, env)
    except ConfigError as exc:
        assert any(name in str(exc) for name in env), str(exc)


def _load_text(text: str) -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "c.yaml"
        path.write_text(text)
        load_config(path, {})


@pytest.mark.parametrize("payload", [b"\xff\xfe", b"{", b'{"text": 1}', b"\x00", b'{"text": "a\\u0000"}'])
def test_known_bad_payloads_are_coded(payload: bytes) -> None:
    assert parse_say(payload, RULES).error is not None
