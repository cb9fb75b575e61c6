"""An in-process MQTT broker (amqtt) bound to loopback, for a first run without mosquitto.

amqtt speaks MQTT 3.1.1 only: the link falls back to 3.1.1 and v5 features (response
topic, correlation data, session expiry) are unavailable. Production uses an external
broker.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

from s2s_daemon.errors import UnavailableError

log = structlog.get_logger(__name__)


class EmbeddedBroker:
    def __init__(self, port: int) -> None:
        self.port = port
        self._broker: Any = None

    async def start(self) -> None:
        try:
            from amqtt.broker import Broker
        except ImportError as exc:
            raise UnavailableError(f"mqtt.broker 'embedded' needs the amqtt package: {exc}") from exc
        # amqtt logs every packet at INFO; keep it to warnings.
        logging.getLogger("amqtt").setLevel(logging.WARNING)
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        broker = Broker(config)
        try:
            await broker.start()
        except Exception as exc:  # amqtt wraps bind failures in its own BrokerError
            raise UnavailableError(f"embedded MQTT broker cannot listen on 127.0.0.1:{self.port}: {exc}") from exc
        self._broker = broker
        log.info("embedded_broker_started", host="127.0.0.1", port=self.port, protocol="3.1.1")

    async def stop(self) -> None:
        if self._broker is not None:
            await self._broker.shutdown()
            self._broker = None
