"""Unit tests of single pieces: channel, queue, ledger, payload parsing, config, topics."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import pkgutil
import time

import pytest

import s2s_daemon
from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError
from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.intake.schemas import parse_say
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.pipeline.channel import Channel, ChannelClosed, ChannelFull, Overflow
from s2s_daemon.pipeline.jobs import (
    ChunkMade,
    FirstSample,
    Job,
    Ledger,
    OnSpeaker,
    Phase,
    PlaybackEnded,
    Released,
)
from s2s_daemon.pipeline.messages import ErrorCode, SayRequest, Status
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.voice_policy import VoicePolicy
from tests.support.wait import loop_turns

RULES = IntakeRules("kitchen", 50, VoicePolicy(("Ryan", "Vivian"), "Ryan"), ("auto", "english", "chinese"), "auto")


def req(rid: str, priority: int = 0, **kw: object) -> SayRequest:
    return SayRequest(id=rid, text="hi", voice=None, language="auto", site_id="kitchen", priority=priority, **kw)  # type: ignore[arg-type]


# -- channel -----------------------------------------------------------------------------


async def test_channel_policies_and_close() -> None:
    drop: Channel[int] = Channel(2, Overflow.DROP_OLDEST, "d")
    for i in range(5):
        drop.put_nowait(i)
    assert drop.clear() == [3, 4] and drop.dropped == 3

    rej: Channel[int] = Channel(1, Overflow.REJECT, "r")
    rej.put_nowait(1)
    with pytest.raises(ChannelFull):
        rej.put_nowait(2)

    block: Channel[int] = Channel(1, Overflow.BLOCK, "b")
    await block.put(1)
    waiter = asyncio.create_task(block.put(2))
    await loop_turns()
    assert not waiter.done()  # back-pressure
    assert await block.get() == 1
    await waiter
    block.close()
    assert [x async for x in block] == [2]  # drains, then ends
    with pytest.raises(ChannelClosed):
        await block.get()


# -- queue -------------------------------------------------------------------------------


async def test_queue_priority_front_remove_drain() -> None:
    q = RequestQueue(4)
    assert q.offer(req("a")) and q.offer(req("b", 5)) and q.offer(req("c"))
    assert q.offer(req("urgent", -9), front=True)
    assert not q.offer(req("overflow"))
    assert q.remove("c") and not q.remove("c")
    assert [(await q.get()).id for _ in range(3)] == ["urgent", "b", "a"]
    q.offer(req("x"))
    assert [r.id for r in q.drain()] == ["x"] and len(q) == 0
    q.close()
    with pytest.raises(ChannelClosed):
        await q.get()


# -- ledger --------------------------------------------------------------------------


class Events:
    def __init__(self) -> None:
        self.done: list[tuple[str, str, str | None]] = []

    def started(self, job: Job) -> None:
        return None

    def finished(self, job: Job) -> None:
        self.done.append((job.request.id, str(job.status), job.error.code if job.error else None))

    def state_changed(self) -> None:
        return None


async def test_ledger_exactly_one_finished() -> None:
    events = Events()
    d = Ledger(RequestQueue(2), events, 16)
    d.submit(req("a"))
    d.submit(req("a"))  # duplicate
    d.submit(req("b"))
    d.submit(req("c"))  # queue full
    assert events.done == [("a", "rejected", ErrorCode.DUPLICATE), ("c", "rejected", ErrorCode.QUEUE_FULL)]
    job = d.take(await d.queue.get())
    assert job is not None and job.phase is Phase.SYNTHESIZING
    assert d.stop_id("b") and not d.stop_id("b")
    d.cancel(job, Status.INTERRUPTED)
    d.cancel(job, Status.CANCELLED)  # a second stop changes nothing
    assert job.should_stop() and job.stopped.is_set()  # the one stop token, for the engine and playback
    d.record(job, PlaybackEnded(time.monotonic()))
    d.record(job, PlaybackEnded(time.monotonic()))  # a second end changes nothing
    # "a" was synthesizing, not one sample heard: cancelled, not interrupted
    assert events.done[2:] == [("b", "cancelled", None), ("a", "cancelled", None)]
    assert d.jobs == {} and d.state() == ("idle", None)


async def test_a_rejected_interrupt_has_no_effect() -> None:
    """Issue 41 item 3: an ``interrupt`` the full queue rejects stops nothing."""
    events = Events()
    d = Ledger(RequestQueue(1), events, 16)
    d.submit(req("a0"))
    playing = d.take(await d.queue.get())
    assert playing is not None
    d.record(playing, OnSpeaker(time.monotonic()))
    d.record(playing, FirstSample(time.monotonic()))
    d.submit(req("a1"))  # queued: the queue is full
    d.submit(req("i-full", interrupt=True))
    assert events.done == [("i-full", "rejected", ErrorCode.QUEUE_FULL)]
    assert not playing.should_stop() and playing.status is None and d.state() == ("speaking", "a0")
    assert "a1" in d.queue
    again = d.submit(req("i-again", interrupt=True))
    assert again.error is not None and again.error.message == "1 request is already waiting"
    # With room in the queue, an interrupt stops the current one and goes first.
    d.queue.remove("a1")
    d.submit(req("i-room", interrupt=True))
    assert playing.should_stop() and d.queue.waiting()[0].id == "i-room"


async def test_interrupted_only_once_a_sample_was_heard() -> None:
    events = Events()
    d = Ledger(RequestQueue(4), events, 16)
    d.submit(req("heard"))
    d.submit(req("silent"))
    heard = d.take(await d.queue.get())
    assert heard is not None
    d.record(heard, OnSpeaker(time.monotonic()))
    d.record(heard, ChunkMade(time.monotonic(), 2.0))
    d.record(heard, FirstSample(time.monotonic()))
    assert d.stop_speaking() == "heard"
    d.record(heard, PlaybackEnded(time.monotonic()))
    silent = d.take(await d.queue.get())
    assert silent is not None
    assert d.stop_speaking() is None  # nothing plays on the speaker
    assert d.stop_current()  # still synthesizing
    d.record(silent, Released(time.monotonic()))
    assert events.done == [("heard", "interrupted", None), ("silent", "cancelled", None)]


async def test_expired_on_take() -> None:
    events = Events()
    d = Ledger(RequestQueue(2), events, 16)
    d.submit(req("old", ttl_ms=0, received_at=0.0))
    assert d.take(await d.queue.get()) is None
    assert events.done == [("old", "expired", None)]


# -- payloads ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "expect"),
    [
        (b"hello", {"text": "hello", "voice": "Ryan", "language": "auto"}),
        (b'\xef\xbb\xbf{"text": "bom"}', {"text": "bom"}),
        (
            b'{"text": " x ", "voice": "VIVIAN", "language": "zh-CN"}',
            {"text": "x", "voice": "Vivian", "language": "chinese"},
        ),
        (b'{"text": "x", "lang": "en_US"}', {"language": "english"}),
        (
            b'{"id": 7, "text": "x", "priority": 3, "interrupt": true, "ttlMs": 5, "volume": 0.5}',
            {"id": "7", "priority": 3, "interrupt": True, "ttl_ms": 5, "volume": 0.5},
        ),
        (b'{"text": "x", "unknownKey": 1, "instruct": "  "}', {"instruct": None}),
    ],
)
def test_parse_say_accepts(payload: bytes, expect: dict[str, object]) -> None:
    parsed = parse_say(payload, RULES)
    assert parsed.error is None
    for key, value in expect.items():
        assert getattr(parsed.request, key) == value


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b'{"text": "x", "volume": NaN}', ErrorCode.BAD_PAYLOAD),
        (b'{"text": "x", "interrupt": "yes"}', ErrorCode.BAD_PAYLOAD),
        (b'{"text": "a\\u0000b"}', ErrorCode.BAD_PAYLOAD),
        (b'{"id": "", "text": "x"}', ErrorCode.BAD_PAYLOAD),
        (b"[" * 100_000, ErrorCode.TEXT_TOO_LONG),
        (b"{" + b"[" * 100_000, ErrorCode.BAD_PAYLOAD),
        (b"x" * 51, ErrorCode.TEXT_TOO_LONG),
        (b"\x00\x01\x02", ErrorCode.BAD_PAYLOAD),
    ],
)
def test_parse_say_rejects(payload: bytes, code: ErrorCode) -> None:
    parsed = parse_say(payload, RULES)
    assert parsed.error is not None and parsed.error.code is code, parsed.error


# -- config and topics -------------------------------------------------------------------


def test_env_overrides_and_errors() -> None:
    cfg = load_config(None, {"S2S_TTS__ENGINE": "mlx", "S2S_MQTT__SHARED_GROUP": "g", "S2S_VAD__ENABLED": "true"})
    assert cfg.tts.engine == "mlx" and cfg.mqtt.shared_group == "g" and cfg.vad.enabled is True
    with pytest.raises(ConfigError, match=r"mqtt\.password_file|password_file needs username"):
        load_config(None, {"S2S_MQTT__PASSWORD_FILE": "/x"})
    with pytest.raises(ConfigError, match="site_id"):
        load_config(None, {"S2S_SITE_ID": "a/b"})
    with pytest.raises(ValueError, match="frozen"):
        cfg.tts.engine = "torch"  # type: ignore[misc]


def test_topics() -> None:
    t = Topics("s2s", "kitchen", "grp")
    assert t.say == "s2s/kitchen/tts/say" and t.pool_subscription == "$share/grp/s2s/pool/tts/say"
    assert Topics("s2s", "kitchen").pool_subscription is None


def test_every_message_dataclass_is_frozen_and_round_trips() -> None:
    """Every dataclass in the package's message modules is frozen with slots, and replace() round-trips."""
    found = 0
    for mod_info in pkgutil.walk_packages(s2s_daemon.__path__, "s2s_daemon."):
        if mod_info.name.split(".")[-1] not in {"messages", "packets", "engine"}:
            continue
        module = importlib.import_module(mod_info.name)
        for obj in vars(module).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                params = obj.__dataclass_params__  # type: ignore[attr-defined]
                assert params.frozen, obj
                assert hasattr(obj, "__slots__"), obj
                found += 1
    assert found >= 8


def test_each_engine_reads_its_own_device_key() -> None:
    from s2s_daemon.tts.registry import engine_options

    env = {"S2S_TTS__TORCH__DEVICE": "cuda", "S2S_TTS__MLX__DEVICE": "cpu"}
    assert engine_options(load_config(None, env).tts).device == "cuda"
    assert engine_options(load_config(None, {**env, "S2S_TTS__ENGINE": "mlx"}).tts).device == "cpu"
    with pytest.raises(ConfigError, match=r"tts\.mlx\.device"):
        load_config(None, {"S2S_TTS__MLX__DEVICE": "cuda"})


async def test_a_stop_of_the_speaker_leaves_a_callers_request_alone() -> None:
    from s2s_daemon.pipeline.output import CallerStream

    events = Events()
    d = Ledger(RequestQueue(4), events, 16)
    d.submit(dataclasses.replace(req("caller"), output=CallerStream()))
    caller = d.take(await d.queue.get())
    assert caller is not None and caller.phase is Phase.SYNTHESIZING
    assert not d.stop_current()  # `tts/stop {}` and `interrupt` are about the room's speaker
    assert not caller.should_stop()
    assert d.stop_all() == 1  # `{"all": true}` stops everything
    assert caller.should_stop()
