"""The web page in a real browser: Debian's chromium, headless, driven by selenium through
chromedriver, against the daemon as a subprocess (the torch engine on the tiny Base checkpoint, a
real mosquitto). The page loads without console errors; the key is asked for; a voice added from an
uploaded file (and one recorded with the microphone: chromium's fake device) shows in the list and
in ``/v1/audio/voices``; "try it" plays in the browser as it streams and shows the text as the text
stage speaks it; the live view shows a request
sent over MQTT; the layout fits a phone. Screenshots of each part go to ``WEB_SCREENSHOTS`` (default:
a folder of this run, printed at the end); ``WEB_SCREENSHOTS=docs/images`` refreshes the docs' ones.

Without chromium (``apt-get install chromium chromium-driver``) these tests are skipped, except
under CI (``CI`` set), where scripts/test installs it and they must run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import DaemonProcess, write_config
from tests.support.wait import until_blocking

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
BASE = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "base"
REF_WAV = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "golden" / "ref_espeak_24k.wav"
REF_TEXT = "Good morning. This is a reference recording for voice cloning."
KEY = "sk-browser-test-0123"
MAX_FRAMES = 40
"""Random weights seldom end an utterance: at most 3.2 s of audio per request."""
NOTHING_YET = "\u2013"
"""What the page shows for a figure it does not have yet (an en dash)."""
WAIT_S = 60.0
"""Longest wait for the page to show something (a busy box runs the engine slowly)."""

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(300)]


def _browser_or_skip() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if not missing:
        return
    why = f"{', '.join(missing)} missing: apt-get install chromium chromium-driver (scripts/test does)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the browser tests: {why}")
    pytest.skip(why)


class Daemon:
    """The daemon subprocess and how to reach it."""

    def __init__(self, base_url: str, mqtt_port: int, log: Callable[[], str]) -> None:
        self.base_url = base_url
        self.mqtt_port = mqtt_port
        self.log = log

    def get(self, path: str) -> Any:
        request = urllib.request.Request(self.base_url + path, headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    _browser_or_skip()
    work = tmp_path_factory.mktemp("web")
    broker = Mosquitto(work)
    broker.start()
    port = free_port()
    key_file = work / "api.key"
    key_file.write_text(KEY + "\n")
    config = write_config(
        work / "daemon.yaml",
        broker.port,
        tts={
            "engine": "torch",
            "model": str(BASE),
            "voice": None,
            "voices_dir": str(work / "voices"),
            "chunk_frames": 2,
            "warmup": False,
            "options": {"max_frames": str(MAX_FRAMES), "voice_cache": str(work / "voice-cache")},
        },
        http={"enabled": True, "port": port, "api_key_file": str(key_file)},
        telemetry={"memory_interval_s": 1},
    )
    process = DaemonProcess(config, env={"OMP_NUM_THREADS": "1"})
    process.start()
    try:
        _wait_ready(process, port)
        yield Daemon(f"http://127.0.0.1:{port}", broker.port, process.log)
    finally:
        if process.proc is not None and process.proc.poll() is None:
            process.signal(signal.SIGTERM)
            try:
                process.proc.wait(30)
            except Exception:
                process.cleanup()
                raise
        broker.stop()


def _wait_ready(process: DaemonProcess, port: int, timeout_s: float = 240.0) -> None:
    """Until ``GET /ready`` answers 200 (the HTTP port listens while the model still loads)."""

    def ready() -> bool:
        assert process.proc is not None
        if process.proc.poll() is not None:
            raise AssertionError(f"the daemon exited {process.proc.returncode}: {process.log()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as answer:
                return answer.status == 200
        except OSError:  # not listening yet, or 503 while it loads (HTTPError is an OSError)
            return False

    try:
        until_blocking(ready, timeout_s, f"/ready on {port}", interval_s=0.2)
    except AssertionError as late:
        raise AssertionError(f"{late}: {process.log()[-2000:]}") from None


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    folder = Path(os.environ.get("WEB_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print(f"\nweb page screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def browser(daemon: Daemon) -> Iterator[WebDriver]:
    os.environ.setdefault("SE_AVOID_STATS", "true")  # selenium's usage statistics go nowhere
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",  # as root
        "--disable-dev-shm-usage",  # a container's small /dev/shm would crash its renderer
        "--window-size=1280,1000",
        "--autoplay-policy=no-user-gesture-required",
        "--use-fake-ui-for-media-stream",  # the microphone is allowed without a prompt
        "--use-fake-device-for-media-stream",  # and is chromium's test signal
        "--lang=en-US",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser: WebDriver, daemon: Daemon) -> Iterator[WebDriver]:
    """The page, signed in; after the test, the browser's console must hold no error."""
    if not browser.current_url.startswith(daemon.base_url):
        browser.get(daemon.base_url + "/")
        until(browser, lambda: browser.find_element(By.ID, "login").is_displayed())
        browser.find_element(By.ID, "login-key").send_keys(KEY)
        browser.find_element(By.CSS_SELECTOR, "#login-form button[type=submit]").click()
        until(browser, lambda: text_of(browser, "live-connection") == "· live")
    yield browser
    logged = browser.get_log("browser")  # type: ignore[no-untyped-call]  # selenium leaves it unannotated
    errors = [e for e in logged if e["level"] == "SEVERE"]
    assert not errors, errors


def until(driver: WebDriver, condition: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    try:
        # The page redraws its lists at its events: an element found a moment ago may be gone.
        wait = WebDriverWait(driver, timeout_s, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException])
        return wait.until(lambda _: condition())
    except TimeoutException:
        raise AssertionError(f"the page did not get there in {timeout_s} s: {condition}") from None


def click(driver: WebDriver, element_id: str) -> None:
    """Scroll the element to the middle of the window (as a person would, clear of the player bar), click it."""
    element = driver.find_element(By.ID, element_id)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    element.click()


def tab(driver: WebDriver, name: str) -> None:
    click(driver, f"tab-button-{name}")
    until(driver, lambda: driver.find_element(By.ID, f"tab-{name}").is_displayed())


def text_of(driver: WebDriver, element_id: str) -> str:
    """The element's text, shown or not (selenium's ``.text`` is empty on a hidden tab)."""
    return str(driver.find_element(By.ID, element_id).get_attribute("textContent"))


def choose(driver: WebDriver, select_id: str, value: str) -> bool:
    Select(driver.find_element(By.ID, select_id)).select_by_value(value)
    return True


def listed(driver: WebDriver, voice: str) -> bool:
    return bool(driver.find_elements(By.CSS_SELECTOR, f'#voice-list li[data-voice="{voice}"]'))


def add_voice_by_api(daemon: Daemon, name: str) -> None:
    """A voice for the tests that need one, whatever ran before them."""
    if name in {v["name"] for v in daemon.get("/api/voices")["voices"]}:
        return
    boundary = "s2s-test-boundary"
    audio = REF_WAV.read_bytes()
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\n{name}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="audio"; filename="ref.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + audio
        + f"\r\n--{boundary}--\r\n".encode()
    )
    request = urllib.request.Request(
        daemon.base_url + "/api/voices",
        data=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 201


# -- the tests ------------------------------------------------------------------------------


def test_the_page_asks_for_the_key_and_loads_without_console_errors(page: WebDriver, daemon: Daemon) -> None:
    assert page.find_element(By.ID, "login").is_displayed() is False
    until(page, lambda: "This base model speaks cloned voices" in text_of(page, "voices-summary"))
    assert "torch" in text_of(page, "engine-line")
    assert page.find_element(By.ID, "state-badge").text == "idle"


def test_a_voice_added_from_an_uploaded_file_is_listed(
    page: WebDriver, daemon: Daemon, shots: Path, tmp_path: Path
) -> None:
    audio, rate = soundfile.read(str(REF_WAV), dtype="float32")
    upload = tmp_path / "my voice.flac"
    soundfile.write(str(upload), np.stack([audio, audio], axis=1), rate, format="FLAC")
    tab(page, "voices")
    page.find_element(By.ID, "clone-name").send_keys("kitchen")
    page.find_element(By.ID, "clone-file").send_keys(str(upload))
    until(page, lambda: "length 3.9 s" in text_of(page, "clone-checks"))  # voices add's checks, before saving
    assert "no clipping" in text_of(page, "clone-checks")
    page.execute_script("arguments[0].scrollIntoView()", page.find_element(By.ID, "clone-card"))
    page.save_screenshot(str(shots / "web-voices-checks.png"))
    page.find_element(By.ID, "clone-text").send_keys(REF_TEXT)
    until(page, lambda: choose(page, "clone-language", "english"))
    click(page, "clone-submit")
    until(page, lambda: "Added kitchen" in text_of(page, "clone-result"))
    until(page, lambda: listed(page, "kitchen"))
    item = until(page, lambda: page.find_element(By.CSS_SELECTOR, '#voice-list li[data-voice="kitchen"]').text)
    assert "with transcript" in item and "english" in item
    assert "kitchen" in [v["id"] for v in daemon.get("/v1/audio/voices")["voices"]]
    page.execute_script("window.scrollTo(0, 0)")
    page.save_screenshot(str(shots / "web-voices.png"))


def test_a_voice_recorded_with_the_microphone(page: WebDriver, daemon: Daemon) -> None:
    tab(page, "voices")
    page.find_element(By.ID, "clone-name").send_keys("recorded")
    click(page, "record-button")
    until(page, lambda: float(text_of(page, "record-time").split()[0]) >= 3.5)
    click(page, "record-button")
    until(page, lambda: "length 3." in text_of(page, "clone-checks"))
    click(page, "clone-submit")
    until(page, lambda: "Added recorded" in text_of(page, "clone-result"))
    until(page, lambda: listed(page, "recorded"))
    assert "recorded" in [v["id"] for v in daemon.get("/v1/audio/voices")["voices"]]


def test_try_it_plays_in_the_browser_as_it_streams(page: WebDriver, daemon: Daemon, shots: Path) -> None:
    prepare_try(page, daemon, "mp3")
    text = page.find_element(By.ID, "try-text")
    text.clear()
    text.send_keys("Hello from the **browser** test, see [the docs](https://example.org/docs).")
    click(page, "try-speak")

    def stat(key: str) -> str:
        return stat_of(page, key)

    # what is spoken, shown under it: the text stage's words (POST /api/text)
    until(page, lambda: page.find_element(By.ID, "try-spoken").is_displayed())
    assert text_of(page, "try-spoken-text") == "Hello from the browser test, see the docs."
    assert text_of(page, "try-spoken-note") == "(prepared by the text stage)"

    until(page, lambda: stat("first-audio").endswith(" ms"))  # sound started while it streamed
    buffered = "const a = document.getElementById('player'); return a.buffered.length ? a.buffered.end(0) : 0"
    until(page, lambda: page.execute_script(buffered) > 0)  # the <audio> element got the audio
    until(page, lambda: page.execute_script("return document.getElementById('player').currentTime") > 0)  # played
    until(page, lambda: stat("rtf") != NOTHING_YET)  # the daemon's latency event for this request
    assert stat("status") == "received" and stat("engine-first").endswith(" ms")
    assert 0 < audio_s(page) <= MAX_FRAMES * 0.08
    request_id = stat("id")
    assert any(e["id"] == request_id for e in daemon.get("/api/status")["history"]["latency"])
    page.save_screenshot(str(shots / "web-try.png"))


def stat_of(driver: WebDriver, key: str) -> str:
    """A figure of "try it"."""
    return str(driver.find_element(By.CSS_SELECTOR, f'#try-stats [data-stat="{key}"]').get_attribute("textContent"))


def audio_s(driver: WebDriver) -> float:
    """Seconds of audio the daemon made for the request "try it" sent (random weights may end early)."""
    return float(stat_of(driver, "audio").split()[0])


def prepare_try(driver: WebDriver, daemon: Daemon, fmt: str = "mp3") -> None:
    add_voice_by_api(daemon, "kitchen")
    tab(driver, "voices")
    until(driver, lambda: listed(driver, "kitchen"))
    tab(driver, "try")
    until(driver, lambda: "kitchen" in [o.text for o in Select(driver.find_element(By.ID, "try-voice")).options])
    until(driver, lambda: choose(driver, "try-voice", "kitchen") and choose(driver, "try-format", fmt))


@pytest.mark.parametrize("fmt", ["wav", "pcm", "opus"])
def test_try_it_in_the_other_formats(page: WebDriver, daemon: Daemon, fmt: str) -> None:
    """wav and pcm stream through Web Audio, opus plays once whole; each ends in the <audio> element."""
    prepare_try(page, daemon, fmt)
    click(page, "try-speak")
    until(page, lambda: stat_of(page, "status") == "received")
    until(page, lambda: stat_of(page, "first-audio").endswith(" ms"))
    until(page, lambda: stat_of(page, "audio") != NOTHING_YET)  # the daemon's latency event
    duration = "return document.getElementById('player').duration"
    until(page, lambda: abs((page.execute_script(duration) or 0) - audio_s(page)) < 0.1)
    if fmt == "wav":  # asked for streamed (the API sends a wav whole otherwise): it plays as it is made
        request_id = stat_of(page, "id")
        answers = [json.loads(line) for line in daemon.log().splitlines() if '"http_speech"' in line]
        assert [a["stream_format"] for a in answers if a.get("request_id") == request_id] == ["audio"], answers


def test_try_it_on_the_daemons_speaker(page: WebDriver, daemon: Daemon) -> None:
    prepare_try(page, daemon)
    speaker = page.find_element(By.ID, "try-speaker")
    if not speaker.is_selected():
        click(page, "try-speaker")
    try:
        click(page, "try-speak")
        until(page, lambda: stat_of(page, "status") == "completed")
        assert stat_of(page, "rtf") != NOTHING_YET and stat_of(page, "first-out").endswith(" ms")
        request_id = stat_of(page, "id")
    finally:
        click(page, "try-speaker")
    recent = {e["id"] for e in daemon.get("/api/status")["history"]["latency"]}
    assert request_id in recent


def test_a_voice_is_played_renamed_and_removed(page: WebDriver, daemon: Daemon) -> None:
    add_voice_by_api(daemon, "spare")
    tab(page, "voices")
    until(page, lambda: listed(page, "spare"))

    def action(voice: str, name: str) -> None:
        def clicked() -> bool:  # the list is redrawn when the library changes: find the button afresh
            try:
                button = page.find_element(
                    By.CSS_SELECTOR, f'#voice-list li[data-voice="{voice}"] [data-action="{name}"]'
                )
                page.execute_script("arguments[0].scrollIntoView({block: 'center'})", button)
                button.click()
            except StaleElementReferenceException:
                return False
            return True

        until(page, clicked)

    action("spare", "play")
    until(page, lambda: "spare: first audio after" in text_of(page, "player-label"))
    action("spare", "rename")
    field = page.find_element(By.CSS_SELECTOR, '#voice-list li[data-voice="spare"] input')
    field.clear()
    field.send_keys("spare2")
    action("spare", "save")
    until(page, lambda: listed(page, "spare2") and not listed(page, "spare"))
    action("spare2", "remove")
    action("spare2", "remove")  # the second click confirms
    until(page, lambda: not listed(page, "spare2"))
    assert {"spare", "spare2"}.isdisjoint(v["name"] for v in daemon.get("/api/voices")["voices"])


def test_the_live_view_shows_a_request_sent_over_mqtt(page: WebDriver, daemon: Daemon, shots: Path) -> None:
    import paho.mqtt.publish

    add_voice_by_api(daemon, "kitchen")
    tab(page, "live")
    until(page, lambda: "CPU" in text_of(page, "live-engine"))
    say = {"id": "from-mqtt", "text": "Dinner is ready.", "voice": "kitchen", "language": "english"}
    paho.mqtt.publish.single("s2s/kitchen/tts/say", json.dumps(say), qos=1, port=daemon.mqtt_port)

    def cells() -> list[str]:  # read in one step: the table is redrawn at every event
        script = "const r = document.querySelector(arguments[0]); return r ? r.innerText : ''"
        return str(page.execute_script(script, '#live-recent tr[data-id="from-mqtt"]')).split()

    until(page, lambda: cells()[1:3] == ["mqtt", "completed"])
    row = " ".join(cells())
    assert re.search(r" \d+ ms [\d.]+ [\d.]+ s$", row), row  # first audio, RTF, seconds of audio
    until(page, lambda: text_of(page, "live-state") == "idle")
    # For the screenshot only (nothing is asserted on it): the memory plot gains a point a second
    # (telemetry.memory_interval_s: 1), and a line of a few points reads better than one dot.
    time.sleep(1.5)
    size = page.get_window_size()
    page.set_window_size(size["width"], 1400)  # the table below the plots too
    try:
        page.execute_script("window.scrollTo(0, 0)")
        page.save_screenshot(str(shots / "web-live.png"))
    finally:
        page.set_window_size(size["width"], size["height"])


def test_the_page_fits_a_phone(page: WebDriver, daemon: Daemon, shots: Path) -> None:
    size = page.get_window_size()
    page.set_window_size(390, 844)
    try:
        for name in ("voices", "try", "live"):
            tab(page, name)
            overflow = page.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{name}: {overflow} px wider than the screen"
            page.save_screenshot(str(shots / f"web-phone-{name}.png"))
    finally:
        page.set_window_size(size["width"], size["height"])


def test_the_daemon_logged_no_error(daemon: Daemon) -> None:
    errors = [line for line in daemon.log().splitlines() if '"level": "error"' in line or "Traceback" in line]
    assert not errors, errors
