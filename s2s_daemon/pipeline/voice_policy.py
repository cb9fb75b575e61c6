"""What a voice name means for the loaded model and its voice library: the one place for it.

A request names a voice (or none); ``VoicePolicy.resolve`` says which voice that is: one of the
model's preset speakers (any case), a library voice the model can speak (``tts.voices_dir``; a
preset wins a clash of names), the default when it names none, or ``UnknownVoiceError`` saying what
to choose. A Base model has no voice of its own: without a library voice to default to, a request
that names none is refused with the reason (``no_default``). OpenAI's built-in names (``alloy``...)
speak with the default unless one of ours has that name (``from_openai``: the speech API). What
every door, the command line and the events know of voices comes from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from s2s_daemon.pipeline.vocabulary import EngineError, UnknownVoiceError, match_voice
from s2s_daemon.pipeline.voices import VoiceKind, VoiceLibrary

OPENAI_VOICES = frozenset(
    {"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer", "verse"}
)
"""OpenAI's built-in voices: clients send them by default (Open WebUI: ``alloy``); they speak with
``tts.voice``, unless a preset or a library voice has that name (``VoicePolicy.is_ours``). Any other
name that is none of the daemon's voices is ``unknown_voice``."""


@dataclass(frozen=True, slots=True)
class VoicePolicy:
    """The voices a request may name on this model, and the one it gets when it names none."""

    presets: tuple[str, ...]
    """The model's preset speakers (``EngineInfo.voices``)."""
    default: str | None
    """The voice of a request that names none (a preset or a library voice); None: the model's own."""
    library: VoiceLibrary | None = None
    """Named cloned / designed voices (``tts.voices_dir``); preset speakers win a clash of names."""
    no_default: str | None = None
    """Why a request must name its voice (a Base model with no ``tts.voice``: nothing to clone); a
    request that names none is rejected ``unknown_voice`` with it. None: the default applies."""

    def resolve(self, value: str | None) -> str | None:
        """The canonical name of the requested voice (a preset or a library voice); None: the model's own.

        ``None`` or blank picks ``default``. Raises UnknownVoiceError for any other name.
        """
        wanted = value.strip() if value is not None and value.strip() else None
        if wanted is None and self.no_default is not None:
            raise UnknownVoiceError(self.no_default)
        library = self.library
        if library is not None:
            name = wanted if wanted is not None else self.default
            if name is not None and not self.is_preset(name):
                found = library.lookup(name)
                if found is not None:
                    return found.name
                if wanted is not None:
                    choices = [*self.presets, *library.names()]
                    listed = f"choose one of {', '.join(choices)}" if choices else "this model has no voices to choose"
                    raise UnknownVoiceError(f"voice {wanted!r} is unknown; {listed}")
        return match_voice(value, self.presets, self.default)

    def default_voice(self) -> str | None:
        """The voice of a request that names none; None when there is none (it must name one)."""
        try:
            return self.resolve(None)
        except EngineError:
            return None

    def is_preset(self, name: str) -> bool:
        return name.strip().lower() in {v.lower() for v in self.presets}

    def is_ours(self, name: str) -> bool:
        """Whether one of the daemon's own voices is called ``name`` (any case): a preset speaker, or a
        library voice, even one of a kind this model cannot speak (``resolve`` then says why)."""
        if self.is_preset(name):
            return True
        if self.library is None:
            return False
        try:
            return self.library.lookup(name) is not None
        except UnknownVoiceError:
            return True

    def from_openai(self, name: str | None) -> str | None:
        """The voice a speech API request names: an OpenAI name that is none of ours is the default (None)."""
        if name is not None and name.strip().lower() in OPENAI_VOICES and not self.is_ours(name.strip()):
            return None
        return name

    def library_voices(self) -> dict[str, VoiceKind]:
        """The library's voices this model can speak, by name, but those a preset speaker shadows."""
        if self.library is None:
            return {}
        return {name: kind for name, kind in self.library.names().items() if not self.is_preset(name)}

    def kinds(self) -> dict[str, str]:
        """Every voice a request may name, preset speakers and library voices, with its kind (``info``)."""
        kinds: dict[str, str] = {}
        if self.library is not None:
            kinds.update({name: str(kind) for name, kind in self.library.names().items()})
        kinds.update({name: str(VoiceKind.PRESET) for name in self.presets})  # presets win a clash
        return kinds


PREFERRED_VOICE = "Ryan"
"""The speaker ``tts.voice: auto`` picks where the model has him (the docs' examples speak English)."""


def model_voice(presets: tuple[str, ...], library: VoiceLibrary | None) -> str | None:
    """The model's own default voice (``tts.voice: auto``): Ryan where he is one of its preset
    speakers, else its first; a model without any (Base, VoiceDesign): the first voice of
    ``library`` it can speak (by name); None when there is none (a Base model then has no default,
    ``no_default_voice``)."""
    if presets:
        return {v.lower(): v for v in presets}.get(PREFERRED_VOICE.lower(), presets[0])
    names = sorted(library.names()) if library is not None else []
    return names[0] if names else None


def library_choices(library: VoiceLibrary) -> str:
    """The library voices this model can speak, or how to make one, for a message."""
    names = sorted(library.names())
    if names:
        return f"its {library.kind} voices: {', '.join(names)}"
    if library.kind is VoiceKind.DESIGN:
        return "make one with: s2s-daemon voices add NAME --instruct 'a description of the voice'"
    if library.kind is VoiceKind.CLONE:
        return "make one with: s2s-daemon voices add NAME --ref-audio FILE.wav --ref-text 'what it says'"
    return "this model speaks its preset voices only"


def check_voice(voice: str, presets: tuple[str, ...], library: VoiceLibrary) -> None:
    """``UnknownVoiceError`` unless ``voice`` is one of the model's preset speakers or a library
    voice it can speak; the message lists both."""
    if voice.strip().lower() in {v.lower() for v in presets}:
        return
    if library.lookup(voice) is not None:  # a library voice of another kind raises, saying so
        return
    if presets:
        names = sorted(library.names())
        also = f"; or a library voice: {', '.join(names)}" if names else ""
        raise UnknownVoiceError(f"voice {voice!r} is unknown; choose one of {', '.join(presets)}{also}")
    raise UnknownVoiceError(
        f"voice {voice!r} is not in the voice library ({library.root}) and this {library.mode} model"
        f" has no preset speakers; {library_choices(library)}"
    )


def no_default_voice(mode: str, presets: tuple[str, ...], library: VoiceLibrary, voice: str | None) -> str | None:
    """Why requests to this model must name a voice, or None. A Base model clones a recording and
    has no voice of its own: without ``tts.voice`` naming a library voice (or a ``say --ref-audio``)
    there is nothing to speak with, and a request that names no voice is refused, saying how to
    make one, rather than spoken in a voice the model was never given."""
    if mode != "base" or presets:
        return None
    try:
        if voice is not None and library.lookup(voice) is not None:
            return None
    except UnknownVoiceError:  # a voice of another kind: check_configured refused a tts.voice set so
        pass
    return (
        "this Base model speaks cloned voices only and has no default voice: name a library voice in"
        f" the request, or set tts.voice to one ({library_choices(library)})"
    )


def command_line_voice(
    cli_voice: str | None, configured: str | None, presets: tuple[str, ...], library: VoiceLibrary
) -> str | None:
    """The voice ``say`` speaks in: ``--voice`` wins; then ``tts.voice`` (``configured``: its
    ``named_voice``); with neither (``auto``) the model's own (``model_voice``). A name that is no
    preset speaker may be a voice of ``library``. Raises ``EngineError`` for a name it cannot speak."""
    named = cli_voice if cli_voice is not None else configured
    if named is None:
        return model_voice(presets, library)
    check_voice(named, presets, library)
    if named.strip().lower() not in {v.lower() for v in presets}:
        found = library.lookup(named)
        if found is not None:
            return found.name
    return match_voice(named, presets, None)
