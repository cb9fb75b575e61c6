"""A recording MQTT test client (aiomqtt) with wait helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

SETTLE_TOPIC = "s2s-test/settle/"
BARRIER_ID = "s2s-test-barrier-"
"""The ids of ``Recorder.barrier``'s requests begin so; ``finished()`` leaves them out."""


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool
    properties: Any

    def json(self) -> Any:
        return json.loads(self.payload)


@dataclass
class Recorder:
    client: aiomqtt.Client
    messages: list[Received] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _settles: int = 0
    _markers: set[str] = field(default_factory=set)
    """Topics of ``settle``'s markers seen (kept out of ``messages``)."""

    def on(self, topic_suffix: str) -> list[Received]:
        return [m for m in self.messages if m.topic.endswith(topic_suffix)]

    def payloads(self, topic_suffix: str) -> list[Any]:
        return [m.json() for m in self.on(topic_suffix)]

    def finished(self) -> dict[str, dict[str, Any]]:
        """The terminal event per id; answers to duplicates (code ``duplicate``) are left out."""
        out: dict[str, dict[str, Any]] = {}
        for p in self.payloads("/tts/finished"):
            if p.get("error", {}).get("code") == "duplicate" or str(p.get("id", "")).startswith(BARRIER_ID):
                continue
            assert p["id"] not in out, f"two tts/finished for {p['id']}: {out[p['id']]} and {p}"
            out[p["id"]] = p
        return out

    async def wait_for(self, predicate: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        async with asyncio.timeout(timeout_s):
            while True:
                result = predicate()
                if result:
                    return result
                self._changed.clear()
                await self._changed.wait()

    async def wait_finished(self, ids: list[str], timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
        def done() -> dict[str, dict[str, Any]] | None:
            got = self.finished()
            return got if all(i in got for i in ids) else None

        try:
            return await self.wait_for(done, timeout_s)  # type: ignore[no-any-return]
        except TimeoutError:
            got = self.finished()
            raise AssertionError(f"missing tts/finished for {[i for i in ids if i not in got]}") from None

    async def settle(self, timeout_s: float = 10.0) -> None:
        """Until a marker this recorder publishes comes back through the broker: every message the
        broker had received before it (from any client, a daemon that has since exited included)
        has then been delivered here. A check that something did NOT arrive follows this, not a sleep."""
        self._settles += 1
        topic = f"{SETTLE_TOPIC}{id(self)}/{self._settles}"
        await self.client.subscribe(topic, qos=1)
        await self.client.publish(topic, b"", qos=1)
        await self.wait_for(lambda: topic in self._markers, timeout_s)

    async def barrier(self, say_topic: str, timeout_s: float = 30.0) -> None:
        """A request of its own on ``say_topic``, until its ``tts/finished``: the daemon has then
        handled every message sent before it (it reads them in order), and any answer to them has
        been published before this one's. A check that the daemon did NOT answer follows this."""
        self._settles += 1
        request_id = f"{BARRIER_ID}{self._settles}"
        await self.say(say_topic, {"id": request_id, "text": "ok"})
        await self.wait_for(lambda: any(p["id"] == request_id for p in self.payloads("/tts/finished")), timeout_s)

    async def say(self, site_topic: str, payload: dict[str, Any] | str | bytes, **kwargs: Any) -> None:
        if isinstance(payload, dict):
            data: bytes | str = json.dumps(payload)
        else:
            data = payload
        await self.client.publish(site_topic, data, qos=1, **kwargs)


@contextlib.asynccontextmanager
async def recorder(
    port: int,
    subscribe: tuple[str, ...] = ("s2s/#",),
    identifier: str | None = None,
    persistent: bool = False,
    v5: bool = True,
    username: str | None = None,
    password: str | None = None,
) -> AsyncIterator[Recorder]:
    kwargs: dict[str, Any] = {}
    if persistent:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 600
        kwargs = {"clean_start": False, "properties": props} if v5 else {"clean_session": False}
    client = aiomqtt.Client(
        "127.0.0.1",
        port,
        identifier=identifier,
        username=username,
        password=password,
        protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311,
        **kwargs,
    )
    async with client:
        rec = Recorder(client)
        for topic in subscribe:
            await client.subscribe(topic, qos=1)

        async def pump() -> None:
            async for m in client.messages:
                if m.topic.value.startswith(SETTLE_TOPIC):
                    rec._markers.add(m.topic.value)
                else:
                    rec.messages.append(Received(m.topic.value, bytes(m.payload), m.retain, m.properties))  # type: ignore[arg-type]
                rec._changed.set()

        task = asyncio.create_task(pump(), name="test.recorder")
        try:
            yield rec
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
