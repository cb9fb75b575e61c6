"""``scripts/prometheus_check.sh``: a real Prometheus server scrapes the daemon and has its series.

Runs where Debian's ``prometheus`` package is installed. ``scripts/test`` does not install it:
the package enables and starts a Prometheus server as a system service, listening on every
interface, which a test run should not do to a developer's machine.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.support.daemon import REPO


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus package is not installed")
def test_a_real_prometheus_scrapes_the_daemon() -> None:
    result = subprocess.run(
        [str(REPO / "scripts" / "prometheus_check.sh")],
        env={"PATH": "/usr/bin:/bin:/usr/sbin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[-1] == "ok", result.stdout + result.stderr
    assert 'up{job="s2s"} = 1' in lines
    assert 's2s_requests_total{intake="http",status="completed"} = 1' in lines
    assert "promtool check metrics: clean" in lines
