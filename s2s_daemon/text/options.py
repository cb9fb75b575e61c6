"""What the text stage does for one request: the ``text:`` section, with a request's overrides."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, StrictBool
from pydantic.alias_generators import to_camel

from s2s_daemon.config import CodeBlocksMode, EmojiMode, NumbersMode, TextConfig


@dataclass(frozen=True, slots=True)
class TextOptions:
    """Each part of the stage, on or off (``config.TextConfig`` says what each value means)."""

    markdown: bool = True
    emoji: EmojiMode = "drop"
    urls: bool = True
    numbers: NumbersMode = "auto"
    code_blocks: CodeBlocksMode = "skip"

    @classmethod
    def from_config(cls, section: TextConfig) -> TextOptions:
        return cls(section.markdown, section.emoji, section.urls, section.numbers, section.code_blocks)

    def overridden(self, overrides: TextOverrides | None) -> TextOptions:
        """These options with what a request set in its own ``overrides`` (None: unchanged)."""
        if overrides is None:
            return self
        return replace(self, **overrides.model_dump(exclude_none=True))


class TextOverrides(BaseModel):
    """A request's own choices (an MQTT payload's ``textOptions``), each key optional and spelt in
    camelCase as the payload's other keys (``codeBlocks``; the section's own spelling is read too);
    a key that is not one of the section's, or a value of the wrong type, is refused (``bad_payload``)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, validate_by_name=True, validate_by_alias=True
    )

    markdown: StrictBool | None = None
    emoji: EmojiMode | None = None
    urls: StrictBool | None = None
    numbers: NumbersMode | None = None
    code_blocks: CodeBlocksMode | None = None
