"""The OpenAI-compatible speech API (http.enabled) against the daemon in this process, a real
mosquitto and the tone engine, through the official openai SDK, curl and a raw HTTP client."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import io
import json
import shutil
import socket
import subprocess
import time
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import numpy as np
import openai
import pytest
import soundfile
import structlog

from s2s_daemon.app import Daemon
from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError, UnavailableError
from s2s_daemon.intake.http import require_http_extra
from s2s_daemon.intake.http.api import unanswered
from s2s_daemon.pipeline.messages import ErrorCode, RequestError, Status
from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import daemon_in_process, write_config
from tests.support.mqtt import Recorder, recorder
from tests.support.wait import until

SAY = "s2s/kitchen/tts/say"
FRAME = 1920
"""Samples per tone-engine frame (80 ms at 24 kHz)."""
KEY = "sk-test-0123456789"


def tone_samples(text: str, ms_per_char: float = 40.0) -> int:
    """What the tone engine synthesizes for ``text`` (tests/support/tone_engine.py)."""
    return max(1, round(len(text) * ms_per_char / 80.0)) * FRAME


def decode(fmt: str, data: bytes) -> np.ndarray[Any, Any]:
    if fmt == "pcm":
        return np.frombuffer(data, "<i2")
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000
    return np.asarray(samples)


@dataclass
class Api:
    rec: Recorder
    daemon: Daemon
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=10)


async def wait_ready(port: int, timeout_s: float = 10.0) -> None:
    """Until ``GET /ready`` answers 200 (the port listens before the model loads)."""
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:

        async def ready() -> bool:
            try:
                async with http.get("/ready") as r:
                    return r.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await until(ready, timeout_s, f"/ready on {port}")


@contextlib.asynccontextmanager
async def speech_api(
    tmp_path: Path, broker: Mosquitto, *, api_key: str | None = KEY, **sections: Any
) -> AsyncIterator[Api]:
    port = free_port()
    http: dict[str, Any] = {"enabled": True, "port": port, **sections.pop("http", {})}
    if api_key is not None:
        key_file = tmp_path / "api.key"
        key_file.write_text(api_key + "\n")
        http["api_key_file"] = str(key_file)
    path = write_config(tmp_path / "daemon.yaml", broker.port, http=http, **sections)
    async with recorder(broker.port) as rec, daemon_in_process(path) as daemon:
        await wait_ready(port)
        # Subscribed too: a say published before the daemon's subscription would be lost.
        await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 30)
        yield Api(rec, daemon, port)


@pytest.mark.integration
async def test_sdk_every_format_decodes_to_the_text_length(tmp_path: Path, mosquitto: Mosquitto) -> None:
    text = "The kettle has boiled, come and get your tea."
    async with speech_api(tmp_path, mosquitto) as api, api.client() as client:
        for fmt in ("wav", "flac", "opus", "mp3", "pcm"):
            raw = await client.audio.speech.with_raw_response.create(
                model="tts-1", voice="alloy", input=text, response_format=fmt
            )
            audio = decode(fmt, raw.parse().content)
            extra = 2 * FRAME if fmt == "mp3" else FRAME  # mp3: LAME's delay and padding (no gapless tag)
            assert 0 <= len(audio) - tone_samples(text) < extra, (fmt, len(audio))
            assert raw.headers["content-type"].startswith({"mp3": "audio/mpeg", "opus": "audio/ogg"}.get(fmt, "audio/"))
            request_id = raw.headers["x-request-id"]
            finished = await api.rec.wait_finished([request_id])
            assert finished[request_id]["status"] == "completed"
            assert finished[request_id]["audioMs"] == pytest.approx(tone_samples(text) / 24.0, rel=0.01)
        default = await client.audio.speech.with_raw_response.create(model="s2s", voice="alloy", input=text)
        assert default.headers["content-type"] == "audio/mpeg"  # OpenAI's default format


@pytest.mark.integration
async def test_streaming_bytes_arrive_before_synthesis_ends(tmp_path: Path, mosquitto: Mosquitto) -> None:
    text = "x" * 100  # 4 s of audio, made in 1 s at speed 4
    fast = {"tts": {"options": {"speed": "4"}}}
    async with speech_api(tmp_path, mosquitto, **fast) as api, api.client() as client:
        async with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="Vivian", input=text, response_format="wav", stream_format="audio"
        ) as response:
            assert response.headers["transfer-encoding"] == "chunked"
            request_id = response.headers["x-request-id"]
            data = b""
            finished_at_first_bytes = None
            first_at = 0.0
            async for piece in response.iter_bytes():
                if finished_at_first_bytes is None:
                    finished_at_first_bytes = request_id in api.rec.finished()
                    first_at = time.monotonic()
                data += piece
            spread_s = time.monotonic() - first_at
        assert finished_at_first_bytes is False  # audio came while the request was still synthesizing,
        assert spread_s > 0.5  # and kept coming as it was made (1 s), not all at once at the end
        assert len(decode("wav", data)) == tone_samples(text)
        assert (await api.rec.wait_finished([request_id]))[request_id]["status"] == "completed"


@pytest.mark.integration
async def test_sse_events_carry_the_audio_and_usage(tmp_path: Path, mosquitto: Mosquitto) -> None:
    text = "Server-sent events, one per chunk."
    async with speech_api(tmp_path, mosquitto, tts={"chunk_frames": 2}) as api, api.client() as client:
        async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="ryan", input=text, response_format="pcm", stream_format="sse"
        ) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) async for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) == -(-tone_samples(text) // (2 * FRAME))  # one event per synthesized chunk
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) == 2 * tone_samples(text)
    assert events[-1]["type"] == "speech.audio.done" and len(events) == len(deltas) + 1
    usage = events[-1]["usage"]
    assert usage["input_tokens"] == len(text)
    assert usage["output_tokens"] == tone_samples(text) // FRAME
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


@pytest.mark.integration
async def test_curl_gets_a_wav_whole_with_its_length_or_streamed_when_asked(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """A WAV asked for as a file has its real length in its header (soxi had said 24:51:18, the
    'unknown length' of a streamed WAV); ``stream_format: audio`` streams it, header and all."""
    curl = shutil.which("curl")
    assert curl is not None, "curl is not installed (apt-get install curl)"
    text = "Hello from curl."
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "wav"}
    async with speech_api(tmp_path, mosquitto) as api:
        for name, extra in (("whole", {}), ("streamed", {"stream_format": "audio"})):
            out, head = tmp_path / f"{name}.wav", tmp_path / f"{name}.txt"
            proc = await asyncio.create_subprocess_exec(
                curl, "-sS", "-N", "--fail-with-body", f"{api.base_url}/v1/audio/speech",
                "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
                "-d", json.dumps({**body, **extra}), "-o", str(out), "-D", str(head),
            )  # fmt: skip
            assert await asyncio.wait_for(proc.wait(), 10) == 0
    whole, streamed = (tmp_path / "whole.txt").read_text().lower(), (tmp_path / "streamed.txt").read_text().lower()
    assert "content-type: audio/wav" in whole and "transfer-encoding: chunked" not in whole
    assert f"content-length: {(tmp_path / 'whole.wav').stat().st_size}" in whole
    assert "transfer-encoding: chunked" in streamed and "content-type: audio/wav" in streamed
    with wave.open(str(tmp_path / "whole.wav")) as wav:
        assert wav.getnframes() == tone_samples(text) and wav.getframerate() == 24000
    with wave.open(str(tmp_path / "streamed.wav")) as wav:
        assert wav.getnframes() > 10 * tone_samples(text)  # 'unknown length': read to the end of the stream
    for name in ("whole", "streamed"):
        assert len(decode("wav", (tmp_path / f"{name}.wav").read_bytes())) == tone_samples(text)
    soxi = shutil.which("soxi")
    if soxi is not None:  # what the newcomer ran
        seconds = subprocess.run([soxi, "-D", str(tmp_path / "whole.wav")], capture_output=True, text=True, check=True)
        assert float(seconds.stdout) == pytest.approx(tone_samples(text) / 24000, abs=0.001)


@pytest.mark.integration
async def test_a_whole_file_reports_its_first_audio_when_it_is_complete(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """Issue 41 item 6: a WAV or FLAC sent whole reaches its caller once all of it is made, so its
    first audio out (the latency event, hence ``s2s_first_audio_seconds``) is then, not at its first
    chunk; a streamed WAV's is at its first chunk. ``tts/started`` comes with it."""
    text = "A whole file is sent once all of it is made."  # 1.8 s of audio, made in 0.9 s
    async with speech_api(tmp_path, mosquitto, tts={"options": {"speed": "2"}}) as api, api.client() as client:
        ids = {}
        asks = (("wav", "wav", {}), ("flac", "flac", {}), ("streamed", "wav", {"stream_format": "audio"}))
        for name, fmt, extra in asks:
            raw = await client.audio.speech.with_raw_response.create(
                model="tts-1",
                voice="alloy",
                input=text,
                response_format=fmt,
                extra_body=extra,  # type: ignore[arg-type]
            )
            assert len(decode(fmt, raw.parse().content)) == tone_samples(text)
            ids[name] = raw.headers["x-request-id"]
        rec = api.rec
        await rec.wait_for(lambda: {p["id"] for p in rec.payloads("/metrics/latency")} >= set(ids.values()))
        latency = {p["id"]: p for p in rec.payloads("/metrics/latency")}
        started = {p["id"] for p in rec.payloads("/tts/started")}
    for name in ("wav", "flac"):
        event = latency[ids[name]]
        synthesized_ms = event["queuedMs"] + event["synthMs"]  # receipt to the end of synthesis, at least
        assert event["firstAudioOutMs"] >= synthesized_ms, (name, event)
        assert event["firstAudioOutMs"] == event["e2eMs"], (name, event)  # all of it at once
        assert ids[name] in started
    streamed = latency[ids["streamed"]]
    assert streamed["firstAudioOutMs"] < streamed["queuedMs"] + streamed["synthMs"], streamed


@pytest.mark.integration
async def test_a_whole_file_stopped_part_way_is_409_and_the_events_agree(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """Issue 41 item 7: a 30-sentence WAV (sent whole) stopped after a second of audio was made: its
    caller gets nothing, so the answer is 409 ``cancelled`` saying what happened, and the events say
    ``cancelled`` with no ``tts/started``, ``audioMs`` 0 and no latency event."""
    text = " ".join(f"This is sentence number {n} of a long text." for n in range(30))
    async with speech_api(tmp_path, mosquitto, tts={"options": {"speed": "1"}}) as api, api.client() as client:
        asked = asyncio.create_task(
            client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="wav")
        )
        assert api.daemon._parts is not None
        ledger = api.daemon._parts.stages.ledger
        # a second of its audio made (polled: no event says so)
        await until(lambda: any(j.timeline.audio_s >= 1.0 for j in ledger.jobs.values()), 20, "1 s of audio made")
        (rid,) = ledger.jobs
        await api.rec.say("s2s/kitchen/tts/stop", {"id": rid})
        with pytest.raises(openai.APIStatusError) as refused:
            await asyncio.wait_for(asked, 10)
        finished = (await api.rec.wait_finished([rid]))[rid]
        rec = api.rec
    assert refused.value.status_code == 409
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "cancelled", body
    assert "s of audio was made" in body["message"] and "sent only once complete" in body["message"], body
    assert finished["status"] == "cancelled" and finished["audioMs"] == 0, finished
    assert rid not in {p["id"] for p in rec.payloads("/tts/started")}
    assert rid not in {p["id"] for p in rec.payloads("/metrics/latency")}


@pytest.mark.integration
async def test_a_client_that_disconnects_frees_the_engine(tmp_path: Path, mosquitto: Mosquitto) -> None:
    real_time = {"tts": {"options": {"speed": "1"}}}  # 100 characters: 4 s of synthesis
    async with speech_api(tmp_path, mosquitto, **real_time) as api, api.client() as client:
        async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="z" * 100, response_format="mp3"
        ) as response:
            gone = response.headers["x-request-id"]
            async for _ in response.iter_bytes():
                break  # the first bytes, then hang up
        async with asyncio.timeout(2.5):  # not after the 4 s the first one would have taken
            nxt = await client.audio.speech.with_raw_response.create(
                model="tts-1", voice="alloy", input="next", response_format="pcm"
            )
        assert len(nxt.parse().content) == 2 * tone_samples("next")
        finished = await api.rec.wait_finished([gone, nxt.headers["x-request-id"]])
        assert finished[gone]["status"] in ("interrupted", "cancelled")
        assert finished[gone]["audioMs"] < 4000
        assert finished[nxt.headers["x-request-id"]]["status"] == "completed"


@pytest.mark.integration
async def test_concurrent_requests_share_the_queue_with_mqtt(tmp_path: Path, mosquitto: Mosquitto) -> None:
    fast = {"tts": {"options": {"speed": "8"}}}
    texts = ["first of two requests.", "the second request, a little longer."]  # as the text stage speaks them
    async with speech_api(tmp_path, mosquitto, **fast) as api, api.client() as client:
        await api.rec.say(SAY, {"id": "from-mqtt", "text": "spoken in the kitchen meanwhile"})
        raws = await asyncio.gather(
            *(
                client.audio.speech.with_raw_response.create(
                    model="tts-1", voice="alloy", input=t, response_format="wav"
                )
                for t in texts
            )
        )
        for text, raw in zip(texts, raws, strict=True):
            assert len(decode("wav", raw.parse().content)) == tone_samples(text)
        ids = [raw.headers["x-request-id"] for raw in raws]
        finished = await api.rec.wait_finished([*ids, "from-mqtt"])
        assert {finished[i]["status"] for i in [*ids, "from-mqtt"]} == {"completed"}
        # HTTP requests are reported like MQTT's: the same payload keys, latency events included
        await api.rec.wait_for(lambda: {p["id"] for p in api.rec.payloads("/metrics/latency")} >= {*ids, "from-mqtt"})
        latency = {p["id"]: p for p in api.rec.payloads("/metrics/latency")}
        assert set(latency[ids[0]]) == set(latency["from-mqtt"])
        assert set(finished[ids[0]]) == set(finished["from-mqtt"])
        assert 0 <= latency[ids[0]]["ttfaMs"] <= latency[ids[0]]["e2eMs"]


@pytest.mark.integration
async def test_a_long_input_is_text_too_long_as_it_was_sent(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """The speech request is checked as it was sent (``admission.admit``), not re-encoded as an MQTT
    payload: 800,000 characters of "é" (1.6 MB as sent, 4.8 MB once escaped as JSON's ASCII) in a
    body the API takes (``http.max_body_bytes``) are ``text_too_long`` naming ``input``, not a
    ``bad_payload`` about a payload the client never sent."""
    text = "é" * 800_000
    async with (
        speech_api(tmp_path, mosquitto, http={"max_body_bytes": 2 * 1024 * 1024}) as api,
        aiohttp.ClientSession(api.base_url) as http,
    ):
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        body = io.BytesIO(
            json.dumps({"model": "tts-1", "input": text}, ensure_ascii=False).encode()
        )  # not raw bytes: large
        async with http.post("/v1/audio/speech", data=body, headers=headers) as r:
            error = (await r.json())["error"]
        assert (r.status, error["code"], error["param"]) == (400, "text_too_long", "input"), error
        assert error["message"] == f"text has {len(text)} characters; the limit is 2000", error


@pytest.mark.integration
async def test_errors_are_openai_error_json(tmp_path: Path, mosquitto: Mosquitto) -> None:
    speech = "/v1/audio/speech"
    good = {"model": "tts-1", "input": "hi", "voice": "alloy"}
    cases: list[tuple[str, str, bytes | None, int, str | None, str | None]] = [
        # method, path, body, status, code, param
        ("POST", speech, b"{not json", 400, "bad_payload", None),
        ("POST", speech, json.dumps({"model": "tts-1", "voice": "alloy"}).encode(), 400, "bad_payload", "input"),
        ("POST", speech, json.dumps({**good, "input": "  "}).encode(), 400, "empty_text", "input"),
        ("POST", speech, json.dumps({**good, "input": "y" * 60}).encode(), 400, "text_too_long", "input"),
        ("POST", speech, json.dumps({**good, "voice": "Nobody"}).encode(), 400, "unknown_voice", "voice"),
        ("POST", speech, json.dumps({**good, "language": "klingon"}).encode(), 400, "unsupported_language", "language"),
        ("POST", speech, json.dumps({**good, "response_format": "aac"}).encode(), 400, "unsupported_response_format",
         "response_format"),
        ("POST", speech, json.dumps({**good, "speed": 5}).encode(), 400, "bad_payload", "speed"),
        ("POST", speech, json.dumps({**good, "instructions": "z" * 101}).encode(), 400, "text_too_long",
         "instructions"),
        ("POST", speech, json.dumps({**good, "voice": "v" * 201}).encode(), 400, "bad_payload", "voice"),
        ("POST", speech, json.dumps({**good, "voice": {"id": "v" * 201}}).encode(), 400, "bad_payload", "voice"),
        ("POST", speech, json.dumps({**good, "language": "l" * 201}).encode(), 400, "bad_payload", "language"),
        ("POST", speech, json.dumps({**good, "input": "x" * 5000}).encode(), 413, "request_too_large", None),
        ("GET", speech, None, 405, "method_not_allowed", None),
        ("GET", "/v1/nothing-here", None, 404, "not_found", None),
    ]  # fmt: skip
    limits = {"tts": {"max_text_chars": 50, "max_instruct_chars": 100}, "http": {"max_body_bytes": 4096}}
    async with speech_api(tmp_path, mosquitto, **limits) as api, aiohttp.ClientSession(api.base_url) as http:
        auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        for method, path, body, status, code, param in cases:
            async with http.request(method, path, data=body, headers=auth) as r:
                error = (await r.json())["error"]
                assert (r.status, error["code"], error["param"]) == (status, code, param), (path, body, error)
                assert error["type"] == "invalid_request_error" and error["message"]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
            async with http.post(speech, json=good, headers=headers) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.get("/health") as r:  # probes need no token
            assert r.status == 200 and await r.json() == {"status": "ok", "phase": "serving"}
        async with http.get("/ready") as r:
            assert r.status == 200 and (await r.json())["ready"] is True
        async with http.get("/metrics") as r:  # the metrics do (on the API's port)
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.get("/metrics", headers=auth) as r:
            assert r.status == 200 and "s2s_requests_total" in await r.text()
        # the SDK maps them onto its exceptions
        async with api.client("sk-wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                await client.audio.speech.create(model="tts-1", voice="alloy", input="hi")
        async with api.client() as client:
            with pytest.raises(openai.BadRequestError) as bad:
                await client.audio.speech.create(model="tts-1", voice="Nobody", input="hi")
            assert bad.value.code == "unknown_voice"
        # a rejected speech request is answered on MQTT too, exactly once
        await api.rec.wait_for(lambda: any(p["error"]["code"] == "unknown_voice" for p in rejected(api.rec)))


def rejected(rec: Recorder) -> list[dict[str, Any]]:
    return [p for p in rec.payloads("/tts/finished") if p["status"] == "rejected"]


@pytest.mark.integration
async def test_models_voices_health_and_the_drain(tmp_path: Path, mosquitto: Mosquitto) -> None:
    fast = {"tts": {"options": {"speed": "4"}}}
    text = "w" * 49 + "."  # 2 s of audio, 0.5 s of synthesis (a sentence: the text stage leaves it)
    async with speech_api(tmp_path, mosquitto, api_key=None, **fast) as api, api.client("any") as client:
        models = [m.id async for m in client.models.list()]
        assert models[0] == api.daemon.config.tts.model and {"tts-1", "tts-1-hd", "gpt-4o-mini-tts"} <= set(models)
        assert (await client.models.retrieve("tts-1")).owned_by == "s2s-daemon"
        async with aiohttp.ClientSession(api.base_url) as http:
            async with http.get("/v1/audio/voices") as r:
                voices = await r.json()
            assert voices["voices"] == [{"id": "Ryan", "name": "Ryan"}, {"id": "Vivian", "name": "Vivian"}]
            assert voices["default"] == "Ryan"
            async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input=text, response_format="pcm"
            ) as response:
                data = b""
                async for piece in response.iter_bytes():
                    if not data:
                        api.daemon.request_stop()  # SIGTERM mid-stream: this response still ends whole
                        await until(lambda: health_phase(http, "draining"), 5, "/health saying draining")
                        async with http.get("/health") as r:  # alive
                            assert r.status == 200 and await r.json() == {"status": "ok", "phase": "draining"}
                        async with http.get("/ready") as r:  # and out of rotation
                            body = await r.json()
                            assert r.status == 503 and body["phase"] == "draining"
                            assert body["not_ready"] == ["accepting"] and "draining" in body["reason"]
                    data += piece
    assert len(data) == 2 * tone_samples(text)


async def read_until_closed(port: int, data: bytes, timeout_s: float = 10.0) -> tuple[bytes, float]:
    """Send ``data`` (no more) and read until the server closes: what it sent, and after how long."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if data:
            writer.write(data)
        began, answer = time.monotonic(), b""
        async with asyncio.timeout(timeout_s):
            with contextlib.suppress(ConnectionError):
                while chunk := await reader.read(65536):
                    answer += chunk
        return answer, time.monotonic() - began
    finally:
        writer.close()


@pytest.mark.integration
async def test_slow_heads_and_bodies_are_cut_and_excess_connections_refused(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Idle and slow connections were never timed out nor capped (each a file descriptor until the
    process had none left). Now a late request head closes its connection, a late body is 408, and
    past ``max_connections`` a connection is answered 503 and closed at accept, on the speech API's
    listener and on the monitor's."""
    monitor = free_port()
    limits = {"max_connections": 3, "header_timeout_s": 0.5, "body_timeout_s": 0.5}
    sections = {"http": limits, "monitor": {"enabled": True, "port": monitor, "max_connections": 2}}
    async with speech_api(tmp_path, mosquitto, api_key=None, **sections) as api:
        answer, after_s = await read_until_closed(api.port, b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost")
        assert answer == b"" and after_s < 5
        head = b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        answer, _ = await read_until_closed(api.port, head + b'Content-Length: 100\r\n\r\n{"input": ', 20)
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in answer, answer
        assert b"http.body_timeout_s" in answer
        for port, cap, key in ((api.port, 3, b"http.max_connections"), (monitor, 2, b"monitor.max_connections")):
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap)]
            try:
                answer, after_s = await read_until_closed(port, b"")
                assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer, answer
                assert key in answer and after_s < 5
            finally:
                for _, writer in held:
                    writer.close()
        async with aiohttp.ClientSession(api.base_url) as http:  # their places free up as they close
            async with asyncio.timeout(10):
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.post(
                            "/v1/audio/speech", json={"input": "Hello.", "response_format": "wav"}
                        ) as r:
                            if r.status == 200:
                                assert (await r.read())[:4] == b"RIFF"
                                break
                    await asyncio.sleep(0.05)


async def health_phase(http: aiohttp.ClientSession, phase: str) -> bool:
    async with http.get("/health") as r:
        return r.status == 200 and (await r.json())["phase"] == phase


@pytest.mark.integration
async def test_draining_refuses_new_speech_with_503(tmp_path: Path, mosquitto: Mosquitto) -> None:
    fast = {"tts": {"options": {"speed": "4"}}}
    refused: pytest.ExceptionInfo[openai.InternalServerError] | None = None
    async with (
        speech_api(tmp_path, mosquitto, api_key=None, **fast) as api,
        api.client("any") as client,
        aiohttp.ClientSession(api.base_url) as http,
    ):
        async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="v" * 50, response_format="pcm"
        ) as response:
            async for _ in response.iter_bytes():  # the first piece of audio: the stream runs
                api.daemon.request_stop()
                await until(lambda: health_phase(http, "draining"), 5, "/health saying draining")
                with pytest.raises(openai.InternalServerError) as refused:
                    await client.audio.speech.create(model="tts-1", voice="alloy", input="too late")
                break
    # Out of the loop: an answer without a body never reached the refusal (this test then proved nothing).
    assert refused is not None, "the first request's answer had no audio"
    assert refused.value.status_code == 503 and refused.value.code == "shutting_down"


async def test_missing_extra_and_taken_port_are_exit_69(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    path = write_config(tmp_path / "daemon.yaml", free_port(), http={"enabled": True, "port": port})
    config = load_config(path, environ={})
    try:
        with pytest.raises(UnavailableError, match=r"cannot listen on 127\.0\.0\.1:") as busy:
            await Daemon(config).run()
        assert busy.value.exit_code == 69
    finally:
        taken.close()
    with monkeypatch.context() as patched:
        real = importlib.util.find_spec
        patched.setattr("importlib.util.find_spec", lambda name, *a: None if name == "aiohttp" else real(name, *a))
        with pytest.raises(UnavailableError, match=r"s2s-daemon\[http\]") as missing:
            require_http_extra(config.http)
        assert missing.value.exit_code == 69
    unreadable = write_config(
        tmp_path / "key.yaml", free_port(), http={"enabled": True, "port": free_port(), "api_key_file": "/nonexistent"}
    )
    with pytest.raises(ConfigError, match=r"http\.api_key_file"):
        await Daemon(load_config(unreadable, environ={})).run()


@pytest.mark.parametrize(
    ("status", "code", "accepting", "http_status", "answer_code"),
    [
        (Status.REJECTED, ErrorCode.QUEUE_FULL, True, 429, "queue_full"),
        (Status.REJECTED, ErrorCode.SHUTTING_DOWN, False, 503, "shutting_down"),
        (Status.CANCELLED, None, False, 503, "shutting_down"),  # queued when the drain began
        (Status.ERROR, ErrorCode.ENGINE_ERROR, True, 500, "engine_error"),
        (Status.CANCELLED, None, True, 409, "cancelled"),  # tts/stop while it waited
    ],
)
def test_requests_that_end_without_audio(
    status: Status, code: ErrorCode | None, accepting: bool, http_status: int, answer_code: str
) -> None:
    error = RequestError(code, "why") if code is not None else None
    answer = unanswered(status, error, accepting)
    assert (answer.status, answer.code) == (http_status, answer_code)
    assert answer.body()["error"]["code"] == answer_code
    if http_status == 429:
        assert answer.headers["Retry-After"] == "1"  # the SDK retries after it
    if http_status in (409, 500):
        assert answer.headers["x-should-retry"] == "false"  # the SDK must not say it again


@pytest.mark.integration
async def test_a_stream_that_fails_part_way_reaches_the_client_as_a_failure(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Streamed audio that the engine fails part-way (here: past ``tts.max_utterance_s``) must not
    read as a whole file: the connection ends without HTTP's terminating chunk, so curl, aiohttp and
    the openai SDK report an error instead of returning truncated bytes; SSE sends OpenAI's error event."""
    curl = shutil.which("curl")
    assert curl is not None, "curl is not installed (apt-get install curl)"
    text = "q" * 100  # 4 s of audio at real time: cut after 1 s
    cut = {"tts": {"options": {"speed": "1"}, "max_utterance_s": 1.0}}
    body = {"model": "tts-1", "input": text, "voice": "alloy"}
    async with speech_api(tmp_path, mosquitto, **cut) as api, api.client() as client:
        with structlog.testing.capture_logs() as logs:
            for fmt in ("wav", "mp3", "opus", "pcm"):
                out = tmp_path / f"cut.{fmt}"
                proc = await asyncio.create_subprocess_exec(
                    curl, "-sS", "-N", f"{api.base_url}/v1/audio/speech",
                    "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
                    "-d", json.dumps({**body, "response_format": fmt, "stream_format": "audio"}), "-o", str(out),
                    stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                _, err = await asyncio.wait_for(proc.communicate(), 20)
                assert proc.returncode == 18, (fmt, proc.returncode, err)  # CURLE_PARTIAL_FILE
                assert out.stat().st_size > 0  # what came before the failure was sent
            async with aiohttp.ClientSession(api.base_url) as http:
                async with http.post(
                    "/v1/audio/speech",
                    json={**body, "response_format": "pcm"},
                    headers={"Authorization": f"Bearer {KEY}"},
                ) as r:
                    assert r.status == 200
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await r.read()
            with pytest.raises(openai.APIConnectionError):  # the SDK reads the whole body: its error
                await client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="pcm")
            with pytest.raises(openai.InternalServerError) as whole:  # a file sent whole: an error answer
                await client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="wav")
            assert whole.value.code == "engine_error"
            with pytest.raises(httpx2.RemoteProtocolError, match="incomplete chunked read"):  # the transport's
                async with client.audio.speech.with_streaming_response.create(
                    model="tts-1", voice="alloy", input=text, response_format="mp3"
                ) as response:
                    async for _ in response.iter_bytes():
                        pass
            async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input=text, response_format="pcm", stream_format="sse"
            ) as response:
                events = [json.loads(line[6:]) async for line in response.iter_lines() if line.startswith("data: ")]
            assert events[0]["type"] == "speech.audio.delta"
            assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "engine_error"
        failed = [entry for entry in logs if entry["event"] == "http_stream_failed"]
        assert len(failed) == 8 and all(entry["code"] == "engine_error" for entry in failed), failed
        finished = await api.rec.wait_for(lambda: len(api.rec.finished()) == 9 and api.rec.finished())
        assert {p["status"] for p in finished.values()} == {"error"}


@pytest.mark.integration
async def test_answers_name_no_paths_and_events_say_where_a_request_came_from(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """``/v1/models`` names a local checkpoint by its folder's name, not its path; ``unknown_voice``
    names OpenAI's voices too; every event says its request's origin (and the latency event where
    its audio went), so that the room's latency can be told from a caller's."""
    folder = tmp_path / "home" / "ann" / "checkpoints" / "kitchen-voice"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    async with speech_api(tmp_path, mosquitto, tts={"model": str(folder)}) as api, api.client() as client:
        models = [m.id async for m in client.models.list()]
        assert models[0] == "kitchen-voice" and not any("/" in m for m in models)
        assert (await client.models.retrieve("kitchen-voice")).id == "kitchen-voice"
        with pytest.raises(openai.BadRequestError) as bad:
            await client.audio.speech.create(model="tts-1", voice="Nobody", input="hi")
        assert "choose one of Ryan, Vivian" in str(bad.value) and "alloy" in str(bad.value)
        raw = await client.audio.speech.with_raw_response.create(
            model="tts-1", voice="alloy", input="from a caller", response_format="pcm"
        )
        caller = raw.headers["x-request-id"]
        await api.rec.say(SAY, {"id": "room", "text": "in the room"})
        await api.rec.wait_finished([caller, "room"])
        latency = await api.rec.wait_for(lambda: len(api.rec.payloads("/metrics/latency")) == 2 and api.rec)
    events = {
        suffix: {p["id"]: p for p in latency.payloads(suffix)}
        for suffix in ("/tts/started", "/tts/finished", "/metrics/latency")
    }
    for payloads in events.values():
        assert payloads[caller]["origin"] == "http" and payloads["room"]["origin"] == "mqtt"
    assert events["/metrics/latency"][caller]["output"] == "caller"
    assert events["/metrics/latency"]["room"]["output"] == "speaker"
