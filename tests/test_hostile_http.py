"""Hostile and careless clients on the HTTP port (issue 42): another site's page, a DNS-rebinding
page, an upload that declares a 1 Hz sample rate, clients that never read their answer, a form of
endless fields. The daemon as a subprocess (the tone engine, a real mosquitto, no API key: the
documented default), aiohttp and raw sockets as the clients. After every test, and while the hostile
requests run, the daemon answers ``/health`` within 1 s, its RSS stays within 200 MB of idle and it
has not exited; each hostile request gets a clear error."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import psutil
import pytest
import soundfile

from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError
from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import DaemonProcess, write_config
from tests.support.mqtt import Recorder, recorder
from tests.support.wait import until_blocking

pytestmark = pytest.mark.integration

SAY = "s2s/kitchen/tts/say"
HEALTH_BOUND_S = 1.0
"""The longest ``/health`` may take, whatever a hostile client does meanwhile."""
RSS_BOUND = 200 * 1024 * 1024
"""How far above idle the daemon's resident memory may go."""
WRITE_TIMEOUT_S = 1.0
"""``http.write_timeout_s`` of the daemon under test."""
MS_PER_CHAR = 400
"""The tone engine's audio per character here: a long text is minutes of audio, more than any
socket buffers hold, so that a client that never reads stalls its answer."""
EVIL = "http://evil.example"
ALLOWED = "TTS.example.org"
"""A name in ``http.allowed_hosts`` (a reverse proxy's), in another case than the requests'."""


@dataclass
class Target:
    proc: DaemonProcess
    broker: Mosquitto
    port: int
    voices: Path
    idle_rss: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss(self) -> int:
        assert self.proc.proc is not None
        return int(psutil.Process(self.proc.proc.pid).memory_info().rss)

    def alive(self) -> bool:
        return self.proc.proc is not None and self.proc.proc.poll() is None


def _get(url: str, timeout_s: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return int(r.status)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    work = tmp_path_factory.mktemp("hostile")
    broker = Mosquitto(work)
    broker.start()
    port = free_port()
    voices = work / "voices"
    config = write_config(
        work / "daemon.yaml",
        broker.port,
        http={"enabled": True, "port": port, "write_timeout_s": WRITE_TIMEOUT_S, "allowed_hosts": [ALLOWED]},
        tts={"options": {"speed": "0", "ms_per_char": str(MS_PER_CHAR)}, "voices_dir": str(voices)},
    )
    proc = DaemonProcess(config)
    proc.start()
    try:

        def ready() -> bool:
            assert proc.proc is not None and proc.proc.poll() is None, proc.log()
            with contextlib.suppress(OSError):
                return _get(f"http://127.0.0.1:{port}/ready", 1.0) == 200
            return False

        until_blocking(ready, 60, "/ready")
        target = Target(proc, broker, port, voices)
        target.idle_rss = target.rss()
        yield target
    finally:
        proc.cleanup()
        broker.stop()


@dataclass
class Watch:
    """What ``watching`` saw: the slowest ``/health`` and the peak RSS."""

    slowest_health_s: float = 0.0
    health_failures: list[str] = field(default_factory=list)
    peak_rss: int = 0


@contextlib.asynccontextmanager
async def watching(target: Target) -> AsyncIterator[Watch]:
    """While the body runs: ``/health`` every 0.2 s and the daemon's RSS every 20 ms; then the bounds."""
    watch = Watch(peak_rss=target.rss())
    timeout = aiohttp.ClientTimeout(total=HEALTH_BOUND_S)

    async def health() -> None:
        async with aiohttp.ClientSession(target.base_url, timeout=timeout) as http:
            while True:
                began = time.monotonic()
                try:
                    async with http.get("/health") as r:
                        if r.status != 200:
                            watch.health_failures.append(f"status {r.status}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    watch.health_failures.append(repr(exc))
                watch.slowest_health_s = max(watch.slowest_health_s, time.monotonic() - began)
                await asyncio.sleep(0.2)  # a probe's period, as a load balancer's

    async def memory() -> None:
        while target.alive():
            with contextlib.suppress(psutil.Error):
                watch.peak_rss = max(watch.peak_rss, target.rss())
            await asyncio.sleep(0.02)  # a sampling period: the peak between two looks is missed

    tasks = [asyncio.create_task(health(), name="test.health"), asyncio.create_task(memory(), name="test.rss")]
    try:
        yield watch
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert target.alive(), f"the daemon exited:\n{target.proc.log()[-3000:]}"
    assert not watch.health_failures, watch.health_failures[:5]
    assert watch.slowest_health_s < HEALTH_BOUND_S, watch.slowest_health_s
    grown = watch.peak_rss - target.idle_rss
    assert grown < RSS_BOUND, f"RSS grew {grown / 2**20:.0f} MB over idle"


@pytest.fixture(autouse=True)
def _survives(target: Target) -> Iterator[None]:
    yield
    assert target.alive(), f"the daemon exited:\n{target.proc.log()[-3000:]}"
    began = time.monotonic()
    assert _get(f"{target.base_url}/health", HEALTH_BOUND_S) == 200
    assert time.monotonic() - began < HEALTH_BOUND_S
    assert target.rss() - target.idle_rss < RSS_BOUND


async def _error(response: aiohttp.ClientResponse) -> dict[str, Any]:
    return dict((await response.json())["error"])


async def _only_marker_spoken(rec: Recorder, session: aiohttp.ClientSession, marker: str) -> None:
    """A request sent after the refused ones is answered, and nothing before it was queued: the
    ledger answers in order, so a refused request that had been queued would show first."""
    async with session.post("/api/say", json={"text": "ok", "id": marker}) as r:
        assert r.status == 202, await r.text()
    await rec.wait_finished([marker], timeout_s=30)
    started = [p["id"] for p in rec.payloads("/tts/started")]
    finished = [p["id"] for p in rec.payloads("/tts/finished")]
    assert started == [marker] and finished == [marker], (started, finished)


# -- item 1: another site's page, a rebinding page ------------------------------------------------


async def test_requests_from_another_site_are_refused_and_nothing_is_queued(target: Target) -> None:
    evil_form = aiohttp.FormData({"text": "Transfer the money.", "force": "true"})
    evil_voice = aiohttp.FormData(default_to_multipart=True)
    evil_voice.add_field("name", "evil")
    evil_voice.add_field("instruct", "A stranger's voice.")
    evil_voice.add_field("force", "true")
    say = json.dumps({"text": "Transfer the money."})
    speech = json.dumps({"model": "tts-1", "input": "Transfer the money.", "voice": "Ryan", "response_format": "wav"})
    cases: list[tuple[str, str, dict[str, str], Any, int, str]] = [
        # method, path, headers, body, status, code: what a form or fetch() of another site sends
        ("POST", "/api/say", {"Origin": EVIL, "Content-Type": "text/plain"}, say, 403, "cross_origin"),
        ("POST", "/api/say", {"Origin": EVIL}, evil_form, 403, "cross_origin"),
        ("POST", "/api/stop", {"Origin": EVIL, "Content-Type": "text/plain"}, '{"all": true}', 403, "cross_origin"),
        ("POST", "/v1/audio/speech", {"Origin": EVIL, "Content-Type": "text/plain"}, speech, 403, "cross_origin"),
        ("POST", "/api/voices", {"Origin": EVIL}, evil_voice, 403, "cross_origin"),
        ("POST", "/api/say", {"Origin": "null", "Content-Type": "application/json"}, say, 403, "cross_origin"),
        ("DELETE", "/api/voices/evil", {"Origin": EVIL}, None, 403, "cross_origin"),
        # the same without an Origin (an old browser, a script): JSON endpoints take only JSON
        ("POST", "/api/say", {"Content-Type": "text/plain"}, say, 415, "unsupported_media_type"),
        ("POST", "/api/say", {}, aiohttp.FormData({"text": "hi"}), 415, "unsupported_media_type"),
        ("POST", "/api/stop", {"Content-Type": "text/plain"}, '{"all": true}', 415, "unsupported_media_type"),
        ("POST", "/v1/audio/speech", {"Content-Type": "text/plain"}, speech, 415, "unsupported_media_type"),
        ("POST", "/v1/audio/speech", {}, aiohttp.FormData({"input": "hi"}), 415, "unsupported_media_type"),
        ("POST", "/api/voices", {}, aiohttp.FormData({"name": "evil", "instruct": "x"}), 415, "unsupported_media_type"),
        ("PATCH", "/api/voices/evil", {"Content-Type": "text/plain"}, '{"name": "x"}', 415, "unsupported_media_type"),
        # a page that rebound its name to 127.0.0.1 sends its own Host, and could read the answers
        ("GET", "/", {"Host": "evil.example"}, None, 403, "host_not_allowed"),
        ("GET", "/api/voices", {"Host": "evil.example"}, None, 403, "host_not_allowed"),
        ("GET", "/api/status", {"Host": "evil.example:5050"}, None, 403, "host_not_allowed"),
        ("GET", "/v1/audio/voices", {"Host": "evil.example"}, None, 403, "host_not_allowed"),
        ("POST", "/api/say", {"Host": "evil.example", "Content-Type": "application/json"}, say, 403,
         "host_not_allowed"),
    ]  # fmt: skip
    async with (
        recorder(target.broker.port, subscribe=("s2s/kitchen/tts/#",)) as rec,
        aiohttp.ClientSession(target.base_url, timeout=aiohttp.ClientTimeout(total=30)) as session,
        watching(target),
    ):
        for method, path, headers, body, status, code in cases:
            async with session.request(method, path, headers=headers, data=body) as r:
                answer = await r.json()
                error = answer.get("error") or {}
                assert (r.status, error.get("code")) == (status, code), (method, path, headers, r.status, answer)
                assert error["message"], error
        assert not (target.voices / "evil").exists()
        await _only_marker_spoken(rec, session, "after-the-refused")


async def test_the_page_localhost_and_the_sdk_are_still_served(target: Target) -> None:
    same_origin = {"Origin": target.base_url}
    async with (
        recorder(target.broker.port, subscribe=("s2s/kitchen/tts/#",)) as rec,
        aiohttp.ClientSession(target.base_url, timeout=aiohttp.ClientTimeout(total=30)) as session,
    ):
        # the page's own fetch() (same origin), by address and by the name localhost
        async with session.post("/api/say", json={"text": "hi", "id": "page"}, headers=same_origin) as r:
            assert r.status == 202, await r.text()
        localhost = f"localhost:{target.port}"
        for path in ("/", "/api/voices", "/api/status"):
            async with session.get(path, headers={"Host": localhost}) as r:
                assert r.status == 200, (path, await r.text())
        origin = {"Host": localhost, "Origin": f"http://{localhost}"}
        async with session.post("/api/stop", json={"id": "none"}, headers=origin) as r:
            assert r.status == 200, await r.text()
        async with session.get("/health", headers={"Host": "evil.example"}) as r:  # probes answer any name
            assert r.status == 200
        proxied = {"Host": "tts.example.org", "Origin": "https://tts.example.org"}  # a TLS proxy's page
        async with session.get("/api/voices", headers=proxied) as r:
            assert r.status == 200, await r.text()
        async with session.post("/api/stop", json={"id": "none"}, headers=proxied) as r:
            assert r.status == 200, await r.text()
        await rec.wait_finished(["page"], timeout_s=30)
    client = openai.AsyncOpenAI(base_url=f"{target.base_url}/v1", api_key="-", max_retries=0, timeout=30)
    async with client:
        wav = await client.audio.speech.create(model="tts-1", voice="Ryan", input="hi", response_format="wav")
    assert len(soundfile.read(io.BytesIO(wav.content))[0]) > 0


@pytest.mark.parametrize("bad", ["http://tts.example.org", "tts.example.org:443", "a/b", "", "tts example"])
def test_allowed_hosts_are_plain_host_names(tmp_path: Path, bad: str) -> None:
    path = write_config(tmp_path / "daemon.yaml", 1883, http={"allowed_hosts": [bad]})
    with pytest.raises(ConfigError, match=r"http\.allowed_hosts: .*not a host name"):
        load_config(path, environ={})
    fixed = load_config(path, environ={"S2S_HTTP__ALLOWED_HOSTS": "[A.Example., '*']"})  # over the file's
    assert fixed.http.allowed_hosts == ("a.example", "*")


# -- item 3: a tiny upload that declares 1 Hz ----------------------------------------------------


def _wav(rate: int, frames: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.zeros(frames, np.int16), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


async def test_a_tiny_upload_declaring_1_hz_is_refused_before_it_is_decoded(target: Target) -> None:
    one_hz = _wav(1, 12_500)  # 25 KB: 3.5 hours at 1 Hz, 300 M samples once resampled to 24 kHz
    assert len(one_hz) < 26_000
    long_one = _wav(8000, 8000 * 90)  # 90 s: longer than anything read, forced or not
    async with (
        aiohttp.ClientSession(target.base_url, timeout=aiohttp.ClientTimeout(total=60)) as session,
        watching(target),
    ):
        for audio, force, code, limit in (
            (one_hz, "false", "unsupported_audio", "8000-192000 Hz"),
            (one_hz, "true", "unsupported_audio", "8000-192000 Hz"),
            (long_one, "true", "reference_length", "at most 60 s"),
        ):
            for dry_run in ("false", "true"):
                form = aiohttp.FormData()
                form.add_field("name", "tiny")
                form.add_field("force", force)
                form.add_field("dry_run", dry_run)
                form.add_field("audio", io.BytesIO(audio), filename="tiny.wav", content_type="audio/wav")
                async with session.post("/api/voices", data=form) as r:
                    error = await _error(r)
                    assert (r.status, error["code"], error["param"]) == (400, code, "audio"), error
                    assert limit in error["message"], error
    assert not (target.voices / "tiny").exists()


# -- item 6: clients that never read -------------------------------------------------------------


def _never_reading(port: int, text: str, stream_format: str) -> socket.socket:
    """A connection that sends a speech request and never reads a byte of the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {"model": "tts-1", "input": text, "voice": "Ryan", "response_format": "pcm", "stream_format": stream_format}
    ).encode()
    head = (
        f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


async def test_clients_that_never_read_are_cut_and_others_are_served(target: Target) -> None:
    text = "Nobody reads this. " * 100  # 1,900 characters: 760 s of audio here, 36 MB of pcm
    sockets: list[socket.socket] = []
    async with (
        recorder(target.broker.port, subscribe=("s2s/kitchen/tts/#",)) as rec,
        watching(target),
    ):
        try:
            for i in range(4):  # tts.max_streams
                sockets.append(_never_reading(target.port, text, "sse" if i % 2 else "audio"))
            await rec.wait_for(lambda: len(rec.payloads("/tts/started")) >= 4, 30)
            stalled = [p["id"] for p in rec.payloads("/tts/started")]
            # meanwhile, an MQTT say and an HTTP speech request are served
            await rec.say(SAY, {"text": "The kettle.", "id": "mqtt-after"})
            client = openai.AsyncOpenAI(base_url=f"{target.base_url}/v1", api_key="-", max_retries=0, timeout=30)
            async with client, asyncio.timeout(30):
                wav = await client.audio.speech.create(model="tts-1", voice="Ryan", input="hi", response_format="wav")
            assert len(soundfile.read(io.BytesIO(wav.content))[0]) > 0
            finished = await rec.wait_finished([*stalled, "mqtt-after"], timeout_s=30)
        finally:
            for sock in sockets:
                sock.close()
    assert finished["mqtt-after"]["status"] == "completed"
    assert {finished[i]["status"] for i in stalled} == {"interrupted"}, [finished[i] for i in stalled]
    assert "http_client_not_reading" in target.proc.log()


# -- item 8: forms of endless fields -------------------------------------------------------------


async def test_a_voice_form_is_bounded_as_a_whole(target: Target) -> None:
    async with (
        aiohttp.ClientSession(target.base_url, timeout=aiohttp.ClientTimeout(total=30)) as session,
        watching(target),
    ):
        repeated = aiohttp.FormData(default_to_multipart=True)
        repeated.add_field("name", "many")
        repeated.add_field("instruct", "A calm voice.")
        for _ in range(30):  # 30 x 8 KB of the same field: the last one used to win, after all were read
            repeated.add_field("description", "x" * 8192)
        async with session.post("/api/voices", data=repeated) as r:
            error = await _error(r)
            assert (r.status, error["code"], error["param"]) == (400, "bad_payload", "description"), error
            assert "twice" in error["message"]
        unknown = aiohttp.FormData(default_to_multipart=True)
        unknown.add_field("name", "many")
        for i in range(30):
            unknown.add_field(f"field{i}", "x" * 8192)
        async with session.post("/api/voices", data=unknown) as r:
            error = await _error(r)
            assert (r.status, error["code"], error["param"]) == (400, "bad_payload", "field0"), error
    assert not (target.voices / "many").exists()
