"""The text stage: what an assistant wrote (Markdown, emoji, links, numbers) as what is spoken.

``TextStage(config.text)`` once; per request ``stage.prepare(text, language, overrides)``, per
streamed text ``stage.stream(language, overrides)`` and its ``feed``/``close`` (docs/text.md).
"""

from s2s_daemon.text.options import TextOptions, TextOverrides
from s2s_daemon.text.stage import SpokenText, StreamingTextStage, TextStage, prepare_text

__all__ = ["SpokenText", "StreamingTextStage", "TextOptions", "TextOverrides", "TextStage", "prepare_text"]
