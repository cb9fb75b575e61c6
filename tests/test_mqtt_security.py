"""Username/password and TLS against a real mosquitto; a persistent session across daemon restarts."""

from __future__ import annotations

import asyncio
import signal
import ssl
import subprocess
from pathlib import Path

import aiomqtt
import pytest

from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import DaemonProcess, daemon_in_process, write_config
from tests.support.mqtt import recorder
from tests.support.wait import until

pytestmark = pytest.mark.integration

SAY = "s2s/kitchen/tts/say"


def make_tls(tmp: Path) -> tuple[Path, Path, Path]:
    ca_key, ca, key, csr, cert = (tmp / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
    run(
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=s2s-test-ca",
    )
    run(
        "openssl",
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=localhost",
    )
    ext = tmp / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run(
        "openssl",
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    return ca, cert, key


async def test_username_password_and_tls(tmp_path: Path) -> None:
    ca, cert, key = make_tls(tmp_path)
    passwords = tmp_path / "passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(passwords), "speaker", "s3cret pass"], check=True, capture_output=True
    )
    tls_port = free_port()
    broker = Mosquitto(
        tmp_path,
        extra_conf=(
            f"per_listener_settings false\npassword_file {passwords}\n"
            f"listener {tls_port} 127.0.0.1\ncafile {ca}\ncertfile {cert}\nkeyfile {key}\n"
        ),
    )
    broker.conf.write_text(broker.conf.read_text().replace("allow_anonymous true", "allow_anonymous false"))
    broker.start()
    try:
        secret = tmp_path / "mqtt-password"
        secret.write_text("s3cret pass\n")
        config = write_config(
            tmp_path / "d.yaml",
            tls_port,
            mqtt={
                "host": "localhost",
                "username": "speaker",
                "password_file": str(secret),
                "tls": {"ca_file": str(ca)},
            },
        )
        context = ssl.create_default_context(cafile=str(ca))
        async with aiomqtt.Client(
            "localhost", tls_port, username="speaker", password="s3cret pass", tls_context=context
        ) as client:
            await client.subscribe("s2s/#", qos=1)
            async with daemon_in_process(config):
                async with asyncio.timeout(20):
                    got: dict[str, bytes] = {}
                    async for m in client.messages:
                        got[m.topic.value] = bytes(m.payload)  # type: ignore[arg-type]
                        if got.get("s2s/kitchen/status") == b"online" and "say" not in got:
                            got["say"] = b""
                            await client.publish(SAY, b"over tls", qos=1)
                        if "s2s/kitchen/tts/finished" in got:
                            break
                assert b'"status":"completed"' in got["s2s/kitchen/tts/finished"]
    finally:
        broker.stop()


async def test_wrong_password_keeps_retrying_without_crashing(tmp_path: Path) -> None:
    passwords = tmp_path / "passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(passwords), "speaker", "right"], check=True, capture_output=True
    )
    broker = Mosquitto(tmp_path, extra_conf=f"password_file {passwords}")
    broker.conf.write_text(broker.conf.read_text().replace("allow_anonymous true", "allow_anonymous false"))
    broker.start()
    try:
        secret = tmp_path / "pw"
        secret.write_text("wrong")
        config = write_config(
            tmp_path / "d.yaml",
            broker.port,
            mqtt={"username": "speaker", "password_file": str(secret), "reconnect_max_s": 0.5},
        )
        proc = DaemonProcess(config)
        proc.start()
        try:
            # refused, it tries again (reconnect_max_s: 0.5) and is refused again, and lives on
            await until(lambda: proc.log().count('"mqtt_disconnected"') >= 2, 30, "a second refusal")
            assert proc.proc is not None and proc.proc.poll() is None
            proc.signal(signal.SIGTERM)
            assert await proc.wait(15) == 0
        finally:
            proc.cleanup()
    finally:
        broker.stop()


@pytest.mark.timeout(60)
async def test_requests_sent_while_the_daemon_was_away_are_served(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = write_config(tmp_path / "d.yaml", mosquitto.port)
    first = DaemonProcess(config, log_path=tmp_path / "first.log")
    async with recorder(mosquitto.port, identifier="watch", persistent=True) as rec:
        first.start()
        await rec.wait_for(lambda: rec.on("/status") and rec.on("/status")[-1].payload == b"online", 30)
        first.signal(signal.SIGTERM)
        assert await first.wait(15) == 0
        await rec.wait_for(lambda: rec.on("/status")[-1].payload == b"offline")
        for i in range(5):
            await rec.say(SAY, {"id": f"away{i}", "text": "sent while the daemon was stopped"})
        second = DaemonProcess(config, log_path=tmp_path / "second.log")
        second.start()
        try:
            fin = await rec.wait_finished([f"away{i}" for i in range(5)], timeout_s=30)
            assert {p["status"] for p in fin.values()} == {"completed"}
        finally:
            second.signal(signal.SIGTERM)
            await second.wait(15)
            second.cleanup()
