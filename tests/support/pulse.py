"""A private PulseAudio server with null sinks, for tests that open real audio devices.

``PulseServer`` starts ``pulseaudio`` as the current user with its own
``XDG_RUNTIME_DIR``/``HOME`` and an anonymous unix socket, and loads two null sinks:

- ``spk``: the default sink; what the daemon plays lands here, ``spk.monitor`` records it.
- ``mic``: a sink whose monitor is the default source; what a test plays into ``mic``
  is what the microphone (PortAudio's ``pulse`` device) hears.

A null sink is clocked by its own thread, which renders as far ahead as the lowest
latency any of its streams asks for, and 2 s when none asks. PortAudio's ALSA ``pulse``
device asks for none, so a lone PortAudio stream would be served in 2 s bursts (its
callbacks stall, its timestamps lie). The server therefore keeps one ``parec`` with a
10 ms latency on each monitor for its whole life, as a real sound card's clock would.

``PULSE_SERVER`` in this process's environment points at it, and PortAudio is
re-initialised so that its ``pulse`` device reaches this server. Child processes get
the same environment from :meth:`PulseServer.env`.

Fixtures: ``pulse_server`` (session scoped; skips with a clear reason only when the
``pulseaudio`` binary is missing). Use it from a test module with
``from tests.support.pulse import pulse_server  # noqa: F401``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from tests.support.wait import until_blocking

SPEAKER_SINK = "spk"
MIC_SINK = "mic"
SPEAKER_RATE_HZ = 44_100
"""Rate of the ``spk`` null sink: the rate PortAudio's ``pulse`` device opens at, so no
resampling happens inside PulseAudio on the way to the monitor."""
MIC_RATE_HZ = 16_000

MISSING_REASON = "pulseaudio is not installed (apt-get install pulseaudio libportaudio2 libasound2-plugins)"


def pulse_available() -> bool:
    return shutil.which("pulseaudio") is not None and shutil.which("pactl") is not None


class PulseServer:
    """One ``pulseaudio`` process with the ``spk`` and ``mic`` null sinks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runtime_dir = root / "runtime"
        self.socket = self.runtime_dir / "native"
        self.process: subprocess.Popen[bytes] | None = None
        self._keepers: list[subprocess.Popen[bytes]] = []

    @property
    def server(self) -> str:
        return f"unix:{self.socket}"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a child process that should use this server."""
        env = dict(os.environ)
        env.update(
            XDG_RUNTIME_DIR=str(self.runtime_dir),
            PULSE_SERVER=self.server,
        )
        env.update(extra)
        return env

    def start(self, timeout_s: float = 15.0) -> None:
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        self.runtime_dir.chmod(0o700)
        home = self.root / "home"
        home.mkdir(exist_ok=True)
        env = dict(os.environ)
        env.update(XDG_RUNTIME_DIR=str(self.runtime_dir), HOME=str(home))
        env.pop("PULSE_SERVER", None)
        args = [
            "pulseaudio",
            "-n",
            "--daemonize=no",
            "--exit-idle-time=-1",
            "--use-pid-file=no",
            "--disallow-exit",
            "--log-target=stderr",
            "--log-level=error",
            "-L",
            f"module-native-protocol-unix auth-anonymous=1 socket={self.socket}",
            "-L",
            f"module-null-sink sink_name={SPEAKER_SINK} rate={SPEAKER_RATE_HZ}",
            "-L",
            f"module-null-sink sink_name={MIC_SINK} rate={MIC_RATE_HZ}",
        ]
        log = (self.root / "pulseaudio.log").open("wb")
        self.process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        process = self.process

        def up() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"pulseaudio exited: {(self.root / 'pulseaudio.log').read_text(errors='replace')}")
            return self.socket.exists() and self.pactl("info", check=False).returncode == 0

        until_blocking(up, timeout_s, "pulseaudio answering", interval_s=0.05)
        self.pactl("set-default-sink", SPEAKER_SINK)
        self.pactl("set-default-source", f"{MIC_SINK}.monitor")
        for sink in (SPEAKER_SINK, MIC_SINK):
            self._keepers.append(
                subprocess.Popen(
                    ["parec", "-d", f"{sink}.monitor", "--raw", "--latency-msec=10"],
                    env=self.env(),
                    stdout=subprocess.DEVNULL,
                )
            )
        until_blocking(lambda: self.recording_streams() >= len(self._keepers), timeout_s, "the keepers recording")

    def recording_streams(self) -> int:
        """How many recording streams (``parec``...) the server has."""
        listed = self.pactl("list", "short", "source-outputs", check=False)
        return len(listed.stdout.splitlines()) if listed.returncode == 0 else 0

    def pactl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["pactl", *args], env=self.env(), capture_output=True, text=True, timeout=10, check=check)

    def stop(self) -> None:
        for keeper in self._keepers:
            keeper.terminate()
            keeper.wait(timeout=5)
        self._keepers.clear()
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process = None

    @contextlib.contextmanager
    def activated(self) -> Iterator[PulseServer]:
        """Point this process (and PortAudio in it) at the server; restore on exit."""
        saved = {k: os.environ.get(k) for k in ("PULSE_SERVER", "XDG_RUNTIME_DIR")}
        os.environ["PULSE_SERVER"] = self.server
        os.environ["XDG_RUNTIME_DIR"] = str(self.runtime_dir)
        reinit_portaudio()
        try:
            yield self
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            reinit_portaudio()

    # --- play into the microphone / record the speaker --------------------------------

    def play_into_mic(self, wav: Path) -> subprocess.Popen[bytes]:
        """Start ``paplay`` of a WAV into the ``mic`` sink (what the microphone hears)."""
        return subprocess.Popen(["paplay", "-d", MIC_SINK, str(wav)], env=self.env())

    def record(self, source: str, rate_hz: int) -> Recorder:
        return Recorder(self, source, rate_hz)


class Recorder:
    """``parec`` of one source as mono float32, in a background reader thread."""

    def __init__(self, server: PulseServer, source: str, rate_hz: int) -> None:
        self.rate_hz = rate_hz
        self._parts: list[bytes] = []
        self._proc = subprocess.Popen(
            [
                "parec",
                "-d",
                source,
                "--raw",
                "--format=float32le",
                f"--rate={rate_hz}",
                "--channels=1",
                "--latency-msec=20",
            ],
            env=server.env(),
            stdout=subprocess.PIPE,
        )
        self._thread = threading.Thread(target=self._read, name="parec-reader", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        while True:
            block = self._proc.stdout.read1(65536)
            if not block:
                return
            self._parts.append(block)

    def seconds(self) -> float:
        """Seconds of audio recorded so far."""
        return sum(len(part) for part in self._parts) / 4 / self.rate_hz

    def samples(self) -> npt.NDArray[np.float32]:
        data = b"".join(self._parts)
        usable = len(data) - len(data) % 4
        return np.frombuffer(data[:usable], dtype="<f4").astype(np.float32)

    def stop(self) -> npt.NDArray[np.float32]:
        self._proc.terminate()
        self._proc.wait(timeout=5)
        self._thread.join(timeout=5)
        assert self._proc.stdout is not None
        self._proc.stdout.close()
        return self.samples()


def reinit_portaudio() -> None:
    """Make PortAudio enumerate devices again (its list is fixed at initialisation)."""
    import sounddevice as sd

    sd._terminate()
    sd._initialize()


def write_wav_int16(path: Path, samples: npt.NDArray[np.float32], rate_hz: int) -> None:
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate_hz)
        out.writeframes(pcm.tobytes())


def read_wav(path: Path) -> tuple[npt.NDArray[np.float32], int]:
    with wave.open(str(path), "rb") as wav:
        assert wav.getsampwidth() == 2 and wav.getnchannels() == 1
        rate = wav.getframerate()
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    return (pcm.astype(np.float32) / 32768.0), rate


def espeak_speech(path: Path, text: str, rate_hz: int = MIC_RATE_HZ) -> npt.NDArray[np.float32]:
    """Real synthetic speech from espeak-ng, converted by sox to mono int16 at ``rate_hz``."""
    raw = path.with_suffix(".espeak.wav")
    subprocess.run(["espeak-ng", "-w", str(raw), text], check=True, timeout=30, capture_output=True)
    subprocess.run(
        ["sox", str(raw), "-r", str(rate_hz), "-c", "1", "-b", "16", str(path)],
        check=True,
        timeout=30,
        capture_output=True,
    )
    samples, rate = read_wav(path)
    assert rate == rate_hz
    return samples


def speech_bounds(samples: npt.NDArray[np.float32], rate_hz: int, window_ms: float = 10.0) -> tuple[float, float]:
    """Seconds of the first and last 10 ms window whose RMS exceeds 2 % of the peak RMS."""
    win = int(rate_hz * window_ms / 1000)
    n = len(samples) // win
    rms = np.sqrt(np.mean(samples[: n * win].reshape(n, win) ** 2, axis=1))
    loud = np.nonzero(rms > 0.02 * rms.max())[0]
    return float(loud[0] * win / rate_hz), float((loud[-1] + 1) * win / rate_hz)


def locate(haystack: npt.NDArray[np.float32], needle: npt.NDArray[np.float32]) -> tuple[int, float]:
    """Offset of ``needle`` in ``haystack`` by FFT cross-correlation (negative when the
    needle begins before the haystack does), and the normalised correlation there."""
    n = len(haystack) + len(needle)
    size = 1 << (n - 1).bit_length()
    corr = np.fft.irfft(np.fft.rfft(haystack, size) * np.conj(np.fft.rfft(needle, size)), size)
    # Lags 0..len(haystack)-1 sit at the front, negative lags wrap around to the end.
    lags = np.concatenate([np.arange(len(haystack)), np.arange(-(len(needle) - 1), 0)])
    values = np.concatenate([corr[: len(haystack)], corr[size - (len(needle) - 1) :]])
    offset = int(lags[int(np.argmax(values))])
    lo, hi = max(0, offset), min(len(haystack), offset + len(needle))
    segment = haystack[lo:hi]
    reference = needle[lo - offset : hi - offset]
    denom = float(np.linalg.norm(segment) * np.linalg.norm(reference)) or 1.0
    return offset, float(np.dot(segment, reference) / denom)


@pytest.fixture(scope="session")
def pulse_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulseServer]:
    """A running private PulseAudio server, active in this process for the session."""
    if not pulse_available():
        pytest.skip(MISSING_REASON)
    root = Path(tempfile.mkdtemp(prefix="pulse-", dir=tmp_path_factory.getbasetemp()))
    server = PulseServer(root)
    server.start()
    try:
        with server.activated():
            yield server
    finally:
        server.stop()
