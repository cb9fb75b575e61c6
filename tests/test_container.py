"""The container image's own files (container/): its configuration, its health check, its build context.

Building and running the image is scripts/container_check.sh (podman, minutes); these hold the
files to the daemon's configuration loader and to HTTP as the health check speaks it.
"""

from __future__ import annotations

import http.server
import importlib.util
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest

from s2s_daemon.config import DaemonConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
CONTAINER = ROOT / "container"
IMAGE_CONFIG = CONTAINER / "s2s-daemon.yaml"


@pytest.fixture
def healthcheck(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """container/healthcheck.py (the image's s2s-healthcheck), reading the image's configuration."""
    for name in [n for n in __import__("os").environ if n.startswith("S2S_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("S2S_CONFIG", str(IMAGE_CONFIG))
    spec = importlib.util.spec_from_file_location("s2s_healthcheck", CONTAINER / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Daemon(http.server.BaseHTTPRequestHandler):
    """Answers ``/ready`` with ``status`` (and counts the requests), anything else 404."""

    status: ClassVar[int] = 200
    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.asked.append(self.path)
        code = self.status if self.path == "/ready" else 404
        body = b'{"ready": true}' if code == 200 else b'{"ready": false, "waiting_for": ["model"]}'
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: no line per request on stderr
        pass


@pytest.fixture
def daemon() -> Iterator[int]:
    _Daemon.asked = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Daemon)
    thread = threading.Thread(target=server.serve_forever, name="test.ready", daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_image_configuration_opens_the_doors_and_keeps_state_in_the_volume() -> None:
    config = load_config(IMAGE_CONFIG, {})
    assert (config.http.enabled, config.http.host, config.http.port) == (True, "0.0.0.0", 5050)
    assert (config.wyoming.enabled, config.wyoming.host, config.wyoming.port) == (True, "0.0.0.0", 10200)
    assert config.wyoming.zeroconf is False
    assert config.tts.voices_dir == Path("/data/voices")


@pytest.mark.parametrize(("status", "code"), [(200, 0), (503, 1)])
def test_the_health_check_is_ready_on_200_only(
    healthcheck: ModuleType,
    daemon: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    status: int,
    code: int,
) -> None:
    monkeypatch.setattr(_Daemon, "status", status)
    monkeypatch.setenv("S2S_HTTP__PORT", str(daemon))  # the port as the daemon reads it
    assert healthcheck.main() == code
    assert _Daemon.asked == ["/ready"]
    out = capsys.readouterr().out
    assert f"http://127.0.0.1:{daemon}/ready {status}" in out
    if status != 200:
        assert '"waiting_for": ["model"]' in out  # the daemon's reason, for the health log


def test_the_health_check_fails_when_nothing_listens(
    healthcheck: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with http.server.HTTPServer(("127.0.0.1", 0), _Daemon) as closed:
        port = closed.server_address[1]
    monkeypatch.setenv("S2S_HTTP__PORT", str(port))
    assert healthcheck.main() == 1
    assert "Connection refused" in capsys.readouterr().out


def test_the_health_check_says_when_no_listener_serves_ready(
    healthcheck: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("S2S_HTTP__ENABLED", "false")
    assert healthcheck.main() == 1
    assert "no listener serves /ready" in capsys.readouterr().out


@pytest.mark.skipif("monitor" not in DaemonConfig.model_fields, reason="this daemon has no monitor listener")
def test_the_health_check_prefers_the_monitor_listener(
    healthcheck: ModuleType, daemon: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("S2S_MONITOR__ENABLED", "true")
    monkeypatch.setenv("S2S_MONITOR__PORT", str(daemon))
    monkeypatch.setenv("S2S_HTTP__PORT", "9")  # the speech API's port is not the one asked
    assert healthcheck.main() == 0
    assert _Daemon.asked == ["/ready"]


def test_the_build_context_lets_through_what_the_containerfile_copies() -> None:
    """.dockerignore keeps .venv and .git out of the context by naming only what is copied."""
    sources = [
        part
        for line in (CONTAINER / "Containerfile").read_text(encoding="utf-8").splitlines()
        if line.startswith("COPY ")
        for part in line.split()[1:-1]
        if not part.startswith("--")
    ]
    allowed = {
        line[1:] for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines() if line[:1] == "!"
    }
    assert sources
    for source in sources:
        assert any(source == entry or source.startswith(f"{entry}/") for entry in allowed), source
        assert (ROOT / source).exists(), source


def test_the_images_torch_is_the_one_the_project_is_tested_with() -> None:
    pinned = re.search(r"torch==([\d.]+)", (ROOT / "scripts" / "test").read_text(encoding="utf-8"))
    assert pinned is not None
    containerfile = (CONTAINER / "Containerfile").read_text(encoding="utf-8")
    assert f"ARG TORCH_VERSION={pinned.group(1)}\n" in containerfile
    build = (ROOT / "homeassistant" / "s2s_daemon" / "build.yaml").read_text(encoding="utf-8")
    assert f"torch=={pinned.group(1)}+cpu" in build
    scripts = (ROOT / "scripts" / "container_base.sh").read_text(encoding="utf-8")  # the aarch64 check's torch
    assert f"\nS2S_TORCH_VERSION={pinned.group(1)}  #" in scripts


def test_the_container_checks_settings_are_not_configuration_keys() -> None:
    """CI may export S2S_CONTAINER_* for scripts/container_check.sh; daemons it also starts must not
    take them for an unknown ``container`` section (exit 78)."""
    config = load_config(
        None, {"S2S_CONTAINER_BASE": "docker.io/library/debian:bookworm-slim", "S2S_CONTAINER_KEEP": "1"}
    )
    assert config == load_config(None, {})


def _torch_install() -> ModuleType:
    """container/torch_install.py, the image's torch installer, as a module."""
    spec = importlib.util.spec_from_file_location("torch_install", CONTAINER / "torch_install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TORCH_AARCH64_REQUIRES = [  # torch 2.13.0's Requires-Dist in PyPI's aarch64 wheel (a CUDA build)
    "filelock",
    "typing-extensions>=4.10.0",
    "setuptools>=77.0.3",
    "sympy>=1.13.3",
    "networkx>=2.5.1",
    "jinja2",
    "fsspec>=0.8.5",
    "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3;"
    ' platform_system == "Linux"',
    'cuda-bindings<14,>=13.0.3; platform_system == "Linux" and python_version < "3.15"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'nvidia-cusparselt-cu13==0.8.1; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
    'nvidia-nvshmem-cu13==3.4.5; platform_system == "Linux"',
    'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
    'optree>=0.13.0; extra == "optree"',
    'opt-einsum>=3.3; extra == "opt-einsum"',
    'pyyaml; extra == "pyyaml"',
]


def test_a_cpu_image_installs_torchs_requirements_but_triton_and_cudas_python_api() -> None:
    wanted = _torch_install().cpu_requirements(TORCH_AARCH64_REQUIRES)
    names = [re.split(r"[\[<>=;! ]", line, maxsplit=1)[0] for line in wanted]
    assert names == [
        "filelock",
        "typing-extensions",
        "setuptools",
        "sympy",
        "networkx",
        "jinja2",
        "fsspec",
        "cuda-toolkit",  # the NVIDIA libraries torch is linked against come from these, pruned after
        "nvidia-cudnn-cu13",
        "nvidia-cusparselt-cu13",
        "nvidia-nccl-cu13",
        "nvidia-nvshmem-cu13",
    ]
    assert wanted[7].endswith('; platform_system == "Linux"')  # the markers are left for pip
    assert _torch_install().requirement_name("Cuda_Bindings.x>=1") == "cuda-bindings-x"


def test_ldd_output_gives_the_files_the_loader_maps_and_the_missing(tmp_path: Path) -> None:
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.13").write_bytes(b"\0")
    ldd = (
        f"{tmp_path}/torch/_C.cpython-311-aarch64-linux-gnu.so:\n"
        "\tlinux-vdso.so.1 (0x0000ffff9b1c4000)\n"
        f"\tlibcudart.so.13 => {tmp_path}/torch/lib/../../nvidia/cu13/lib/libcudart.so.13 (0x0000ffff8d6a0000)\n"
        "\tlibcublasLt.so.13 => not found\n"
        "\tlibc.so.6 => /lib/aarch64-linux-gnu/libc.so.6 (0x0000ffff8d4f0000)\n"
        "\t/lib/ld-linux-aarch64.so.1 (0x0000ffff9b187000)\n"
    )
    found, missing = _torch_install().linked_libraries(ldd)
    assert (lib / "libcudart.so.13").resolve() in found
    assert Path("/lib/aarch64-linux-gnu/libc.so.6").resolve() in found
    assert missing == ["libcublasLt.so.13"]


def test_pruning_keeps_the_linked_libraries_and_the_packages_python(tmp_path: Path) -> None:
    nvidia = tmp_path / "nvidia"
    files = {
        "__init__.py": b"",
        "cu13/__init__.py": b"",
        "cu13/lib/libcublas.so.13": b"x" * 100,  # linked
        "cu13/lib/libcusolver.so.12": b"x" * 1000,  # opened only by torch's GPU linear algebra
        "cu13/include/cublas.h": b"x" * 10,
        "cudnn/lib/libcudnn.so.9": b"x" * 50,  # linked
        "cudnn/lib/libcudnn_engines_precompiled.so.9": b"x" * 5000,  # opened by cuDNN on a GPU
    }
    for name, data in files.items():
        (nvidia / name).parent.mkdir(parents=True, exist_ok=True)
        (nvidia / name).write_bytes(data)
    keep = {(nvidia / "cu13/lib/libcublas.so.13").resolve(), (nvidia / "cudnn/lib/libcudnn.so.9").resolve()}
    kept, removed = _torch_install().prune(nvidia, keep)
    left = sorted(str(p.relative_to(nvidia)) for p in nvidia.rglob("*") if p.is_file())
    assert left == ["__init__.py", "cu13/__init__.py", "cu13/lib/libcublas.so.13", "cudnn/lib/libcudnn.so.9"]
    assert (kept, removed) == (150, 6010)
    assert not (nvidia / "cu13" / "include").exists()  # emptied folders go too


def test_the_addon_builds_the_same_torch_installer() -> None:
    """The add-on's build sees only its own folder: it carries a copy of container/torch_install.py."""
    addon_copy = ROOT / "homeassistant" / "s2s_daemon" / "torch_install.py"
    assert addon_copy.read_bytes() == (CONTAINER / "torch_install.py").read_bytes()


def test_torchs_metadata_no_longer_requires_what_was_left_out() -> None:
    """pip resolves an installed torch's requirements again when the daemon is installed after it."""
    metadata = (
        "Metadata-Version: 2.4\nName: torch\nVersion: 2.13.0\n"
        + "".join(f"Requires-Dist: {line}\n" for line in TORCH_AARCH64_REQUIRES)
        + "\nRequires-Dist: triton, in the description, stays.\n"
    )
    kept = _torch_install().drop_requirements(metadata)
    assert "Requires-Dist: triton==" not in kept and "Requires-Dist: cuda-bindings" not in kept
    assert kept.partition("\n\n")[0].count("Requires-Dist:") == len(TORCH_AARCH64_REQUIRES) - 2
    assert kept.startswith("Metadata-Version: 2.4\nName: torch\n")
    assert kept.endswith("\n\nRequires-Dist: triton, in the description, stays.\n")
