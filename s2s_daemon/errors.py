"""Exit codes and the exceptions that map onto them."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_UNAVAILABLE = 69
"""EX_UNAVAILABLE: a required service or component is missing."""
EXIT_SOFTWARE = 70
"""EX_SOFTWARE: the engine thread is wedged (it did not return after a request failed); a
service manager restarts the daemon, and the journal resumes the unanswered requests."""
EXIT_NOPERM = 77
"""EX_NOPERM: the broker refused one of the daemon's subscriptions (its ACL): restarting cannot fix it."""
EXIT_CONFIG = 78
"""EX_CONFIG: the configuration is invalid."""


class DaemonError(Exception):
    """Base of the errors that end the process with a specific exit code."""

    exit_code = EXIT_FAILURE


class ConfigError(DaemonError):
    """The configuration is invalid; the message names the key."""

    exit_code = EXIT_CONFIG


class UnavailableError(DaemonError):
    """A required component (an extra, a device, a broker) is unavailable."""

    exit_code = EXIT_UNAVAILABLE
