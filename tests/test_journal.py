"""The request journal: unit tests of the file and its batching, then faults against real processes
(mosquitto, the daemon as a subprocess killed with SIGKILL, a broker restart mid-burst)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from s2s_daemon.errors import EXIT_UNAVAILABLE, UnavailableError
from s2s_daemon.intake.mqtt import MQTT_ORIGINS
from s2s_daemon.mqtt.link import _Publishes
from s2s_daemon.mqtt.packets import OutMessage
from s2s_daemon.pipeline.jobs import Job, Ledger
from s2s_daemon.pipeline.journal import RequestJournal, default_journal_path
from s2s_daemon.pipeline.messages import ReplyTo, SayRequest, Status
from s2s_daemon.pipeline.outbox import DurableRequests, Outbox
from s2s_daemon.pipeline.queue import RequestQueue
from tests.support.broker import Mosquitto
from tests.support.daemon import DaemonProcess, write_config
from tests.support.mqtt import Recorder, recorder

SAY = "s2s/kitchen/tts/say"


class Manual:
    """Runs the journal's flushes when told (no event loop needed)."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def __call__(self, callback: Callable[[], None]) -> None:
        self.pending.append(callback)

    def run(self) -> None:
        pending, self.pending = self.pending, []
        for callback in pending:
            callback()


def request(rid: str, **kw: object) -> SayRequest:
    kw.setdefault("text", f"text of {rid}")
    return SayRequest(id=rid, voice="Ryan", language="english", site_id="kitchen", **kw)  # type: ignore[arg-type]


def crash(journal: RequestJournal) -> None:
    """What a SIGKILL does to the file: the connection ends, nothing more is committed."""
    assert journal._db is not None
    journal._db.close()
    journal._db = None


def journal_at(path: Path, window: int = 16) -> tuple[RequestJournal, Manual]:
    manual = Manual()
    return RequestJournal(path, window, "full", schedule=manual), manual


# -- the file ------------------------------------------------------------------------------


def test_what_a_crash_leaves_is_recovered_in_order(tmp_path: Path) -> None:
    path = tmp_path / "state" / "journal.sqlite3"
    journal, manual = journal_at(path)
    assert journal.open().open == []
    assert path.exists()  # the folder is created
    reply = ReplyTo("my/replies", b"\x00\x01")
    seqs = [
        journal.admit(request(f"r{i}", ttl_ms=5000, reply_to=reply if i == 1 else None), time.time(), lambda: None)
        for i in range(3)
    ]
    journal.done(seqs[0])
    row = journal.outgoing("r0", "s2s/kitchen/tts/finished", b'{"id":"r0"}', 1, None)
    kept = journal.outgoing("r0", "my/replies", b'{"id":"r0"}', 1, b"\x00\x01")
    journal.sent(row)
    manual.run()
    crash(journal)
    again, _ = journal_at(path)
    got = again.open()
    assert [e.request.id for e in got.open] == ["r1", "r2"]
    assert got.open[0].request.reply_to == reply
    assert got.open[0].request.ttl_ms == 5000
    assert 0 <= got.open[0].age_s < 5
    assert abs((time.monotonic() - got.open[0].request.received_at) - got.open[0].age_s) < 0.5
    assert [(u.row, u.topic, u.correlation_data) for u in got.unsent] == [(kept, "my/replies", b"\x00\x01")]
    assert got.seen_ids == ["r0"]


def test_the_spoken_text_is_journaled_and_a_row_without_it_reads_as_asked(tmp_path: Path) -> None:
    """A request keeps what was asked (``text``) and what the text stage made of it (``spoken``),
    so that one resumed after a restart speaks the same; rows written before have no ``spoken``."""
    path = tmp_path / "journal.sqlite3"
    journal, manual = journal_at(path)
    journal.open()
    journal.admit(request("md", text="**Hi** 👋", spoken="Hi.", text_changed=True), time.time(), lambda: None)
    journal.admit(request("plain"), time.time(), lambda: None)
    manual.run()
    crash(journal)
    db = sqlite3.connect(path)
    try:  # the row "plain" as a daemon before the text stage wrote it
        (old,) = db.execute("SELECT request FROM requests WHERE id = 'plain'").fetchone()
        row = {k: v for k, v in json.loads(old).items() if k not in ("spoken", "textChanged")}
        db.execute("UPDATE requests SET request = ? WHERE id = 'plain'", (json.dumps(row),))
        db.commit()
    finally:
        db.close()
    again, _ = journal_at(path)
    md, plain = (entry.request for entry in again.open().open)
    assert (md.text, md.spoken, md.text_changed, md.to_speak) == ("**Hi** 👋", "Hi.", True, "Hi.")
    assert (plain.text, plain.spoken, plain.text_changed, plain.to_speak) == (
        "text of plain",
        None,
        False,
        "text of plain",
    )


def test_uncommitted_writes_are_not_recovered_and_callbacks_follow_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    journal, manual = journal_at(path)
    journal.open()
    order: list[str] = []
    journal.admit(request("a"), time.time(), lambda: order.append("lost"))
    journal.then(lambda: order.append("ack a"))
    assert order == []  # nothing before the commit
    manual.run()
    assert order == ["ack a"]
    assert journal.commits == 1
    journal.admit(request("b"), time.time(), lambda: order.append("lost"))
    crash(journal)  # before the commit
    again, _ = journal_at(path)
    assert [e.request.id for e in again.open().open] == ["a"]


@pytest.mark.slow
def test_one_daemon_per_journal(tmp_path: Path) -> None:
    first, _ = journal_at(tmp_path / "j.sqlite3")
    first.open()
    second, _ = journal_at(tmp_path / "j.sqlite3")
    with pytest.raises(UnavailableError, match="is held by another daemon: one daemon per journal"):
        second.open()
    first.close()
    second.open()


async def test_the_writer_commits_a_burst_together_and_in_order(tmp_path: Path) -> None:
    journal = RequestJournal(tmp_path / "j.sqlite3", 16)  # no scheduler: the writer task commits
    journal.open()
    writer = asyncio.create_task(journal.run(), name="test.journal")
    order: list[object] = []
    for i in range(50):
        journal.admit(request(f"r{i}"), time.time(), lambda: order.append("lost"))
        journal.then(lambda i=i: order.append(i))  # type: ignore[misc]
    assert order == []
    await asyncio.wait_for(journal.settle(), 5)
    assert order == list(range(50))
    assert journal.commits == 1  # one turn's writes share one transaction
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer
    journal.close()
    again, _ = journal_at(tmp_path / "j.sqlite3")
    assert len(again.open().open) == 50


def test_the_dedup_window_bounds_what_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("s2s_daemon.pipeline.journal.PRUNE_EVERY", 8)
    journal, manual = journal_at(tmp_path / "j.sqlite3", window=16)
    journal.open()
    for i in range(64):
        journal.done(journal.admit(request(f"r{i}"), time.time(), lambda: None))
        manual.run()
    journal.close()
    db = sqlite3.connect(tmp_path / "j.sqlite3")
    count = db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
    db.close()
    assert 16 <= count <= 16 + 8
    again, _ = journal_at(tmp_path / "j.sqlite3", window=16)
    assert again.open().seen_ids == [f"r{i}" for i in range(48, 64)]


def test_an_unwritable_journal_is_exit_69_naming_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    journal, _ = journal_at(blocker / "journal.sqlite3")
    with pytest.raises(UnavailableError, match=r"a-file/journal\.sqlite3.*journal\.enabled: false") as refused:
        journal.open()
    assert refused.value.exit_code == EXIT_UNAVAILABLE


def test_default_path_follows_systemd_then_xdg_then_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    systemd = {"STATE_DIRECTORY": "/var/lib/s2s-daemon"}
    assert default_journal_path("k", systemd, home) == Path("/var/lib/s2s-daemon/journal-k.sqlite3")
    assert default_journal_path("k", {"XDG_STATE_HOME": "/x"}, home) == Path("/x/s2s-daemon/journal-k.sqlite3")
    in_home = home / ".local/state/s2s-daemon/journal-k.sqlite3"
    assert default_journal_path("k", {"XDG_STATE_HOME": "relative"}, home) == in_home  # the spec ignores those
    assert default_journal_path("k", {}, home) == in_home


# -- disk full while running -----------------------------------------------------------------


class RecordingEvents:
    def __init__(self, outbox: Outbox[OutMessage]) -> None:
        self.outbox = outbox
        self.finished_jobs: list[Job] = []

    def started(self, job: Job) -> None:
        pass

    def finished(self, job: Job) -> None:
        self.finished_jobs.append(job)
        self.outbox.answer(job, [OutMessage("s2s/kitchen/tts/finished", job.request.id.encode(), 1)])

    def state_changed(self) -> None:
        pass


def durable_setup(tmp_path: Path) -> tuple[RequestJournal, Manual, Ledger, DurableRequests, list[OutMessage]]:
    journal, manual = journal_at(tmp_path / "j.sqlite3")
    journal.open()
    sent: list[OutMessage] = []
    outbox = Outbox(journal, sent.append, OutMessage.restore, MQTT_ORIGINS)
    ledger = Ledger(RequestQueue(100), RecordingEvents(outbox), 64)
    durable = DurableRequests(outbox, ledger)
    return journal, manual, ledger, durable, sent


def fill_the_disk(journal: RequestJournal) -> None:
    """sqlite's own "database or disk is full", as on a full file system: no page can be added."""
    db = journal._db
    assert db is not None
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")


def test_a_full_disk_rejects_the_batch_with_journal_error(tmp_path: Path) -> None:
    journal, manual, ledger, durable, sent = durable_setup(tmp_path)
    order: list[str] = []
    kept = ledger.submit(request("kept"))
    durable.admit(kept, time.time())
    manual.run()
    fill_the_disk(journal)
    jobs = []
    for i in range(20):
        big = SayRequest(id=f"r{i}", text="x" * 2000, voice=None, language="english", site_id="kitchen")
        job = ledger.submit(big)
        assert durable.admit(job, time.time())
        journal.then(lambda i=i: order.append(f"ack r{i}"))  # type: ignore[misc]
        jobs.append(job)
    assert journal.flush() is False
    assert all(j.status is Status.REJECTED and j.error is not None and j.error.code == "journal_error" for j in jobs)
    assert all(j.request.id not in ledger.jobs for j in jobs)  # never kept in memory only
    assert order == [f"ack r{i}" for i in range(20)]  # answered first, then acknowledged, in order
    assert "kept" in ledger.jobs  # what was stored stays queued
    journal.flush()  # their answers' own commit (small rows: they fit where the batch was)
    assert sorted(m.payload.decode() for m in sent) == sorted(j.request.id for j in jobs)


def test_terminal_events_wait_for_the_commit_and_are_forgotten_once_acknowledged(tmp_path: Path) -> None:
    journal, manual, ledger, durable, sent = durable_setup(tmp_path)
    job = ledger.submit(request("a"))
    durable.admit(job, time.time())
    manual.run()
    ledger.cancel(job, Status.CANCELLED)
    assert sent == []  # held for the commit
    manual.run()
    assert [m.payload for m in sent] == [b"a"]
    assert journal._db is not None
    assert journal._db.execute("SELECT payload FROM outgoing").fetchall() == [(b"a",)]  # not acknowledged yet
    assert sent[0].on_sent is not None
    sent[0].on_sent()
    manual.run()
    crash(journal)
    again, _ = journal_at(tmp_path / "j.sqlite3")
    got = again.open()
    assert got.unsent == [] and got.open == [] and got.seen_ids == ["a"]


def test_the_link_reports_an_acknowledged_publish() -> None:
    calls: list[str] = []

    async def main() -> None:
        publishes = _Publishes()
        publishes.inflight[7] = OutMessage("t", b"x", 1, on_sent=lambda: calls.append("acked"))
        publishes.inflight[8] = None
        publishes.acknowledged(8)
        publishes.acknowledged(7)
        publishes.acknowledged(7)  # a repeat does nothing

    asyncio.run(main())
    assert calls == ["acked"]


# -- faults, with real processes ---------------------------------------------------------------


async def online(rec: Recorder, timeout_s: float = 30) -> None:
    await rec.wait_for(lambda: rec.on("/status") and rec.on("/status")[-1].payload == b"online", timeout_s)


def open_rows(journal: Path, table: str = "requests WHERE done = 0") -> int:
    db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        return int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
    finally:
        db.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("max_age_s", "after"), [(300, "completed"), (0, "expired")])
async def test_sigkill_with_requests_queued_then_restart(
    tmp_path: Path, mosquitto: Mosquitto, max_age_s: float, after: str
) -> None:
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={"options": {"speed": "1", "ms_per_char": "25"}},
        queue={"resume_max_age_s": max_age_s},
    )
    proc = DaemonProcess(config)
    text = "about one second of speech here."
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            ids = [f"k{i}" for i in range(5)]
            for i in ids:
                await rec.say(SAY, {"id": i, "text": text})
            await rec.say(SAY, {"id": "short", "text": text, "ttlMs": 1500})
            await rec.wait_for(lambda: rec.payloads("/tts/started"))  # k0 is speaking
            proc.signal(signal.SIGKILL)
            await proc.wait(10)
            assert rec.finished() == {}
            assert open_rows(config.with_suffix(".journal.sqlite3")) == 6
            # published while the daemon is down: its persistent session keeps them
            for i in ("down0", "down1"):
                await rec.say(SAY, {"id": i, "text": text})
            await asyncio.sleep(1.6)  # "short" is past its ttl: the clock passing it is what is tested
            proc.start()
            everyone = [*ids, "short", "down0", "down1"]
            fin = await rec.wait_finished(everyone, timeout_s=40)
            assert {fin[i]["status"] for i in ids} == {after}, fin
            assert fin["short"]["status"] == "expired"
            assert {fin[i]["status"] for i in ("down0", "down1")} == {"completed"}
            assert "journal_resumed" in proc.log()
            proc.signal(signal.SIGTERM)
            assert await proc.wait(15) == 0
            await rec.settle()  # all it ever published has reached us
            assert set(rec.finished()) == set(everyone)  # and exactly one each (finished() checks)
        assert open_rows(config.with_suffix(".journal.sqlite3")) == 0
        assert open_rows(config.with_suffix(".journal.sqlite3"), "outgoing") == 0  # every answer acknowledged
    finally:
        proc.cleanup()


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_redelivered_finished_id_after_a_restart_is_a_duplicate(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = write_config(tmp_path / "d.yaml", mosquitto.port)
    proc = DaemonProcess(config)
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            await rec.say(SAY, {"id": "once", "text": "only once"})
            await rec.wait_finished(["once"])
            # The broker acknowledged the terminal event: its PUBACK reached the daemon before the
            # barrier's request did, and was handled first (the journal is locked while it runs).
            await rec.barrier(SAY)
            proc.signal(signal.SIGKILL)
            await proc.wait(10)
            rec.messages.clear()
            proc.start()
            await online(rec)
            await rec.say(SAY, {"id": "once", "text": "only once"})  # as a broker redelivery would
            await rec.say(SAY, {"id": "fresh", "text": "new"})
            await rec.wait_finished(["fresh"])
            answers = [p for p in rec.payloads("/tts/finished") if p["id"] == "once"]
            assert [(a["status"], a["error"]["code"]) for a in answers] == [("rejected", "duplicate")]
            assert not [p for p in rec.payloads("/tts/started") if p["id"] == "once"]
    finally:
        proc.cleanup()


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_broker_restart_mid_burst_answers_each_once(tmp_path: Path, persistent_mosquitto: Mosquitto) -> None:
    broker = persistent_mosquitto
    config = write_config(
        tmp_path / "d.yaml",
        broker.port,
        tts={"options": {"speed": "8"}},
        queue={"max_pending": 500},
        mqtt={"reconnect_max_s": 1},
    )
    proc = DaemonProcess(config)
    accepted: list[str] = []
    try:
        proc.start()
        async with recorder(broker.port, identifier="watcher", persistent=True) as rec:
            await online(rec)
        async with recorder(broker.port, subscribe=(), identifier="producer") as pub:
            for i in range(60):
                await pub.say(SAY, {"id": f"b{i}", "text": "burst"})
                accepted.append(f"b{i}")
        await asyncio.to_thread(broker.restart, 1.0)
        async with recorder(broker.port, subscribe=(), identifier="producer") as pub:
            for i in range(60, 100):
                await pub.say(SAY, {"id": f"b{i}", "text": "burst"})
                accepted.append(f"b{i}")
        async with recorder(broker.port, identifier="watcher", persistent=True) as rec:
            fin = await rec.wait_finished(accepted, timeout_s=60)
            assert {fin[i]["status"] for i in accepted} == {"completed"}
        assert "mqtt_disconnected" in proc.log()
        proc.signal(signal.SIGTERM)
        assert await proc.wait(15) == 0
        assert open_rows(config.with_suffix(".journal.sqlite3")) == 0
        assert open_rows(config.with_suffix(".journal.sqlite3"), "outgoing") == 0  # every answer acknowledged
    finally:
        proc.cleanup()


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_an_unwritable_journal_stops_the_daemon_at_start(tmp_path: Path, mosquitto: Mosquitto) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = write_config(tmp_path / "d.yaml", mosquitto.port, journal={"path": str(blocker / "j.sqlite3")})
    proc = DaemonProcess(config)
    try:
        proc.start()
        assert await proc.wait(30) == EXIT_UNAVAILABLE
        assert "a-file/j.sqlite3" in proc.log()
    finally:
        proc.cleanup()


def test_the_service_units_give_the_journal_a_state_directory() -> None:
    from s2s_daemon.service import template_text

    for kind in ("systemd-user", "systemd-system"):
        assert "StateDirectory=s2s-daemon" in template_text(kind).splitlines()
