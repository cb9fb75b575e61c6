"""Pipeline plumbing: bounded channels, messages, cancellation."""
