"""Outgoing events: request lifecycle, state, latency and memory telemetry."""
