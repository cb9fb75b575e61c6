"""A soak: thousands of short utterances through the whole daemon, its resources sampled as it goes.

    .venv/bin/python scripts/soak.py [CHECKPOINT] [-n 2000] [--every 100] [--engine torch|tone] [--json]

Starts a real mosquitto on a free loopback port and the daemon as a subprocess
(``python -m s2s_daemon run -c CONFIG``; with ``--engine tone``, ``python -m
tests.support.tone_daemon run -c CONFIG``, the zero-cost test engine), configured with the
external broker, ``audio.sink: discard``, the request journal on (its own file in a temporary
folder), warm-up on and, for torch, the CPU with ``tts.options.max_frames`` small (``--max-frames``,
default 4: every utterance is at most 4 codec frames, 320 ms of audio). CHECKPOINT defaults to the
tests' tiny random checkpoint (``tests/fixtures/qwen3_tiny/custom_voice``).

It then sends ``-n`` short say requests (QoS 1, each a different text) with paho-mqtt, at most
``--window`` in flight (default 4: the next one goes out when a ``tts/finished`` comes back), and
records every terminal event. Every ``--every`` utterances it lets the window drain (so that each
sample sees the daemon idle, in the same state) and samples the daemon's process: VmRSS and
RssAnon (``/proc/PID/status``), open file descriptors (``/proc/PID/fd``), threads (``Threads``) and
the journal's size (the SQLite file + its ``-wal``). File descriptors and threads are read three
times 20 ms apart and the lowest count is kept: a file the daemon opens for a moment (its memory
event reads ``/proc/self``) or a thread that lives for a moment is not a leak; a leaked one is in
all three. One sample is also taken right after the daemon is ready (0 utterances).

The journal's dedup window (``queue.dedup_window``) is lowered to ``--dedup-window`` (default 256):
the journal keeps the finished requests of that window and prunes older ones every
``PRUNE_EVERY`` (512) admissions, so a soak of 2,000 exercises the pruning (with the default
window of 4,096 it would never run). After the daemon has stopped the script opens the journal and
counts its rows.

Warm-up is the first 10% of the utterances, and at least the first sample interval: the first
sample at or after it is the baseline; the samples from it to the last are "after warm-up".

Verdict (exit 0 when every check passes, 1 otherwise; the limits are options):

- answers: every request answered by exactly one ``tts/finished``, every one ``completed``, no
  terminal event for an id the soak did not send;
- RSS (VmRSS) growth after warm-up, baseline to last sample, at most
  ``max(--rss-mib-per-1000 (20) x utterances after warm-up / 1000, --rss-floor-mib (16))``: the floor
  keeps a short run from failing on allocator noise (on the tiny checkpoint the torch engine's RSS
  moves up and down by about 8 MiB from one sample to the next; SQLite's page cache grows with the
  file up to its 2 MiB cap); a leak of 20 KiB per utterance crosses 20 MiB per 1,000. The
  least-squares slope over the samples after warm-up is reported beside it (not checked);
- file descriptors after warm-up: max - min at most ``--fd-slack`` (0);
- threads after warm-up: max - min at most ``--thread-slack`` (0). The journal commits on a thread
  of its own: the loop's default executor, which it used before, starts one more worker whenever a
  job is submitted in the instant between the last worker handing back its result and counting
  itself idle, at a random moment (seen at 200-250 of 300 utterances);
- journal: its size (file + WAL) at every sample at most ``--max-journal-kib`` (8192: the WAL is
  checkpointed at 1,000 pages of 4 KiB and then reused, not grown), and after the stop at most
  ``dedup_window + PRUNE_EVERY`` rows of requests, none unanswered, no event left unsent;
- the daemon's log: no line at level error or critical;
- the daemon exits 0 after SIGTERM.

Run it on a quiet machine for figures: the client, the broker and the daemon share the CPUs.
``--json`` prints one JSON object instead of the table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402
import yaml  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from s2s_daemon.bench.machine import machine_record  # noqa: E402
from s2s_daemon.pipeline.journal import PRUNE_EVERY  # noqa: E402
from tests.support.broker import Mosquitto  # noqa: E402

TINY = REPO / "tests" / "fixtures" / "qwen3_tiny" / "custom_voice"
SITE = "soak"
SAY = f"s2s/{SITE}/tts/say"
FINISHED = f"s2s/{SITE}/tts/finished"
STATUS = f"s2s/{SITE}/status"
TEXTS = (
    "Hello there.",
    "The kitchen timer is done.",
    "Good morning.",
    "Rain is expected later.",
    "Your parcel has arrived.",
    "The door is open.",
    "Dinner is ready.",
)
WARMUP_FRACTION = 0.1


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- the daemon ------------------------------------------------------------------------------


def write_config(args: argparse.Namespace, work: Path, port: int) -> tuple[Path, Path]:
    journal = work / "journal" / "journal.sqlite3"
    if args.engine == "tone":
        tts: dict[str, Any] = {"engine": "tone", "options": {"speed": "0"}}
    else:
        options = {"max_frames": str(args.max_frames), "prepared_cache": str(work / "prepared")}
        if args.threads is not None:
            options["threads"] = str(args.threads)
        tts = {
            "engine": "torch",
            "model": str(args.checkpoint),
            "torch": {"device": "cpu", "kernels": args.kernels},
            "options": options,
        }
    tts.update({"warmup": True, "chunk_frames": 2})
    data: dict[str, Any] = {
        "site_id": SITE,
        "mqtt": {"broker": "external", "host": "127.0.0.1", "port": port},
        "tts": tts,
        "audio": {"sink": "discard"},
        "queue": {"dedup_window": args.dedup_window},
        "journal": {"enabled": True, "path": str(journal)},
        "log": {"format": "json", "level": "warning"},
        "shutdown": {"drain_timeout_s": 10},
    }
    path = work / "soak.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path, journal


def start_daemon(args: argparse.Namespace, config: Path, log: Path) -> subprocess.Popen[bytes]:
    module = "tests.support.tone_daemon" if args.engine == "tone" else "s2s_daemon"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, "run", "-c", str(config)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _status(pid: int) -> dict[str, int]:
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "Threads"):
            fields[key] = int(value.split()[0])
    return fields


def sample(pid: int, journal: Path, done: int, elapsed_s: float) -> dict[str, Any]:
    """One row: memory now; fds and threads as the lowest of three reads (a transient one is no leak)."""
    fds: list[int] = []
    threads: list[int] = []
    status: dict[str, int] = {}
    for i in range(3):
        if i:
            time.sleep(0.02)
        fds.append(len(os.listdir(f"/proc/{pid}/fd")))
        status = _status(pid)
        threads.append(status["Threads"])
    size = sum(p.stat().st_size for p in (journal, journal.with_name(journal.name + "-wal")) if p.exists())
    return {
        "done": done,
        "elapsed_s": round(elapsed_s, 2),
        "rss_mib": round(status["VmRSS"] / 1024, 2),
        "anon_mib": round(status["RssAnon"] / 1024, 2),
        "fds": min(fds),
        "threads": min(threads),
        "journal_kib": round(size / 1024, 1),
    }


def journal_rows(path: Path) -> dict[str, int]:
    """What the journal holds once the daemon has released it."""
    db = sqlite3.connect(path)
    try:
        requests = db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
        unanswered = db.execute("SELECT COUNT(*) FROM requests WHERE done = 0").fetchone()[0]
        outgoing = db.execute("SELECT COUNT(*) FROM outgoing").fetchone()[0]
    finally:
        db.close()
    return {"requests": int(requests), "unanswered": int(unanswered), "outgoing": int(outgoing)}


def log_errors(log: Path) -> list[str]:
    bad = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            level = json.loads(line).get("level")
        except (ValueError, AttributeError):
            continue
        if level in ("error", "critical"):
            bad.append(line)
    return bad


# -- the client ------------------------------------------------------------------------------


class Client:
    """paho-mqtt on its own thread; terminal events and status changes land in a queue."""

    def __init__(self, port: int) -> None:
        self.events: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.subscribed = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"soak-{os.getpid()}", protocol=mqtt.MQTTv5)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        if not self.subscribed.wait(10):
            raise TimeoutError("the soak's client could not subscribe")

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        client.subscribe([(FINISHED, 1), (STATUS, 1)])

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        self.subscribed.set()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        self.events.put((message.topic, bytes(message.payload)))

    def say(self, rid: str, text: str) -> None:
        info = self.client.publish(SAY, json.dumps({"id": rid, "text": text}), qos=1)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise RuntimeError(f"publish failed: {mqtt.error_string(info.rc)}")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Tally:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.answers: dict[str, list[dict[str, Any]]] = {}
        self.unexpected: list[dict[str, Any]] = []

    def add(self, payload: dict[str, Any]) -> bool:
        """True when this is the first answer to a request the soak sent."""
        rid = payload.get("id")
        if rid not in self.answers:
            self.unexpected.append(payload)
            return False
        self.answers[rid].append(payload)
        return len(self.answers[rid]) == 1

    def summary(self) -> dict[str, Any]:
        statuses: dict[str, int] = {}
        for answers in self.answers.values():
            for p in answers:
                key = p.get("status", "?") if "error" not in p else f"{p.get('status')}:{p['error'].get('code')}"
                statuses[key] = statuses.get(key, 0) + 1
        return {
            "sent": len(self.sent),
            "answered_once": sum(1 for a in self.answers.values() if len(a) == 1),
            "missing": sum(1 for a in self.answers.values() if not a),
            "duplicates": sum(1 for a in self.answers.values() if len(a) > 1),
            "unexpected": len(self.unexpected),
            "statuses": statuses,
        }


def wait_online(client: Client, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode} before it was ready")
        try:
            topic, payload = client.events.get(timeout=0.5)
        except queue.Empty:
            continue
        if topic == STATUS and payload == b"online":
            return
    raise TimeoutError(f"the daemon was not online after {timeout_s:.0f} s")


def soak(
    args: argparse.Namespace,
    client: Client,
    proc: subprocess.Popen[bytes],
    journal: Path,
    tally: Tally,
    samples: list[dict[str, Any]],
) -> None:
    """Send the requests, at most ``--window`` unanswered; sample at each ``--every`` with none in flight
    (into ``samples``, which keeps what was taken when the soak fails half-way)."""
    samples.append(sample(proc.pid, journal, 0, 0.0))
    if not args.json:
        print_row(samples[-1])
    started = progress = time.monotonic()
    done = 0
    while done < args.utterances:
        boundary = min(args.utterances, (done // args.every + 1) * args.every)
        while done < boundary:
            while len(tally.sent) - done < args.window and len(tally.sent) < boundary:
                i = len(tally.sent)
                rid = f"soak-{i:06d}"
                tally.sent.append(rid)
                tally.answers[rid] = []
                client.say(rid, f"{TEXTS[i % len(TEXTS)]} Number {i}.")
            try:
                topic, payload = client.events.get(timeout=1.0)
            except queue.Empty:
                if proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited with {proc.returncode} during the soak") from None
                if time.monotonic() - progress > args.timeout_s:
                    raise TimeoutError(f"no new tts/finished for {args.timeout_s:.0f} s after {done}") from None
                continue
            if topic == FINISHED and tally.add(json.loads(payload)):
                done += 1
                progress = time.monotonic()
        time.sleep(args.settle_s)  # the answer is out; let the daemon finish its bookkeeping
        samples.append(sample(proc.pid, journal, done, time.monotonic() - started))
        if not args.json:
            print_row(samples[-1])


def stop_daemon(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int | None:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


# -- the verdict -----------------------------------------------------------------------------


def warmup_utterances(n: int, every: int) -> int:
    """The first 10% of the utterances, and at least the first sample interval."""
    return min(n, max(math.ceil(WARMUP_FRACTION * n), every))


def slope_per_1000(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(utterances, MiB)`` points, in MiB per 1,000 utterances."""
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def check(value: Any, limit: Any, ok: bool) -> dict[str, Any]:
    return {"value": value, "limit": limit, "ok": bool(ok)}


def verdict(
    samples: list[dict[str, Any]],
    answers: dict[str, Any],
    limits: dict[str, float],
    n: int,
    every: int,
    rows: dict[str, int] | None,
    dedup_window: int,
    errors: int,
    exit_code: int | None,
) -> dict[str, dict[str, Any]]:
    """The checks of the docstring, each ``{value, limit, ok}``."""
    warm = warmup_utterances(n, every)
    after = [s for s in samples if s["done"] >= warm]
    checks: dict[str, dict[str, Any]] = {
        "samples_after_warmup": check(len(after), ">= 2", len(after) >= 2),
    }
    expected = {"completed": n}
    checks["answers"] = check(
        answers,
        f"{n} sent, each answered once, all completed, none unexpected",
        answers["sent"] == n
        and answers["answered_once"] == n
        and answers["missing"] == 0
        and answers["duplicates"] == 0
        and answers["unexpected"] == 0
        and answers["statuses"] == expected,
    )
    if after:
        first, last = after[0], after[-1]
        span = last["done"] - first["done"]
        growth = last["rss_mib"] - first["rss_mib"]
        allowed = max(limits["rss_mib_per_1000"] * span / 1000, limits["rss_floor_mib"])
        checks["rss_growth_mib"] = check(round(growth, 2), round(allowed, 2), growth <= allowed)
        checks["rss_mib_per_1000"] = check(
            round(1000 * growth / span, 2) if span else 0.0, limits["rss_mib_per_1000"], True
        )  # reported; the limit is applied through rss_growth_mib (with its floor)
        fit = [(s["done"], s["rss_mib"]) for s in after]
        checks["rss_slope_mib_per_1000"] = check(round(slope_per_1000(fit), 2), None, True)
        checks["anon_growth_mib"] = check(round(last["anon_mib"] - first["anon_mib"], 2), None, True)
        fds = [s["fds"] for s in after]
        threads = [s["threads"] for s in after]
        checks["fds_range"] = check(max(fds) - min(fds), limits["fd_slack"], max(fds) - min(fds) <= limits["fd_slack"])
        checks["threads_range"] = check(
            max(threads) - min(threads), limits["thread_slack"], max(threads) - min(threads) <= limits["thread_slack"]
        )
        checks["journal_growth_kib"] = check(round(last["journal_kib"] - first["journal_kib"], 1), None, True)
    biggest = max(s["journal_kib"] for s in samples)
    checks["journal_max_kib"] = check(biggest, limits["max_journal_kib"], biggest <= limits["max_journal_kib"])
    most = dedup_window + PRUNE_EVERY
    checks["journal_rows"] = check(
        rows,
        f"requests <= {most}, unanswered 0, outgoing 0",
        rows is not None and rows["requests"] <= most and rows["unanswered"] == 0 and rows["outgoing"] == 0,
    )
    checks["log_errors"] = check(errors, 0, errors == 0)
    checks["exit_code"] = check(exit_code, 0, exit_code == 0)
    return checks


# -- the report ------------------------------------------------------------------------------

HEADER = f"{'done':>6} {'elapsed s':>9} {'RSS MiB':>8} {'anon MiB':>8} {'fds':>4} {'threads':>7} {'journal KiB':>11}"


def print_row(s: dict[str, Any]) -> None:
    print(
        f"{s['done']:6d} {s['elapsed_s']:9.1f} {s['rss_mib']:8.1f} {s['anon_mib']:8.1f} {s['fds']:4d}"
        f" {s['threads']:7d} {s['journal_kib']:11.1f}",
        flush=True,
    )


def print_header(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(f"soak {m['date']}  {m['cpu']}, {m['cores']} cores, load {m['load1']}, Python {m['python']}")
    setup = report["setup"]
    engine = setup["engine"]
    if engine == "torch":
        engine += f" {setup['torch']} (cpu, kernels {setup['kernels']}, max_frames {setup['max_frames']})"
    print(f"engine {engine}  model {setup['model']}")
    print(
        f"{setup['utterances']} utterances, a sample every {setup['every']}, window {setup['window']},"
        f" dedup window {setup['dedup_window']}, warm-up {setup['warmup_utterances']} utterances"
    )
    print(HEADER, flush=True)


def print_verdict(report: dict[str, Any]) -> None:
    c = report["checks"]
    a = report["answers"]
    print(
        f"answers: {a['sent']} sent, {a['answered_once']} answered once, {a['missing']} missing,"
        f" {a['duplicates']} duplicated, {a['unexpected']} unexpected, {a['statuses']}"
        f"  {'ok' if c['answers']['ok'] else 'FAIL'}"
    )
    if "rss_growth_mib" in c:
        print(
            f"after warm-up: RSS {c['rss_growth_mib']['value']:+.1f} MiB ({c['rss_mib_per_1000']['value']:+.1f} MiB"
            f" per 1000 utterances, slope {c['rss_slope_mib_per_1000']['value']:+.1f}; allowed"
            f" {c['rss_growth_mib']['limit']:.1f} MiB)"
            f"  anon {c['anon_growth_mib']['value']:+.1f} MiB  {'ok' if c['rss_growth_mib']['ok'] else 'FAIL'}"
        )
        print(
            f"after warm-up: fds max-min {c['fds_range']['value']} (limit {c['fds_range']['limit']:g})"
            f"  {'ok' if c['fds_range']['ok'] else 'FAIL'};"
            f"  threads max-min {c['threads_range']['value']} (limit {c['threads_range']['limit']:g})"
            f"  {'ok' if c['threads_range']['ok'] else 'FAIL'}"
        )
    rows = c["journal_rows"]["value"]
    growth = "" if "journal_growth_kib" not in c else f", {c['journal_growth_kib']['value']:+.1f} KiB after warm-up"
    print(
        f"journal: at most {c['journal_max_kib']['value']:.1f} KiB (limit {c['journal_max_kib']['limit']:g}){growth};"
        f" rows after the stop {rows} ({c['journal_rows']['limit']})"
        f"  {'ok' if c['journal_max_kib']['ok'] and c['journal_rows']['ok'] else 'FAIL'}"
    )
    print(
        f"daemon: {c['log_errors']['value']} error lines in its log, exit {c['exit_code']['value']}"
        f"  {'ok' if c['log_errors']['ok'] and c['exit_code']['ok'] else 'FAIL'}"
    )
    if not c["samples_after_warmup"]["ok"]:
        print(f"only {c['samples_after_warmup']['value']} sample(s) after warm-up: raise -n or lower --every  FAIL")
    print(f"verdict: {'PASS' if report['ok'] else 'FAIL'}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, default=TINY, help="torch: the checkpoint folder")
    parser.add_argument("--engine", choices=("torch", "tone"), default="torch")
    parser.add_argument("-n", "--utterances", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100, help="sample every this many utterances")
    parser.add_argument("--window", type=int, default=4, help="requests in flight at most")
    parser.add_argument("--max-frames", type=int, default=4, help="torch: codec frames per utterance at most")
    parser.add_argument("--threads", type=int, default=None, help="torch: intra-op threads (default: the engine's)")
    parser.add_argument("--kernels", choices=("auto", "native", "torch"), default="auto", help="torch: CPU kernels")
    parser.add_argument("--dedup-window", type=int, default=256, help="queue.dedup_window (the journal's window)")
    parser.add_argument("--settle-s", type=float, default=0.1, help="pause before each sample")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="longest wait for the next answer")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0, help="longest wait for the daemon's online")
    parser.add_argument("--rss-mib-per-1000", type=float, default=20.0)
    parser.add_argument("--rss-floor-mib", type=float, default=16.0)
    parser.add_argument("--fd-slack", type=int, default=0)
    parser.add_argument("--thread-slack", type=int, default=0)
    parser.add_argument("--max-journal-kib", type=float, default=8192.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.utterances < 1 or args.every < 1 or args.window < 1:
        parser.error("-n, --every and --window must be at least 1")
    if args.engine == "torch" and not (args.checkpoint / "config.json").exists():
        parser.error(f"{args.checkpoint} is not a checkpoint folder (no config.json)")

    report: dict[str, Any] = {
        "machine": machine_record(),
        "setup": {
            "engine": args.engine,
            "model": str(args.checkpoint) if args.engine == "torch" else "tone",
            "torch": _version("torch") if args.engine == "torch" else None,
            "kernels": args.kernels if args.engine == "torch" else None,
            "max_frames": args.max_frames if args.engine == "torch" else None,
            "threads": args.threads,
            "utterances": args.utterances,
            "every": args.every,
            "window": args.window,
            "dedup_window": args.dedup_window,
            "warmup_utterances": warmup_utterances(args.utterances, args.every),
        },
    }
    if not args.json:
        print_header(report)
    tally = Tally()
    samples: list[dict[str, Any]] = []
    failure: str | None = None
    rows: dict[str, int] | None = None
    exit_code: int | None = None
    with tempfile.TemporaryDirectory(prefix="s2s-soak-") as tmp:
        work = Path(tmp)
        broker = Mosquitto(work)
        broker.start()
        log = work / "daemon.log"
        proc: subprocess.Popen[bytes] | None = None
        client: Client | None = None
        try:
            config, journal = write_config(args, work, broker.port)
            client = Client(broker.port)
            proc = start_daemon(args, config, log)
            wait_online(client, proc, args.ready_timeout_s)
            soak(args, client, proc, journal, tally, samples)
        except (RuntimeError, TimeoutError, OSError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            if proc is not None:
                exit_code = stop_daemon(proc) if proc.poll() is None else proc.returncode
            if client is not None:
                time.sleep(0.5)  # a late second answer would still be counted
                while not client.events.empty():
                    topic, payload = client.events.get()
                    if topic == FINISHED:
                        tally.add(json.loads(payload))
                client.close()
            broker.stop()
        if proc is not None and journal.exists():
            try:
                rows = journal_rows(journal)
            except sqlite3.Error as exc:
                failure = failure or f"journal: {exc}"
        errors = log_errors(log) if log.exists() else []
        log_tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
    limits = {
        "rss_mib_per_1000": args.rss_mib_per_1000,
        "rss_floor_mib": args.rss_floor_mib,
        "fd_slack": args.fd_slack,
        "thread_slack": args.thread_slack,
        "max_journal_kib": args.max_journal_kib,
    }
    answers = tally.summary()
    checks = verdict(
        samples or [{"done": 0, "journal_kib": 0.0}],
        answers,
        limits,
        args.utterances,
        args.every,
        rows,
        args.dedup_window,
        len(errors),
        exit_code,
    )
    report.update(
        {
            "samples": samples,
            "answers": answers,
            "checks": checks,
            "failure": failure,
            "log_errors": errors[:10],
            "ok": failure is None and all(c["ok"] for c in checks.values()),
        }
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if failure is not None:
            print(f"failed: {failure}")
        print_verdict(report)
    if not report["ok"]:
        print("\n".join(["the daemon's log, last lines:", *log_tail]), file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
