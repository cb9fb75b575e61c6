"""Text-to-speech: the engine protocol, registry, worker thread and stage."""
