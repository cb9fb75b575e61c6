"""``/health``, ``/ready`` and ``/metrics``: the monitor listener and the speech API's port, probed
with curl while a real daemon process loads its model, and scraped after real requests (the openai
SDK, MQTT through a real mosquitto), the exposition read back with prometheus_client's parser."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from s2s_daemon.app import Daemon
from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError, UnavailableError
from s2s_daemon.events.metrics import DaemonMetrics
from s2s_daemon.events.publisher import latency_payload
from s2s_daemon.events.readiness import LifecyclePhase, Readiness
from s2s_daemon.intake.http import require_monitor_extra
from s2s_daemon.pipeline.jobs import Job, Timeline
from s2s_daemon.pipeline.messages import SayRequest, Status
from s2s_daemon.pipeline.vocabulary import EngineInfo
from s2s_daemon.tts.bridge import EngineThread
from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import DaemonProcess, daemon_in_process, write_config
from tests.support.mqtt import recorder
from tests.support.wait import until
from tests.test_http_speech import tone_samples, wait_ready

SAY = "s2s/kitchen/tts/say"


async def curl(url: str) -> tuple[int, dict[str, Any] | None]:
    """GET ``url`` with curl: (status, JSON body); status 0 when nothing answers."""
    assert shutil.which("curl") is not None, "curl is not installed (apt-get install curl)"
    proc = await asyncio.create_subprocess_exec(
        "curl", "-s", "-m", "5", "-w", "\n%{http_code}", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await proc.communicate()
    body, _, code = out.decode().rpartition("\n")
    return int(code or 0), json.loads(body) if body.strip() else None


async def curl_until(url: str, wanted: int, timeout_s: float = 30.0) -> dict[str, Any] | None:
    async def answer() -> tuple[int, dict[str, Any] | None] | None:
        status, body = await curl(url)
        return (status, body) if status == wanted else None

    _, body = await until(answer, timeout_s, f"{url} answering {wanted}", interval_s=0.05)
    return body


def samples(exposition: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the exposition by (name, labels), as prometheus_client's parser reads it."""
    out = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(parsed: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return parsed[(name, frozenset(labels.items()))]


# -- a real daemon process, probed with curl while its model loads ---------------------------------


@pytest.mark.integration
async def test_probes_answer_while_the_model_loads_then_ready(tmp_path: Path, mosquitto: Mosquitto) -> None:
    gate = tmp_path / "loaded"  # the tone engine's load ends when this file exists
    monitor, api = free_port(), free_port()
    config = write_config(
        tmp_path / "daemon.yaml",
        mosquitto.port,
        tts={"options": {"load_gate": str(gate)}},
        monitor={"enabled": True, "port": monitor},
        http={"enabled": True, "port": api},
    )
    proc = DaemonProcess(config)
    proc.start()
    try:
        base = f"http://127.0.0.1:{monitor}"
        health = await curl_until(f"{base}/health", 200)
        assert health == {"status": "ok", "phase": "loading"}
        status, ready = await curl(f"{base}/ready")
        assert status == 503 and ready is not None
        assert ready["ready"] is False and ready["phase"] == "loading"
        assert ready["checks"]["model_loaded"] is False and "model_loaded" in ready["not_ready"]
        assert "the model is loading" in ready["reason"]
        # The speech API's port answers the probes too, and its own paths say why they cannot serve yet.
        status, _ = await curl(f"http://127.0.0.1:{api}/ready")
        assert status == 503
        status, models = await curl(f"http://127.0.0.1:{api}/v1/models")
        assert status == 503 and models is not None and models["error"]["code"] == "model_loading"
        gate.touch()
        ready = await curl_until(f"{base}/ready", 200)
        assert ready == {
            "ready": True,
            "phase": "serving",
            "checks": {"model_loaded": True, "warmed_up": True, "accepting": True, "broker_connected": True},
        }
        assert (await curl(f"http://127.0.0.1:{api}/ready"))[0] == 200
        assert (await curl(f"http://127.0.0.1:{api}/v1/models"))[0] == 200
    finally:
        proc.cleanup()


@pytest.mark.integration
async def test_ready_follows_the_broker(tmp_path: Path, mosquitto: Mosquitto) -> None:
    port = free_port()
    config = write_config(
        tmp_path / "daemon.yaml",
        mosquitto.port,
        mqtt={"reconnect_max_s": 0.5},
        monitor={"enabled": True, "port": port},
    )
    base = f"http://127.0.0.1:{port}"
    async with daemon_in_process(config):
        await curl_until(f"{base}/ready", 200)
        await asyncio.to_thread(mosquitto.stop)
        body = await curl_until(f"{base}/ready", 503)
        assert body is not None and body["not_ready"] == ["broker_connected"] and body["phase"] == "serving"
        assert (await curl(f"{base}/health"))[0] == 200  # alive all along
        await asyncio.to_thread(mosquitto.start)
        await curl_until(f"{base}/ready", 200)


# -- metrics after real requests ----------------------------------------------------------------------


async def scrape(port: int) -> tuple[str, str]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert r.status == 200
        return r.headers["Content-Type"], await r.text()


@pytest.mark.integration
async def test_metrics_count_what_the_requests_did(tmp_path: Path, mosquitto: Mosquitto) -> None:
    monitor, api = free_port(), free_port()
    config = write_config(
        tmp_path / "daemon.yaml",
        mosquitto.port,
        tts={"options": {"speed": "8"}},
        monitor={"enabled": True, "port": monitor},
        http={"enabled": True, "port": api},
        telemetry={"memory_interval_s": 0.2},
    )
    texts = ["a first request over http.", "and a second one."]  # as the text stage speaks them
    async with recorder(mosquitto.port) as rec, daemon_in_process(config):
        await wait_ready(api)
        before = samples((await scrape(monitor))[1])
        assert value(before, "s2s_requests_total", intake="http", status="completed") == 0  # exists at zero
        assert value(before, "s2s_ready") == 1
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key="none", max_retries=0)
        async with client:
            ids = []
            for text in texts:
                raw = await client.audio.speech.with_raw_response.create(
                    model="tts-1", voice="alloy", input=text, response_format="pcm"
                )
                assert len(raw.parse().content) == 2 * tone_samples(text)
                ids.append(raw.headers["x-request-id"])
            with pytest.raises(openai.BadRequestError):
                await client.audio.speech.create(model="tts-1", voice="Nobody", input="who?")
        await rec.say(SAY, {"id": "spoken", "text": "and one on the speaker"})
        await rec.wait_finished([*ids, "spoken"])
        await rec.wait_for(lambda: rec.payloads("/metrics/memory"))
        content_type, text = await scrape(monitor)
    assert content_type.startswith("text/plain; version=")  # the text exposition format
    got = samples(text)
    assert value(got, "s2s_requests_total", intake="http", status="completed") == 2
    assert value(got, "s2s_requests_total", intake="http", status="rejected") == 1
    assert value(got, "s2s_requests_total", intake="mqtt", status="completed") == 1
    assert value(got, "s2s_first_audio_seconds_count", intake="http") == 2
    assert value(got, "s2s_first_audio_seconds_count", intake="mqtt") == 1
    assert value(got, "s2s_first_audio_seconds_sum", intake="http") > 0
    assert value(got, "s2s_real_time_factor_count", intake="http") == 2
    audio_s = sum(tone_samples(t) for t in texts) / 24000
    assert value(got, "s2s_audio_seconds_total", intake="http") == pytest.approx(audio_s)
    assert value(got, "s2s_underruns_total") == 0
    assert value(got, "s2s_queue_depth") == 0
    assert value(got, "s2s_engine_busy_seconds_total") > 0
    assert value(got, "s2s_journal_commit_seconds_count") >= 1  # the MQTT request was journaled
    assert value(got, "s2s_resident_memory_bytes") > 10 * 1024 * 1024
    assert value(got, "s2s_resident_memory_peak_bytes") >= value(got, "s2s_resident_memory_bytes") * 0.5
    build = next(labels for (name, labels) in got if name == "s2s_build_info")
    assert dict(build)["engine"] == "tone" and dict(build)["version"]
    # Prometheus' conventions: counters end in _total, units in the name, one prefix.
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert all(name.startswith("s2s_") for name in families)
    assert families["s2s_requests"] == "counter" and families["s2s_first_audio_seconds"] == "histogram"
    assert families["s2s_queue_depth"] == "gauge" and families["s2s_journal_commit_seconds"] == "histogram"


@pytest.mark.integration
async def test_a_local_model_is_one_name_everywhere(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """Issue 41 item 13: a local checkpoint is its folder's name in ``info``, the latency event,
    ``s2s_build_info``, the page's status, ``/v1/models`` and Home Assistant's device: never its path."""
    folder = tmp_path / "checkpoints" / "my-voice-model"
    folder.mkdir(parents=True)
    monitor, api = free_port(), free_port()
    config = write_config(
        tmp_path / "daemon.yaml",
        mosquitto.port,
        tts={"model": str(folder)},
        monitor={"enabled": True, "port": monitor},
        http={"enabled": True, "port": api},
        ha={"discovery": True},
    )
    async with recorder(mosquitto.port, subscribe=("s2s/#", "homeassistant/#")) as rec, daemon_in_process(config):
        await wait_ready(api)
        await rec.say(SAY, {"id": "named", "text": "which model speaks"})
        await rec.wait_for(lambda: [p for p in rec.payloads("/metrics/latency") if p["id"] == "named"])
        info = rec.payloads("/kitchen/info")[-1]
        latency = next(p for p in rec.payloads("/metrics/latency") if p["id"] == "named")
        build = dict(next(labels for (name, labels) in samples((await scrape(monitor))[1]) if name == "s2s_build_info"))
        _, status = await curl(f"http://127.0.0.1:{api}/api/status")
        _, models = await curl(f"http://127.0.0.1:{api}/v1/models")
        device = next(m.json()["device"] for m in rec.messages if m.topic.startswith("homeassistant/") and m.payload)
    assert status is not None and models is not None
    assert info["model"] == latency["model"] == build["model"] == status["engine"]["model"] == "my-voice-model"
    assert models["data"][0]["id"] == "my-voice-model"
    assert device["model"] == "my-voice-model (tone)"
    assert str(tmp_path) not in json.dumps([info, latency, build, status, models, device])


@pytest.mark.integration
async def test_memory_has_a_figure_from_the_start(tmp_path: Path, mosquitto: Mosquitto) -> None:
    port = free_port()
    config = write_config(
        tmp_path / "daemon.yaml",
        mosquitto.port,
        monitor={"enabled": True, "port": port},
        telemetry={"memory_interval_s": 3600},  # no utterance, no period: only the one at start
    )
    async with recorder(mosquitto.port) as rec, daemon_in_process(config):
        await rec.wait_for(lambda: rec.payloads("/metrics/memory"))
        got = samples((await scrape(port))[1])
    assert value(got, "s2s_resident_memory_bytes") > 10 * 1024 * 1024


# -- units ---------------------------------------------------------------------------------------------


def _job(origin: str, status: Status, underruns: int = 0, underrun_ms: float = 0.0) -> Job:
    tl = Timeline(received=10.0, dequeued=10.0, synth_started=10.0, first_chunk=10.1, synth_done=10.5)
    tl.first_sample_out, tl.audio_s, tl.underruns, tl.underrun_ms = 10.25, 2.0, underruns, underrun_ms
    job = Job(SayRequest("r", "text", None, "auto", "kitchen", origin=origin), tl)
    job.status = status
    return job


INFO = EngineInfo(engine="tone", model="m", device="cpu", sample_rate=24000, voices=(), languages=("auto",))


def test_a_terminal_event_fills_the_series_as_the_latency_event_has_them() -> None:
    metrics = DaemonMetrics()
    metrics.finished(_job("wyoming", Status.COMPLETED, underruns=3, underrun_ms=1250.0), INFO)
    metrics.finished(_job("wyoming", Status.INTERRUPTED), INFO)
    got = samples(metrics.exposition().decode())
    assert value(got, "s2s_requests_total", intake="wyoming", status="completed") == 1
    assert value(got, "s2s_requests_total", intake="wyoming", status="interrupted") == 1
    assert value(got, "s2s_first_audio_seconds_sum", intake="wyoming") == pytest.approx(0.5)
    assert value(got, "s2s_first_audio_seconds_bucket", intake="wyoming", le="0.2") == 0
    assert value(got, "s2s_first_audio_seconds_bucket", intake="wyoming", le="0.3") == 2
    assert value(got, "s2s_real_time_factor_count", intake="wyoming") == 1  # a stopped one is not the pace
    assert value(got, "s2s_real_time_factor_sum", intake="wyoming") == pytest.approx(0.25)
    assert value(got, "s2s_underruns_total") == 3
    assert value(got, "s2s_underrun_seconds_total") == pytest.approx(1.25)  # the silence, apart from the count
    latency = latency_payload(_job("mqtt", Status.COMPLETED, underruns=3, underrun_ms=1250.0), INFO)
    assert latency["underruns"] == 3 and latency["underrunMs"] == 1250.0
    metrics.memory({"rssMiB": 100.0, "peakRssMiB": 120.0, "deviceKind": "cuda", "deviceAllocatedMiB": 2.0})
    got = samples(metrics.exposition().decode())
    assert value(got, "s2s_resident_memory_bytes") == 100 * 1024 * 1024
    assert value(got, "s2s_device_memory_bytes", device="cuda") == 2 * 1024 * 1024


def test_every_daemon_has_a_registry_of_its_own() -> None:
    first, second = DaemonMetrics(), DaemonMetrics()  # the global registry would refuse the second
    first.finished(_job("http", Status.COMPLETED), INFO)
    assert value(samples(first.exposition().decode()), "s2s_requests_total", intake="http", status="completed") == 1
    assert value(samples(second.exposition().decode()), "s2s_requests_total", intake="http", status="completed") == 0
    assert not any(name.startswith("s2s_") for name in prometheus_client.REGISTRY._names_to_collectors)


def test_readiness_names_what_it_waits_for_in_each_phase() -> None:
    readiness = Readiness()
    connected = [False]
    readiness.broker_connected = lambda: connected[0]
    expected = {
        LifecyclePhase.STARTING: ["model_loaded", "warmed_up", "accepting", "broker_connected"],
        LifecyclePhase.LOADING: ["model_loaded", "warmed_up", "accepting", "broker_connected"],
        LifecyclePhase.WARMING: ["warmed_up", "accepting", "broker_connected"],
        LifecyclePhase.OPENING: ["accepting", "broker_connected"],
        LifecyclePhase.SERVING: ["broker_connected"],
    }
    for phase, missing in expected.items():
        readiness.enter(phase)
        ready, body = readiness.report()
        assert not ready and body["not_ready"] == missing and body["phase"] == str(phase)
        assert readiness.health() == {"status": "ok", "phase": str(phase)}
    connected[0] = True
    assert readiness.report() == (
        True,
        {
            "ready": True,
            "phase": "serving",
            "checks": {"model_loaded": True, "warmed_up": True, "accepting": True, "broker_connected": True},
        },
    )
    readiness.enter(LifecyclePhase.DRAINING)
    ready, body = readiness.report()
    assert not ready and body["not_ready"] == ["accepting"] and "draining" in body["reason"]


async def test_engine_busy_time_counts_the_call_in_progress() -> None:
    thread = EngineThread("test.engine")
    try:
        assert thread.busy_s() == 0.0
        release = threading.Event()
        started = time.monotonic()
        call = asyncio.wrap_future(thread.submit(release.wait))
        during = await until(thread.busy_s, what="busy time while the call still runs")
        release.set()
        await call
        after = thread.busy_s()
        assert during <= after <= time.monotonic() - started
        assert thread.busy_s() == after  # idle: it stands still
    finally:
        thread.shutdown()


# -- configuration and startup errors ------------------------------------------------------------------


def test_the_monitor_port_must_be_its_own(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "d.yaml", 1883, monitor={"enabled": True, "port": 5050}, http={"enabled": True, "port": 5050}
    )
    with pytest.raises(ConfigError, match=r"monitor\.port 5050 is http\.port too") as bad:
        load_config(path, environ={})
    assert bad.value.exit_code == 78


async def test_a_taken_monitor_port_or_a_missing_extra_is_exit_69(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    gate = tmp_path / "never"  # the model never loads: the port is refused before it would
    path = write_config(
        tmp_path / "d.yaml",
        free_port(),
        tts={"options": {"load_gate": str(gate)}},
        monitor={"enabled": True, "port": port},
    )
    config = load_config(path, environ={})
    try:
        taken_message = r"monitor\.port: cannot listen on 127\.0\.0\.1:\d+: the port is in use"
        with pytest.raises(UnavailableError, match=taken_message) as busy:
            await asyncio.wait_for(Daemon(config).run(), 10)
        assert busy.value.exit_code == 69
    finally:
        taken.close()
    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "aiohttp" else real(name, *a))
    with pytest.raises(UnavailableError, match=r"monitor\.enabled needs the http extra") as missing:
        require_monitor_extra(config.monitor)
    assert missing.value.exit_code == 69
