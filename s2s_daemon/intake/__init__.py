"""Intake: payload schemas and the MQTT message handler (say, stop, pool, Hermes); the link is s2s_daemon.mqtt."""
