"""Web and e-mail addresses as a person reads them: a URL by its host name (``docs dot python
dot org``), an e-mail address whole (``alice at example dot com``). Every pattern starts where a
run of address characters starts, so a long word is scanned once (linear time)."""

from __future__ import annotations

import re

from s2s_daemon.text.languages import AT, DOT

_URL = re.compile(r"(?<![\w/.@-])(?:https?://|www\.)[^\s\x00-\x1f<>()\[\]{}\"'`]+", re.IGNORECASE)
_EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_TRAILING = ".,;:!?'\""


def _dotted(name: str, language: str) -> str:
    parts = [part for part in name.split(".") if part]
    joiner = DOT[language] if language in ("zh",) else f" {DOT[language]} "
    return joiner.join(parts)


def _host(url: str) -> str:
    rest = url.split("://", 1)[1] if "://" in url else url
    host = re.split(r"[/?#]", rest, maxsplit=1)[0].rsplit("@", 1)[-1]
    host = host.split(":", 1)[0] if host.count(":") == 1 else host  # a port, not an IPv6 address
    return host[4:] if host.lower().startswith("www.") else host


def read_addresses(text: str, language: str) -> str:
    """``text`` with every URL as its host name and every e-mail address in words."""
    if "://" in text or "www." in text.lower():
        text = _URL.sub(lambda m: _url(m.group(0), language), text)
    if "@" in text:
        text = _EMAIL.sub(lambda m: _email(m.group(0), language), text)
    return text


def _url(found: str, language: str) -> str:
    stripped = found.rstrip(_TRAILING)
    host = _host(stripped)
    spoken = _dotted(host, language) if host else ""
    return spoken + found[len(stripped) :]


def _email(found: str, language: str) -> str:
    local, domain = found.rsplit("@", 1)
    stripped = domain.rstrip(_TRAILING)
    at = AT[language]
    return f"{_dotted(local, language)} {at} {_dotted(stripped, language)}{domain[len(stripped) :]}"
