"""The daemon's lifecycle: startup -> ready -> run -> drain (bounded) -> stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import Any

import structlog

from s2s_daemon.audio.playback import PlaybackStage
from s2s_daemon.audio.sink import AudioDeviceError, AudioSink
from s2s_daemon.config import DaemonConfig
from s2s_daemon.errors import EXIT_FAILURE, EXIT_OK, ConfigError, UnavailableError
from s2s_daemon.events.discovery import HaDiscovery
from s2s_daemon.events.memory import memory_payload
from s2s_daemon.events.publisher import MqttEvents, now_ms
from s2s_daemon.intake.http import open_http_server, require_http_extra
from s2s_daemon.intake.mqtt import MqttIntake
from s2s_daemon.intake.schemas import IntakeRules
from s2s_daemon.mqtt.broker import EmbeddedBroker
from s2s_daemon.mqtt.connection import MqttProtocol
from s2s_daemon.mqtt.link import MqttLink
from s2s_daemon.mqtt.messages import OutMessage
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.notify import SystemdNotifier
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import Dispatcher
from s2s_daemon.pipeline.messages import ErrorCode, RequestError, Utterance
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.vocabulary import EngineError, EngineInfo, match_voice, normalize_language
from s2s_daemon.tts.engine import CheckpointError, EngineOptions, ModelUnavailableError, TtsEngine
from s2s_daemon.tts.registry import create_engine
from s2s_daemon.tts.stage import TtsStage
from s2s_daemon.tts.worker import EngineWorker
from s2s_daemon.vad.policy import BargeIn, VadGate

log = structlog.get_logger(__name__)

UTTERANCES_AHEAD = 1
"""Utterances synthesized ahead of the one playing (gapless hand-over, bounded memory)."""
CLOSE_TIMEOUT_S = 5.0
MEMORY_MIN_INTERVAL_S = 0.25
"""Per-utterance memory events are at most this often (a burst of short utterances shares one)."""


def engine_options(config: DaemonConfig) -> EngineOptions:
    tts = config.tts
    quantization: str
    if tts.engine == "mlx":
        quantization = tts.mlx.quantization
    elif tts.engine == "torch":
        quantization = tts.torch.quantization
    else:
        quantization = tts.options.get("quantization", "none")
    return EngineOptions(
        model=tts.model,
        device=tts.mlx.device if tts.engine == "mlx" else tts.torch.device,
        dtype=tts.torch.dtype,
        quantization=quantization,
        kernels=tts.torch.kernels,
        revision=tts.revision,
        extra=dict(tts.options),
    )


async def load_engine(config: DaemonConfig) -> tuple[EngineWorker, EngineInfo]:
    """Create and load the configured engine on its worker thread; map failures to exit codes."""
    engine: TtsEngine = create_engine(config.tts.engine, engine_options(config))
    worker = EngineWorker(engine)
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
        if config.tts.voice is not None and info.voices:
            match_voice(config.tts.voice, info.voices, None)
        normalize_language(config.tts.language, info.languages)
    except EngineError as exc:
        await worker.close()
        key = "tts.voice" if exc.code == "unknown_voice" else "tts.language"
        raise ConfigError(f"{key}: {exc}") from exc
    return worker, info


def require_wyoming() -> None:
    """``wyoming.enabled`` without the package is exit 69 naming the extra (before the model loads)."""
    try:
        import wyoming  # noqa: F401 -- only whether it imports
    except ImportError as exc:
        msg = f"wyoming.enabled needs the wyoming package: pip install 's2s-daemon[wyoming]' ({exc})"
        raise UnavailableError(msg) from exc


class Daemon:
    """Wires the stages together. The constructor does no I/O."""

    def __init__(self, config: DaemonConfig, notifier: SystemdNotifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or SystemdNotifier.from_env()
        self.topics = Topics(config.mqtt.topic_prefix, config.site_id, config.mqtt.shared_group)
        self._stop = asyncio.Event()
        self._sigint_count = 0
        self._memory_now = asyncio.Event()

    # -- signals -----------------------------------------------------------------------

    def request_stop(self) -> None:
        if not self._stop.is_set():
            log.info("stop_requested")
        self._stop.set()

    def _on_sigint(self) -> None:
        self._sigint_count += 1
        if self._sigint_count > 1:
            log.warning("forced_exit")
            os._exit(EXIT_FAILURE)
        self.request_stop()

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)

    def _remove_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    # -- lifecycle ---------------------------------------------------------------------

    async def run(self) -> int:
        self._install_signals()
        try:
            return await self._run()
        finally:
            self._remove_signals()

    async def _run(self) -> int:
        cfg = self.config
        log.info("starting", site_id=cfg.site_id, engine=cfg.tts.engine, model=cfg.tts.model)
        broker: EmbeddedBroker | None = None
        if cfg.wyoming.enabled:
            require_wyoming()
        require_http_extra(cfg.http)  # exit 69 before the model loads
        worker, info = await load_engine(cfg)
        sink: AudioSink | None = None
        try:
            if cfg.tts.warmup:
                await worker.warmup()
            from s2s_daemon.audio.select import make_sink

            sink = make_sink(cfg.audio)
            try:
                await sink.open()
            except AudioDeviceError as exc:
                raise UnavailableError(f"audio.sink {cfg.audio.sink!r}: {exc}") from exc
            if cfg.mqtt.broker == "embedded":
                broker = EmbeddedBroker(cfg.mqtt.port)
                await broker.start()
            if self._stop.is_set():
                return EXIT_OK
            return await self._serve(worker, info, sink)
        finally:
            if sink is not None:
                with contextlib.suppress(AudioDeviceError):
                    await sink.close()
            await worker.close()
            if broker is not None:
                await broker.stop()
            self.notifier.close()

    async def _serve(self, worker: EngineWorker, info: EngineInfo, sink: AudioSink) -> int:
        cfg = self.config
        requests = RequestQueue(cfg.queue.max_pending)
        utterances: Channel[Utterance] = Channel(UTTERANCES_AHEAD, Overflow.BLOCK, "utterances")
        link: MqttLink

        def snapshot() -> tuple[str, str | None, int]:
            state, current = dispatcher.state()
            return state, current, len(requests)

        events = MqttEvents(
            publish=lambda m: link.publish(m),
            topics=self.topics,
            info=info,
            qos=cfg.mqtt.qos,
            hermes=cfg.mqtt.hermes,
            state=snapshot,
            on_utterance_end=self._memory_now.set,
        )
        dispatcher = Dispatcher(requests, events, cfg.queue.dedup_window)
        rules = IntakeRules(
            site_id=cfg.site_id,
            max_text_chars=cfg.tts.max_text_chars,
            voices=info.voices,
            languages=info.languages,
            default_voice=cfg.tts.voice,
            default_language=cfg.tts.language,
        )
        discovery = HaDiscovery(cfg.ha, self.topics, info)

        def on_ha_birth(payload: bytes) -> None:
            for message in discovery.on_birth(payload):
                link.publish(message)

        ha_birth = (discovery.birth_topic, on_ha_birth) if discovery.enabled else None
        intake = MqttIntake(dispatcher, rules, self.topics, cfg.mqtt.hermes, ha_birth=ha_birth)

        def on_connect() -> list[OutMessage]:
            retained = [events.status_message(True), events.info_message(), events.state_message()]
            return retained + discovery.connect_messages()  # Home Assistant's configs, or their removal

        link = MqttLink(
            cfg.mqtt,
            self.topics,
            cfg.mqtt.client_id or f"s2s-{cfg.site_id}",
            intake.handle,
            on_connect,
            # amqtt speaks 3.1.1 only and stalls on a v5 CONNECT instead of refusing it.
            protocol=MqttProtocol.V311 if cfg.mqtt.broker == "embedded" else None,
            subscriptions=discovery.subscriptions(),
        )
        link.prepare()
        wyoming = await self._open_wyoming(dispatcher, rules, info)
        http = await open_http_server(cfg.http, dispatcher, rules, info)  # listening (port taken: 69); None when off

        vad_gate = VadGate(cfg.vad.max_wait_s)
        vad_stage = await self._open_vad(dispatcher, events, vad_gate)
        tts = TtsStage(worker, info, requests, utterances, dispatcher, cfg.tts.chunk_frames, gate=vad_gate.hold)
        playback = PlaybackStage(sink, utterances, dispatcher)

        async with asyncio.TaskGroup() as tg:
            link_task = tg.create_task(link.run(), name="s2s.mqtt")
            tts_task = tg.create_task(tts.run(), name="s2s.tts")
            play_task = tg.create_task(playback.run(), name="s2s.playback")
            wyoming_task = tg.create_task(wyoming.run(), name="s2s.wyoming") if wyoming is not None else None
            helpers = [
                tg.create_task(events.run_state(), name="s2s.events.state"),
                tg.create_task(self._memory_loop(worker, events), name="s2s.telemetry.memory"),
            ]
            if self.notifier.watchdog_interval_s:
                helpers.append(tg.create_task(self._watchdog(), name="s2s.watchdog"))
            if vad_stage is not None:
                helpers.append(tg.create_task(vad_stage.run(), name="s2s.vad"))
            if http is not None:  # cancelled after the drain: closes, letting responses being written end
                helpers.append(tg.create_task(http.serve(), name="s2s.http"))
            self.notifier.ready(f"ready: {info.engine} {info.model} on {info.device}")
            log.info("ready", engine=info.engine, model=info.model, device=info.device, voices=len(info.voices))
            await self._stop.wait()

            # -- drain ---------------------------------------------------------------------
            self.notifier.stopping()
            log.info("draining", queued=len(requests), timeout_s=cfg.shutdown.drain_timeout_s)
            dispatcher.close()  # accepts no more; queued requests are answered cancelled
            if wyoming is not None:
                wyoming.stop_accepting()
            _, pending = await asyncio.wait({tts_task, play_task}, timeout=cfg.shutdown.drain_timeout_s)
            if pending:
                log.warning("drain_timeout", interrupted=[j.request.id for j in dispatcher.jobs.values()])
                dispatcher.stop_all()
                _, pending = await asyncio.wait(pending, timeout=CLOSE_TIMEOUT_S)
                for task in pending:
                    task.cancel()
            dispatcher.abandon(RequestError(ErrorCode.SHUTTING_DOWN, "the daemon stopped"))
            if wyoming_task is not None:
                wyoming.close()  # every synthesis has ended: its clients get what is left, then hang-up
                await asyncio.wait({wyoming_task}, timeout=CLOSE_TIMEOUT_S)
                wyoming_task.cancel()
            if vad_stage is not None:
                await vad_stage.close()
            for task in helpers:
                task.cancel()
            link.publish(events.state_message())
            await link.close([events.status_message(False)], CLOSE_TIMEOUT_S)
            link_task.cancel()
        log.info("stopped")
        return EXIT_OK

    async def _open_wyoming(self, dispatcher: Dispatcher, rules: IntakeRules, info: EngineInfo) -> Any:
        """The Wyoming TTS server, listening (a taken port is exit 69); None when it is off."""
        cfg = self.config.wyoming
        if not cfg.enabled:
            return None
        require_wyoming()
        from s2s_daemon.intake.wyoming import WyomingServer

        server = WyomingServer(cfg, dispatcher, rules, info, self.config.site_id)
        await server.start()
        return server

    async def _open_vad(self, dispatcher: Dispatcher, events: MqttEvents, gate: VadGate) -> Any:
        cfg = self.config.vad
        if not cfg.enabled:
            return None
        from s2s_daemon.vad.stage import VadStage

        barge_in = BargeIn(cfg.policy, gate, dispatcher)

        def on_event(event: Any) -> None:
            events.vad(event.speaking, event.signal_ms)
            barge_in.on_speech(event.speaking)

        stage = VadStage(cfg, on_event)
        await stage.open()
        return stage

    async def _memory_loop(self, worker: EngineWorker, events: MqttEvents) -> None:
        interval = self.config.telemetry.memory_interval_s
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._memory_now.wait()
            self._memory_now.clear()
            device = await worker.memory()
            events.memory(memory_payload(self.config.site_id, now_ms(), device))
            # Utterances that end in a burst share one event: the next one waits out the
            # minimum gap, then reports the memory after the latest of them.
            await asyncio.sleep(MEMORY_MIN_INTERVAL_S)

    async def _watchdog(self) -> None:
        interval = self.notifier.watchdog_interval_s
        assert interval is not None
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval / 2)
