"""Exit codes and the exceptions that map onto them."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 64
"""EX_USAGE: a command was given something it cannot take (a voice name with a slash)."""
EXIT_DATAERR = 65
"""EX_DATAERR: an input file is not what the command needs (a recording it cannot read, or silence)."""
EXIT_NOINPUT = 66
"""EX_NOINPUT: an input file does not exist or cannot be read."""
EXIT_CANTCREAT = 73
"""EX_CANTCREAT: an output file cannot be made (``say --out`` where nothing can be written)."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT: a command stopped by Ctrl-C, as a shell reports it."""
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


class UsageError(DaemonError):
    """A command's argument is not acceptable; the message says which and why."""

    exit_code = EXIT_USAGE


class DataError(DaemonError):
    """An input file is not what the command needs (its format, its content)."""

    exit_code = EXIT_DATAERR


class NoInputError(DaemonError):
    """An input file does not exist or cannot be read."""

    exit_code = EXIT_NOINPUT


class UnavailableError(DaemonError):
    """A required component (an extra, a device, a broker) is unavailable."""

    exit_code = EXIT_UNAVAILABLE


class CantCreateError(DaemonError):
    """An output file cannot be made or written."""

    exit_code = EXIT_CANTCREAT
