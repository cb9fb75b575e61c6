"""What a user reads when something is off: one clear line in the daemon's own log format, naming
what to do, never a library's raw traceback or a C library's stray stderr line."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import io
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from s2s_daemon.errors import UnavailableError
from s2s_daemon.logs import configure_logging
from s2s_daemon.mqtt.broker import EmbeddedBroker
from tests.support.broker import free_port
from tests.support.daemon import REPO, DaemonProcess, write_config


def test_library_log_records_are_lines_of_the_json_log() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    logging.getLogger("amqtt.broker").error("No data from client", exc_info=ValueError("no data"))
    logging.getLogger("aiohttp.server").warning("something odd")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["logger"], e["level"], e["event"]) for e in lines] == [
        ("amqtt.broker", "error", "No data from client"),
        ("aiohttp.server", "warning", "something odd"),
    ]
    assert "ValueError: no data" in lines[0]["exception"]


async def test_an_embedded_broker_on_a_taken_port_says_so_in_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    configure_logging("json", "info")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UnavailableError) as refused:
            await EmbeddedBroker(port).start()
    message = str(refused.value)
    assert message.startswith(f"mqtt.port: the embedded broker cannot listen on 127.0.0.1:{port}")
    assert f"held by pid {os.getpid()}" in message
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.integration
async def test_a_second_daemon_without_journal_stops_before_its_model_with_one_line(tmp_path: Path) -> None:
    """Journal off, the embedded broker's port taken (by the first daemon): exit 69 naming the port
    and who holds it, before the model loads (the tone engine takes 120 s to load here), without
    amqtt's traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = write_config(
            tmp_path / "d.yaml",
            port,
            mqtt={"broker": "embedded"},
            journal={"enabled": False},
            tts={"options": {"load_s": "120"}},
        )
        second = DaemonProcess(path)
        second.start()
        try:
            assert await second.wait(60) == 69
        finally:
            second.cleanup()
    log = second.log()
    assert f"mqtt.port: cannot listen on 127.0.0.1:{port}: the port is in use by pid {os.getpid()}" in log
    assert "Traceback" not in log


# -- s2s-daemon devices without a device -----------------------------------------------------


def test_no_devices_says_what_to_install_or_start(tmp_path: Path) -> None:
    from s2s_daemon.audio.devices import no_devices_hint

    runtime = tmp_path / "run"
    (runtime / "pulse").mkdir(parents=True)
    plugins = tmp_path / "alsa-lib"
    plugins.mkdir()
    snd = tmp_path / "snd"
    nothing = no_devices_hint("linux", snd, {"XDG_RUNTIME_DIR": str(runtime)}, (str(plugins),))
    assert "no sound server for this user" in nothing[0] and "pipewire" in nothing[0]
    assert "audio.sink: wav" in nothing[-1]
    (runtime / "pulse" / "native").touch()  # a server runs, but ALSA cannot reach it
    assert "libasound2-plugins" in no_devices_hint("linux", snd, {"XDG_RUNTIME_DIR": str(runtime)}, (str(plugins),))[0]
    (plugins / "libasound_module_pcm_pulse.so").touch()
    snd.mkdir()
    (snd / "pcmC0D0p").touch()
    card = no_devices_hint("linux", snd, {}, (str(plugins),))
    assert "usermod -aG audio" in card[0]
    assert "System Settings" in no_devices_hint("darwin")[0]


def test_the_devices_command_prints_the_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from s2s_daemon.audio import devices
    from s2s_daemon.cli import main

    monkeypatch.setattr(devices, "list_devices", list)
    monkeypatch.setattr(devices, "no_devices_hint", lambda: ["start a sound server", "or use audio.sink: wav"])
    assert main(["devices"]) == 0
    assert capsys.readouterr().out == "no sound devices found\n  start a sound server\n  or use audio.sink: wav\n"


# -- ALSA's own lines ------------------------------------------------------------------------

ALSA_SNIPPET = """
import ctypes, ctypes.util
from s2s_daemon.logs import configure_logging
from s2s_daemon.audio.devices import portaudio
configure_logging("json", "info")
portaudio()  # what the speaker and `devices` load first
asound = ctypes.CDLL(ctypes.util.find_library("asound"))
handle = ctypes.c_void_p()
assert asound.snd_pcm_open(ctypes.byref(handle), b"no_such_pcm", 0, 0) < 0
"""


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ALSA is Linux's")
def test_alsa_lines_are_lines_of_the_log() -> None:
    """ALSA prints its errors from C (``ALSA lib pcm.c:8545:(snd_pcm_recover) underrun occurred``);
    once PortAudio is loaded they are events of the JSON log, their arguments filled in."""
    if ctypes.util.find_library("asound") is None:
        pytest.fail("libasound2 is not installed (scripts/test installs it with PortAudio)")
    result = subprocess.run(
        [sys.executable, "-c", ALSA_SNIPPET], capture_output=True, text=True, timeout=60, check=False, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert "ALSA lib" not in result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    alsa = [e for e in events if e["event"] == "alsa_message"]
    assert alsa and alsa[0]["message"] == "Unknown PCM no_such_pcm" and alsa[0]["level"] == "warning"
    assert alsa[0]["function"] == "snd_pcm_open_noupdate" and alsa[0]["where"].startswith("pcm.c:")


def test_c_formats_are_filled_from_raw_arguments() -> None:
    from s2s_daemon.audio.devices import format_c

    name = ctypes.create_string_buffer(b"hw:0")
    address = ctypes.addressof(name)
    assert format_c("cannot open %s (%d%%)", [address, 2**32 - 5]) == "cannot open hw:0 (-5%)"
    assert format_c("%s %s %s %s", [address, address, address]) == "%s %s %s %s"  # more than it reads
    assert format_c("no args", []) == "no args"


# amqtt leaves the transport of a session that never began open until the garbage collector closes it.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning")
async def test_a_port_probe_of_the_embedded_broker_is_not_an_error(capfd: pytest.CaptureFixture[str]) -> None:
    """A health check or ``nc -z`` connects and closes without an MQTT packet: amqtt logged an error
    and a warning for each."""
    configure_logging("json", "info")
    port = free_port()
    broker = EmbeddedBroker(port)
    await broker.start()
    try:
        for _ in range(3):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
        # A window, not a wait for something: amqtt's handler of a closed probe ends within a few
        # loop turns, and would have logged its error by then; nothing says that it did not.
        await asyncio.sleep(0.3)
    finally:
        await broker.stop()
        gc.collect()  # amqtt's leaked transports go now, under this test's filter
    err = capfd.readouterr().err
    assert "No data to decode" not in err and '"level": "error"' not in err, err
