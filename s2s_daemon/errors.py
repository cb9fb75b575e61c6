"""Exit codes and the exceptions that map onto them."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_UNAVAILABLE = 69
"""EX_UNAVAILABLE: a required service or component is missing."""
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
