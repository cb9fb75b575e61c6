"""The suite collects without the engines' extras: a module that needs torch or mlx skips itself
(``pytest.importorskip``, or the import inside the test), it does not fail to import. Someone who
installed ``.[dev]`` alone gets the tests that can run there, not collection errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.daemon import REPO

ENGINE_EXTRAS = ("torch", "safetensors", "tokenizers", "transformers", "huggingface_hub", "mlx", "mlx_audio")
"""What the torch and mlx extras bring that nothing else needs."""

COLLECT = textwrap.dedent(
    """
    import sys

    for name in {blocked!r}:
        sys.modules[name] = None  # "import torch" now fails as when it is not installed

    import pytest

    sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"]))
    """
)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_module_collects_without_the_engine_extras() -> None:
    done = subprocess.run(
        [sys.executable, "-c", COLLECT.format(blocked=ENGINE_EXTRAS)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    errors = [line for line in done.stdout.splitlines() if line.startswith("ERROR ")]
    assert done.returncode == 0 and not errors, "\n".join(errors) or done.stdout[-3000:] + done.stderr[-3000:]
