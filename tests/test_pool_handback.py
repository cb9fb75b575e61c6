"""A pool daemon that drains hands its queued pool requests back to the pool (issue 15), and a
hand-back leaves its journal only once another member took it (its receipt; issue 41).

Unit tests of the hand-back payload, the ledger's side, the journal's and the receipts, then
real daemon processes on a real mosquitto sharing ``$share/<group>/s2s/pool/tts/say``: three,
one of them stopped with SIGTERM mid-run; two beside a watcher on ``s2s/#``, each stopped in
turn with SIGTERM and SIGKILL and restarted. Every request is answered exactly once, ``completed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.intake.mqtt import MQTT_ORIGINS, MqttIntake
from s2s_daemon.intake.pool import PoolHandBack, hand_back_message, hand_back_payload
from s2s_daemon.intake.schemas import parse_say
from s2s_daemon.mqtt.packets import InMessage, OutMessage
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.pipeline.jobs import Job, Ledger
from s2s_daemon.pipeline.journal import RequestJournal
from s2s_daemon.pipeline.messages import ReplyTo, SayRequest
from s2s_daemon.pipeline.outbox import DurableRequests, Outbox
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.voice_policy import VoicePolicy
from tests.support.broker import Mosquitto
from tests.support.daemon import DaemonProcess, write_config
from tests.support.mqtt import Recorder, recorder

RULES = IntakeRules("kitchen", 2000, VoicePolicy(("Ryan", "Vivian"), "Ryan"), ("auto", "english", "chinese"), "auto")
TOPICS = Topics("s2s", "kitchen", "speakers")
POOL = "s2s/pool/tts/say"


class Events:
    def __init__(self) -> None:
        self.finished_ids: list[tuple[str, str]] = []

    def started(self, job: Job) -> None:
        return None

    def finished(self, job: Job) -> None:
        self.finished_ids.append((job.request.id, str(job.status)))

    def state_changed(self) -> None:
        return None


class Manual:
    """Runs the journal's flushes when told."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def __call__(self, callback: Callable[[], None]) -> None:
        self.pending.append(callback)

    def run(self) -> None:
        pending, self.pending = self.pending, []
        for callback in pending:
            callback()


def log_events(text: str) -> list[dict[str, object]]:
    """The JSON log lines of a daemon."""
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                out.append(event)
    return out


def pool_request(rid: str, **kw: object) -> SayRequest:
    fields: dict[str, object] = {
        "id": rid,
        "text": f"text of {rid}",
        "voice": "Vivian",
        "language": "english",
        "site_id": "kitchen",
        "origin": "pool",
    }
    fields.update(kw)
    return SayRequest(**fields)  # type: ignore[arg-type]


# -- the payload ---------------------------------------------------------------------------


def test_hand_back_payload_keeps_the_fields_and_the_remaining_ttl() -> None:
    now = time.monotonic()
    request = pool_request(
        "p-1",
        instruct="whisper it",
        session_id="s-9",
        priority=7,
        interrupt=True,
        ttl_ms=5000,
        volume=0.5,
        received_at=now - 1.5,
        reply_to=ReplyTo("my/replies", b"\x00\x2a"),
    )
    message = hand_back_message(request, TOPICS, now=now)
    assert message.topic == POOL and message.qos == 1 and not message.retain
    assert message.response_topic == "my/replies" and message.correlation_data == b"\x00\x2a"
    data = json.loads(message.payload)
    assert data["ttlMs"] == 3500  # 5000 ms less the 1.5 s it waited here
    # What the taker parses is the same request (its own site, a fresh receipt, the remaining ttl).
    again = parse_say(message.payload, RULES, origin="pool", reply_to=ReplyTo("my/replies", b"\x00\x2a"))
    assert again.error is None
    got = again.request
    assert (got.id, got.text, got.voice, got.language, got.instruct, got.session_id) == (
        "p-1",
        "text of p-1",
        "Vivian",
        "english",
        "whisper it",
        "s-9",
    )
    assert (got.priority, got.interrupt, got.ttl_ms, got.volume, got.reply_to) == (
        7,
        True,
        3500,
        0.5,
        request.reply_to,
    )


def test_hand_back_payload_of_a_plain_request() -> None:
    now = time.monotonic()
    data = json.loads(hand_back_payload(pool_request("p-2", voice=None, received_at=now), now=now))
    assert data == {
        "id": "p-2",
        "text": "text of p-2",
        "language": "english",
        "priority": 0,
        "interrupt": False,
        "volume": 1.0,
    }
    message = hand_back_message(pool_request("p-2"), TOPICS)
    assert message.response_topic is None and message.correlation_data is None
    # A ttl that ran out while it was held: 0, never negative (the taker answers it expired).
    late = pool_request("p-3", ttl_ms=100, received_at=now - 1.0)
    assert json.loads(hand_back_payload(late, now=now))["ttlMs"] == 0


# -- the ledger and the journal ----------------------------------------------------------------


def test_the_ledger_hands_back_queued_pool_requests_without_a_terminal_event() -> None:
    events = Events()
    ledger = Ledger(RequestQueue(16), events, 64)
    now = time.monotonic()
    ledger.submit(pool_request("p-low"))
    ledger.submit(pool_request("site", origin="mqtt"))
    ledger.submit(pool_request("p-high", priority=5))
    ledger.submit(pool_request("p-old", ttl_ms=1000, received_at=now - 2.0))
    handed = ledger.hand_back(lambda r: r.origin == "pool")
    assert [j.request.id for j in handed] == ["p-high", "p-low"]  # serving order
    assert all(j.done.is_set() and j.status is None for j in handed)
    assert events.finished_ids == [("p-old", "expired")]  # past its ttl: answered here
    assert list(ledger.jobs) == ["site"] and len(ledger.queue) == 1
    ledger.close()
    assert events.finished_ids[-1] == ("site", "cancelled")  # the site's own: cancelled as before


def test_the_journal_entry_is_finished_only_once_a_member_took_the_hand_back(tmp_path: Path) -> None:
    manual = Manual()
    journal = RequestJournal(tmp_path / "j.sqlite3", 64, "full", schedule=manual)
    journal.open()
    events = Events()
    ledger = Ledger(RequestQueue(16), events, 64)
    published: list[OutMessage] = []
    durable = DurableRequests(Outbox(journal, published.append, OutMessage.restore, MQTT_ORIGINS), ledger)
    pool = PoolHandBack(ledger, RULES, TOPICS, published.append, durable)
    intake = MqttIntake(ledger, RULES, TOPICS, hermes=False, durable=durable, pool=pool)
    now = time.monotonic()
    for rid in ("q1", "q2"):
        intake.handle(InMessage(POOL, json.dumps({"id": rid, "text": "queued"}).encode(), None, now))
    manual.run()
    assert pool.begin() == 2
    # Arrives while the daemon waits for the UNSUBACK: held, not rejected, not published yet.
    intake.handle(InMessage(POOL, json.dumps({"id": "late", "text": "arrived"}).encode(), None, now))
    manual.run()
    assert published == []
    assert pool.release() == 3
    manual.run()  # published once the admissions are committed
    assert [json.loads(m.payload)["id"] for m in published] == ["q1", "q2", "late"]
    assert events.finished_ids == []  # no terminal event from the daemon that hands back
    # A redelivery of a handed-back one is handed back again, not answered as a duplicate.
    intake.handle(InMessage(POOL, json.dumps({"id": "q1", "text": "queued"}).encode(), None, now))
    manual.run()
    assert [json.loads(m.payload)["id"] for m in published][-1] == "q1" and events.finished_ids == []
    # The broker acknowledged every hand-back (a watcher on s2s/# matched them): that is no member.
    for message in published:
        assert message.on_sent is not None
        message.on_sent()
    manual.run()
    assert pool.acknowledged == 4 and pool.taken_count == 0
    # Only q1 (its first hand-back) and late were taken by a member before the "crash".
    tokens = [json.loads(m.payload)["handBack"] for m in published]
    assert len(set(tokens)) == 4  # one token a hand-back
    for i in (0, 2, 2):  # a receipt that comes twice counts once
        rid = json.loads(published[i].payload)["id"]
        pool.taken(json.dumps({"id": rid, "handBack": tokens[i], "siteId": "b"}).encode())
    pool.taken(b'{"id": "q2", "handBack": "another member\'s", "siteId": "b"}')  # not ours
    pool.taken(b"not json")
    manual.run()
    assert pool.taken_count == 2
    journal._db.close()  # type: ignore[union-attr]  # a SIGKILL: nothing more is committed
    journal._db = None
    again = RequestJournal(tmp_path / "j.sqlite3", 64, "full", schedule=manual)
    recovered = again.open()
    assert [e.request.id for e in recovered.open] == ["q2", "q1"]  # q2 and the redelivered q1: resumed
    assert "late" in recovered.seen_ids and "q1" in recovered.seen_ids
    again.close()


def test_a_member_says_it_took_a_handed_back_request_once_its_journal_has_it(tmp_path: Path) -> None:
    manual = Manual()
    journal = RequestJournal(tmp_path / "j.sqlite3", 64, "full", schedule=manual)
    journal.open()
    events = Events()
    ledger = Ledger(RequestQueue(16), events, 64)
    published: list[OutMessage] = []
    durable = DurableRequests(Outbox(journal, published.append, OutMessage.restore, MQTT_ORIGINS), ledger)
    pool = PoolHandBack(ledger, RULES, TOPICS, published.append, durable)
    intake = MqttIntake(ledger, RULES, TOPICS, hermes=False, durable=durable, pool=pool)
    now = time.monotonic()
    intake.handle(InMessage(POOL, b'{"id": "fresh", "text": "from a requester"}', None, now))
    intake.handle(InMessage(POOL, b'{"id": "back", "text": "handed back", "handBack": "t-1"}', None, now))
    intake.handle(InMessage(POOL, b'{"id": 7, "text": "", "handBack": "t-2"}', None, now))  # answered: taken too
    assert published == []  # nothing before the commit
    manual.run()
    receipts = [json.loads(m.payload) for m in published if m.topic == "s2s/pool/tts/taken"]
    assert receipts == [
        {"id": "back", "handBack": "t-1", "siteId": "kitchen"},
        {"id": "7", "handBack": "t-2", "siteId": "kitchen"},
    ]
    assert all(m.qos == 1 for m in published)
    assert "back" in ledger.jobs and events.finished_ids == [("7", "rejected")]
    journal.close()


async def test_an_untaken_hand_back_is_kept_with_the_journal_and_cancelled_without() -> None:
    events = Events()
    ledger = Ledger(RequestQueue(16), events, 64)
    published: list[OutMessage] = []
    pool = PoolHandBack(ledger, RULES, TOPICS, published.append)
    ledger.submit(pool_request("p-1"))
    ledger.submit(pool_request("p-2"))
    assert pool.begin() == 2 and pool.release() == 2
    token = json.loads(published[0].payload)["handBack"]
    pool.taken(json.dumps({"id": "p-1", "handBack": token, "siteId": "b"}).encode())
    assert events.finished_ids == []
    assert await pool.wait_taken(0.05) == ["p-2"]
    assert events.finished_ids == [("p-2", "cancelled")]  # no journal keeps it: its requester hears
    # Everything taken: no wait at all.
    assert await pool.wait_taken(60) == []


# -- three daemons, one stopped -----------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_a_stopped_pool_member_hands_its_requests_to_the_others(tmp_path: Path, mosquitto: Mosquitto) -> None:
    sites = ("a", "b", "c")
    procs = {}
    for site in sites:
        config = write_config(
            tmp_path / f"{site}.yaml",
            mosquitto.port,
            site_id=site,
            mqtt={"shared_group": "speakers"},
            # 12 characters at 40 ms each: 480 ms of audio, made in 120 ms (4x real time): slower
            # than the requests come, so that the stopped daemon has a queue to hand back.
            tts={"options": {"speed": "4"}},
            queue={"max_pending": 200},
        )
        procs[site] = DaemonProcess(config, log_path=tmp_path / f"{site}.log")
    ids = [f"r{i:03d}" for i in range(120)]
    try:
        async with recorder(mosquitto.port, subscribe=("s2s/#",)) as rec:
            for proc in procs.values():
                proc.start()

            def online() -> set[str]:
                return {m.topic.split("/")[1] for m in rec.on("/status") if m.payload == b"online"}

            await rec.wait_for(lambda: online() == set(sites), 30)
            for n, rid in enumerate(ids):
                await rec.say(POOL, {"id": rid, "text": "pool request", "ttlMs": 60_000})
                if n == 60:
                    procs["c"].signal(signal.SIGTERM)  # mid-run: c has a queue, and more arrive
                await asyncio.sleep(0.01)  # the scenario: requests arrive at a pace, not in one burst
            assert await procs["c"].wait(30) == 0
            finished = await rec.wait_finished(ids, timeout_s=40)
            for site in ("a", "b"):
                procs[site].signal(signal.SIGTERM)
            for site in ("a", "b"):
                assert await procs[site].wait(30) == 0
            await rec.settle()  # every answer any of them published has reached us
            finished = rec.finished()  # asserts exactly one tts/finished per id
            statuses = {rid: p["status"] for rid, p in finished.items()}
            assert set(statuses) == set(ids)
            assert {s for s in statuses.values() if s != "completed"} == set(), {
                rid: s for rid, s in statuses.items() if s != "completed"
            }
            answered_by = {m.json()["id"]: m.topic.split("/")[1] for m in rec.on("/tts/finished")}
            published = [m.json()["id"] for m in rec.messages if m.topic == POOL]
            handed = {rid for rid in ids if published.count(rid) > 1}
            events = log_events(procs["c"].log())
            left = [e for e in events if e.get("event") == "pool_left"]
            total = [e for e in events if e.get("event") == "pool_handed_back"]
            assert len(left) == 1 and left[0]["confirmed"] is True, events[-20:]
            assert len(total) == 1 and total[0]["requests"] == total[0]["taken"] == len(handed) > 0
            # What c handed back was served by the others, and by c nothing after that.
            assert {answered_by[rid] for rid in handed} <= {"a", "b"}
            assert {answered_by[rid] for rid in ids} >= {"a", "b"}
            served_by_c = [rid for rid in ids if answered_by[rid] == "c"]
            assert not (set(served_by_c) & handed)
    finally:
        for proc in procs.values():
            if proc.proc is not None and proc.proc.poll() is None:
                proc.signal(signal.SIGTERM)
        for proc in procs.values():
            if proc.proc is not None:
                try:
                    await proc.wait(15)
                except TimeoutError:
                    pass
            proc.cleanup()


# -- two members, a watcher on s2s/#, each stopped in turn -----------------------------------------


def _latest_status(rec: Recorder) -> dict[str, bytes]:
    latest: dict[str, bytes] = {}
    for message in rec.on("/status"):
        latest[message.topic.split("/")[1]] = message.payload
    return latest


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_watcher_on_the_pool_topic_loses_no_hand_back(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """Issue 41 item 1: a ``#`` watcher (the README's ``mosquitto_sub -t 's2s/#'``) makes the broker
    accept every hand-back, though no member takes it. Two members, each stopped in turn with
    SIGTERM (the other alive, then none) and SIGKILL, restarted: every request answered once."""
    sites = ("a", "b")
    procs: dict[str, DaemonProcess] = {}
    for site in sites:
        config = write_config(
            tmp_path / f"{site}.yaml",
            mosquitto.port,
            site_id=site,
            mqtt={"shared_group": "speakers"},
            # About 2.2 s of audio a request, made in 0.55 s: a member holds a queue for a while.
            tts={"options": {"speed": "4"}},
            queue={"max_pending": 100},
        )
        procs[site] = DaemonProcess(config, log_path=tmp_path / f"{site}.log")
    text = "a pool request that is long enough to be spoken for a while"
    ids: list[str] = []
    try:
        async with recorder(mosquitto.port, subscribe=("s2s/#",)) as rec:  # the watcher

            async def start(site: str) -> None:
                before = len(rec.on(f"{site}/status"))
                procs[site].start()
                await rec.wait_for(
                    lambda: len(rec.on(f"{site}/status")) > before and _latest_status(rec).get(site) == b"online", 30
                )

            async def stop(site: str, sig: signal.Signals) -> None:
                procs[site].signal(sig)
                await procs[site].wait(30)
                await rec.wait_for(lambda: _latest_status(rec).get(site) == b"offline", 10)

            async def batch(name: str, n: int) -> list[str]:
                batch_ids = [f"{name}{i:02d}" for i in range(n)]
                for rid in batch_ids:
                    await rec.say(POOL, {"id": rid, "text": text})
                ids.extend(batch_ids)

                def busy() -> bool:
                    started = {m.topic.split("/")[1] for m in rec.on("/tts/started") if m.json()["id"] in batch_ids}
                    return started == set(sites)

                await rec.wait_for(busy, 20)  # both members took some: each holds a queue
                return batch_ids

            for site in sites:
                await start(site)
            # SIGTERM a while b is there (a's queue goes to b), then b, the last member: nobody takes
            # its queue, though the broker delivers it (to the watcher).
            await batch("t", 12)
            await stop("a", signal.SIGTERM)
            await stop("b", signal.SIGTERM)
            for site in sites:
                await start(site)
            # The other way round.
            await batch("u", 12)
            await stop("b", signal.SIGTERM)
            await stop("a", signal.SIGTERM)
            for site in sites:
                await start(site)
            # SIGKILL each in turn: its journal serves what it held at the restart.
            await batch("k", 12)
            await stop("a", signal.SIGKILL)
            await start("a")
            await stop("b", signal.SIGKILL)
            await start("b")
            await rec.wait_finished(ids, timeout_s=60)
            for site in sites:  # whatever either would still send is sent before they exit
                await stop(site, signal.SIGTERM)
            finished = rec.finished()  # asserts exactly one tts/finished per id
            assert set(finished) == set(ids)
            assert {rid: p["status"] for rid, p in finished.items() if p["status"] != "completed"} == {}
            # Both ways were taken: hand-backs a member took, and the last member's, that nobody took.
            events = [e for site in sites for e in log_events(procs[site].log())]
            totals = [e for e in events if e.get("event") == "pool_handed_back"]
            untaken = [e for e in events if e.get("event") == "pool_hand_back_untaken"]
            assert sum(int(e["taken"]) for e in totals) > 0, totals  # type: ignore[call-overload]
            assert len(untaken) >= 2 and all(e["kept"] and not e["cancelled"] for e in untaken), untaken
    finally:
        for proc in procs.values():
            proc.cleanup()
