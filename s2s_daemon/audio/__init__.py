"""Audio sinks: speaker (PortAudio), WAV files, discard."""
