"""The engine and the speech pipeline, loaded and built one way for ``run`` and ``say``: the engine
on its worker thread (load failures mapped to exit codes), the request queue, the ledger, the
TTS stage on the engine's worker and the playback stage in front of the sink, and the rules every
intake checks a request against.

```
 intake(s) --submit--> ledger --> request queue --> TtsStage --utterances--> PlaybackStage --> sink
                         ^  (events from the stages)      \\--> a caller's CallerStream (read by its intake)
```
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from s2s_daemon.audio.playback import PlaybackStage
from s2s_daemon.audio.sink import AudioSink
from s2s_daemon.config import DaemonConfig
from s2s_daemon.errors import ConfigError, UnavailableError
from s2s_daemon.intake.schemas import IntakeRules
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import Dispatcher, JobEvents
from s2s_daemon.pipeline.messages import Utterance
from s2s_daemon.pipeline.pacing import Pacer
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.vocabulary import EngineError, EngineInfo, match_voice, normalize_language
from s2s_daemon.pipeline.voices import VoiceKind, VoiceLibrary, default_voices_dir
from s2s_daemon.tts.engine import (
    CheckpointError,
    ModelUnavailableError,
    SynthesisRequest,
    TtsEngine,
    UnknownVoiceError,
)
from s2s_daemon.tts.registry import create_engine, engine_options
from s2s_daemon.tts.stage import TtsStage
from s2s_daemon.tts.worker import EngineWorker

log = structlog.get_logger(__name__)


async def load_engine(config: DaemonConfig) -> tuple[EngineWorker, EngineInfo]:
    """Create and load the configured engine on its worker thread; map failures to exit codes."""
    log.info("engine_loading", engine=config.tts.engine, model=config.tts.model)
    engine: TtsEngine = create_engine(config.tts.engine, engine_options(config.tts))
    worker = EngineWorker(
        engine, stall_timeout_s=config.tts.stall_timeout_s, max_utterance_s=config.tts.max_utterance_s
    )
    try:
        info = await worker.load()
    except CheckpointError as exc:
        await worker.close()
        raise ConfigError(f"tts.model: {exc}") from exc
    except ModelUnavailableError as exc:
        # Not a configuration error: a box that boots before its network must be retried.
        await worker.close()
        first = (
            "download it once with the network up (HF_HUB_OFFLINE unset)"
            if exc.offline
            else "check the network and try again (a service retries by itself)"
        )
        raise UnavailableError(
            f"tts.model: {exc}. To go on: {first}, or set tts.model (say: --model) to a local checkpoint folder,"
            " or try the daemon offline with a generated checkpoint (random weights):"
            f" {sys.executable} -m s2s_daemon.tools.make_checkpoint DIR --size tiny --kind custom_voice"
        ) from exc
    except (EngineError, OSError) as exc:
        await worker.close()
        raise UnavailableError(f"engine {config.tts.engine!r} failed to load {config.tts.model!r}: {exc}") from exc
    try:
        voice = config.tts.voice
        if voice is not None and voice.strip().lower() not in {v.lower() for v in info.voices}:
            if info.voices:
                if voice_library(config, info).lookup(voice) is None:
                    match_voice(voice, info.voices, None)
            elif "voice" in config.tts.model_fields_set:  # no presets: it must be a library voice
                library = voice_library(config, info)
                if library.lookup(voice) is None:
                    raise UnknownVoiceError(
                        f"voice {voice!r} is not in the voice library ({library.root}) and this"
                        f" {info.mode} model has no preset speakers; {_library_choices(library)}"
                    )
        normalize_language(config.tts.language, info.languages)
    except EngineError as exc:
        await worker.close()
        key = "tts.voice" if exc.code == "unknown_voice" else "tts.language"
        raise ConfigError(f"{key}: {exc}") from exc
    return worker, info


def voice_library(config: DaemonConfig, info: EngineInfo) -> VoiceLibrary:
    """The library of named voices (``tts.voices_dir``) as the loaded model can speak them."""
    return VoiceLibrary(config.tts.voices_dir or default_voices_dir(), info.mode)


def _library_choices(library: VoiceLibrary) -> str:
    names = [name for name, kind in library.names().items() if kind is VoiceKind.CLONE]
    if names:
        return f"its clone voices: {', '.join(names)}"
    return "make one with: s2s-daemon voices add NAME --ref-audio FILE.wav --ref-text 'what it says'"


def no_default_voice(config: DaemonConfig, info: EngineInfo, library: VoiceLibrary, voice: str | None) -> str | None:
    """Why requests to this model must name a voice, or None. A Base model clones a recording and
    has no voice of its own: without ``tts.voice`` naming a library voice (or a ``say --ref-audio``)
    there is nothing to speak with, and a request that names no voice is refused, saying how to
    make one, rather than spoken in a voice the model was never given."""
    if info.mode != "base" or info.voices:
        return None
    try:
        if voice is not None and library.lookup(voice) is not None:
            return None
    except UnknownVoiceError:  # a voice of another kind: load_engine refused a tts.voice set so
        pass
    return (
        "this Base model speaks cloned voices only and has no default voice: name a library voice in"
        f" the request, or set tts.voice to one ({_library_choices(library)})"
    )


UTTERANCES_AHEAD = 1
"""Utterances synthesized ahead of the one playing (gapless hand-over, bounded memory)."""


@dataclass(frozen=True, slots=True)
class Pipeline:
    requests: RequestQueue
    ledger: Dispatcher
    rules: IntakeRules
    tts: TtsStage
    playback: PlaybackStage
    library: VoiceLibrary | None = None

    def voice_kinds(self) -> dict[str, str]:
        """Every voice a request may name, preset speakers and library voices, with its kind (``info``)."""
        kinds: dict[str, str] = {}
        if self.library is not None:
            kinds.update({name: str(kind) for name, kind in self.library.names().items()})
        kinds.update({name: str(VoiceKind.PRESET) for name in self.rules.voices})  # presets win a clash
        return kinds

    def snapshot(self) -> tuple[str, str | None, int]:
        """(idle|synthesizing|speaking, current id, queue length) for the retained state topic."""
        state, current = self.ledger.state()
        return state, current, len(self.requests)

    async def run(self) -> None:
        """Both stages until the request queue is closed and drained (``say``; the daemon runs them
        as tasks of its own group)."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.tts.run(), name="s2s.tts")
            tg.create_task(self.playback.run(), name="s2s.playback")


def build_pipeline(
    config: DaemonConfig,
    worker: EngineWorker,
    info: EngineInfo,
    sink: AudioSink,
    events: JobEvents,
    *,
    max_pending: int | None = None,
    default_voice: str | None = None,
    gate: Callable[[], asyncio.Future[None] | None] | None = None,
    template: SynthesisRequest | None = None,
) -> Pipeline:
    """The pipeline for ``config``; ``default_voice`` overrides ``tts.voice`` (``say --voice``)."""
    requests = RequestQueue(config.queue.max_pending if max_pending is None else max_pending)
    ledger = Dispatcher(requests, events, config.queue.dedup_window)
    library = voice_library(config, info)
    voice = config.tts.voice if default_voice is None else default_voice
    cloning = template is not None and template.ref_audio is not None  # say --ref-audio
    no_default = None if cloning else no_default_voice(config, info, library, voice)
    if no_default is not None:
        voice = None
        log.warning("no_default_voice", model=info.model, mode=info.mode, requests_without_a_voice=no_default)
    elif info.voices or voice is not None:
        log.info("default_voice", voice=match_voice(None, info.voices, voice) if info.voices else voice)
    rules = IntakeRules(
        site_id=config.site_id,
        max_text_chars=config.tts.max_text_chars,
        voices=info.voices,
        languages=info.languages,
        default_voice=voice,
        default_language=config.tts.language,
        library=library,
        stream_idle_s=config.tts.stream_idle_s,
        no_default=no_default,
    )
    utterances: Channel[Utterance] = Channel(UTTERANCES_AHEAD, Overflow.BLOCK, "utterances")
    # Only a speaker heard as it plays is worth waiting for: a file, the discard sink and callers'
    # streams take the audio as it comes, and nobody is kept out of the engine's steps for them.
    realtime = bool(getattr(sink, "realtime", False))
    pacer = Pacer(enabled=config.audio.gapless and realtime, max_wait_s=config.audio.prebuffer_max_s)
    tts = TtsStage(
        worker,
        info,
        requests,
        utterances,
        ledger,
        config.tts.chunk_frames,
        gate=gate,
        template=template,
        library=library,
        pacer=pacer,
        max_streams=config.tts.max_streams,
        paced_speaker=realtime,
    )
    playback = PlaybackStage(sink, utterances, ledger, pacer)
    return Pipeline(requests, ledger, rules, tts, playback, library)
