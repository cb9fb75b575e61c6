"""The text stage at every door (issue 38): an assistant's Markdown answer, sent through MQTT (say,
and a stream split across deltas), the speech API (the openai SDK), the web page's ``/api/say``,
Wyoming (``synthesize`` and the streamed ``synthesize-chunk``, wyoming's own client) and ``say`` /
``say -``, is spoken as its words. What is spoken is what the tests' tone engine was asked to
synthesize (its ``record`` file), against the daemon in this process (the doors) or as a
subprocess (``say``, a restart), with a real mosquitto."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from wyoming.client import AsyncTcpClient
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import REPO, DaemonProcess, daemon_in_process, write_config
from tests.support.mqtt import Recorder, recorder
from tests.support.tone_engine import recorded
from tests.test_http_speech import KEY, wait_ready
from tests.test_wyoming import Answer, read_answer, wait_listening

pytestmark = pytest.mark.timeout(60)

SAY = "s2s/kitchen/tts/say"
STREAM = "s2s/kitchen/tts/stream"
AUTH = {"Authorization": f"Bearer {KEY}"}

ANSWER = """## Your trip 🎉

Here is **the plan** for *Saturday*:

- Visit the [museum](https://www.louvre.fr/en) 🏛️
- Lunch at noon

| Stop | Time |
|---|---|
| Museum | 10:00 |
| Park | 14:30 |

```python
print("hello")
```

Enjoy! 😀"""
"""An assistant's answer: a heading, emphasis, a list, a link, a table, a code block and emoji."""
SPOKEN = [
    "Your trip.",
    "Here is the plan for Saturday.",
    "Visit the museum.",
    "Lunch at noon.",
    "Stop, Time.",
    "Museum, 10:00.",
    "Park, 14:30.",
    "Code block skipped.",
    "Enjoy!",
]
"""What a listener should hear, sentence by sentence (one engine call each): the words, each list
item and table row a sentence, the link as its text, a note for the code, no emoji, no markup."""
DELTAS = [
    "## Your trip 🎉\n\nHere is **the",  # a ** opened here ...
    " plan** for *Saturday*:\n\n- Visit the [museum](https://www.lou",  # ... closed here; a link cut
    "vre.fr/en) 🏛️\n- Lunch at noon\n\n| Stop | Time |\n|---|---|\n| Museum | 10:00 |\n| Pa",
    "rk | 14:30 |\n\n``",  # a fence opened across three deltas
    "`pyth",
    'on\nprint("hel',
    'lo")\n```\n\nEnjoy! 😀',
]
assert "".join(DELTAS) == ANSWER
EMOJI_ONLY = "🎉😀👍"


@dataclass
class Doors:
    rec: Recorder
    http_port: int
    wyoming_port: int
    record: Path

    def spoken(self) -> list[str]:
        """The texts the engine was asked to synthesize since the last call."""
        texts = recorded(self.record)
        self.record.unlink(missing_ok=True)
        return texts

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key=KEY, max_retries=0, timeout=10
        )

    def http(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(f"http://127.0.0.1:{self.http_port}", headers=AUTH)


@contextlib.asynccontextmanager
async def doors(tmp_path: Path, broker: Mosquitto, **sections: Any) -> AsyncIterator[Doors]:
    """The daemon with MQTT, the speech API (with a key) and Wyoming, its engine recording."""
    http_port, wyoming_port = free_port(), free_port()
    record = tmp_path / "spoken.jsonl"
    key_file = tmp_path / "api.key"
    key_file.write_text(KEY + "\n")
    path = write_config(
        tmp_path / "daemon.yaml",
        broker.port,
        tts={"options": {"speed": "0", "record": str(record)}},
        http={"enabled": True, "port": http_port, "api_key_file": str(key_file)},
        wyoming={"enabled": True, "host": "127.0.0.1", "port": wyoming_port, "zeroconf": False},
        **sections,
    )
    async with recorder(broker.port) as rec, daemon_in_process(path):
        await wait_ready(http_port)
        await wait_listening(wyoming_port)
        await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 30)
        yield Doors(rec, http_port, wyoming_port, record)


async def wyoming(port: int, *events: Any, streaming: bool = False) -> Answer:
    async with AsyncTcpClient("127.0.0.1", port) as client:
        for event in events:
            await client.write_event(event)
        return await read_answer(client, streaming=streaming, timeout_s=20)


@pytest.mark.integration
async def test_a_markdown_answer_said_over_mqtt_is_spoken_as_its_words(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with doors(tmp_path, mosquitto) as d:
        await d.rec.say(SAY, {"id": "md", "text": ANSWER})
        fin = await d.rec.wait_finished(["md"])
        assert fin["md"]["status"] == "completed", fin
        assert d.spoken() == SPOKEN
        # tts/started says what the stage made of it: the spoken text's length, and that it changed
        started = next(p for p in d.rec.payloads("/tts/started") if p["id"] == "md")
        assert started["spokenChars"] == len("\n".join(SPOKEN)) and started["textChanged"] is True
        await d.rec.say(SAY, {"id": "plain", "text": "Nothing to change here."})
        await d.rec.wait_finished(["plain"])
        assert d.spoken() == ["Nothing to change here."]
        started = next(p for p in d.rec.payloads("/tts/started") if p["id"] == "plain")
        assert started["spokenChars"] == len("Nothing to change here.") and started["textChanged"] is False


@pytest.mark.integration
async def test_a_markdown_answer_streamed_over_mqtt_is_spoken_as_the_whole(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """The deltas cut a ``**``, a link and a code fence: read as the whole answer is."""
    async with doors(tmp_path, mosquitto) as d:
        for seq, delta in enumerate(DELTAS):
            await d.rec.say(STREAM, {"id": "st", "seq": seq, "text": delta})
        await d.rec.say(STREAM, {"id": "st", "seq": len(DELTAS), "end": True})
        fin = await d.rec.wait_finished(["st"])
        assert fin["st"]["status"] == "completed", fin
        assert d.spoken() == SPOKEN
        started = next(p for p in d.rec.payloads("/tts/started") if p["id"] == "st")
        assert started["spokenChars"] is None and started["textChanged"] is None  # still being written


@pytest.mark.integration
async def test_a_markdown_answer_through_the_speech_api_and_the_web_page(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with doors(tmp_path, mosquitto) as d:
        async with d.client() as client:
            raw = await client.audio.speech.with_raw_response.create(
                model="tts-1", voice="alloy", input=ANSWER, response_format="pcm"
            )
            assert raw.http_response.status_code == 200 and raw.parse().content
        assert d.spoken() == SPOKEN
        async with d.http() as http, http.post("/api/say", json={"id": "web", "text": ANSWER}) as r:
            assert r.status == 202, await r.text()
        await d.rec.wait_finished(["web"])
        assert d.spoken() == SPOKEN


@pytest.mark.integration
async def test_a_markdown_answer_through_wyoming_whole_and_streamed(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with doors(tmp_path, mosquitto) as d:
        answer = await wyoming(d.wyoming_port, Synthesize(text=ANSWER).event())
        assert not answer.errors and len(answer.groups) == 1 and answer.groups[0].stopped
        assert d.spoken() == SPOKEN
        chunks = [SynthesizeChunk(text=delta).event() for delta in DELTAS]
        events = [SynthesizeStart().event(), *chunks, SynthesizeStop().event()]
        streamed = await wyoming(d.wyoming_port, *events, streaming=True)
        assert not streamed.errors and streamed.synthesize_stopped, streamed.events
        assert d.spoken() == SPOKEN  # one request a sentence, cut from what the stream's stage gave out
        assert len(streamed.groups) == len(SPOKEN)


@pytest.mark.integration
async def test_an_emoji_only_text_is_empty_text_at_every_door(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with doors(tmp_path, mosquitto) as d:
        await d.rec.say(SAY, {"id": "say", "text": EMOJI_ONLY})
        await d.rec.say(STREAM, {"id": "stream", "seq": 0, "text": EMOJI_ONLY[:2]})
        await d.rec.say(
            STREAM, {"id": "stream", "seq": 1, "text": "** " + EMOJI_ONLY[2:] + " **\n\n---\n", "end": True}
        )
        fin = await d.rec.wait_finished(["say", "stream"])
        assert fin["say"]["status"] == "rejected" and fin["say"]["error"]["code"] == "empty_text"
        assert "nothing to speak once prepared" in fin["say"]["error"]["message"]
        assert fin["stream"]["status"] == "error" and fin["stream"]["error"]["code"] == "empty_text"
        assert "nothing to speak once prepared" in fin["stream"]["error"]["message"]
        async with d.client() as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.audio.speech.create(model="tts-1", voice="alloy", input=EMOJI_ONLY)
            assert refused.value.code == "empty_text"
        async with d.http() as http, http.post("/api/say", json={"text": EMOJI_ONLY}) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["code"] == "empty_text", body
        whole = await wyoming(d.wyoming_port, Synthesize(text=EMOJI_ONLY).event())
        assert [e.code for e in whole.errors] == ["empty_text"] and not whole.groups
        chunks = [SynthesizeChunk(text=EMOJI_ONLY[:1]).event(), SynthesizeChunk(text=EMOJI_ONLY[1:]).event()]
        events = [SynthesizeStart().event(), *chunks, SynthesizeStop().event()]
        streamed = await wyoming(d.wyoming_port, *events, streaming=True)
        assert [e.code for e in streamed.errors] == ["empty_text"] and not streamed.groups
        assert d.spoken() == []
        # and the daemon serves on
        await d.rec.say(SAY, {"id": "after", "text": "Still here."})
        assert (await d.rec.wait_finished(["after"]))["after"]["status"] == "completed"


@pytest.mark.integration
async def test_mqtt_text_options_override_the_section_and_a_bad_one_is_refused(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    options = {"emoji": "name", "codeBlocks": "read", "markdown": True}
    text = "Run this 👍\n\n```sql\nSELECT name FROM users;\n```"
    async with doors(tmp_path, mosquitto) as d:
        await d.rec.say(SAY, {"id": "own", "text": text, "textOptions": options})
        assert (await d.rec.wait_finished(["own"]))["own"]["status"] == "completed"
        assert d.spoken() == ["Run this thumbs up.", "SELECT name FROM users."]
        await d.rec.say(STREAM, {"id": "st", "seq": 0, "text": "Run this 👍\n\n``", "textOptions": options})
        await d.rec.say(STREAM, {"id": "st", "seq": 1, "text": "`sql\nSELECT name FROM users;\n```", "end": True})
        assert (await d.rec.wait_finished(["st"]))["st"]["status"] == "completed"
        assert d.spoken() == ["Run this thumbs up.", "SELECT name FROM users."]
        await d.rec.say(SAY, {"id": "default", "text": text})  # the section's defaults
        assert (await d.rec.wait_finished(["default"]))["default"]["status"] == "completed"
        assert d.spoken() == ["Run this.", "Code block skipped."]
        await d.rec.say(SAY, {"id": "bad-key", "text": text, "textOptions": {"codeblocks": "read"}})
        await d.rec.say(SAY, {"id": "bad-value", "text": text, "textOptions": {"emoji": "shout"}})
        await d.rec.say(STREAM, {"id": "bad-st", "seq": 0, "text": text, "textOptions": {"numbers": 1}})
        fin = await d.rec.wait_finished(["bad-key", "bad-value", "bad-st"])
        assert {fin[i]["status"] for i in fin if i.startswith("bad")} == {"rejected"}
        assert {fin[i]["error"]["code"] for i in fin if i.startswith("bad")} == {"bad_payload"}
        assert "textOptions.codeblocks" in fin["bad-key"]["error"]["message"]
        assert "textOptions.emoji" in fin["bad-value"]["error"]["message"]
        assert "textOptions.numbers" in fin["bad-st"]["error"]["message"]
        assert d.spoken() == []


@pytest.mark.integration
async def test_api_text_shows_what_a_say_would_speak(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """``POST /api/text`` (the page's Try it): JSON only, behind the key and the same-origin rule."""
    async with doors(tmp_path, mosquitto) as d, d.http() as http:
        async with http.post("/api/text", json={"text": ANSWER, "language": "en"}) as r:
            assert r.status == 200 and await r.json() == {"spoken": "\n".join(SPOKEN), "changed": True}
        async with http.post("/api/text", json={"text": "Das kostet 28.000 €.", "language": "de"}) as r:
            assert (await r.json())["spoken"] == "Das kostet achtundzwanzigtausend Euro."
        own = {"text": "Hi 👍", "textOptions": {"emoji": "name"}}
        async with http.post("/api/text", json=own) as r:
            assert await r.json() == {"spoken": "Hi thumbs up.", "changed": True}
        async with http.post("/api/text", json={"text": EMOJI_ONLY}) as r:
            assert await r.json() == {"spoken": "", "changed": True}  # a say of it: empty_text
        for body, code in [
            ({"text": ""}, "empty_text"),
            ({"text": "x", "language": "klingon"}, "unsupported_language"),
            ({"text": "x", "textOptions": {"emojis": "drop"}}, "bad_payload"),
            ({"txt": "x"}, "bad_payload"),
        ]:
            async with http.post("/api/text", json=body) as r:
                answer = await r.json()
                assert r.status == 400 and answer["error"]["code"] == code, (body, answer)
        async with http.post("/api/text", data="text=x", headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 415
        cross = {"Origin": "http://evil.example", "Content-Type": "application/json"}
        async with http.post("/api/text", data=json.dumps({"text": "x"}), headers=cross) as r:
            assert r.status == 403
        async with aiohttp.ClientSession(f"http://127.0.0.1:{d.http_port}") as anonymous:
            async with anonymous.post("/api/text", json={"text": "x"}) as r:
                assert r.status == 401


# -- say, say -, and a restart: the daemon as a subprocess ----------------------------------------


def say(tmp_path: Path, *args: str, stdin: bytes | None = None) -> tuple[subprocess.CompletedProcess[bytes], list[str]]:
    """``s2s-daemon say ARGS`` on the tone engine; what it said, and the texts it spoke."""
    record = tmp_path / "said.jsonl"
    record.unlink(missing_ok=True)
    config = tmp_path / "say.yaml"
    tts = {"engine": "tone", "options": {"speed": "0", "record": str(record)}, "warmup": False}
    config.write_text(yaml.safe_dump({"tts": tts, "journal": {"enabled": False}, "log": {"level": "warning"}}))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    environ["PYTHONPATH"] = str(REPO)
    out = tmp_path / "out.wav"
    command = [sys.executable, "-m", "tests.support.tone_daemon", "say", *args, "-c", str(config), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=environ, input=stdin or b"", capture_output=True, timeout=50)
    return done, recorded(record)


@pytest.mark.integration
def test_say_and_say_dash_speak_a_markdown_answer_as_its_words(tmp_path: Path) -> None:
    done, spoken = say(tmp_path, ANSWER)
    assert done.returncode == 0, done.stderr.decode()
    assert spoken == SPOKEN
    done, spoken = say(tmp_path, "-", stdin=ANSWER.encode())
    assert done.returncode == 0, done.stderr.decode()
    assert spoken == SPOKEN
    done, spoken = say(tmp_path, EMOJI_ONLY)
    assert done.returncode == 64 and spoken == []
    assert b"s2s-daemon: say: text has nothing to speak once prepared" in done.stderr
    done, spoken = say(tmp_path, "-", stdin=f"{EMOJI_ONLY} **\n\n---\n".encode())
    assert done.returncode == 64 and spoken == []
    assert b"s2s-daemon: say: the streamed text has nothing to speak once prepared" in done.stderr


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_a_request_resumed_from_the_journal_speaks_its_prepared_text(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Killed with the request queued, restarted with another ``text:`` section: the request speaks
    what its text was prepared into when it was admitted (its own ``textOptions`` included)."""
    record = tmp_path / "spoken.jsonl"
    log = {"format": "json", "level": "debug"}
    tts = {"options": {"speed": "1", "ms_per_char": "25", "record": str(record)}}
    config = write_config(tmp_path / "d.yaml", mosquitto.port, tts=tts, log=log)
    proc = DaemonProcess(config)
    text = "**Hello** 👋, see [the docs](https://docs.example.org/start)."
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await rec.wait_for(lambda: rec.on("/status") and rec.on("/status")[-1].payload == b"online", 30)
            await rec.say(SAY, {"id": "first", "text": "About a second of speech, spoken first."})
            await rec.say(SAY, {"id": "md", "text": text, "textOptions": {"emoji": "name"}})
            await rec.wait_for(lambda: rec.payloads("/tts/started"))  # "first" speaks, "md" waits
            proc.signal(signal.SIGKILL)
            await proc.wait(10)
            assert "md" not in rec.finished()
            prepared = [
                json.loads(line)
                for line in proc.log().splitlines()
                if line.startswith("{") and '"text_prepared"' in line and '"md"' in line
            ]
            assert prepared and prepared[0]["changed"] is True, proc.log()
            assert prepared[0]["asked_chars"] == len(text) and prepared[0]["spoken_chars"] < len(text)
            # the section at the restart would read it otherwise: Markdown and the emoji as written
            write_config(config, mosquitto.port, tts=tts, log=log, text={"markdown": False, "emoji": "keep"})
            proc.start()
            fin = await rec.wait_finished(["first", "md"], timeout_s=40)
            assert fin["md"]["status"] == "completed", fin
            assert "journal_resumed" in proc.log()
        said = [t for t in recorded(record) if "Hello" in t]
        assert said == ["Hello waving hand, see the docs."], said
    finally:
        proc.cleanup()
