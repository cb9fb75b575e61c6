"""Two speech requests at once against the daemon as a subprocess (the tone engine, a real
mosquitto), through the official openai SDK: with ``tts.max_streams`` above 1 the second is
answered while the first is still being made; with 1 it waits for the first."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import openai
import pytest

from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import DaemonProcess, write_config
from tests.support.mqtt import recorder
from tests.test_http_speech import tone_samples, wait_ready

pytestmark = pytest.mark.integration

MS_PER_CHAR = 1000.0
FIRST = "x" * 299 + "."
"""One sentence of 300 s of audio, 14 MB of PCM: more than the daemon (88 chunks, 1.4 MB) and
the sockets between (Linux's 4 MB send buffer at most, and the receiver's) hold for a client that
does not read, so its synthesis cannot end while its client waits. (5.8 MB was not enough.) Its
full stop is its own: the text stage leaves it as it is."""
SECOND = "y" * 19 + "."


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_streams", [4, 1])
async def test_a_second_speech_request_is_answered_beside_the_first(
    tmp_path: Path, mosquitto: Mosquitto, max_streams: int
) -> None:
    port = free_port()
    # A second of audio a character is far slower than speech: no runaway cut (tts/runaway.py).
    tts = {"max_streams": max_streams, "runaway_margin": 0, "options": {"speed": "0", "ms_per_char": str(MS_PER_CHAR)}}
    config = write_config(tmp_path / "d.yaml", mosquitto.port, http={"enabled": True, "port": port}, tts=tts)
    proc = DaemonProcess(config)
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await wait_ready(port, 30)
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=30)
            async with (
                client,
                client.audio.speech.with_streaming_response.create(
                    model="tts-1", voice="alloy", input=FIRST, response_format="pcm"
                ) as first,
            ):
                first_id = first.headers["x-request-id"]
                pieces = first.iter_bytes()
                data = await anext(pieces)  # its first bytes; then the first is not read for a while
                second = asyncio.ensure_future(
                    client.audio.speech.with_raw_response.create(
                        model="tts-1", voice="alloy", input=SECOND, response_format="pcm"
                    )
                )
                done, _ = await asyncio.wait({second}, timeout=5 if max_streams > 1 else 2)
                if max_streams > 1:
                    assert done, "the second request waited for the first"
                    assert first_id not in rec.finished()  # the first is still being made
                else:
                    assert not done  # one stream: the second waits for the first's synthesis to end
                async for piece in pieces:
                    data += piece
                answer = await asyncio.wait_for(second, 10)
            assert len(answer.parse().content) == 2 * tone_samples(SECOND, MS_PER_CHAR)
            assert len(data) == 2 * tone_samples(FIRST, MS_PER_CHAR)
            second_id = answer.headers["x-request-id"]
            finished = await rec.wait_finished([first_id, second_id])
            assert finished[first_id]["status"] == finished[second_id]["status"] == "completed"
        proc.signal(signal.SIGTERM)
        assert await proc.wait(15) == 0, proc.log()
    finally:
        proc.cleanup()
