"""The engine and the speech pipeline, loaded and built one way for ``run`` and ``say``: the engine
on its worker thread (load failures mapped to exit codes), the request queue, the ledger, the
TTS stage on the engine's worker and the playback stage in front of the sink, and the rules every
intake checks a request against; for ``run`` also the daemon's graph around it (``build_daemon``:
events, journal outbox, intakes, MQTT link, listeners), built in one direction.

```
 intake(s) --submit--> ledger --> request queue --> TtsStage --utterances--> PlaybackStage --> sink
                         ^  (events from the stages)      \\--> a caller's CallerStream (read by its intake)
```
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from s2s_daemon.audio.playback import PlaybackStage
from s2s_daemon.audio.sink import AudioDeviceError, AudioSink
from s2s_daemon.config import DaemonConfig
from s2s_daemon.errors import ConfigError, UnavailableError
from s2s_daemon.events.discovery import HaDiscovery
from s2s_daemon.events.metrics import DaemonMetrics, MeteredEvents
from s2s_daemon.events.publisher import MqttEvents
from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.intake.door import Intake, IntakeContext, IntakeOpener
from s2s_daemon.intake.http.live import LiveFeed
from s2s_daemon.intake.mqtt import MQTT_ORIGINS, MqttIntake
from s2s_daemon.intake.pool import PoolHandBack
from s2s_daemon.intake.streams import StreamIntake
from s2s_daemon.mqtt.broker import EmbeddedBroker
from s2s_daemon.mqtt.connection import MqttProtocol
from s2s_daemon.mqtt.link import MqttLink
from s2s_daemon.mqtt.packets import OutMessage, Publisher
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import JobEvents, Ledger, SpeakerTurn
from s2s_daemon.pipeline.journal import Recovered, RequestJournal, default_journal_path
from s2s_daemon.pipeline.outbox import DurableRequests, Outbox
from s2s_daemon.pipeline.pacing import Pacer
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.vocabulary import EngineError, EngineInfo, match_voice, normalize_language
from s2s_daemon.pipeline.voice_policy import VoicePolicy, check_voice, model_voice, no_default_voice
from s2s_daemon.pipeline.voices import VoiceLibrary, default_voices_dir
from s2s_daemon.text import TextStage
from s2s_daemon.tts.engine import (
    CheckpointError,
    ModelUnavailableError,
    SynthesisRequest,
    TtsEngine,
)
from s2s_daemon.tts.registry import create_engine, engine_options
from s2s_daemon.tts.stage import TtsStage
from s2s_daemon.tts.worker import EngineWorker
from s2s_daemon.vad.policy import BargeIn, VadGate

if TYPE_CHECKING:  # their modules need extras (aiohttp, a microphone): imported where they are opened
    from s2s_daemon.intake.http.server import HttpSpeechServer
    from s2s_daemon.vad.detector import VadEvent
    from s2s_daemon.vad.stage import VadStage

log = structlog.get_logger(__name__)


async def load_engine(
    config: DaemonConfig, on_wedged: Callable[[str], None] | None = None
) -> tuple[EngineWorker, EngineInfo]:
    """Create and load the configured engine on its worker thread; map failures to exit codes.
    ``on_wedged``: the engine thread is stuck for good (``EngineWorker``)."""
    log.info("engine_loading", engine=config.tts.engine, model=config.tts.model)
    engine: TtsEngine = create_engine(config.tts.engine, engine_options(config.tts))
    worker = EngineWorker(
        engine,
        stall_timeout_s=config.tts.stall_timeout_s,
        max_utterance_s=config.tts.max_utterance_s,
        on_wedged=on_wedged,
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
        voice = config.tts.named_voice  # None: auto, the model's own (build_rules)
        if voice is not None:
            check_voice(voice, info.voices, voice_library(config, info))
        normalize_language(config.tts.language, info.languages)
    except EngineError as exc:
        await worker.close()
        key = "tts.voice" if exc.code == "unknown_voice" else "tts.language"
        raise ConfigError(f"{key}: {exc}") from exc
    return worker, info


def voice_library(config: DaemonConfig, info: EngineInfo) -> VoiceLibrary:
    """The library of named voices (``tts.voices_dir``) as the loaded model can speak them."""
    return VoiceLibrary(config.tts.voices_dir or default_voices_dir(), info.mode)


UTTERANCES_AHEAD = 1
"""Utterances synthesized ahead of the one playing (gapless hand-over, bounded memory)."""


@dataclass(frozen=True, slots=True)
class SpeechStages:
    """The request queue, the ledger, the rules and the two stages (TTS, playback) that ``run`` and
    ``say`` share; built of the ``pipeline/`` package's types."""

    requests: RequestQueue
    ledger: Ledger
    rules: IntakeRules
    tts: TtsStage
    playback: PlaybackStage
    library: VoiceLibrary | None = None

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


def build_rules(
    config: DaemonConfig,
    info: EngineInfo,
    *,
    default_voice: str | None = None,
    template: SynthesisRequest | None = None,
) -> IntakeRules:
    """The rules every intake checks a request against; ``default_voice`` overrides ``tts.voice``
    (``say --voice``)."""
    library = voice_library(config, info)
    voice = config.tts.named_voice if default_voice is None else default_voice
    if voice is None:  # tts.voice: auto
        voice = model_voice(info.voices, library)
    cloning = template is not None and template.ref_audio is not None  # say --ref-audio
    no_default = None if cloning else no_default_voice(info.mode, info.voices, library, voice)
    if no_default is not None:
        voice = None
        log.warning("no_default_voice", model=info.model, mode=info.mode, requests_without_a_voice=no_default)
    elif info.voices or voice is not None:
        log.info("default_voice", voice=match_voice(None, info.voices, voice) if info.voices else voice)
    return IntakeRules(
        site_id=config.site_id,
        max_text_chars=config.tts.max_text_chars,
        max_instruct_chars=config.tts.max_instruct_chars,
        voices=VoicePolicy(info.voices, voice, library, no_default),
        languages=info.languages,
        default_language=config.tts.language,
        stream_idle_s=config.tts.stream_idle_s,
        text=TextStage(config.text),
    )


def build_stages(
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
    rules: IntakeRules | None = None,
) -> SpeechStages:
    """The speech stages for ``config``; ``default_voice`` overrides ``tts.voice`` (``say --voice``);
    ``rules`` when they were built before (the daemon's events name their voices)."""
    requests = RequestQueue(config.queue.max_pending if max_pending is None else max_pending)
    ledger = Ledger(requests, events, config.queue.dedup_window)
    if rules is None:
        rules = build_rules(config, info, default_voice=default_voice, template=template)
    library = rules.voices.library
    utterances: Channel[SpeakerTurn] = Channel(UTTERANCES_AHEAD, Overflow.BLOCK, "utterances")
    # Only a speaker heard as it plays is worth waiting for: a file, the discard sink and callers'
    # streams take the audio as it comes, and nobody is kept out of the engine's steps for them.
    realtime = sink.realtime
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
        runaway_margin=config.tts.runaway_margin,
    )
    playback = PlaybackStage(sink, utterances, ledger, pacer)
    return SpeechStages(requests, ledger, rules, tts, playback, library)


@dataclass(frozen=True, slots=True)
class DaemonHooks:
    """What the lifecycle (``app.py``) hears from the parts it runs."""

    on_utterance_end: Callable[[], None]
    """An utterance ended (the memory event is due)."""
    on_denied: Callable[[list[tuple[str, str]]], None]
    """The broker refused subscriptions: (topic, reason) each."""


@dataclass(frozen=True, slots=True)
class DaemonParts:
    """What ``build_daemon`` built: the speech stages, their MQTT events and link, the intakes, the rest."""

    stages: SpeechStages
    events: MqttEvents
    link: MqttLink
    intakes: tuple[Intake, ...]
    """The doors beside MQTT's (``INTAKES``, the microphone's barge-in, the speech API last): run,
    drained and closed by the lifecycle in one loop."""
    durable: DurableRequests | None = None
    """The journal's side of admission (and through it the outbox); None without the journal."""
    pool: PoolHandBack | None = None
    """A pool member's hand-back (``mqtt.shared_group``); None otherwise."""
    streams: StreamIntake | None = None
    """The streamed says the MQTT intake has open (``tts/stream``)."""


async def build_daemon(
    config: DaemonConfig,
    topics: Topics,
    worker: EngineWorker,
    info: EngineInfo,
    sink: AudioSink,
    metrics: DaemonMetrics,
    hooks: DaemonHooks,
    journal: RequestJournal | None = None,
    http: HttpSpeechServer | None = None,
    openers: Sequence[IntakeOpener] | None = None,
) -> DaemonParts:
    """The daemon's graph, each part built after what it needs. The MQTT link comes last (it needs
    the intake, which needs the ledger, which needs the events): the parts before it publish
    through a ``Publisher`` bound to the link once it exists. With the journal, terminal events go
    through the ``Outbox`` and the MQTT intake acknowledges what it journaled once committed; every
    terminal event is counted into the metrics first (``MeteredEvents``); the web page's live view
    hears every event's payload as it is published (``LiveFeed``). The intakes (``openers``:
    ``INTAKES`` unless a test names others) are opened here, listening (a taken port is exit 69
    before anything runs); the speech API, listening since before the model loaded, is handed the
    pipeline."""
    publisher = Publisher()
    feed = LiveFeed() if config.http.enabled else None
    outbox = Outbox(journal, publisher, OutMessage.restore, MQTT_ORIGINS) if journal is not None else None
    rules = build_rules(config, info)
    events = MqttEvents(
        publish=publisher,
        topics=topics,
        info=info,
        qos=config.mqtt.qos,
        hermes=config.mqtt.hermes,
        on_utterance_end=hooks.on_utterance_end,
        voice_kinds=rules.voices.kinds,
        outbox=outbox,
        live=feed.add if feed is not None else None,
    )
    gate = VadGate(config.vad.max_wait_s)
    stages = build_stages(config, worker, info, sink, MeteredEvents(events, metrics, info), gate=gate.hold, rules=rules)
    ledger = stages.ledger
    durable = DurableRequests(outbox, ledger) if outbox is not None else None
    pool = (  # a pool member hands its pool requests back on drain
        PoolHandBack(ledger, rules, topics, publisher, durable) if topics.pool_subscription is not None else None
    )
    discovery = HaDiscovery(config.ha, topics, info)

    def on_ha_birth(payload: bytes) -> None:
        for message in discovery.on_birth(payload):
            publisher(message)

    ha_birth = (discovery.birth_topic, on_ha_birth) if discovery.enabled else None
    intake = MqttIntake(ledger, rules, topics, config.mqtt.hermes, ha_birth=ha_birth, durable=durable, pool=pool)

    def on_connect() -> list[OutMessage]:
        retained = [events.status_message(True), events.info_message(), events.state_message(stages.snapshot())]
        return retained + discovery.connect_messages()  # Home Assistant's configs, or their removal

    link = MqttLink(
        config.mqtt,
        topics,
        config.mqtt.client_id or f"s2s-{config.site_id}",
        intake.handle,
        on_connect,
        # amqtt speaks 3.1.1 only and stalls on a v5 CONNECT instead of refusing it.
        protocol=MqttProtocol.V311 if config.mqtt.broker == "embedded" else None,
        subscriptions=discovery.subscriptions(),
        auto_ack=durable is None,  # the intake acknowledges once the journal committed
        on_denied=hooks.on_denied,
    )
    publisher.bind(link.publish)
    link.prepare()
    context = IntakeContext(ledger, rules, info)
    intakes: list[Intake] = []
    for opener in INTAKES if openers is None else openers:
        opened = await opener(config, context)
        if opened is not None:
            intakes.append(opened)
    vad = await open_vad(config, ledger, events, gate)
    if vad is not None:
        intakes.append(vad)
    if http is not None:  # listening since before the model loaded (the probes): closed last
        http.attach(ledger, rules, info, feed)
        intakes.append(http)
    return DaemonParts(stages, events, link, tuple(intakes), durable, pool, intake.streams)


def open_journal(
    config: DaemonConfig, on_commit: Callable[[float], None]
) -> tuple[RequestJournal | None, Recovered | None]:
    """The request journal, open, and what it recovered (``journal.enabled``; an unwritable one is
    exit 69 naming its path); ``(None, None)`` without it."""
    if not config.journal.enabled:
        log.warning("journal_disabled", consequence="requests queued at a crash are lost")
        return None, None
    path = config.journal.path or default_journal_path(config.site_id)
    journal = RequestJournal(path, config.queue.dedup_window, config.journal.synchronous, on_commit=on_commit)
    return journal, journal.open()


async def open_sink(config: DaemonConfig) -> AudioSink:
    """The configured sink, open; a device it cannot open is exit 69 naming ``audio.sink``."""
    from s2s_daemon.audio.select import make_sink  # the sound libraries load with the sink

    sink = make_sink(config.audio)
    try:
        await sink.open()
    except AudioDeviceError as exc:
        raise UnavailableError(f"audio.sink {config.audio.sink!r}: {exc}") from exc
    return sink


async def start_broker(config: DaemonConfig) -> EmbeddedBroker | None:
    """The embedded broker, started (``mqtt.broker: embedded``); None for an external one."""
    if config.mqtt.broker != "embedded":
        return None
    broker = EmbeddedBroker(config.mqtt.port)
    await broker.start()
    return broker


def require_wyoming() -> None:
    """``wyoming.enabled`` without the package is exit 69 naming the extra (before the model loads)."""
    try:
        import wyoming  # noqa: F401 -- only whether it imports
    except ImportError as exc:
        msg = f"wyoming.enabled needs the wyoming package: pip install 's2s-daemon[wyoming]' ({exc})"
        raise UnavailableError(msg) from exc


async def open_wyoming(config: DaemonConfig, context: IntakeContext) -> Intake | None:
    """The Wyoming TTS server, listening (a taken port is exit 69); None when it is off. Its module
    is imported here: the ``wyoming`` package is an extra."""
    if not config.wyoming.enabled:
        return None
    require_wyoming()
    from s2s_daemon.intake.wyoming import WyomingServer

    server = WyomingServer(config.wyoming, context.ledger, context.rules, context.info, config.site_id)
    await server.start()
    return server


INTAKES: tuple[IntakeOpener, ...] = (open_wyoming,)
"""The intakes opened beside MQTT's, in this order (each reads its own config section; None: off).
A new intake is its module and one line here (docs/extending.md: adding an intake). The speech API
(opened before the model loads, for the probes) and the microphone's barge-in are added by
``build_daemon`` itself."""


async def open_vad(config: DaemonConfig, ledger: Ledger, events: MqttEvents, gate: VadGate) -> VadStage | None:
    """The microphone's voice activity stage, open (its events and the barge-in); None when it is off."""
    if not config.vad.enabled:
        return None
    from s2s_daemon.vad.stage import VadStage

    barge_in = BargeIn(config.vad.policy, gate, ledger)

    def on_event(event: VadEvent) -> None:
        events.vad(event.speaking, event.signal_ms)
        barge_in.on_speech(event.speaking)

    stage = VadStage(config.vad, on_event)
    await stage.open()
    return stage
