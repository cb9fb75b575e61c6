"""The README's Quick start, as a newcomer types it: ``configs/default.yaml`` (embedded broker),
the tiny checkpoint, and mosquitto's own command-line clients (QoS 0, connect-publish-disconnect).

Only the port (a free one instead of 1883), the model (the tiny fixture instead of the hub) and
the sink (discard) differ from the README's commands.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.broker import free_port, wait_port
from tests.support.daemon import REPO
from tests.support.wait import until_blocking

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.timeout(120)]

TINY = REPO / "tests" / "fixtures" / "qwen3_tiny" / "custom_voice"


class Sub:
    """``mosquitto_sub -V mqttv311 -v -t TOPIC``, its lines collected as (topic, payload)."""

    def __init__(self, port: int, topic: str) -> None:
        self.proc = subprocess.Popen(
            ["mosquitto_sub", "-V", "mqttv311", "-p", str(port), "-v", "-t", topic],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[str, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            topic, _, payload = line.rstrip("\n").partition(" ")
            self.lines.append((topic, payload))

    def on(self, suffix: str) -> list[str]:
        return [payload for topic, payload in list(self.lines) if topic.endswith(suffix)]

    def wait(self, predicate: Callable[[], object], timeout_s: float) -> bool:
        try:
            until_blocking(predicate, timeout_s)
        except AssertionError:
            return False
        return True

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)
        self._reader.join(5)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def quick_start_daemon(tmp_path: Path) -> Iterator[int]:
    if shutil.which("mosquitto_pub") is None:
        pytest.fail("mosquitto-clients is not installed (scripts/test installs it)")
    port = free_port()
    env = {
        **os.environ,
        "S2S_MQTT__PORT": str(port),
        "S2S_TTS__MODEL": str(TINY),
        "S2S_AUDIO__SINK": "discard",
        "S2S_LOG__FORMAT": "json",
        "PYTHONUNBUFFERED": "1",
        "XDG_STATE_HOME": str(tmp_path / "state"),  # its own request journal, not the home's
    }
    log_path = tmp_path / "daemon.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "s2s_daemon", "run", "-c", "configs/default.yaml"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_port(port, 60)
        yield port
    finally:
        proc.terminate()
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        assert code == 0, log_path.read_text(errors="replace")


def mosquitto_pub(port: int, *args: str) -> None:
    subprocess.run(["mosquitto_pub", "-V", "mqttv311", "-p", str(port), *args], check=True, timeout=10)


def test_quick_start_qos0_publish_is_spoken_with_a_subscriber_watching(quick_start_daemon: int) -> None:
    port = quick_start_daemon
    watch = Sub(port, "s2s/#")  # the README's `mosquitto_sub -v -t 's2s/#' &`
    try:
        assert watch.wait(lambda: "online" in watch.on("/status"), 30)
        for i in range(5):
            mosquitto_pub(port, "-t", "s2s/default/tts/say", "-m", f"Hello from the kitchen, number {i}.")
        assert watch.wait(lambda: len(watch.on("/tts/finished")) == 5, 60), watch.lines
        finished = [json.loads(p) for p in watch.on("/tts/finished")]
        assert {f["status"] for f in finished} == {"completed"}
        assert all(f["audioMs"] > 0 for f in finished)
        # each say arrived at the broker once and was seen by the watcher too
        assert len(watch.on("/tts/say")) == 5
    finally:
        watch.stop()


def test_retained_messages_go_only_to_subscribers_and_once(quick_start_daemon: int) -> None:
    port = quick_start_daemon
    first = Sub(port, "s2s/#")
    try:
        assert first.wait(lambda: first.on("/status") and first.on("/info") and first.on("/state"), 30)
        second = Sub(port, "s2s/#")  # another subscriber to the same filter joins later
        # a client that never subscribes (it only listens to a topic nobody publishes)
        bystander = Sub(port, "elsewhere/nothing")
        try:
            assert second.wait(lambda: second.on("/status") and second.on("/info") and second.on("/state"), 10)
            # Markers published now come after anything the broker still had to send them.
            mosquitto_pub(port, "-t", "s2s/test/marker", "-m", "marker")
            mosquitto_pub(port, "-t", "elsewhere/nothing", "-m", "marker")
            for sub in (first, second, bystander):
                assert sub.wait(lambda sub=sub: sub.on("/marker") or sub.on("elsewhere/nothing"), 10), sub.lines
            for suffix in ("/status", "/info", "/state"):
                assert len(second.on(suffix)) == 1, (suffix, second.lines)
                assert len(first.on(suffix)) == 1, (suffix, first.lines)
            assert bystander.lines == [("elsewhere/nothing", "marker")]
        finally:
            second.stop()
            bystander.stop()
    finally:
        first.stop()
