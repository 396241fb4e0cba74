"""Which origins a dashboard change may come from (``guard.py`` asks, for a change made with the
session cookie whose browser sent ``Origin`` and no ``Sec-Fetch-Site``).

The request's own ``Host`` gives one: the dashboard's address when the browser reaches uvicorn
directly. Behind a reverse proxy that rewrites Host (nginx's ``proxy_pass http://127.0.0.1:8080``
sends ``Host: 127.0.0.1:8080``) the browser's origin is the proxy's, ``https://fleet.example.com``,
and only the operator knows it: ``aggregator serve --public-origin https://fleet.example.com``
(repeatable) names it, as Django's ``CSRF_TRUSTED_ORIGINS`` does. ``X-Forwarded-Host`` is never
read: any client can send it, and trusting it would let a page on another site name itself the
dashboard.

Which scheme the dashboard is at, for a request, says which Host-derived origin counts and whether
the session cookie is ``Secure`` (``guard.py``): see :meth:`DashboardOrigins.scheme`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")
EXPECTED = "expected scheme://host[:port] as the browser's address bar shows it, e.g. https://fleet.example.com"


def _serialized_origin(text: str) -> str:
    """``text`` as browsers serialize an origin (RFC 6454: lower case, the scheme's default port
    left out); ValueError saying what is not an origin in it."""
    if text != text.strip() or any(c.isspace() for c in text):
        raise ValueError("it holds white space")
    try:
        parts = urlsplit(text)
        port = parts.port                   # ValueError: not a number, or past 65535
    except ValueError:
        raise ValueError("its host or port cannot be read (a port is 1..65535)") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise ValueError("its scheme is not http or https (one origin per flag, no wildcards)")
    if parts.username is not None or parts.password is not None or parts.path not in ("", "/") \
            or parts.query or parts.fragment or "?" in text or "#" in text:
        raise ValueError("an origin has no user, path, query or fragment")
    host = parts.hostname or ""
    if parts.netloc.endswith("]") or ":" in host:       # an IPv6 literal, bracketed in the origin
        try:
            host = f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError:
            raise ValueError("its host is not an IPv6 address") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError("its host is not a host name or address (a name in punycode, no wildcards)")
    if port == 0:
        raise ValueError("its port is 0 (a port is 1..65535)")
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != DEFAULT_PORTS[scheme] else "")


def public_origin(text: str) -> str:
    """One ``--public-origin`` value, serialized as the browser will send it; ValueError, one line
    naming the flag, the value and what is expected."""
    try:
        return _serialized_origin(text)
    except ValueError as exc:
        raise ValueError(f"--public-origin {text!r}: {exc}; {EXPECTED}") from None


def _host_origin(scheme: str, host: str) -> str | None:
    """The origin a request's ``Host`` names under ``scheme``, serialized; None for a Host that is no
    host[:port]."""
    try:
        return _serialized_origin(f"{scheme}://{host}")
    except ValueError:
        return None


class DashboardOrigins:
    """The origins the dashboard is reached at: the request's Host, and the public origins named."""

    def __init__(self, public: Iterable[str] = ()):
        self.public = frozenset(public_origin(origin) for origin in public)

    def scheme(self, request_scheme: str, host: str) -> str:
        """The scheme the browser reaches the dashboard by for a request that uvicorn received as
        ``request_scheme`` (https: uvicorn's own TLS, or X-Forwarded-Proto from a proxy it trusts):
        https, too, when Host is a public origin named only as https (a proxy that forwards the
        browser's Host but not its scheme). http otherwise: local use over http://127.0.0.1."""
        if request_scheme == "https":
            return "https"
        named_https = _host_origin("https", host) in self.public and _host_origin("http", host) not in self.public
        return "https" if named_https else "http"

    def allows(self, origin: str, host: str, request_scheme: str = "http") -> bool:
        """Whether a browser's ``Origin`` is the dashboard's: the origin Host names under the
        dashboard's scheme (also https when that is http: a TLS proxy that does not say so; never
        http when it is https, where a page on the plain-HTTP side of the same name, which anyone
        on the network can write, passed before), or exactly a named public origin."""
        if origin == "null":                # an opaque origin (a sandboxed frame, a file): never ours
            return False
        try:
            given = _serialized_origin(origin)
        except ValueError:
            return False
        if given in self.public:
            return True
        schemes = ("https",) if self.scheme(request_scheme, host) == "https" else ("http", "https")
        return given in {_host_origin(scheme, host) for scheme in schemes} - {None}
