"""docs/extending.md's worked example of an intake, built as the page says (its module, one line of
wiring, its config section) and sent requests end to end: a real TCP client, the daemon in this
process on the tone engine, a real mosquitto for the events."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from s2s_daemon.app import Daemon
from s2s_daemon.config import DaemonConfig
from s2s_daemon.wiring import INTAKES
from tests.support import line_intake
from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import write_config
from tests.support.line_intake import LineConfig, open_line
from tests.support.mqtt import Recorder, recorder

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
EXAMPLE = Path(line_intake.__file__)


def doc_block(marker: str) -> str:
    """The fenced block that follows ``<!-- marker -->`` in docs/extending.md."""
    found = re.search(rf"<!-- {re.escape(marker)} -->\n```\w*\n(.*?)```\n", DOC.read_text(encoding="utf-8"), re.S)
    assert found is not None, f"docs/extending.md has no block after <!-- {marker} -->"
    return found.group(1)


class ExampleConfig(DaemonConfig):
    """``DaemonConfig`` with the example's section, as config.py gains it (the page's third step)."""

    line: LineConfig = LineConfig()


@contextlib.asynccontextmanager
async def line_daemon(tmp_path: Path, broker: Mosquitto, port: int) -> AsyncIterator[Recorder]:
    path = write_config(tmp_path / "daemon.yaml", broker.port, line={"enabled": True, "port": port})
    config = ExampleConfig.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    daemon = Daemon(config, intakes=(*INTAKES, open_line))  # the line wiring.INTAKES gains
    async with recorder(broker.port) as rec:
        task = asyncio.create_task(daemon.run(), name="test.daemon")
        try:
            await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 30)
            yield rec
        finally:
            daemon.request_stop()
            assert await asyncio.wait_for(task, 30) == 0


async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: str) -> list[str]:
    writer.write(line.encode() + b"\n")
    await writer.drain()
    async with asyncio.timeout(20):
        return (await reader.readline()).decode().rstrip("\n").split(" ", 2)


def test_the_page_shows_the_example_as_it_is() -> None:
    assert doc_block("example: tests/support/line_intake.py") == EXAMPLE.read_text(encoding="utf-8")
    wiring = doc_block("wiring")
    assert "INTAKES: tuple[IntakeOpener, ...] = (open_wyoming, open_line)" in wiring
    section = doc_block("config.py")
    assert "line: LineConfig = LineConfig()" in section
    assert yaml.safe_load(doc_block("configs/default.yaml")) == {"line": LineConfig().model_dump()}


@pytest.mark.integration
async def test_the_example_intake_speaks_its_lines_end_to_end(tmp_path: Path, mosquitto: Mosquitto) -> None:
    port = free_port()
    async with line_daemon(tmp_path, mosquitto, port) as rec:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            spoken = await ask(reader, writer, "Hello from a line.")
            refused = await ask(reader, writer, "   ")
        finally:
            writer.close()
        finished = await rec.wait_finished([spoken[0], refused[0]])
    assert spoken[1:] == ["completed"], spoken
    assert refused[1:] == ["rejected", "empty_text: text is empty"], refused
    done: dict[str, Any] = finished[spoken[0]]
    assert done["status"] == "completed" and done["audioMs"] > 0, done
    assert finished[refused[0]]["status"] == "rejected", finished
    # Drained and closed with the daemon: the port no longer listens.
    with contextlib.suppress(ConnectionRefusedError):
        _, late = await asyncio.open_connection("127.0.0.1", port)
        late.close()
        raise AssertionError("the line intake still listens after the daemon stopped")
