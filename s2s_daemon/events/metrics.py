"""The daemon's Prometheus metrics (``GET /metrics``), from the events it already reports.

Nothing here keeps books of its own: a request's series come from its terminal event, read off the
ledger's timeline with the same figures as the MQTT latency event (``latency_payload``); memory
from the memory event's payload; the queue depth, the engine's busy time and readiness are read
when scraped. Each daemon has its own ``CollectorRegistry`` (several run in one test process).

Names follow Prometheus' conventions: an ``s2s_`` prefix, base units (seconds, bytes) in the name,
``_total`` on counters. The request series are labelled by ``intake`` (the request's origin:
``mqtt``, ``pool``, ``hermes``, ``http``, ``wyoming``) and the requests counter by ``status``
too (``tts/finished``'s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from s2s_daemon import __version__
from s2s_daemon.events.publisher import latency_payload
from s2s_daemon.pipeline.jobs import Job, JobEvents
from s2s_daemon.pipeline.messages import Status
from s2s_daemon.pipeline.vocabulary import EngineInfo

INTAKES = ("mqtt", "pool", "hermes", "http", "wyoming")
"""Origins whose series exist from the start (at zero): a rate over them needs no first request."""
FIRST_AUDIO_BUCKETS_S = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
COMMIT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MIB = 1024 * 1024


class _EngineBusy(Collector):
    """``s2s_engine_busy_seconds_total``, read from the engine thread when scraped."""

    def __init__(self, busy_s: Callable[[], float]) -> None:
        self.busy_s = busy_s

    def describe(self) -> list[Any]:
        return []  # not asked to collect at registration (the engine may not be loaded)

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "s2s_engine_busy_seconds",
            "Seconds the engine thread spent in engine calls (load, warm-up, synthesis, memory figures)",
            value=self.busy_s(),
        )


class DaemonMetrics:
    """The registry and its series. The constructor does no I/O."""

    content_type = CONTENT_TYPE_LATEST
    """The text exposition format's media type, as prometheus_client writes it."""

    def __init__(self, queue_depth: Callable[[], int] = lambda: 0, ready: Callable[[], bool] = lambda: False) -> None:
        """``queue_depth`` and ``ready`` are read when scraped."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "s2s_requests", "Requests answered, by intake and terminal status", ["intake", "status"], registry=r
        )
        self.first_audio = Histogram(
            "s2s_first_audio_seconds",
            "From receipt to the first sample out (to the device, or to the caller)",
            ["intake"],
            buckets=FIRST_AUDIO_BUCKETS_S,
            registry=r,
        )
        self.real_time_factor = Histogram(
            "s2s_real_time_factor",
            "Synthesis seconds per second of audio, per request (below 1: faster than real time)",
            ["intake"],
            buckets=RTF_BUCKETS,
            registry=r,
        )
        self.audio = Counter("s2s_audio_seconds", "Seconds of audio synthesized", ["intake"], registry=r)
        self.underruns = Counter(
            "s2s_underruns",
            "Times the speaker's buffer ran dry in the middle of an utterance (a run of starved periods is one)",
            registry=r,
        )
        self.underrun = Counter(
            "s2s_underrun_seconds", "Seconds of silence the speaker played while its buffer was dry", registry=r
        )
        self.runaways = Counter(
            "s2s_runaway_truncated",
            "Requests cut short where the engine ran away (truncated: runaway), by what gave it away",
            ["cause"],
            registry=r,
        )
        self.queue_depth = Gauge("s2s_queue_depth", "Requests waiting in the queue", registry=r)
        self.ready = Gauge("s2s_ready", "1 when the daemon is ready (GET /ready answers 200), else 0", registry=r)
        self.queue_depth.set_function(lambda: float(queue_depth()))
        self.ready.set_function(lambda: 1.0 if ready() else 0.0)
        self.resident_memory = Gauge("s2s_resident_memory_bytes", "Resident set size of the process", registry=r)
        self.resident_memory_peak = Gauge(
            "s2s_resident_memory_peak_bytes", "Highest resident set size of the process since start", registry=r
        )
        self.device_memory = Gauge(
            "s2s_device_memory_bytes", "Memory the engine holds on its device", ["device"], registry=r
        )
        self.device_memory_peak = Gauge(
            "s2s_device_memory_peak_bytes", "Highest memory the engine held on its device", ["device"], registry=r
        )
        self.journal_commit = Histogram(
            "s2s_journal_commit_seconds",
            "Time of one request-journal commit (a group of writes, fsynced with synchronous: full)",
            buckets=COMMIT_BUCKETS_S,
            registry=r,
        )
        self.build = Info("s2s_build", "The daemon's version and the engine it loaded", registry=r)
        self.build.info({"version": __version__})
        for intake in INTAKES:
            self.first_audio.labels(intake)
            self.real_time_factor.labels(intake)
            self.audio.labels(intake)
            for status in Status:
                self.requests.labels(intake, str(status))
        for cause in ("length", "silence", "loop"):
            self.runaways.labels(cause)

    # -- what the daemon reports -------------------------------------------------------

    def engine_loaded(self, info: EngineInfo, busy_s: Callable[[], float]) -> None:
        self.build.info({"version": __version__, "engine": info.engine, "model": info.model, "device": info.device})
        self.registry.register(_EngineBusy(busy_s))

    def finished(self, job: Job, info: EngineInfo) -> None:
        """A request's terminal event: its figures as the latency event has them."""
        intake = job.request.origin
        self.requests.labels(intake, str(job.status)).inc()
        if job.truncated is not None:
            self.runaways.labels(job.truncated_cause or "length").inc()
        if job.timeline.first_sample_out is None:
            return  # nothing was heard: no latency event, no latency figures
        latency = latency_payload(job, info)
        first_ms = latency["firstAudioOutMs"]
        if isinstance(first_ms, float):
            self.first_audio.labels(intake).observe(first_ms / 1000.0)
        rtf = latency["rtf"]
        if isinstance(rtf, float) and job.status is Status.COMPLETED:  # a stopped one's is not the engine's pace
            self.real_time_factor.labels(intake).observe(rtf)
        self.audio.labels(intake).inc(job.timeline.audio_s)
        self.underruns.inc(job.timeline.underruns)
        self.underrun.inc(job.timeline.underrun_ms / 1000.0)

    def memory(self, payload: dict[str, object]) -> None:
        """The memory event's payload (``events/memory.py``)."""
        for gauge, key in ((self.resident_memory, "rssMiB"), (self.resident_memory_peak, "peakRssMiB")):
            value = payload.get(key)
            if isinstance(value, int | float):
                gauge.set(value * MIB)
        kind = str(payload.get("deviceKind"))
        for gauge, key in ((self.device_memory, "deviceAllocatedMiB"), (self.device_memory_peak, "devicePeakMiB")):
            value = payload.get(key)
            if kind != "none" and isinstance(value, int | float):
                gauge.labels(kind).set(value * MIB)

    def journal_committed(self, seconds: float) -> None:
        """One journal commit (called on the journal's writer thread; the histogram is thread-safe)."""
        self.journal_commit.observe(seconds)

    def exposition(self) -> bytes:
        """The text format a scraper reads."""
        return generate_latest(self.registry)


class MeteredEvents:
    """``JobEvents`` that count each terminal event into the metrics, then hand every event on."""

    def __init__(self, inner: JobEvents, metrics: DaemonMetrics, info: EngineInfo) -> None:
        self.inner = inner
        self.metrics = metrics
        self.info = info

    def started(self, job: Job) -> None:
        self.inner.started(job)

    def finished(self, job: Job) -> None:
        self.metrics.finished(job, self.info)
        self.inner.finished(job)

    def state_changed(self) -> None:
        self.inner.state_changed()
