"""TLS client certificates against a real mosquitto (``require_certificate true``): the daemon
connects with ``mqtt.tls.cert_file``/``key_file``; a missing or foreign certificate is retried
(the broker is away for it, never fatal); a key file that cannot be used is exit 78 naming it."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from s2s_daemon.config import TlsConfig
from s2s_daemon.errors import EXIT_CONFIG, ConfigError
from s2s_daemon.mqtt.connection import tls_context
from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import DaemonProcess, daemon_in_process, write_config
from tests.support.mqtt import recorder
from tests.support.wait import until
from tests.test_mqtt_security import make_tls

pytestmark = pytest.mark.integration

SAY = "s2s/kitchen/tts/say"


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def client_cert(tmp: Path, name: str, ca: Path, ca_key: Path) -> tuple[Path, Path]:
    """A client certificate ``CN=name`` signed by ``ca``, and its unencrypted key."""
    key, csr, cert = tmp / f"{name}.key", tmp / f"{name}.csr", tmp / f"{name}.pem"
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "2",
    )  # fmt: skip
    return cert, key


def foreign_ca(tmp: Path) -> tuple[Path, Path]:
    key, ca = tmp / "rogue-ca.key", tmp / "rogue-ca.pem"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(ca),
            "-days", "2", "-subj", "/CN=rogue-ca")  # fmt: skip
    return ca, key


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    pki_dir = tmp_path / "pki"
    pki_dir.mkdir()
    ca, server_cert, server_key = make_tls(pki_dir)
    cert, key = client_cert(pki_dir, "s2s-kitchen", ca, pki_dir / "ca.key")
    rogue_ca, rogue_ca_key = foreign_ca(pki_dir)
    rogue_cert, rogue_key = client_cert(pki_dir, "s2s-kitchen-rogue", rogue_ca, rogue_ca_key)
    return {
        "ca": ca,
        "server_cert": server_cert,
        "server_key": server_key,
        "cert": cert,
        "key": key,
        "rogue_cert": rogue_cert,
        "rogue_key": rogue_key,
    }


@pytest.fixture
def mtls_broker(tmp_path: Path, pki: dict[str, Path]) -> Iterator[Mosquitto]:
    """The plain listener (anonymous, for the tests' client) and a TLS one that requires a client
    certificate from the CA, its common name as the user name."""
    tls_port = free_port()
    broker = Mosquitto(
        tmp_path,
        extra_conf=(
            f"listener {tls_port} 127.0.0.1\nallow_anonymous false\n"
            f"cafile {pki['ca']}\ncertfile {pki['server_cert']}\nkeyfile {pki['server_key']}\n"
            "require_certificate true\nuse_identity_as_username true\n"
        ),
    )
    broker.conf.write_text("per_listener_settings true\n" + broker.conf.read_text())
    broker.tls_port = tls_port  # type: ignore[attr-defined]
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def tls_config(tmp_path: Path, port: int, tls: dict[str, str], name: str = "d") -> Path:
    return write_config(tmp_path / f"{name}.yaml", port, mqtt={"host": "localhost", "tls": tls})


async def test_the_daemon_connects_with_its_client_certificate(
    tmp_path: Path, pki: dict[str, Path], mtls_broker: Mosquitto
) -> None:
    tls = {"ca_file": str(pki["ca"]), "cert_file": str(pki["cert"]), "key_file": str(pki["key"])}
    config = tls_config(tmp_path, mtls_broker.tls_port, tls)  # type: ignore[attr-defined]
    async with recorder(mtls_broker.port) as rec, daemon_in_process(config):
        await rec.wait_for(lambda: [m for m in rec.on("/kitchen/status") if m.payload == b"online"], 20)
        await rec.say(SAY, {"id": "mtls-1", "text": "with a client certificate"})
        assert (await rec.wait_finished(["mtls-1"], 20))["mtls-1"]["status"] == "completed"
    log = mtls_broker.log.read_text(errors="replace")
    assert "u's2s-kitchen'" in log  # the certificate's name was the user name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["none", "foreign"])
async def test_a_missing_or_foreign_client_certificate_is_retried(
    tmp_path: Path, pki: dict[str, Path], mtls_broker: Mosquitto, which: str
) -> None:
    tls = {"ca_file": str(pki["ca"])}
    if which == "foreign":
        tls |= {"cert_file": str(pki["rogue_cert"]), "key_file": str(pki["rogue_key"])}
    config = write_config(
        tmp_path / "d.yaml",
        mtls_broker.tls_port,  # type: ignore[attr-defined]
        mqtt={"host": "localhost", "tls": tls, "reconnect_max_s": 0.5},
    )
    proc = DaemonProcess(config)
    try:
        async with recorder(mtls_broker.port) as rec:
            proc.start()

            def retried() -> bool:  # and not given up
                assert proc.proc is not None and proc.proc.poll() is None, proc.log()[-2000:]
                return proc.log().count("mqtt_disconnected") >= 2

            await until(retried, 30, "a second failed connection")
            assert rec.on("/kitchen/status") == []  # it never got in
            if which == "none":
                assert "it may require a client certificate" in proc.log()
            proc.signal(signal.SIGTERM)
            assert await proc.wait(20) == 0
    finally:
        proc.cleanup()


def test_an_unusable_key_file_is_a_config_error_naming_it(tmp_path: Path, pki: dict[str, Path]) -> None:
    missing = tmp_path / "nope.key"
    with pytest.raises(ConfigError, match=rf"mqtt\.tls\.key_file: cannot read {missing}"):
        tls_context(TlsConfig(ca_file=pki["ca"], cert_file=pki["cert"], key_file=missing))
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    with pytest.raises(ConfigError, match=rf"mqtt\.tls\.key_file {garbage}: not a usable PEM"):
        tls_context(TlsConfig(ca_file=pki["ca"], cert_file=pki["cert"], key_file=garbage))
    with pytest.raises(ConfigError, match=r"not a usable PEM"):  # a key that is not the certificate's
        tls_context(TlsConfig(ca_file=pki["ca"], cert_file=pki["cert"], key_file=pki["rogue_key"]))
    encrypted = tmp_path / "encrypted.key"
    openssl("pkey", "-in", str(pki["key"]), "-aes256", "-passout", "pass:secret", "-out", str(encrypted))
    with pytest.raises(ConfigError, match=r"the key is encrypted"):  # never a prompt on the terminal
        tls_context(TlsConfig(ca_file=pki["ca"], cert_file=pki["cert"], key_file=encrypted))
    with pytest.raises(ConfigError, match=r"mqtt\.tls\.key_file: .* without mqtt\.tls\.cert_file"):
        tls_context(TlsConfig(ca_file=pki["ca"], key_file=pki["key"]))
    with pytest.raises(ConfigError, match=r"mqtt\.tls\.cert_file: cannot read"):
        tls_context(TlsConfig(ca_file=pki["ca"], cert_file=tmp_path / "nope.pem", key_file=pki["key"]))
    assert tls_context(TlsConfig(ca_file=pki["ca"], cert_file=pki["cert"], key_file=pki["key"])) is not None


@pytest.mark.timeout(60)
async def test_the_daemon_exits_78_when_its_key_file_cannot_be_read(tmp_path: Path, pki: dict[str, Path]) -> None:
    missing = tmp_path / "gone.key"
    tls = {"ca_file": str(pki["ca"]), "cert_file": str(pki["cert"]), "key_file": str(missing)}
    proc = DaemonProcess(tls_config(tmp_path, free_port(), tls))
    try:
        proc.start()
        assert await proc.wait(30) == EXIT_CONFIG
        assert f"mqtt.tls.key_file: cannot read {missing}" in proc.log()
    finally:
        proc.cleanup()
