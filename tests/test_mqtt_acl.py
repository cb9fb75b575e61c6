"""The daemon under a broker's access control: the documented mosquitto ACL (docs/mqtt.md) is enough, a refused
publish is logged once per topic, a refused subscription is exit 77 (never a deaf daemon that
says ``online``)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
from pathlib import Path

import pytest

from s2s_daemon.errors import EXIT_NOPERM
from tests.support.broker import Mosquitto
from tests.support.daemon import REPO, DaemonProcess, write_config
from tests.support.mqtt import recorder

pytestmark = pytest.mark.integration

SAY = "s2s/kitchen/tts/say"
POOL = "s2s/pool/tts/say"
DYNSEC = Path("/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so")


def readme_acl() -> str:
    """The MQTT contract's ready-to-copy ``acl_file`` (the test runs the daemon under exactly it)."""
    readme = (REPO / "docs" / "mqtt.md").read_text(encoding="utf-8")
    found = re.search(r"```\n(# mosquitto acl_file: the daemon of site \"kitchen\".*?)```", readme, re.DOTALL)
    assert found is not None, "docs/mqtt.md: the mosquitto acl_file example is missing"
    return found.group(1)


def log_events(text: str) -> list[dict[str, object]]:
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                out.append(event)
    return out


def acl_broker(tmp_path: Path, acl: str) -> Mosquitto:
    """mosquitto with passwords and ``acl``; the user ``watch`` (the tests' client) may do anything."""
    passwords = tmp_path / "passwd"
    for n, (user, password) in enumerate((("s2s-kitchen", "daemon pw"), ("watch", "watch pw"))):
        args = ["mosquitto_passwd", "-b", *(["-c"] if n == 0 else []), str(passwords), user, password]
        subprocess.run(args, check=True, capture_output=True)
    acl_file = tmp_path / "acl"
    acl_file.write_text(acl + "\nuser watch\ntopic readwrite #\n")
    broker = Mosquitto(tmp_path, extra_conf=f"password_file {passwords}\nacl_file {acl_file}")
    broker.conf.write_text(broker.conf.read_text().replace("allow_anonymous true", "allow_anonymous false"))
    return broker


def daemon_config(tmp_path: Path, port: int, **sections: object) -> Path:
    secret = tmp_path / "daemon-pw"
    secret.write_text("daemon pw\n")
    mqtt = {"username": "s2s-kitchen", "password_file": str(secret), "shared_group": "speakers"}
    return write_config(tmp_path / "d.yaml", port, mqtt=mqtt, **sections)


async def stop(proc: DaemonProcess) -> int:
    proc.signal(signal.SIGTERM)
    return await proc.wait(20)


@pytest.mark.timeout(60)
async def test_the_readme_acl_is_all_the_daemon_needs(tmp_path: Path) -> None:
    broker = acl_broker(tmp_path, readme_acl())
    broker.start()
    # Slow enough (480 ms of audio made in 480 ms) that pool requests are still queued at SIGTERM.
    proc = DaemonProcess(daemon_config(tmp_path, broker.port, tts={"options": {"speed": "1"}}))
    try:
        async with recorder(broker.port, username="watch", password="watch pw") as rec:
            proc.start()
            await rec.wait_for(lambda: [m for m in rec.on("/kitchen/status") if m.payload == b"online"], 30)
            await rec.say(SAY, {"id": "site-1", "text": "over the acl"})
            await rec.say(POOL, {"id": "pool-1", "text": "pooled"})
            fin = await rec.wait_finished(["site-1", "pool-1"], 20)
            assert {p["status"] for p in fin.values()} == {"completed"}
            await rec.client.publish("s2s/kitchen/tts/stop", b"{}", qos=1)
            for i in range(3):  # queued when it stops: handed back to the (otherwise empty) pool
                await rec.say(POOL, {"id": f"back-{i}", "text": "pool request"})
            await rec.wait_for(lambda: [m for m in rec.on("/tts/started") if m.json()["id"] == "back-0"], 10)
            assert await stop(proc) == 0
            await rec.wait_for(lambda: rec.on("/kitchen/status")[-1].payload == b"offline", 10)
            republished = [m.json()["id"] for m in rec.messages if m.topic == POOL]
            assert republished.count("back-1") == 2 and republished.count("back-2") == 2
        events = log_events(proc.log())
        denied = [e for e in events if "denied" in str(e.get("event"))]
        assert denied == [], denied
        assert [e for e in events if e.get("event") == "stop_current"], "the stop request was not received"
        handed = [e for e in events if e.get("event") == "pool_handed_back"]
        assert handed and handed[0]["requests"] == handed[0]["acknowledged"] == 2
    finally:
        proc.cleanup()
        broker.stop()


@pytest.mark.timeout(60)
async def test_a_refused_publish_is_logged_once_per_topic_and_serving_goes_on(tmp_path: Path) -> None:
    acl = readme_acl().replace("topic write s2s/kitchen/tts/started\n", "")
    assert "tts/started" not in acl
    broker = acl_broker(tmp_path, acl)
    broker.start()
    proc = DaemonProcess(daemon_config(tmp_path, broker.port))
    try:
        async with recorder(broker.port, username="watch", password="watch pw") as rec:
            proc.start()
            await rec.wait_for(lambda: [m for m in rec.on("/kitchen/status") if m.payload == b"online"], 30)
            ids = [f"r{i}" for i in range(4)]
            for rid in ids:
                await rec.say(SAY, {"id": rid, "text": "started is refused"})
            fin = await rec.wait_finished(ids, 20)
            assert {p["status"] for p in fin.values()} == {"completed"}
            assert rec.on("/tts/started") == []  # the broker dropped them
            assert proc.proc is not None and proc.proc.poll() is None
            assert await stop(proc) == 0
        denied = [e for e in log_events(proc.log()) if e.get("event") == "mqtt_publish_denied"]
        loud = [e for e in denied if e.get("level") == "error"]
        assert len(loud) == 1, denied
        assert loud[0]["topic"] == "s2s/kitchen/tts/started" and loud[0]["reason"] == "Not authorized"
    finally:
        proc.cleanup()
        broker.stop()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not DYNSEC.exists(), reason="mosquitto's dynamic security plugin is not installed")
async def test_a_refused_subscription_is_exit_77_naming_the_topic(tmp_path: Path) -> None:
    # mosquitto's acl_file grants every SUBSCRIBE; its dynamic security plugin checks them (SUBACK 0x87).
    dynsec = {
        "defaultACLAccess": {
            "publishClientSend": True,
            "publishClientReceive": True,
            "subscribe": True,
            "unsubscribe": True,
        },
        "clients": [],
        "groups": [{"groupname": "anonymous", "roles": [{"rolename": "no-stop"}], "clients": []}],
        "anonymousGroup": "anonymous",
        "roles": [
            {
                "rolename": "no-stop",
                "acls": [
                    {"acltype": "subscribePattern", "topic": "s2s/kitchen/tts/stop", "priority": 0, "allow": False}
                ],
            }
        ],
    }
    state = tmp_path / "dynsec.json"
    state.write_text(json.dumps(dynsec))
    broker = Mosquitto(tmp_path, extra_conf=f"plugin {DYNSEC}\nplugin_opt_config_file {state}")
    broker.start()
    proc = DaemonProcess(write_config(tmp_path / "d.yaml", broker.port))
    try:
        async with recorder(broker.port) as rec:
            proc.start()
            assert await proc.wait(30) == EXIT_NOPERM
            await rec.settle()  # whatever it published before it exited has reached us
            assert [m.payload for m in rec.on("/kitchen/status")] in ([], [b"offline"])  # never online
        events = log_events(proc.log())
        denied = [e for e in events if e.get("event") == "mqtt_subscription_denied"]
        assert [(e["topic"], e["reason"], e["level"]) for e in denied] == [
            ("s2s/kitchen/tts/stop", "Not authorized", "error")
        ]
        exiting = [e for e in events if e.get("event") == "exiting_subscription_denied"]
        assert exiting and exiting[0]["topics"] == ["s2s/kitchen/tts/stop"] and exiting[0]["exit_code"] == 77
        assert not [e for e in events if e.get("event") == "mqtt_connected"]
    finally:
        proc.cleanup()
        broker.stop()
