"""Who may drive the HTTP port from a browser: the ``Host`` allow-list, the same-origin rule for
state-changing requests and JSON bodies sent as JSON.

A web page the user visits can send requests to ``127.0.0.1:5050``: as a form or ``text/plain``
(no CORS preflight), or after rebinding its own DNS name to 127.0.0.1, then with its own name as
``Host`` and the answers readable. So the server answers only a ``Host`` that is a loopback name, an
IP address (a page cannot rebind one: its origin would be that address), the configured host, this
machine's name or a name in ``http.allowed_hosts``; refuses a POST/PUT/PATCH/DELETE whose ``Origin``
is another site's (clients with no ``Origin``, as the openai SDK and curl, are served); and a JSON
endpoint refuses any other content type (415), which no form can send cross-site without CORS.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from s2s_daemon.intake.http.api import ApiError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
"""Names of this machine's loopback; ``*.localhost`` too (browsers resolve them to loopback themselves)."""
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that change nothing: served whatever their ``Origin``."""
DEFAULT_PORTS = {"http": "80", "https": "443"}


def split_host(host: str) -> tuple[str, str | None]:
    """A ``Host`` header's name (lower case) and port: ``[::1]:5050`` -> ``("::1", "5050")``."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return host[1:], None
        port = host[end + 1 :]
        return host[1:end], port[1:] if port.startswith(":") and port[1:].isdigit() else None
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        return name.rstrip("."), port
    return host.rstrip("."), None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class RequestGuard:
    """The checks the middleware runs before the key's: ``check(request)`` raises the 403."""

    def __init__(self, host: str, allowed_hosts: tuple[str, ...]) -> None:
        machine = socket.gethostname().lower()
        self.any_host = "*" in allowed_hosts
        self.names = frozenset(
            {split_host(host)[0], machine, machine.partition(".")[0], f"{machine.partition('.')[0]}.local"}
            | set(allowed_hosts)
        )
        """The names answered besides loopback names and IP addresses."""

    def host_allowed(self, name: str) -> bool:
        return (
            self.any_host or _is_ip(name) or name in LOOPBACK_NAMES or name.endswith(".localhost") or name in self.names
        )

    def check(self, request: web.Request) -> None:
        host = request.headers.get(hdrs.HOST)
        name = split_host(host)[0] if host is not None else None
        if name is not None and not self.host_allowed(name):
            raise ApiError(
                403,
                f"Host {name!r} is not served here: add it to http.allowed_hosts if this server is"
                " reached by that name (a web page can point its own name at this machine: DNS rebinding)",
                code="host_not_allowed",
            )
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is not None and request.method not in SAFE_METHODS and not _same_origin(origin, host):
            raise ApiError(
                403,
                f"cross-site request refused: Origin {origin!r} is not this server ({host or 'no Host'});"
                " send it from the page itself, or without an Origin header (the openai SDK, curl)",
                code="cross_origin",
            )


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether ``Origin`` names the server at ``Host`` (the page's own fetches). Behind a proxy that
    ends TLS the page is https and this server http: the scheme is not compared, host and port are."""
    if host is None or origin == "null":
        return False
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in DEFAULT_PORTS or parts.hostname is None:
        return False
    name, host_port = split_host(host)
    origin_port = str(port) if port is not None else DEFAULT_PORTS[parts.scheme]
    return parts.hostname.rstrip(".") == name and origin_port == (host_port or DEFAULT_PORTS[parts.scheme])


async def json_body(request: web.Request) -> bytes:
    """The body of a request to a JSON endpoint; 415 unless it is sent as ``application/json``."""
    if request.content_type != "application/json":
        sent = request.content_type if hdrs.CONTENT_TYPE in request.headers else "no content type"
        raise ApiError(415, f"send the body as application/json, not {sent}", code="unsupported_media_type")
    return await request.read()
