"""``configs/default.yaml`` "lists every key with its default": the file and the schema stay equal,
key for key and value for value, whatever is added to either later."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from s2s_daemon.config import DaemonConfig, TtsConfig, load_config
from s2s_daemon.engines import sections as engine_sections

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def section_of(annotation: Any) -> type[BaseModel] | None:
    """The model of a field that is a section (``TtsConfig``), None for a value (an ``X | None``
    holding a model, such as ``mqtt.tls``, is a value whose default is written as ``null``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def keys_of(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """A section's keys, each with its model when it is a section itself; ``tts`` has each
    registered engine's own block besides its fields (``tts.torch``: ``engines.py``)."""
    found = {name: section_of(field.annotation) for name, field in model.model_fields.items()}
    return {**found, **engine_sections()} if model is TtsConfig else found


def schema_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for name, section in keys_of(model).items():
        keys |= schema_keys(section, f"{prefix}{name}.") if section is not None else {f"{prefix}{name}"}
    return keys


def file_keys(data: dict[str, Any], model: type[BaseModel], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for name, value in data.items():
        section = keys_of(model).get(str(name))
        if section is not None and isinstance(value, dict):
            keys |= file_keys(value, section, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_the_default_file_has_every_key_of_the_schema_and_no_other() -> None:
    data = yaml.safe_load(DEFAULT_YAML.read_text(encoding="utf-8"))
    missing = sorted(schema_keys(DaemonConfig) - file_keys(data, DaemonConfig))
    unknown = sorted(file_keys(data, DaemonConfig) - schema_keys(DaemonConfig))
    assert missing == [], f"configs/default.yaml lacks {missing}"
    assert unknown == [], f"configs/default.yaml has keys the schema does not: {unknown}"


def test_the_default_file_says_the_defaults() -> None:
    from_file = load_config(DEFAULT_YAML, environ={}).model_dump()
    defaults = DaemonConfig().model_dump()
    differ = {key: (from_file[key], defaults[key]) for key in defaults if from_file[key] != defaults[key]}
    assert differ == {}, f"configs/default.yaml says (file, schema): {differ}"


def test_the_walk_sees_sections_and_values() -> None:
    """The helpers themselves: a section is walked into, an optional model is one value."""
    keys = schema_keys(DaemonConfig)
    assert {"mqtt.tls", "tts.torch.quantization", "tts.options", "site_id"} <= keys
    assert not any(key.startswith("mqtt.tls.") for key in keys)
    assert file_keys({"mqtt": {"port": 1}, "tts": {"torch": {"dtype": "auto"}}}, DaemonConfig) == {
        "mqtt.port",
        "tts.torch.dtype",
    }
