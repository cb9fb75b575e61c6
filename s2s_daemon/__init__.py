"""s2s-daemon: a real-time voice output daemon (MQTT in, Qwen3-TTS, speaker out)."""

__version__ = "0.1.0"
