"""A model that cannot be had now exits 69 (retried by the service manager); a wrong one exits 78.

Each test runs the real CLI (``python -m s2s_daemon say``) as a subprocess with an empty hub cache
(``HF_HOME``) and a hub endpoint (``HF_ENDPOINT``) on this machine: a closed port stands for a box
whose network is not up yet, a small HTTP server for a hub that answers 404 or 503. Nothing is
downloaded, even on a machine with internet.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from s2s_daemon.errors import EXIT_CONFIG, EXIT_UNAVAILABLE

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "qwen3_tiny" / "custom_voice"
HUB_ID = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
ENGINES = [
    pytest.param("torch", marks=pytest.mark.torch, id="torch"),
    pytest.param("mlx", marks=pytest.mark.mlx, id="mlx"),
]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(tmp_path: Path, engine: str, model: str, endpoint: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "S2S_", "HUGGINGFACE"))}
    clean.update(
        HF_HOME=str(tmp_path / "hf"),
        HF_ENDPOINT=endpoint,
        **env,
    )
    command = [sys.executable, "-m", "s2s_daemon", "say", "hi", "--engine", engine, "--model", model]
    return subprocess.run(
        [*command, "--out", str(tmp_path / "x.wav")],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("s2s-daemon: ")]
    assert lines, done.stderr[-2000:]
    return lines[-1]


@pytest.fixture
def fake_hub() -> Iterator[tuple[str, list[int]]]:
    """An HTTP hub at the returned URL whose every answer is ``status[0]`` (404 says RepoNotFound)."""
    status = [404]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status[0])
            if status[0] == 404:
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("X-Error-Message", "Repository not found")
            self.send_header("Content-Type", "application/json")
            body = b'{"error": "test hub"}'
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving = threading.Thread(target=server.serve_forever, name="test.fake_hub", daemon=True)
    serving.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", status
    finally:
        server.shutdown()
        serving.join(5)
        server.server_close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_hub_id_without_network_exits_unavailable(tmp_path: Path, engine: str) -> None:
    done = _say(tmp_path, engine, HUB_ID, f"http://127.0.0.1:{_closed_port()}")
    line = _error_line(done)
    assert done.returncode == EXIT_UNAVAILABLE, done.stderr[-2000:]
    assert line.startswith("s2s-daemon: tts.model: cannot download ")
    assert "the hub cannot be reached (ConnectError" in line
    assert str(tmp_path / "hf" / "hub") in line  # the cache that was searched
    assert "check the network" in line and "local checkpoint folder" in line
    assert "python -m s2s_daemon.tools.make_checkpoint DIR --size tiny --kind custom_voice" in line
    assert "offline=" not in done.stderr and "local_files_only" not in line
    assert "native_kernels" not in done.stderr


@pytest.mark.parametrize("engine", ENGINES)
def test_offline_mode_without_a_cached_copy_exits_unavailable(tmp_path: Path, engine: str) -> None:
    done = _say(tmp_path, engine, HUB_ID, f"http://127.0.0.1:{_closed_port()}", HF_HUB_OFFLINE="1")
    line = _error_line(done)
    assert done.returncode == EXIT_UNAVAILABLE, done.stderr[-2000:]
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in line
    assert "has no complete copy" in line and "download it once with the network up" in line
    assert "offline=" not in done.stderr and "HF_HUB_OFFLINE=0" not in line


@pytest.mark.parametrize("engine", ENGINES)
def test_a_hub_that_answers_503_exits_unavailable(tmp_path: Path, engine: str, fake_hub: tuple[str, list[int]]) -> None:
    url, status = fake_hub
    status[0] = 503
    done = _say(tmp_path, engine, HUB_ID, url)
    assert done.returncode == EXIT_UNAVAILABLE, done.stderr[-2000:]
    assert "the hub answered HTTP 503" in _error_line(done)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_hub_id_the_hub_does_not_know_exits_config(
    tmp_path: Path, engine: str, fake_hub: tuple[str, list[int]]
) -> None:
    """A typo in the id: retrying cannot make the hub grow the repository, so it is configuration."""
    url, _ = fake_hub
    done = _say(tmp_path, engine, "someone/no-such-model", url)
    line = _error_line(done)
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert line.startswith("s2s-daemon: tts.model: the hub has no model 'someone/no-such-model'")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_folder_that_is_not_a_checkpoint_exits_config_before_any_kernel_build(tmp_path: Path, engine: str) -> None:
    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello\n")
    done = _say(tmp_path, engine, str(folder), f"http://127.0.0.1:{_closed_port()}")
    line = _error_line(done)
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert line.startswith("s2s-daemon: tts.model: ") and "config.json" in line
    assert "native_kernels" not in done.stderr
    assert not (tmp_path / "ext").exists()  # no build folder was even made


@pytest.mark.torch
def test_a_wrong_model_type_exits_config_before_any_kernel_build(tmp_path: Path) -> None:
    """config.json is parsed before the kernels: a non-Qwen3-TTS checkpoint fails in seconds."""
    import json
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "qwen2"
    (folder / "config.json").write_text(json.dumps(config))
    done = _say(tmp_path, "torch", str(folder), f"http://127.0.0.1:{_closed_port()}")
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert "model_type" in _error_line(done)
    assert not (tmp_path / "ext").exists()
