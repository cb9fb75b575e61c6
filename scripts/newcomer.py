"""A newcomer's pass over every door of s2s-daemon, as the README tells them to try it.

``scripts/newcomer`` (once ``scripts/run`` or ``scripts/test`` made ``.venv``): generates tiny random
checkpoints (the README's offline route), runs the daemon from ``configs/default.yaml`` with the
HTTP API, Wyoming and Home Assistant discovery turned on (free ports, a scratch folder for its
journal and voices), and knocks on every door with the clients a user has: mosquitto's
``mosquitto_pub``/``mosquitto_sub`` (paho when they are not installed), curl, the openai SDK, the
wyoming client, and the ``s2s-daemon`` commands. One line per door, ``ok`` or ``FAIL`` and what it
saw; the exit status is 0 when every door is ok.

    scripts/newcomer [--keep] [--timeout-s S]

Random weights speak noise and never end an utterance: ``tts.options.max_frames`` caps them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "s2s_daemon"]
SITE = "default"
SAY = f"s2s/{SITE}/tts/say"
MAX_FRAMES = "12"
"""About 1 s of audio per sentence: enough to hear, quick on any CPU."""


class Doors:
    """The results, printed as they come."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.count = 0

    def report(self, door: str, ok: bool, what: str) -> None:
        self.count += 1
        if not ok:
            self.failed.append(door)
        print(f"{'ok  ' if ok else 'FAIL'} {door:<16} {what}", flush=True)

    def check(self, door: str, probe: Callable[[], str]) -> None:
        """Run ``probe``: its return is an ok line; an AssertionError or any exception a FAIL line."""
        try:
            self.report(door, True, probe())
        except AssertionError as exc:
            self.report(door, False, str(exc) or "assertion failed")
        except Exception as exc:  # a door that crashes is a FAIL line, and the next door is tried
            self.report(door, False, f"{type(exc).__name__}: {exc}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


def run(args: list[str], env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, check=False)


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


# -- MQTT: mosquitto's clients when installed, else paho ------------------------------------------


class Watch:
    """Everything under ``s2s/#`` (and ``homeassistant/#``): ``mosquitto_sub -V mqttv311 -v``."""

    def __init__(self, port: int, topics: tuple[str, ...] = ("s2s/#", "homeassistant/#")) -> None:
        self.lines: list[tuple[str, str]] = []
        self.mosquitto = shutil.which("mosquitto_sub") is not None
        if self.mosquitto:
            args = ["mosquitto_sub", "-V", "mqttv311", "-p", str(port), "-v"]
            for topic in topics:
                args += ["-t", topic]
            self.proc: subprocess.Popen[str] | None = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            threading.Thread(target=self._read, daemon=True).start()
        else:
            import paho.mqtt.client as paho

            self.proc = None
            self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
            self.client.on_message = lambda c, u, m: self.lines.append((m.topic, m.payload.decode(errors="replace")))
            self.client.connect("127.0.0.1", port)
            for topic in topics:
                self.client.subscribe(topic)
            self.client.loop_start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            topic, _, payload = line.rstrip("\n").partition(" ")
            self.lines.append((topic, payload))

    def on(self, suffix: str) -> list[str]:
        return [payload for topic, payload in list(self.lines) if topic.endswith(suffix)]

    def json_on(self, suffix: str) -> list[dict[str, Any]]:
        out = []
        for payload in self.on(suffix):
            try:
                out.append(json.loads(payload))
            except ValueError:
                continue
        return out

    def finished(self, rid: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for payload in self.json_on("/tts/finished"):
                if payload.get("id") == rid:
                    return payload
            time.sleep(0.05)
        raise AssertionError(f"no tts/finished for {rid!r} within {timeout_s:g} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(5)
        else:
            self.client.loop_stop()
            self.client.disconnect()


def publish(port: int, topic: str, payload: str, qos: int = 1) -> None:
    if shutil.which("mosquitto_pub") is not None:
        subprocess.run(
            ["mosquitto_pub", "-V", "mqttv311", "-p", str(port), "-q", str(qos), "-t", topic, "-m", payload],
            check=True,
            timeout=10,
        )
        return
    import paho.mqtt.publish as single

    single.single(topic, payload, qos=qos, hostname="127.0.0.1", port=port)


# -- the daemon -------------------------------------------------------------------------------


class Daemon:
    def __init__(self, work: Path, name: str, env: dict[str, str], **overrides: Any) -> None:
        self.work = work
        self.env = env
        self.mqtt_port = free_port()
        self.http_port = free_port()
        self.wyoming_port = free_port()
        data = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
        data["mqtt"]["port"] = self.mqtt_port
        data["tts"].update(
            model=str(work / "tiny"), voices_dir=str(work / "voices"), options={"max_frames": MAX_FRAMES}
        )
        data["audio"]["sink"] = "discard"  # a box without a speaker; `auto` picks it there too
        data["log"]["format"] = "json"
        data["ha"]["discovery"] = True
        data["http"].update(enabled=True, port=self.http_port, api_key_file=str(work / "api.key"))
        data["wyoming"].update(enabled=True, host="127.0.0.1", port=self.wyoming_port, zeroconf=False)
        for section, values in overrides.items():
            if isinstance(data.get(section), dict):
                data[section].update(values)
            else:
                data[section] = values  # a top-level key (site_id)
        self.config = work / f"{name}.yaml"
        self.config.write_text(yaml.safe_dump(data))
        self.log_path = work / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*CLI, "run", "-c", str(self.config)], cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout_s: float) -> float:
        began = time.monotonic()
        deadline = began + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode}: {tail(self.log())}")
            if '"event": "ready"' in self.log() and wait_port(self.mqtt_port, 1):
                return time.monotonic() - began
            time.sleep(0.2)
        raise AssertionError(f"not ready within {timeout_s:g} s: {tail(self.log())}")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# -- the doors ----------------------------------------------------------------------------------


def door_check_config(d: Daemon, env: dict[str, str]) -> str:
    good = run([*CLI, "check-config", str(d.config)], env)
    assert good.returncode == 0 and "valid" in good.stdout, f"exit {good.returncode}: {tail(good.stderr)}"
    bad = run([*CLI, "check-config", str(d.config)], {**env, "S2S_TTS__MODEL": "/nonexistent/dir"})
    assert bad.returncode == 78 and "tts.model: /nonexistent/dir" in bad.stderr, f"a wrong path: {bad.stderr}"
    printed = run([*CLI, "check-config", "--print", str(d.config)], env)
    saved = d.work / "printed.yaml"
    saved.write_text(printed.stdout)
    again = run([*CLI, "check-config", str(saved)], env)
    assert again.returncode == 0, f"--print's YAML does not read back: {tail(again.stderr)}"
    return "valid; a wrong tts.model is 78 naming it; --print's YAML reads back"


def door_devices(env: dict[str, str]) -> str:
    out = run([*CLI, "devices"], env)
    assert out.returncode == 0, f"exit {out.returncode}: {tail(out.stderr)}"
    lines = out.stdout.strip().splitlines()
    if lines and lines[0] == "no sound devices found":
        assert len(lines) > 1, "no devices, and no word on what to install or start"
        return f"none here; it says: {lines[1].strip()[:90]}..."
    return f"{len(lines) - 2} devices listed"


def door_mqtt(d: Daemon, watch: Watch) -> str:
    publish(d.mqtt_port, SAY, json.dumps({"id": "newcomer-1", "text": "Hello from the kitchen."}))
    publish(d.mqtt_port, SAY, "Plain text works too.")
    fin = watch.finished("newcomer-1", 120)
    assert fin["status"] == "completed", f"tts/finished {fin}"
    assert fin.get("origin") == "mqtt", f"no origin in {fin}"
    started = [p for p in watch.json_on("/tts/started") if p.get("id") == "newcomer-1"]
    assert started, "no tts/started before tts/finished"
    plain = [p for p in watch.json_on("/tts/finished") if p.get("id") != "newcomer-1"]
    deadline = time.monotonic() + 120
    while not plain and time.monotonic() < deadline:
        time.sleep(0.1)
        plain = [p for p in watch.json_on("/tts/finished") if p.get("id") != "newcomer-1"]
    assert plain and plain[0]["status"] == "completed", "the plain-text say was not answered completed"
    client = "mosquitto_pub/sub" if watch.mosquitto else "paho (mosquitto-clients not installed)"
    return f"JSON and plain say completed, audioMs {fin['audioMs']:g} ({client})"


def door_stream(d: Daemon, watch: Watch) -> str:
    rid = "newcomer-stream"
    for seq, text in enumerate(["The kettle ", "has boiled. ", "Tea is ready"]):
        publish(d.mqtt_port, f"s2s/{SITE}/tts/stream", json.dumps({"id": rid, "seq": seq, "text": text}))
    publish(d.mqtt_port, f"s2s/{SITE}/tts/stream", json.dumps({"id": rid, "seq": 3, "end": True}))
    fin = watch.finished(rid, 120)
    assert fin["status"] == "completed", f"tts/finished {fin}"
    started = [p for p in watch.json_on("/tts/started") if p.get("id") == rid]
    assert len(started) == 1, f"{len(started)} tts/started for one stream"
    return "4 pieces, one request: one tts/started, one tts/finished completed"


def door_stop(d: Daemon, watch: Watch) -> str:
    seen = []
    for n, stop in enumerate(({}, {"all": True})):
        rid = f"newcomer-stop-{n}"
        publish(d.mqtt_port, SAY, json.dumps({"id": rid, "text": "A sentence that will be stopped. " * 4}))
        time.sleep(0.3)
        publish(d.mqtt_port, f"s2s/{SITE}/tts/stop", json.dumps(stop), qos=0)
        fin = watch.finished(rid, 120)
        started = any(p.get("id") == rid for p in watch.json_on("/tts/started"))
        latency = any(p.get("id") == rid for p in watch.json_on("/metrics/latency"))
        if fin["status"] == "cancelled":
            assert not started and fin["audioMs"] == 0 and not latency, f"cancelled but heard: {fin}"
        elif fin["status"] == "interrupted":
            assert started and fin["audioMs"] > 0, f"interrupted without a start: {fin}"
        else:
            assert fin["status"] == "completed", f"tts/finished {fin}"
        seen.append(f"{json.dumps(stop)} -> {fin['status']}")
    return "; ".join(seen) + " (the contract holds for each)"


def curl(d: Daemon, body: dict[str, Any], out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    key = (d.work / "api.key").read_text().strip()
    return subprocess.run(
        ["curl", "-sS", "-N", *extra, f"http://127.0.0.1:{d.http_port}/v1/audio/speech",
         "-H", f"Authorization: Bearer {key}", "-H", "Content-Type: application/json",
         "-d", json.dumps(body), "-o", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def door_probes(d: Daemon) -> str:
    """docs/operations.md's probes, with curl as there (on the speech API's port: the same paths)."""
    assert shutil.which("curl") is not None, "curl is not installed"
    base = f"http://127.0.0.1:{d.http_port}"
    health = subprocess.run(["curl", "-s", f"{base}/health"], capture_output=True, text=True, check=False)
    assert json.loads(health.stdout).get("phase") == "serving", f"/health: {health.stdout}"
    ready = subprocess.run(["curl", "-fsS", f"{base}/ready"], capture_output=True, text=True, check=False)
    assert ready.returncode == 0 and json.loads(ready.stdout)["ready"] is True, f"/ready: {ready.stdout}"
    key = (d.work / "api.key").read_text().strip()
    metrics = subprocess.run(
        ["curl", "-s", "-H", f"Authorization: Bearer {key}", f"{base}/metrics"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert "s2s_ready 1.0" in metrics.stdout, f"/metrics: {tail(metrics.stdout)}"
    return "/health serving, /ready 200, /metrics s2s_ready 1"


def door_curl(d: Daemon) -> str:
    assert shutil.which("curl") is not None, "curl is not installed"
    body = {"model": "tts-1", "input": "Dinner is ready.", "voice": "Vivian", "response_format": "wav"}
    out = d.work / "curl.wav"
    done = curl(d, body, out, "--fail-with-body")
    assert done.returncode == 0, f"curl exit {done.returncode}: {done.stderr.strip()}"
    with wave.open(str(out)) as wav:
        frames, rate = wav.getnframes(), wav.getframerate()
    assert frames * 2 + 44 == out.stat().st_size, f"the header says {frames} frames, the file holds other"
    length = f"{frames / rate:.2f} s in its header"
    if shutil.which("soxi"):
        soxi = subprocess.run(["soxi", "-d", str(out)], capture_output=True, text=True, check=False)
        length += f", soxi {soxi.stdout.strip()}"
    mp3 = curl(d, {**body, "response_format": "mp3"}, d.work / "curl.mp3", "--fail-with-body")
    assert mp3.returncode == 0 and (d.work / "curl.mp3").stat().st_size > 0, f"mp3: {mp3.stderr}"
    curl(d, {**body, "voice": "Nobody"}, d.work / "bad.json")
    error = json.loads((d.work / "bad.json").read_text())["error"]
    assert error["code"] == "unknown_voice" and "alloy" in error["message"], f"unknown voice: {error}"
    return f"wav {length}; mp3 streamed; an unknown voice is 400 unknown_voice naming the choices"


def door_openai(d: Daemon) -> str:
    try:
        import openai
    except ImportError:
        raise AssertionError("the openai SDK is not installed (pip install openai)") from None
    key = (d.work / "api.key").read_text().strip()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{d.http_port}/v1", api_key=key, max_retries=0, timeout=120)
    audio = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello from the SDK.", response_format="pcm")
    assert len(audio.content) > 0, "no audio"
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="Streamed.", response_format="mp3"
    ) as response:
        size = sum(len(piece) for piece in response.iter_bytes())
    assert size > 0, "no streamed mp3"
    models = [m.id for m in client.models.list()]
    assert not any(m.startswith("/") for m in models), f"/v1/models shows a path: {models}"
    return f"pcm {len(audio.content)} bytes; streamed mp3 {size} bytes; /v1/models: {', '.join(models[:2])}, ..."


def door_wyoming(d: Daemon) -> str:
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info
    from wyoming.tts import Synthesize

    async def talk() -> str:
        async with AsyncTcpClient("127.0.0.1", d.wyoming_port) as client:
            await client.write_event(Describe().event())
            event = await asyncio.wait_for(client.read_event(), 30)
            assert event is not None and Info.is_type(event.type), "no info for describe"
            voices = [v.name for program in Info.from_event(event).tts for v in program.voices]
            await client.write_event(Synthesize(text="Hello from Home Assistant.").event())
            kinds, samples = [], 0
            while True:
                event = await asyncio.wait_for(client.read_event(), 120)
                assert event is not None, "the server hung up"
                if AudioStart.is_type(event.type):
                    kinds.append("start")
                elif AudioChunk.is_type(event.type):
                    samples += len(AudioChunk.from_event(event).audio) // 2
                elif AudioStop.is_type(event.type):
                    kinds.append("stop")
                    break
                else:
                    raise AssertionError(f"unexpected {event.type}: {event.data}")
            assert kinds == ["start", "stop"] and samples > 0, f"{kinds}, {samples} samples"
            return f"describe lists {len(voices)} voices; synthesize streamed {samples / 24000:.2f} s of audio"

    return asyncio.run(talk())


def door_ha(watch: Watch) -> str:
    configs = {}
    deadline = time.monotonic() + 30
    while len(configs) < 6 and time.monotonic() < deadline:
        configs = {t: p for t, p in list(watch.lines) if t.startswith("homeassistant/") and t.endswith("/config") and p}
        time.sleep(0.1)
    assert len(configs) == 6, f"{len(configs)} discovery configs, not 6"
    device = json.loads(next(iter(configs.values())))["device"]
    assert not re.search(r"(^|\s)/", device["model"]), f"the device's model is a path: {device['model']}"
    return f"6 entities of device {device['name']!r}, model {device['model']!r}"


def door_say(work: Path, env: dict[str, str]) -> str:
    out = work / "say.wav"
    said = run([*CLI, "say", "Hello there.", "--model", str(work / "tiny"), "--out", str(out)], env, 300)
    assert said.returncode == 0, f"exit {said.returncode}: {tail(said.stderr)}"
    with wave.open(str(out)) as wav:
        seconds = wav.getnframes() / wav.getframerate()
    base = run([*CLI, "say", "Hello.", "--model", str(work / "base"), "--out", str(work / "b.wav")], env, 300)
    assert base.returncode != 0 and "no default voice" in base.stderr, f"a Base model without a voice: {base}"
    return f"wrote {seconds:.2f} s; a Base model without a voice says how to give it one"


def door_say_ctrl_c(work: Path, env: dict[str, str]) -> str:
    """``llm | s2s-daemon say -`` stopped with Ctrl-C while its writer is still at it: exit 130, what
    was made written, no interpreter abort (it was SIGABRT, ``_enter_buffered_busy``)."""
    out = work / "stdin.wav"
    proc = subprocess.Popen(
        [*CLI, "say", "-", "--model", str(work / "tiny"), "--out", str(out)],
        cwd=REPO,
        env={**env, "S2S_LOG__FORMAT": "json", "S2S_TTS__OPTIONS__MAX_FRAMES": MAX_FRAMES},
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdin is not None and proc.stderr is not None
    proc.stdin.write("The first sentence is here. And the second one is still being writ")
    proc.stdin.flush()
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not any("audio_started" in line for line in list(lines)):
        assert proc.poll() is None, f"exit {proc.returncode}: {tail(''.join(lines))}"
        assert time.monotonic() < deadline, "no audio_started within 300 s"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # its input stays open
    code = proc.wait(60)
    reader.join(10)
    proc.stdin.close()
    said = "".join(lines)
    assert "Fatal Python error" not in said, tail(said)
    assert code == 130 and "s2s-daemon: interrupted" in said, f"exit {code}: {tail(said)}"
    line = next(ln for ln in said.splitlines() if ln.startswith("s2s-daemon: interrupted"))
    return f"exit 130: {line.removeprefix('s2s-daemon: ')}"


def door_killed_build(work: Path, env: dict[str, str]) -> str:
    """A first start killed while it prepares its weights (Ctrl-C, a service manager's start
    timeout) must not hang the next one: ``say`` with a fresh prepared-weights folder, SIGKILL as
    soon as it holds the folder's build lock, then a start that must finish (the native kernels
    are built at install: nothing compiles at run time)."""
    cache = work / "prepared"
    out = str(work / "k.wav")
    args = [*CLI, "say", "Hello.", "--model", str(work / "tiny"), "--quantization", "int8", "--out", out]
    env = {**env, "S2S_TTS__OPTIONS__PREPARED_CACHE": str(cache)}
    first = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(cache.glob(".lock-*")) and first.poll() is None:
        assert time.monotonic() < deadline, "the first start never began to prepare its weights"
        time.sleep(0.02)
    killed = first.poll() is None
    if killed:
        os.killpg(first.pid, signal.SIGKILL)
    first.wait(10)
    began = time.monotonic()
    second = run(args, env, 600)
    assert second.returncode == 0, f"the start after the killed one: exit {second.returncode}: {tail(second.stderr)}"
    how = "killed while preparing its weights" if killed else "the first start finished before the kill"
    return f"{how}; the next start spoke in {time.monotonic() - began:.0f} s"


def door_base_run(work: Path, env: dict[str, str], timeout_s: float) -> str:
    """A Base model through the shipped configuration, as ``S2S_TTS__MODEL=... scripts/run`` runs it
    (``s2s-daemon run -c configs/default.yaml``, without the install): it used to load, then exit 78
    on ``voice: Ryan`` while check-config said valid."""
    base = Daemon(work, "base-run", env)
    base.env = {**env, "S2S_TTS__MODEL": str(work / "base"), "S2S_TTS__VOICES_DIR": str(work / "no-voices"),
                "S2S_MQTT__PORT": str(base.mqtt_port)}  # fmt: skip
    checked = run([*CLI, "check-config", "configs/default.yaml"], base.env)
    assert checked.returncode == 0, f"check-config: exit {checked.returncode}: {tail(checked.stderr)}"
    base.config = REPO / "configs" / "default.yaml"
    try:
        base.start()
        took = base.wait_ready(timeout_s)
        assert '"event": "no_default_voice"' in base.log(), "no no_default_voice warning"
    finally:
        code = base.stop()
    assert code == 0, f"SIGTERM: exit {code}: {tail(base.log())}"
    return f"check-config valid, ready after {took:.1f} s with no default voice (the warning), stopped 0"


def door_voices(work: Path, env: dict[str, str]) -> str:
    recording = work / "me.wav"
    if shutil.which("espeak-ng"):
        subprocess.run(
            ["espeak-ng", "-w", str(recording), "Good morning. This is my voice, recorded for a clone."], check=True
        )
    else:  # a voiced, varying tone: not silence
        import numpy as np

        t = np.arange(24000 * 4) / 24000
        audio = 0.3 * np.sin(2 * np.pi * (140 + 40 * np.sin(2 * np.pi * 3 * t)) * t)
        with wave.open(str(recording), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(24000)
            w.writeframes((audio * 32767).astype("<i2").tobytes())
    voices = ["voices", "--dir", str(work / "voices")]
    added = run([*CLI, *voices[:1], "add", "grandma", "--ref-audio", str(recording), *voices[1:]], env)
    assert added.returncode == 0, f"add: exit {added.returncode}: {tail(added.stderr)}"
    assert "cannot speak a clone voice" in added.stderr, "no hint that this CustomVoice model cannot clone"
    missing = run([*CLI, "voices", "add", "x", "--ref-audio", str(work / "nope.wav"), *voices[1:]], env)
    assert missing.returncode == 66 and "No such file" in missing.stderr, f"a missing file: {missing.stderr}"
    listed = run([*CLI, "voices", "list", *voices[1:]], env)
    assert "grandma\tclone" in listed.stdout, f"list: {listed.stdout}"
    renamed = run([*CLI, "voices", "rename", "grandma", "nana", *voices[1:]], env)
    assert renamed.returncode == 0, f"rename: {renamed.stderr}"
    removed = run([*CLI, "voices", "remove", "nana", *voices[1:]], env)
    assert removed.returncode == 0, f"remove: {removed.stderr}"
    return "add (with a hint: this model cannot clone), list, rename, remove; a missing file is 66"


def door_service(work: Path, env: dict[str, str]) -> str:
    if not sys.platform.startswith("linux"):
        out = run([*CLI, "service", "print"], env)
        assert out.returncode == 0, tail(out.stderr)
        return "the LaunchAgent renders"
    config = work / "service.yaml"
    config.write_text("site_id: kitchen\n")
    user = run([*CLI, "service", "print", "-c", str(config)], env)
    assert user.returncode == 0 and "ExecStart=" in user.stdout, f"user unit: {tail(user.stderr)}"
    system = run([*CLI, "service", "print", "--system", "-c", str(config)], env)
    if str(config).startswith(("/tmp/", "/var/tmp/")):
        assert "PrivateTmp=yes" in system.stderr, "a system unit under /tmp without a warning"
        return "user unit renders; a system unit under /tmp is warned about (PrivateTmp)"
    return "user and system units render"


def door_bench(work: Path, env: dict[str, str]) -> str:
    args = [*CLI, "bench", "--model", str(work / "tiny"), "--runs", "1", "--warmup", "0"]
    out = run([*args, "--max-frames", "4", "--texts", "short", "--no-progress"], env, 600)
    assert out.returncode == 0, f"exit {out.returncode}: {tail(out.stderr)}"
    assert "TTFA" in out.stdout, f"no table: {tail(out.stdout)}"
    return "one configuration measured, table printed"


def door_second_daemon(first: Daemon, env: dict[str, str]) -> str:
    assert first.proc is not None
    second = Daemon(first.work, "second", env)
    second.config.write_text(first.config.read_text())
    began = time.monotonic()
    second.start()
    assert second.proc is not None
    code = second.proc.wait(120)
    took = time.monotonic() - began
    log = second.log()
    assert code == 69, f"exit {code}: {tail(log)}"
    assert f"pid {first.proc.pid}" in log, f"the first daemon's pid is not named: {tail(log)}"
    assert "Traceback" not in log, "a traceback"
    reason = re.search(r"(journal\.path|mqtt\.port|http\.port|wyoming\.port): [^\n]{0,80}", log)
    return f"exit 69 after {took:.1f} s, naming pid {first.proc.pid}: {reason.group(0) if reason else ''}..."


def door_failed_stream(d: Daemon) -> str:
    """The issue's repro: a long input past ``tts.max_utterance_s`` (4 s), streamed."""
    body = {"model": "tts-1", "input": "This text runs past the time limit of one utterance. " * 8,
            "voice": "alloy", "response_format": "pcm", "stream_format": "audio"}  # fmt: skip
    done = curl(d, body, d.work / "cut.pcm")
    code = done.returncode
    assert code != 0, "curl exited 0: a stream that failed read as a whole file"
    if code == 18:
        assert "http_stream_failed" in d.log(), "curl exit 18, but the daemon logged no http_stream_failed"
        return f"curl exit 18 after {(d.work / 'cut.pcm').stat().st_size} bytes: the body never ended; logged"
    return f"curl exit {code}: {done.stderr.strip()}"


def door_rejected_interrupt(d: Daemon, watch: Watch) -> str:
    """A rejected request has no effect (issue 41): ``queue.max_pending: 1``, a0 speaking, a1 queued,
    an ``interrupt`` rejected ``queue_full`` stops nothing."""
    publish(d.mqtt_port, SAY, json.dumps({"id": "full-a0", "text": "A long first sentence that keeps speaking. " * 4}))
    deadline = time.monotonic() + 120
    while not [p for p in watch.json_on("/tts/started") if p.get("id") == "full-a0"]:
        assert time.monotonic() < deadline, "no tts/started for full-a0"
        time.sleep(0.05)
    publish(d.mqtt_port, SAY, json.dumps({"id": "full-a1", "text": "Queued behind it."}))
    publish(d.mqtt_port, SAY, json.dumps({"id": "i-full", "text": "Interrupt when full.", "interrupt": True}))
    rejected = watch.finished("i-full", 60)
    assert rejected["status"] == "rejected" and rejected["error"]["code"] == "queue_full", f"i-full: {rejected}"
    first = watch.finished("full-a0", 120)
    assert first["status"] != "interrupted", f"the rejected interrupt stopped full-a0: {first}"
    second = watch.finished("full-a1", 120)
    message = rejected["error"]["message"]
    return f"i-full rejected queue_full ({message!r}); full-a0 {first['status']}, full-a1 {second['status']}"


def door_pool(work: Path, env: dict[str, str], timeout_s: float) -> str:
    """Two daemons in one pool on mosquitto, the README's watcher on ``s2s/#`` (it makes the broker
    accept every hand-back): the first stopped hands its queue to the second, the second (the last
    member) stopped keeps its queue in its journal, restarted serves it. Every request once."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(binary).exists():
        return "skipped: no mosquitto (a pool needs an external broker: apt-get install mosquitto)"
    port = free_port()
    conf = work / "pool-mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n" + ("user root\n" if os.geteuid() == 0 else ""))
    broker = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    members: dict[str, Daemon] = {}
    watch: Watch | None = None
    try:
        assert wait_port(port, 10), "mosquitto did not listen"
        watch = Watch(port, ("s2s/#",))
        for site in ("pool-a", "pool-b"):
            member = Daemon(work, site, env, site_id=site, mqtt={"broker": "external", "port": port,
                            "shared_group": "speakers"}, http={"enabled": False}, wyoming={"enabled": False},
                            ha={"discovery": False})  # fmt: skip
            member.mqtt_port = port
            members[site] = member
            member.start()
        for member in members.values():
            member.wait_ready(timeout_s)
        ids = [f"pool-{n:02d}" for n in range(16)]
        for rid in ids:
            publish(port, "s2s/pool/tts/say", json.dumps({"id": rid, "text": "A pool request, long enough to wait."}))
        for site in ("pool-a", "pool-b"):  # the first hands back to the second; the second to nobody
            assert members[site].stop() == 0, f"{site}: SIGTERM: {tail(members[site].log())}"
        members["pool-b"].start()
        members["pool-b"].wait_ready(timeout_s)
        answers: dict[str, list[str]] = {}
        deadline = time.monotonic() + 300
        while len(answers) < len(ids) and time.monotonic() < deadline:
            answers = {}
            for topic, payload in list(watch.lines):
                if topic.endswith("/tts/finished"):
                    answer = json.loads(payload)
                    answers.setdefault(answer["id"], []).append(answer["status"])
            time.sleep(0.1)
        assert members["pool-b"].stop() == 0, f"pool-b: SIGTERM after its restart: {tail(members['pool-b'].log())}"
        lost = [rid for rid in ids if rid not in answers]
        twice = {rid: s for rid, s in answers.items() if len(s) > 1}
        assert not lost and not twice, f"lost {lost}, answered twice {twice}"
        handed = [json.loads(line) for m in members.values() for line in m.log().splitlines()
                  if '"pool_handed_back"' in line]  # fmt: skip
        taken = sum(int(h["taken"]) for h in handed)
        kept = sum(int(h["requests"]) - int(h["taken"]) for h in handed)
        statuses = sorted({s[0] for s in answers.values()})
        done = f"{len(ids)} requests answered once ({', '.join(statuses)})"
        return f"{done}; {taken} handed back and taken, {kept} kept for the restart (a watcher on s2s/#)"
    finally:
        for member in members.values():
            member.stop()
        if watch is not None:
            watch.stop()
        broker.terminate()
        broker.wait(10)


def door_signals(d: Daemon, watch: Watch) -> str:
    assert d.proc is not None
    publish(d.mqtt_port, SAY, json.dumps({"id": "newcomer-last", "text": "Still speaking when asked to stop. " * 6}))
    time.sleep(0.5)
    d.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    second = time.monotonic()
    d.proc.send_signal(signal.SIGINT)
    code = d.proc.wait(30)
    took = time.monotonic() - second
    assert code == 1 and took < 1.0, f"second Ctrl-C: exit {code} after {took:.2f} s"
    return f"a second Ctrl-C exited {code} after {took * 1000:.0f} ms"


def door_sigterm(d: Daemon, watch: Watch) -> str:
    assert d.proc is not None
    began = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(60)
    assert code == 0, f"SIGTERM: exit {code}: {tail(d.log())}"
    deadline = time.monotonic() + 5
    while "offline" not in watch.on("/status") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "offline" in watch.on("/status"), "no offline status"
    return f"SIGTERM drained and exited 0 in {time.monotonic() - began:.1f} s; status offline"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, files)")
    parser.add_argument("--timeout-s", type=float, default=300, help="longest wait for a daemon to be ready")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="s2s-newcomer-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    env.update(
        PYTHONUNBUFFERED="1",
        XDG_STATE_HOME=str(work / "state"),
        XDG_DATA_HOME=str(work / "data"),
        S2S_PREPARED_CACHE=str(work / "prepared"),
        S2S_VOICE_CACHE=str(work / "voice-cache"),
    )
    (work / "api.key").write_text("sk-newcomer-0123456789\n")  # at least 16 characters
    (work / "api.key").chmod(0o600)  # readable by others: the daemon warns
    doors = Doors()
    print(f"s2s-daemon newcomer pass in {work}", flush=True)
    for kind in ("custom_voice", "base"):
        made = run([sys.executable, "-m", "s2s_daemon.tools.make_checkpoint", str(work / ("tiny" if kind ==
                   "custom_voice" else "base")), "--size", "tiny", "--kind", kind], env)  # fmt: skip
        if made.returncode != 0:
            doors.report("checkpoint", False, tail(made.stderr))
            return 1
    daemon = Daemon(work, "daemon", env)
    doors.check("check-config", lambda: door_check_config(daemon, env))
    doors.check("devices", lambda: door_devices(env))
    watch: Watch | None = None
    try:
        daemon.start()
        doors.check("run", lambda: f"ready after {daemon.wait_ready(args.timeout_s):.1f} s (default.yaml)")
        watch = Watch(daemon.mqtt_port)
        w = watch
        doors.check("mqtt say", lambda: door_mqtt(daemon, w))
        doors.check("mqtt stream", lambda: door_stream(daemon, w))
        doors.check("mqtt stop", lambda: door_stop(daemon, w))
        doors.check("probes", lambda: door_probes(daemon))
        doors.check("http curl", lambda: door_curl(daemon))
        doors.check("http openai", lambda: door_openai(daemon))
        doors.check("wyoming", lambda: door_wyoming(daemon))
        doors.check("ha discovery", lambda: door_ha(w))
        doors.check("second daemon", lambda: door_second_daemon(daemon, env))
        doors.check("sigterm", lambda: door_sigterm(daemon, w))
    finally:
        daemon.stop()
        if watch is not None:
            watch.stop()
    doors.check("say", lambda: door_say(work, env))
    doors.check("say - ctrl-c", lambda: door_say_ctrl_c(work, env))
    doors.check("base via run", lambda: door_base_run(work, env, args.timeout_s))
    doors.check("killed build", lambda: door_killed_build(work, env))
    doors.check("voices", lambda: door_voices(work, env))
    doors.check("service", lambda: door_service(work, env))
    doors.check("bench", lambda: door_bench(work, env))
    doors.check("pool watcher", lambda: door_pool(work, env, args.timeout_s))
    cut = Daemon(
        work, "cut", env, tts={"max_utterance_s": 4, "options": {"max_frames": "400"}}, queue={"max_pending": 1}
    )
    watch = None
    try:
        cut.start()
        cut.wait_ready(args.timeout_s)
        watch = Watch(cut.mqtt_port)
        w = watch
        doors.check("http failure", lambda: door_failed_stream(cut))
        doors.check("full interrupt", lambda: door_rejected_interrupt(cut, w))
        doors.check("second ctrl-c", lambda: door_signals(cut, w))
    except AssertionError as exc:
        doors.report("http failure", False, f"its daemon did not start: {exc}")
    finally:
        cut.stop()
        if watch is not None:
            watch.stop()
    verdict = "every door ok" if not doors.failed else f"FAIL: {', '.join(doors.failed)}"
    print(f"{doors.count} doors: {verdict}" + (f" (scratch: {work})" if args.keep or doors.failed else ""))
    if not args.keep and not doors.failed:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not doors.failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
