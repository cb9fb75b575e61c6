"""What the text stage does for one request: the ``text:`` section, with a request's overrides."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, StrictBool

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
    """A request's own choices (an MQTT payload's object of them), each key optional; a key that
    is not one of the section's, or a value of the wrong type, is refused (``bad_request``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    markdown: StrictBool | None = None
    emoji: EmojiMode | None = None
    urls: StrictBool | None = None
    numbers: NumbersMode | None = None
    code_blocks: CodeBlocksMode | None = None
