"""MQTT intake: topics, payload schemas, the client link, the Hermes bridge, the embedded broker."""
