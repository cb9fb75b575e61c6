"""The broker connection: paho-mqtt behind our adapter, the messages both ways, topics, the embedded broker."""
