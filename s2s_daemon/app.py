"""The daemon's lifecycle: startup -> ready -> run -> drain (bounded) -> stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from s2s_daemon import preflight
from s2s_daemon.audio.sink import AudioDeviceError, AudioSink
from s2s_daemon.config import DaemonConfig
from s2s_daemon.errors import EXIT_FAILURE, EXIT_NOPERM, EXIT_OK, EXIT_SOFTWARE
from s2s_daemon.events.memory import memory_payload
from s2s_daemon.events.metrics import DaemonMetrics
from s2s_daemon.events.publisher import MqttEvents, now_ms
from s2s_daemon.events.readiness import LifecyclePhase, Readiness
from s2s_daemon.intake.door import CLOSE_TIMEOUT_S as INTAKE_CLOSE_S
from s2s_daemon.intake.door import IntakeOpener
from s2s_daemon.intake.http import open_http_server, open_monitor_server, require_http_extra, require_monitor_extra
from s2s_daemon.mqtt.broker import EmbeddedBroker
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.notify import SystemdNotifier
from s2s_daemon.pipeline.journal import Recovered, RequestJournal
from s2s_daemon.pipeline.messages import ErrorCode, RequestError
from s2s_daemon.pipeline.vocabulary import EngineInfo
from s2s_daemon.progress import Progress
from s2s_daemon.tts.worker import EngineWorker
from s2s_daemon.wiring import (
    DaemonHooks,
    DaemonParts,
    build_daemon,
    load_engine,
    open_journal,
    open_sink,
    require_wyoming,
    start_broker,
)

if TYPE_CHECKING:  # aiohttp is an extra: the server is imported where it is opened
    from s2s_daemon.intake.http.server import HttpSpeechServer

log = structlog.get_logger(__name__)

CLOSE_TIMEOUT_S = 5.0
MEMORY_MIN_INTERVAL_S = 0.25
"""Per-utterance memory events are at most this often (a burst of short utterances shares one)."""
ACCEPT_FAILED_LOG_S = 1.0
"""A listener that cannot accept (no file descriptor left) is logged at most this often: asyncio
reports it once per connection waiting, with a traceback, each time it retries."""
ACCEPT_FAILED = "socket.accept() out of system resource"


class Daemon:
    """Runs the daemon through its phases (the graph is ``wiring.build_daemon``'s). The constructor does no I/O."""

    def __init__(
        self,
        config: DaemonConfig,
        notifier: SystemdNotifier | None = None,
        intakes: Sequence[IntakeOpener] | None = None,
    ) -> None:
        self.config = config
        self.notifier = notifier or SystemdNotifier.from_env()
        self.intakes = intakes
        """The intakes' openers (``wiring.INTAKES`` when None)."""
        self.topics = Topics(config.mqtt.topic_prefix, config.site_id, config.mqtt.shared_group)
        self._stop = asyncio.Event()
        self._sigint_count = 0
        self._memory_now = asyncio.Event()
        self._exit_code = EXIT_OK
        """What ``run`` returns: EXIT_SOFTWARE after a wedged engine."""
        self.readiness = Readiness(broker_connected=self._broker_connected)
        """The phase ``/health`` and ``/ready`` report."""
        self.metrics = DaemonMetrics(queue_depth=self._queue_depth, ready=self.readiness.ready)
        """``/metrics``: a registry of this daemon's own."""
        self._parts: DaemonParts | None = None
        """What ``build_daemon`` built, once the daemon serves (the engine's wedge stops it)."""
        self._accept_failed = 0
        """Failed accepts since the last ``accept_failed`` line."""
        self._accept_failed_logged_at = -ACCEPT_FAILED_LOG_S

    def _broker_connected(self) -> bool:
        return self._parts is not None and self._parts.link.connected.is_set()

    def _queue_depth(self) -> int:
        return len(self._parts.stages.requests) if self._parts is not None else 0

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
        loop.set_exception_handler(self._loop_exception)

    def _remove_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        loop.set_exception_handler(None)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's errors as its default handler logs them, but a listener out of file
        descriptors (EMFILE) once a second with a count: asyncio logs it with a traceback for
        every connection waiting, each time it retries, thousands of lines a second."""
        if context.get("message") != ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        self._accept_failed += 1
        now = loop.time()
        if now - self._accept_failed_logged_at >= ACCEPT_FAILED_LOG_S:
            error = context.get("exception")
            log.warning("accept_failed", error=str(error), times=self._accept_failed, retry_s=1)
            self._accept_failed, self._accept_failed_logged_at = 0, now

    # -- lifecycle ---------------------------------------------------------------------

    async def run(self) -> int:
        self._install_signals()
        try:
            return await self._run()
        finally:
            self._remove_signals()

    async def _run(self) -> int:
        """The listeners (monitor, speech API) first, so that probes answer while the model loads;
        then the rest of the startup, the service and the stop; the listeners close last."""
        cfg = self.config
        log.info("starting", site_id=cfg.site_id, engine=cfg.tts.engine, model=cfg.tts.model)
        if cfg.wyoming.enabled:
            require_wyoming()
        require_http_extra(cfg.http)  # exit 69 before the model loads
        require_monitor_extra(cfg.monitor)
        preflight.require(cfg)  # every file, folder and port the configuration names: 78 or 69, before it too
        async with contextlib.AsyncExitStack() as listeners:
            monitor = await open_monitor_server(cfg.monitor, self.readiness, self.metrics)  # port taken: 69
            if monitor is not None:
                listeners.push_async_callback(monitor.close)
            http = await open_http_server(cfg.http, self.readiness, self.metrics)
            if http is not None:
                listeners.push_async_callback(http.close)  # the drain closed it already: a no-op then
            return await self._start_up(http)

    async def _start_up(self, http: HttpSpeechServer | None) -> int:
        """startup (engine, warm-up, sink, embedded broker) -> serve -> stop (close them in reverse)."""
        cfg = self.config
        broker: EmbeddedBroker | None = None
        journal, recovered = open_journal(cfg, self.metrics.journal_committed)  # unwritable: exit 69 naming the path
        try:
            self.readiness.enter(LifecyclePhase.LOADING)
            loaded = await self._load_unless_stopped()
        except BaseException:
            if journal is not None:
                journal.close()
            raise
        if loaded is None:  # stopped while loading
            if journal is not None:
                journal.close()
            self.notifier.close()
            return EXIT_OK
        worker, info = loaded
        self.metrics.engine_loaded(info, worker.busy_s)
        sink: AudioSink | None = None
        try:
            if cfg.tts.warmup:
                self.readiness.enter(LifecyclePhase.WARMING)
                with Progress("warming_up", started="warming_up", done="warmed_up", engine=info.engine):
                    await worker.warmup()
            self.readiness.enter(LifecyclePhase.OPENING)
            sink = await open_sink(cfg)
            broker = await start_broker(cfg)
            if self._stop.is_set():
                return EXIT_OK
            return await self._serve(worker, info, sink, journal, recovered, http)
        finally:
            if journal is not None:
                journal.close()  # commits what the drain left (the last acknowledgements)
            if sink is not None:
                with contextlib.suppress(AudioDeviceError):
                    await sink.close()
            await worker.close()
            if broker is not None:
                await broker.stop()
            self.notifier.close()

    async def _load_unless_stopped(self) -> tuple[EngineWorker, EngineInfo] | None:
        """The engine, loaded; None when a stop came first. A load still running then gets
        ``shutdown.drain_timeout_s`` to end (and is closed); after that it is left on its thread
        (a daemon thread: the process exits without it), so that a start waiting on a build
        (``build_lock``) or a slow disk ends when asked to."""
        load = asyncio.ensure_future(load_engine(self.config, on_wedged=self._engine_wedged))
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            load.cancel()
            raise
        finally:
            stop.cancel()
        if load.done():
            return load.result()
        timeout_s = self.config.shutdown.drain_timeout_s
        log.info("stopping_while_loading", timeout_s=timeout_s)
        await asyncio.wait({load}, timeout=timeout_s)
        if not load.done():
            load.cancel()
            log.warning("load_abandoned", reason="stopped while the engine was loading", timeout_s=timeout_s)
            return None
        worker, _ = load.result()  # a load that failed meanwhile exits with its own code
        await worker.close()
        return None

    async def _serve(
        self,
        worker: EngineWorker,
        info: EngineInfo,
        sink: AudioSink,
        journal: RequestJournal | None = None,
        recovered: Recovered | None = None,
        http: HttpSpeechServer | None = None,
    ) -> int:
        """ready -> run -> drain, with every long-lived task in one group."""
        cfg = self.config
        hooks = DaemonHooks(on_utterance_end=self._memory_now.set, on_denied=self._subscription_denied)
        wiring = await build_daemon(
            cfg, self.topics, worker, info, sink, self.metrics, hooks, journal, http, self.intakes
        )
        self._parts = wiring  # the readiness and the metrics read the link and the queue through it
        if wiring.durable is not None and recovered is not None:
            queued, expired = wiring.durable.resume(recovered, cfg.queue.resume_max_age_s)
            if recovered.open or recovered.unsent:
                log.info("journal_resumed", queued=queued, expired=expired, republished=len(recovered.unsent))
        async with asyncio.TaskGroup() as tg:
            tasks = self._start(tg, wiring, worker)
            self.readiness.enter(LifecyclePhase.SERVING)
            self.notifier.ready(f"ready: {info.engine} {info.model} on {info.device}")
            log.info("ready", engine=info.engine, model=info.model, device=info.device, voices=len(info.voices))
            await self._stop.wait()
            await self._drain(wiring, tasks)
        log.info("stopped", exit_code=self._exit_code)
        return self._exit_code

    def _subscription_denied(self, refused: list[tuple[str, str]]) -> None:
        """The broker refused a subscription (its ACL): a daemon that cannot hear its requests stops,
        exit 77, rather than sit deaf. The link never published ``online`` for that connection."""
        if self._exit_code == EXIT_OK:
            self._exit_code = EXIT_NOPERM
        log.critical(
            "exiting_subscription_denied",
            topics=[topic for topic, _ in refused],
            reasons=[reason for _, reason in refused],
            exit_code=EXIT_NOPERM,
            fix=(
                "grant the daemon read access to these topics in the broker's ACL (docs/mqtt.md: Broker access control)"
            ),
        )
        self.request_stop()

    def _start(self, tg: asyncio.TaskGroup, wiring: DaemonParts, worker: EngineWorker) -> _Tasks:
        stages = wiring.stages
        tasks = _Tasks(
            link=tg.create_task(wiring.link.run(), name="s2s.mqtt"),
            tts=tg.create_task(stages.tts.run(), name="s2s.tts"),
            playback=tg.create_task(stages.playback.run(), name="s2s.playback"),
            intakes=[tg.create_task(intake.run(), name=f"s2s.{intake.name}") for intake in wiring.intakes],
            journal=tg.create_task(wiring.durable.journal.run(), name="s2s.journal")
            if wiring.durable is not None
            else None,
        )
        tasks.helpers.append(tg.create_task(wiring.events.run_state(stages.snapshot), name="s2s.events.state"))
        tasks.helpers.append(tg.create_task(self._memory_loop(worker, wiring.events), name="s2s.telemetry.memory"))
        if self.notifier.watchdog_interval_s:
            tasks.helpers.append(tg.create_task(self._watchdog(worker), name="s2s.watchdog"))
        return tasks

    async def _drain(self, wiring: DaemonParts, tasks: _Tasks) -> None:
        """Accept no more, let the current utterance end (at most ``shutdown.drain_timeout_s``),
        answer everything still open, say ``offline``."""
        cfg = self.config
        ledger = wiring.stages.ledger
        self.readiness.enter(LifecyclePhase.DRAINING)
        self.notifier.stopping()
        log.info("draining", queued=len(wiring.stages.requests), timeout_s=cfg.shutdown.drain_timeout_s)
        deadline = asyncio.get_running_loop().time() + cfg.shutdown.drain_timeout_s
        pool = wiring.pool
        if pool is not None:  # the queued pool requests go back to the pool, not cancelled
            held = pool.begin()
        ledger.close()  # accepts no more; queued requests are answered cancelled
        if wiring.streams is not None:
            wiring.streams.close()  # an open stream takes no more text: what came is spoken
        for intake in wiring.intakes:
            intake.drain()
        if pool is not None:
            # Leave the shared group first, so that the broker sends the hand-backs (and new pool
            # requests) to the other members; pool requests arriving meanwhile are held too.
            left = await wiring.link.leave_pool(CLOSE_TIMEOUT_S)
            if not left:
                log.warning("pool_leave_unconfirmed", timeout_s=CLOSE_TIMEOUT_S)
            released = pool.release()
            log.info("pool_left", confirmed=left, handing_back=released, queued=held)
        _, pending = await asyncio.wait({tasks.tts, tasks.playback}, timeout=cfg.shutdown.drain_timeout_s)
        if pool is not None:  # a hand-back leaves the journal once a member took it (its receipt)
            await pool.wait_taken(deadline - asyncio.get_running_loop().time())
        if pending:
            log.warning("drain_timeout", interrupted=[j.request.id for j in ledger.jobs.values()])
            ledger.stop_all()
            _, pending = await asyncio.wait(pending, timeout=CLOSE_TIMEOUT_S)
            for task in pending:
                task.cancel()
        ledger.abandon(RequestError(ErrorCode.SHUTTING_DOWN, "the daemon stopped"))
        for intake, task in zip(wiring.intakes, tasks.intakes, strict=True):
            # Every synthesis has ended: its clients get what is left, then the hang-up.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(INTAKE_CLOSE_S):
                    await intake.close()
            task.cancel()
        for task in tasks.helpers:
            task.cancel()
        if wiring.durable is not None:  # the last terminal events go out before the link closes
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await wiring.durable.journal.settle()
        wiring.link.publish(wiring.events.state_message(wiring.stages.snapshot()))
        await wiring.link.close([wiring.events.status_message(False)], CLOSE_TIMEOUT_S)
        tasks.link.cancel()
        if pool is not None:
            log.info(
                "pool_handed_back", requests=pool.handed_back, acknowledged=pool.acknowledged, taken=pool.taken_count
            )
        if tasks.journal is not None:
            tasks.journal.cancel()  # what the last acknowledgements wrote is committed by its close

    async def _memory_loop(self, worker: EngineWorker, events: MqttEvents) -> None:
        """The memory event: once at start (the metrics and Home Assistant's sensor have a figure
        at once), then every ``telemetry.memory_interval_s`` and after utterances."""
        interval = self.config.telemetry.memory_interval_s
        self._memory_now.set()
        failing = False
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._memory_now.wait()
            self._memory_now.clear()
            device = await worker.memory()
            try:
                payload = memory_payload(self.config.site_id, now_ms(), device)
            except OSError as exc:  # /proc unreadable: at the open-file limit (EMFILE), for one
                if not failing:
                    log.warning("memory_sample_failed", error=str(exc), consequence="no memory event until it reads")
                failing = True
                continue
            if failing:
                log.info("memory_sample_recovered")
                failing = False
            events.memory(payload)
            self.metrics.memory(payload)
            # Utterances that end in a burst share one event: the next one waits out the
            # minimum gap, then reports the memory after the latest of them.
            await asyncio.sleep(MEMORY_MIN_INTERVAL_S)

    def _engine_wedged(self, reason: str) -> None:
        """The engine thread is stuck for good (``EngineWorker``): stop serving and exit 70 through
        the drain. What was not spoken is left to the next start: journaled MQTT requests stopped
        now are not answered (their rows stay open), the failed request was answered already.
        Before the daemon serves (warm-up), the failure surfaces where the engine was called."""
        wiring = self._parts
        if self._exit_code == EXIT_SOFTWARE or wiring is None:
            return
        self._exit_code = EXIT_SOFTWARE
        log.critical("exiting_engine_wedged", reason=reason, exit_code=EXIT_SOFTWARE)
        if wiring.durable is not None:
            wiring.durable.outbox.leave_open()
        stopped = wiring.stages.ledger.stop_all()
        log.info("left_for_restart_total", requests=stopped, journal=wiring.durable is not None)
        self.request_stop()

    async def _watchdog(self, worker: EngineWorker | None = None) -> None:
        """Ping the service manager's watchdog while the daemon can serve: not once the engine is
        wedged (a drain that then hangs is killed and restarted by the service manager)."""
        interval = self.notifier.watchdog_interval_s
        assert interval is not None
        while True:
            if worker is not None and worker.wedged is not None:
                log.warning("watchdog_withheld", reason=worker.wedged)
                return
            self.notifier.watchdog()
            await asyncio.sleep(interval / 2)


@dataclass(slots=True)
class _Tasks:
    link: asyncio.Task[None]
    tts: asyncio.Task[None]
    playback: asyncio.Task[None]
    intakes: list[asyncio.Task[None]]
    """One per intake, in ``DaemonParts.intakes``' order."""
    journal: asyncio.Task[None] | None = None
    helpers: list[asyncio.Task[Any]] = field(default_factory=list)
    """Cancelled at the end of the drain."""
