"""The web page's HTTP side (http.enabled): its files served without the key and every data call
with it; the voice library over HTTP (``/api/voices``: add from an upload with ``voices add``'s
checks, design, rename, remove, the recording); speaking on the speaker (``/api/say``, ``/api/stop``);
the live view's event stream (``/api/events``) carrying what the daemon publishes over MQTT. The
daemon in this process, a real mosquitto, aiohttp as the client."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import io
import json
import re
import socket
import threading
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import soundfile

from s2s_daemon.intake.http import voice_admin
from s2s_daemon.intake.http.web import static_dir
from s2s_daemon.tts.registry import register_engine
from tests.support.broker import Mosquitto
from tests.test_http_speech import KEY, Api, speech_api
from tests.test_http_voices import REF_WAV, RecordingEngine

AUTH = {"Authorization": f"Bearer {KEY}"}
REF_TEXT = "Good morning. This is a reference recording for voice cloning."


@pytest.fixture
def recording() -> Iterator[list[Any]]:
    """The recording engine (tests/test_http_voices.py): one frame per request, requests kept."""
    register_engine("recording", RecordingEngine)
    RecordingEngine.heard.clear()
    yield RecordingEngine.heard
    RecordingEngine.heard.clear()


@contextlib.asynccontextmanager
async def web_api(
    tmp_path: Path, mosquitto: Mosquitto, mode: str = "base", voices: str = "", **sections: Any
) -> AsyncIterator[tuple[Api, aiohttp.ClientSession]]:
    tts = {
        "engine": "recording",
        "voice": None,
        "voices_dir": str(tmp_path / "voices"),
        "options": {"mode": mode, "voices": voices},
    }
    async with (
        speech_api(tmp_path, mosquitto, tts=tts, **sections) as api,
        aiohttp.ClientSession(api.base_url, headers=AUTH, timeout=aiohttp.ClientTimeout(total=30)) as session,
    ):
        yield api, session


def _audio_file(seconds: float | None = None, *, fmt: str = "WAV", silent: bool = False) -> bytes:
    """The tests' reference recording (``seconds`` of it), as ``fmt`` at 8 kHz stereo."""
    audio, rate = soundfile.read(str(REF_WAV), dtype="float32")
    if seconds is not None:
        audio = audio[: round(seconds * rate)]
    if silent:
        audio = np.zeros(4 * rate, np.float32)
    stereo = np.stack([audio, audio], axis=1)[::3]
    out = io.BytesIO()
    soundfile.write(out, stereo, rate // 3, format=fmt)
    return out.getvalue()


def _form(audio: bytes | None = None, filename: str = "me.flac", **fields: str) -> aiohttp.FormData:
    form = aiohttp.FormData(default_to_multipart=True)  # as the page's FormData, with a file or without
    for key, value in fields.items():
        form.add_field(key, value)
    if audio is not None:
        form.add_field("audio", audio, filename=filename, content_type="application/octet-stream")
    return form


async def _error(response: aiohttp.ClientResponse) -> dict[str, Any]:
    body = await response.json()
    return dict(body["error"])


async def _voice_names(session: aiohttp.ClientSession) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The page's list (by name) and the OpenAI-style list's ids."""
    async with session.get("/api/voices") as listed, session.get("/v1/audio/voices") as openai_listed:
        page = {v["name"]: v for v in (await listed.json())["voices"]}
        ids = [v["id"] for v in (await openai_listed.json())["voices"]]
    return page, ids


async def events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The Server-Sent Events of ``response``, as (kind, payload)."""
    kind, data = "message", ""
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif not line and data:
            yield kind, json.loads(data)
            kind, data = "message", ""


# -- the page and the key ------------------------------------------------------------------


@pytest.mark.integration
async def test_the_page_is_public_and_every_data_call_needs_the_key(
    tmp_path: Path, mosquitto: Mosquitto, recording: list[Any]
) -> None:
    async with web_api(tmp_path, mosquitto) as (api, _), aiohttp.ClientSession(api.base_url) as anonymous:
        async with anonymous.get("/") as page:
            assert page.status == 200 and page.content_type == "text/html"
            assert "default-src 'self'" in page.headers["Content-Security-Policy"]
            html = await page.text()
        async with anonymous.get("/api/auth") as auth:
            assert await auth.json() == {"key_required": True}
        linked = set(re.findall(r'(?:src|href)="(/static/[^"]+)"', html))
        imported = {
            f"/static/{m}" for p in static_dir().glob("*.js") for m in re.findall(r'from "\./([^"]+)"', p.read_text())
        }
        assert "/static/app.js" in linked and "/static/player.js" in imported
        for path in sorted(linked | imported | {"/static/recorder-worklet.js"}):
            async with anonymous.get(path) as served:
                assert served.status == 200, path
                assert served.content_type in ("text/javascript", "text/css", "image/svg+xml"), path
        calls = [
            ("GET", "/api/voices"),
            ("POST", "/api/voices"),
            ("GET", "/api/voices/x"),
            ("PATCH", "/api/voices/x"),
            ("DELETE", "/api/voices/x"),
            ("GET", "/api/voices/x/reference"),
            ("GET", "/api/status"),
            ("GET", "/api/events"),
            ("POST", "/api/say"),
            ("POST", "/api/stop"),
        ]
        for method, path in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with anonymous.request(method, path, headers=headers) as refused:
                    assert refused.status == 401, (method, path)
                    assert (await _error(refused))["code"] == "invalid_api_key"
        async with anonymous.get("/static/../server.py") as outside, anonymous.get("/static/nope.js") as missing:
            assert outside.status in (401, 404) and missing.status in (401, 404)


def test_the_page_files_are_package_data() -> None:
    """A wheel without them would serve a page that cannot load its script."""
    repo = Path(__file__).resolve().parents[1]
    data = tomllib.loads((repo / "pyproject.toml").read_text(encoding="utf-8"))
    globs = data["tool"]["setuptools"]["package-data"]["s2s_daemon"]
    files = sorted(p.name for p in static_dir().iterdir())
    assert "index.html" in files and "app.js" in files
    for name in files:
        path = f"intake/http/static/{name}"
        assert any(fnmatch.fnmatch(path, g) for g in globs), f"pyproject.toml: package-data must include {path}"


# -- the voice library ---------------------------------------------------------------------


@pytest.mark.integration
async def test_a_voice_added_from_an_uploaded_file_is_listed_and_spoken(
    tmp_path: Path, mosquitto: Mosquitto, recording: list[Any]
) -> None:
    flac = _audio_file(fmt="FLAC")  # another format, rate and channel count than the library keeps
    async with web_api(tmp_path, mosquitto) as (_, session):
        fields = {"name": "alice", "ref_text": REF_TEXT, "language": "en", "description": "from the test"}
        async with session.post("/api/voices", data=_form(flac, **fields)) as added:
            assert added.status == 201, await added.text()
            assert added.headers["Location"] == "/api/voices/alice"
            answer = await added.json()
        voice = answer["voice"]
        assert voice["kind"] == "clone" and voice["speakable"] is True and voice["transcript"] == REF_TEXT
        assert voice["language"] == "english" and voice["description"] == "from the test"
        assert voice["seconds"] == pytest.approx(3.9, abs=0.1) and answer["warnings"] == []
        assert answer["checks"]["seconds"] == pytest.approx(3.9, abs=0.1) and answer["checks"]["clipped_share"] == 0
        page, ids = await _voice_names(session)
        assert "alice" in page and "alice" in ids
        async with session.get("/api/voices/ALICE/reference") as reference:
            assert reference.content_type == "audio/wav"
            info = soundfile.info(io.BytesIO(await reference.read()))
        assert (info.samplerate, info.channels, info.subtype) == (24000, 1, "PCM_16")
        speech = {"model": "tts-1", "input": "Hello.", "voice": "alice", "response_format": "pcm"}
        async with session.post("/v1/audio/speech", json=speech) as spoken:
            assert spoken.status == 200
            await spoken.read()
    assert recording[-1].ref_audio is not None and Path(recording[-1].ref_audio).parent.name == "alice"
    assert (tmp_path / "voices" / "alice" / "ref.txt").read_text(encoding="utf-8").strip() == REF_TEXT


@pytest.mark.integration
async def test_an_upload_gets_the_checks_of_voices_add_and_clear_errors(
    tmp_path: Path, mosquitto: Mosquitto, recording: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    wav = _audio_file()
    async with web_api(tmp_path, mosquitto) as (_, session):

        async def post(data: Any, status: int) -> dict[str, Any]:
            async with session.post("/api/voices", data=data) as response:
                assert response.status == status, await response.text()
                return dict(await response.json())

        await post(_form(wav, name="bob"), 201)
        assert (await post(_form(wav, name="bob"), 409))["error"]["code"] == "voice_exists"
        await post(_form(wav, name="bob", force="true", ref_text=REF_TEXT), 201)  # replaced
        assert (await post(_form(wav, name="BOB"), 409))["error"]["code"] == "name_taken"
        bad = (await post(_form(wav, name="../evil"), 400))["error"]
        assert bad["code"] == "bad_voice_name" and bad["param"] == "name"
        short = (await post(_form(_audio_file(0.5), name="short"), 400))["error"]
        assert short["code"] == "reference_length" and "0.5 s" in short["message"] and short["param"] == "audio"
        checked = await post(_form(_audio_file(0.5), dry_run="true"), 422)  # the page's check: nothing saved
        assert checked["error"]["code"] == "reference_length" and checked["checks"]["seconds"] == 0.5
        assert checked["error"]["param"] == "audio"  # before: 200 with the error inside (issue 41, item 12)
        fine = await post(_form(wav, dry_run="true"), 200)
        assert fine["error"] is None and fine["checks"]["seconds"] > 3
        await post(_form(_audio_file(0.5), name="short", force="true"), 201)  # force takes any length
        refused = await post(_form(_audio_file(silent=True), name="quiet"), 400)  # no voice to clone
        assert refused["error"]["code"] == "silent_reference", refused
        quiet = await post(_form(_audio_file(silent=True), name="quiet", force="true"), 201)
        assert any("silent" in w for w in quiet["warnings"])
        unreadable = (await post(_form(b"RIFF not a wav at all", name="junk"), 400))["error"]
        assert unreadable["code"] == "unreadable_audio" and "me.flac" in unreadable["message"]
        unknown = (await post(_form(wav, name="x", colour="blue"), 400))["error"]
        assert unknown["code"] == "bad_payload" and unknown["param"] == "colour"
        assert (await post(_form(name="nothing"), 400))["error"]["code"] == "bad_voice"
        assert (await post(_form(wav, name="x", language="klingon"), 400))["error"]["code"] == "unsupported_language"
        async with session.post("/api/voices", data=b"name=x", headers={"Content-Type": "text/plain"}) as plain:
            assert plain.status == 415 and (await _error(plain))["code"] == "unsupported_media_type"
        async with session.post("/api/voices", data={"name": "x", "instruct": "A voice."}) as urlencoded:
            assert urlencoded.status == 415 and (await _error(urlencoded))["code"] == "unsupported_media_type"
        monkeypatch.setattr(voice_admin, "MAX_REFERENCE_BYTES", 1000)
        assert (await post(_form(wav, name="big"), 413))["error"]["code"] == "request_too_large"
        page, _ = await _voice_names(session)
    assert sorted(page) == ["bob", "quiet", "short"]
    assert sorted(p.name for p in (tmp_path / "voices").iterdir()) == ["bob", "quiet", "short"]  # no staging left


@pytest.mark.integration
async def test_a_model_that_cannot_clone_says_so_and_keeps_the_voice(
    tmp_path: Path, mosquitto: Mosquitto, recording: list[Any]
) -> None:
    async with web_api(tmp_path, mosquitto, mode="custom_voice", voices="Ryan,Vivian") as (_, session):
        async with session.get("/api/voices") as listed:
            library = await listed.json()
        assert library["can_clone"] is False and library["can_design"] is False and library["default"] == "Ryan"
        assert [(v["name"], v["kind"], v["speakable"]) for v in library["voices"]] == [
            ("Ryan", "preset", True),
            ("Vivian", "preset", True),
        ]
        async with session.post("/api/voices", data=_form(_audio_file(), name="carol")) as added:
            assert added.status == 201
            answer = await added.json()
        assert answer["voice"]["speakable"] is False
        assert any("custom_voice model cannot speak clone voices" in w for w in answer["warnings"])
        page, ids = await _voice_names(session)
    assert page["carol"]["speakable"] is False and "carol" not in ids


@pytest.mark.integration
async def test_a_designed_voice_from_an_instruction(tmp_path: Path, mosquitto: Mosquitto, recording: list[Any]) -> None:
    instruct = "A warm, low voice, speaking slowly."
    async with web_api(tmp_path, mosquitto, mode="voice_design") as (_, session):
        # The page's "Listen first": the instruction spoken before the voice is kept (no voice named).
        first = {"model": "tts-1", "input": "Hello.", "instructions": "A first try.", "response_format": "pcm"}
        async with session.post("/v1/audio/speech", json=first) as tried:
            assert tried.status == 200
            await tried.read()
        async with session.post("/api/voices", json={"name": "narrator", "instruct": instruct}) as added:
            assert added.status == 201, await added.text()
            answer = await added.json()
        assert answer["voice"]["kind"] == "design" and answer["voice"]["speakable"] is True
        assert answer["warnings"] == [] and answer["checks"] is None
        _, ids = await _voice_names(session)
        assert "narrator" in ids
        speech = {"model": "tts-1", "input": "Hello.", "voice": "narrator", "response_format": "pcm"}
        async with session.post("/v1/audio/speech", json=speech) as spoken:
            assert spoken.status == 200
            await spoken.read()
        async with session.post("/api/voices", json={"name": "x", "instruct": 5}) as bad:
            assert bad.status == 400 and (await _error(bad))["param"] == "instruct"
    assert [r.instruct for r in recording] == ["A first try.", instruct]


@pytest.mark.integration
async def test_rename_and_remove(tmp_path: Path, mosquitto: Mosquitto, recording: list[Any]) -> None:
    broken = tmp_path / "voices" / "broken"
    broken.mkdir(parents=True)
    (broken / "ref.txt").write_text("x" * 70_000, encoding="utf-8")  # too long: unreadable
    async with web_api(tmp_path, mosquitto) as (_, session):
        for name in ("alice", "carol"):
            async with session.post("/api/voices", data=_form(_audio_file(), name=name)) as added:
                assert added.status == 201
        async with session.patch("/api/voices/alice", json={"name": "bob"}) as renamed:
            assert renamed.status == 200 and (await renamed.json())["voice"]["name"] == "bob"
        async with session.get("/api/voices/alice") as gone:
            assert gone.status == 404 and (await _error(gone))["code"] == "voice_not_found"
        async with session.patch("/api/voices/bob", json={"name": "Carol"}) as taken:
            assert taken.status == 409 and (await _error(taken))["code"] == "name_taken"
        async with session.patch("/api/voices/bob", json={"name": "a/b"}) as bad:
            assert bad.status == 400 and (await _error(bad))["code"] == "bad_voice_name"
        async with session.patch("/api/voices/bob", json={"title": "x"}) as unknown:
            assert unknown.status == 400 and (await _error(unknown))["code"] == "bad_payload"
        page, ids = await _voice_names(session)
        assert sorted(page) == ["bob", "broken", "carol"] and page["broken"]["unreadable"] is True
        assert "bob" in ids and "alice" not in ids
        for name in ("bob", "broken"):
            async with session.delete(f"/api/voices/{name}") as removed:
                assert removed.status == 200 and await removed.json() == {"name": name, "deleted": True}
        async with session.delete("/api/voices/bob") as again:
            assert again.status == 404
        page, _ = await _voice_names(session)
    assert sorted(page) == ["carol"]


# -- speaking on the speaker, the live view ------------------------------------------------


@pytest.mark.integration
async def test_the_event_stream_carries_what_mqtt_carries(
    tmp_path: Path, mosquitto: Mosquitto, recording: list[Any]
) -> None:
    async with (
        web_api(tmp_path, mosquitto, mode="custom_voice", voices="Ryan") as (api, session),
        session.get("/api/events") as stream,
    ):
        assert stream.content_type == "text/event-stream"
        seen: list[tuple[str, dict[str, Any]]] = []
        reader = aiter(events(stream))
        kind, snapshot = await anext(reader)
        assert kind == "snapshot" and snapshot["engine"]["engine"] == "recording"
        assert snapshot["state"] == {"state": "idle", "queue": 0, "currentId": None}
        assert snapshot["machine"]["cores"] >= 1 and "mp3" in snapshot["formats"]
        await api.rec.say("s2s/kitchen/tts/say", {"id": "m1", "text": "Hello from MQTT."})
        async with session.post("/api/say", json={"id": "w1", "text": "Hello from the page."}) as said:
            assert said.status == 202 and await said.json() == {"id": "w1", "status": "queued"}
        async with session.post("/api/say", json={"text": "x", "voice": "Nobody"}) as refused:
            assert refused.status == 400 and (await _error(refused))["code"] == "unknown_voice"
        for body, param in (({"text": ""}, "text"), ({"text": "x" * 3000}, "text"), ({"id": "", "text": "x"}, "id")):
            async with session.post("/api/say", json=body) as refused:  # its own field names, not the speech API's
                assert refused.status == 400 and (await _error(refused))["param"] == param, body
        async with asyncio.timeout(10):
            while {"m1", "w1"} - {p["id"] for k, p in seen if k == "latency"}:
                seen.append(await anext(reader))
        mqtt = await api.rec.wait_finished(["m1", "w1"])
    finished = {p["id"]: p for k, p in seen if k == "finished"}
    assert finished["m1"] == mqtt["m1"] and finished["w1"] == mqtt["w1"]  # the same payloads
    assert finished["w1"]["status"] == "completed"
    kinds = [k for k, _ in seen]
    assert {"state", "started", "jobs"} <= set(kinds)
    origins = {j["id"]: j["origin"] for k, p in seen if k == "jobs" for j in p["jobs"]}
    assert origins.get("m1", "mqtt") == "mqtt" and origins.get("w1", "web") == "web"


@pytest.mark.integration
async def test_status_shows_the_request_in_hand_and_stop_stops_it(tmp_path: Path, mosquitto: Mosquitto) -> None:
    slow = {"options": {"speed": "1"}}  # the tone engine in real time: 4 s for 100 characters
    async with speech_api(tmp_path, mosquitto, tts=slow) as api:
        session = aiohttp.ClientSession(api.base_url, headers=AUTH)
        async with session:
            await api.rec.say("s2s/kitchen/tts/say", {"id": "long", "text": "z" * 100, "voice": "Vivian"})
            await api.rec.say("s2s/kitchen/tts/say", {"id": "next", "text": "y" * 10})
            speaking = {"state": "speaking", "currentId": "long"}
            await api.rec.wait_for(lambda: any(m.json().items() >= speaking.items() for m in api.rec.on("/state")))
            async with session.get("/api/status") as status:
                snapshot = await status.json()
            jobs = {j["id"]: j for j in snapshot["jobs"]}
            assert [j["id"] for j in snapshot["jobs"]] == ["long", "next"]
            assert jobs["long"]["origin"] == "mqtt" and jobs["long"]["voice"] == "Vivian"
            # its text as it is spoken (the text stage ended it with a full stop)
            assert jobs["long"]["output"] == "speaker" and jobs["long"]["text"] == "z" * 100 + "."
            assert jobs["next"]["phase"] == "queued"
            assert snapshot["state"]["currentId"] == "long"
            async with session.post("/api/stop", json={"id": "long"}) as stopped:
                assert await stopped.json() == {"stopped": 1}
            async with session.post("/api/stop", json={"all": "yes"}) as bad:
                assert bad.status == 400
            finished = await api.rec.wait_finished(["long", "next"])
    assert finished["long"]["status"] == "interrupted" and finished["next"]["status"] == "completed"


@pytest.mark.integration
async def test_open_event_streams_end_cleanly_when_the_daemon_stops(
    tmp_path: Path, mosquitto: Mosquitto, recording: list[Any]
) -> None:
    async with web_api(tmp_path, mosquitto) as (api, session):
        async with session.get("/api/events") as stream:
            reader = aiter(events(stream))
            assert (await anext(reader))[0] == "snapshot"
            api.daemon.request_stop()
            rest = [kind async for kind, _ in reader]  # read to the end: no ServerDisconnected, no payload error
        assert "snapshot" not in rest


def _page_server(tmp_path: Path, feed: Any, config: Any = None) -> Any:
    """The speech API's server (the tone engine's info, no daemon around it) attached to ``feed``."""
    from s2s_daemon.config import HttpConfig
    from s2s_daemon.events.metrics import DaemonMetrics
    from s2s_daemon.events.readiness import Readiness
    from s2s_daemon.intake.admission import IntakeRules
    from s2s_daemon.intake.http.monitor import MonitorRoutes
    from s2s_daemon.intake.http.server import HttpSpeechServer
    from s2s_daemon.pipeline.jobs import Job, Ledger
    from s2s_daemon.pipeline.queue import RequestQueue
    from s2s_daemon.pipeline.vocabulary import EngineInfo
    from s2s_daemon.pipeline.voice_policy import VoicePolicy
    from s2s_daemon.pipeline.voices import VoiceLibrary

    class NoEvents:
        def started(self, job: Job) -> None: ...
        def finished(self, job: Job) -> None: ...
        def state_changed(self) -> None: ...

    info = EngineInfo("tone", "m", "cpu", 24000, voices=("Ryan",))
    rules = IntakeRules(
        "kitchen", 100, VoicePolicy(info.voices, None, VoiceLibrary(tmp_path, info.mode)), info.languages, "auto"
    )
    server = HttpSpeechServer(config or HttpConfig(), MonitorRoutes(Readiness(), DaemonMetrics()))
    server.attach(Ledger(RequestQueue(4), NoEvents(), 16), rules, info, feed)
    return server


async def test_an_event_published_while_a_page_connects_reaches_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot's history and the events after it do not overlap: an event the daemon published
    while the stream was being opened is in one or the other, not both (a point twice on the plots)."""
    from aiohttp.test_utils import TestClient, TestServer

    from s2s_daemon.intake.http import web as web_module
    from s2s_daemon.intake.http.live import LiveFeed

    feed = LiveFeed()
    loop = asyncio.get_running_loop()

    def machine_while_an_event_comes() -> dict[str, Any]:
        observed = threading.Event()

        def latency() -> None:
            feed.add("latency", {"id": "meanwhile"})
            observed.set()

        loop.call_soon_threadsafe(latency)
        assert observed.wait(10)
        return {"cpu": "test"}

    monkeypatch.setattr(web_module, "machine", machine_while_an_event_comes)
    async with TestClient(TestServer(_page_server(tmp_path, feed).app())) as client:
        response = await client.get("/api/events")
        reader = aiter(events(response))
        kind, snapshot = await anext(reader)
        assert kind == "snapshot" and snapshot["machine"] == {"cpu": "test"}
        feed.add("state", {"state": "idle", "queue": 0, "currentId": None})
        after = [await anext(reader) for _ in range(2)]  # the state, then its jobs
        response.close()
    in_history = [e["id"] for e in snapshot["history"]["latency"]]
    as_events = [p["id"] for k, p in after if k == "latency"]
    assert in_history + as_events == ["meanwhile"], (in_history, as_events)
    assert [k for k, _ in after] == ["state", "jobs"]


@pytest.mark.slow
async def test_a_page_that_reads_nothing_is_cut_from_the_event_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event stream whose client took nothing for http.write_timeout_s is closed: it held its
    connection (one of http.max_connections) for as long as the client stayed connected."""
    from aiohttp.test_utils import TestServer

    from s2s_daemon.config import HttpConfig
    from s2s_daemon.intake.http import web as web_module
    from s2s_daemon.intake.http.live import LiveFeed

    monkeypatch.setattr(web_module, "machine", lambda: {"cpu": "test"})  # no lscpu: no process here
    feed = LiveFeed()
    server = _page_server(tmp_path, feed, HttpConfig(write_timeout_s=0.5))
    async with TestServer(server.app()) as http:
        loop = asyncio.get_running_loop()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        try:
            await loop.sock_connect(client, ("127.0.0.1", http.port))
            await loop.sock_sendall(client, b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            pad = "x" * 65536
            for i in range(150):  # 10 MB offered while the client reads nothing: more than the buffers hold
                feed.add("latency", {"id": str(i), "pad": pad})
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)  # past write_timeout_s with the writer stuck
            try:
                async with asyncio.timeout(10):  # what was buffered, then the end (no keepalive comes in 10 s)
                    while await loop.sock_recv(client, 1 << 16):
                        pass
            except ConnectionResetError:
                pass  # cut with a reset: the kernel drops what was buffered
            except TimeoutError:
                pytest.fail("the event stream stayed open for a client that read nothing")
        finally:
            client.close()
