"""Install torch into the image's virtual environment, and for a CPU image only what a CPU uses.

    python3 torch_install.py VARIANT TORCH_SPEC [PIP_ARGS...]

VARIANT ``cpu`` (the image runs on the CPU) or a CUDA tag (``cu130``: torch as pip installs it).
On the CPU, torch is installed without its dependencies, then with those a CPU needs: triton
(torch.compile's GPU code generator) and cuda-bindings (CUDA's Python API) are left out, and
torch's installed metadata no longer requires them (a later ``pip install`` of something that
requires torch, such as the daemon, would bring them back: pip resolves an installed
distribution's requirements again). A torch
that is a CUDA build (PyPI's aarch64 torch is: a CPU build is on PyTorch's CPU index only) is
linked against NVIDIA's libraries, which the dynamic loader maps when ``import torch`` runs, GPU or
not: those libraries are installed, and every other file of the NVIDIA packages (the libraries
torch opens only on a GPU, such as cuDNN's engines and cuSOLVER; static libraries, headers) is
removed. ``ldd`` on torch's extension module is the list of what the loader maps.

The same file is ``container/torch_install.py`` (the container image) and
``homeassistant/s2s_daemon/torch_install.py`` (the add-on, whose build sees only its own folder);
tests/test_container.py holds them equal.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

LEFT_OUT_ON_CPU = frozenset({"triton", "cuda-bindings", "cuda-pathfinder"})
"""torch's requirements that a CPU never loads (names as PEP 503 normalises them)."""


def requirement_name(requirement: str) -> str:
    """The PEP 503 name of a requirement line (``cuda-toolkit[cublas]==13.0.3; ...`` -> cuda-toolkit)."""
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if found is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", found.group(1)).lower()


def cpu_requirements(requires: Iterable[str]) -> list[str]:
    """torch's requirements a CPU image installs: not an extra's, not one a CPU never loads.
    Their environment markers are left for pip to evaluate."""
    return [
        line
        for line in requires
        if not re.search(r"\bextra\s*==", line) and requirement_name(line) not in LEFT_OUT_ON_CPU
    ]


def drop_requirements(metadata: str) -> str:
    """A distribution's METADATA without the ``Requires-Dist`` lines that ``cpu_requirements`` leaves out
    (in its header: the description after the first blank line is left as it is)."""
    header, blank, description = metadata.partition("\n\n")
    prefix = "Requires-Dist:"
    kept = [
        line
        for line in header.split("\n")
        if not (
            line.startswith(prefix)
            and not re.search(r"\bextra\s*==", line)
            and requirement_name(line[len(prefix) :]) in LEFT_OUT_ON_CPU
        )
    ]
    return "\n".join(kept) + blank + description


def linked_libraries(ldd_output: str) -> tuple[set[Path], list[str]]:
    """The files ``ldd`` says the loader maps (real paths), and the libraries it cannot find."""
    found: set[Path] = set()
    missing: list[str] = []
    for line in ldd_output.splitlines():
        name, arrow, target = line.strip().partition(" => ")
        if not arrow:
            continue
        if target.startswith("not found"):
            missing.append(name)
        elif target.startswith("/"):
            found.add(Path(target.split(" (")[0]).resolve())
    return found, missing


def prune(folder: Path, keep: set[Path]) -> tuple[int, int]:
    """Remove every file under ``folder`` except those in ``keep`` and the Python files (the packages'
    ``__init__.py``); returns (bytes kept, bytes removed)."""
    kept = removed = 0
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        size = path.stat().st_size
        if path.resolve() in keep or path.suffix == ".py":
            kept += size
        else:
            path.unlink()
            removed += size
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return kept, removed


def torch_ldd(site_packages: Path, run: Callable[[list[str]], str]) -> str:
    """``ldd`` of what ``import torch`` loads: its extension module and libtorch_global_deps."""
    files = [*sorted((site_packages / "torch").glob("_C.*.so")), site_packages / "torch/lib/libtorch_global_deps.so"]
    return run(["ldd", *(str(f) for f in files if f.exists())])


def pip(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", *args], check=True)


def ldd(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 64
    variant, spec, pip_args = argv[0], argv[1], argv[2:]
    if variant != "cpu":
        pip([*pip_args, spec])
        return 0
    pip(["--no-deps", *pip_args, spec])
    torch = importlib.metadata.distribution("torch")
    requires = cpu_requirements(torch.requires or [])
    if requires:
        pip([*pip_args, *requires])
    metadata = next(Path(str(torch.locate_file(f))) for f in torch.files or [] if f.name == "METADATA")
    metadata.write_text(drop_requirements(metadata.read_text(encoding="utf-8")), encoding="utf-8")
    site_packages = Path(str(torch.locate_file("")))
    nvidia = site_packages / "nvidia"
    if nvidia.is_dir():
        keep, missing = linked_libraries(torch_ldd(site_packages, ldd))
        if missing:
            print(f"torch_install: torch's libraries need {', '.join(missing)}: not installed", file=sys.stderr)
            return 1
        kept, removed = prune(nvidia, keep)
        _, missing = linked_libraries(torch_ldd(site_packages, ldd))
        if missing:
            print(f"torch_install: pruning removed {', '.join(missing)}", file=sys.stderr)
            return 1
        print(
            f"torch_install: a CUDA build of torch on the CPU: kept the NVIDIA libraries it is linked against "
            f"({kept / 1e6:.0f} MB), removed the rest of the NVIDIA packages ({removed / 1e6:.0f} MB)"
        )
    torch_mb = sum(f.stat().st_size for f in (site_packages / "torch").rglob("*") if f.is_file()) / 1e6
    left_out = ", ".join(sorted(LEFT_OUT_ON_CPU))
    print(f"torch_install: torch {torch.version} ({torch_mb:.0f} MB); left out: {left_out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    raise SystemExit(main(sys.argv[1:]))
