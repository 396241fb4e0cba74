"""The admin API's client for ``fedfleet admin``: one request, its answer bounded and read as JSON, a
refusal or an unreachable API one line (``AdminError``); redirects never followed (the token stays).
Only the standard library is used (urllib)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .terminal_text import literal_line, one_line, terminal_safe

# what the CLI reads of an answer: the API's largest JSON answers (a job's rounds, the fleet's
# devices) are a few megabytes; an error's body a line. Past these the answer is refused unread,
# so a server that is not the admin API (a mistyped --url, a proxy) fills no memory.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024


class AdminError(Exception):
    """The API refused a request (message from its ``detail``) or could not be reached."""


def error_detail(body: bytes) -> str:
    """An error answer's ``detail`` (FastAPI's; a validation error's list as its Python literal,
    ``literal_line``), else its text, as one line: the server's words may quote a device's (a
    decline reason, a profile), so their controls are escaped, once, and a body past
    ``MAX_ERROR_BYTES`` is cut."""
    text = body[:MAX_ERROR_BYTES].decode(errors="replace")
    try:
        detail = json.loads(text)["detail"]
        if not isinstance(detail, str):
            return literal_line(detail)
    except (ValueError, TypeError, KeyError, RecursionError):   # RecursionError: too deep for json or repr
        detail = text
    return one_line(detail + ("\u2026" if len(body) > MAX_ERROR_BYTES else ""))


class RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """The admin API never redirects. urllib's own handler would follow a redirect with every
    header of the request, the bearer token included, to whatever host the answer names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise AdminError(f"{req.get_method()} {req.full_url}: HTTP {code} redirect to {terminal_safe(newurl)!r} "
                         "not followed (the admin API never redirects; the token stays here)")


class AdminClient:
    def __init__(self, url: str, token: str, timeout: float = 30.0):
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout
        self.opener = urllib.request.build_opener(RefuseRedirects)

    def request(self, method: str, path: str, body: Any = None, raw: bool = False):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              **({"Content-Type": "application/json"} if data else {})})
        try:
            with self.opener.open(req, timeout=self.timeout) as resp:
                payload = resp.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as exc:
            try:
                detail = error_detail(exc.read(MAX_ERROR_BYTES + 1))
            except (OSError, http.client.HTTPException) as cut:     # the body cut short: said, not raised
                detail = f"(its body unread: {type(cut).__name__})"
            raise AdminError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise AdminError(f"cannot reach the admin API at {self.url}: {exc.reason}") from None
        except http.client.HTTPException as exc:
            # no OSError, so urllib lets it through: a --url naming another service (an SSH banner's
            # BadStatusLine) or a connection cut inside a chunked answer (IncompleteRead)
            raise AdminError(f"{method} {path}: {self.url} did not answer as an HTTP server "
                             f"({type(exc).__name__}: {one_line(exc, 200)})") from None
        if len(payload) > MAX_ANSWER_BYTES:
            raise AdminError(f"{method} {path}: the answer is larger than {MAX_ANSWER_BYTES} bytes: not read")
        if raw:
            return payload
        try:
            return json.loads(payload)
        except RecursionError:          # nested thousands deep: json raises no ValueError for that
            raise AdminError(f"{method} {path}: the answer is nested deeper than JSON is read here") from None

    def get(self, path: str, raw: bool = False):
        return self.request("GET", path, raw=raw)

    def post(self, path: str, body: Any = None):
        return self.request("POST", path, body if body is not None else {})


def all_pages(client: AdminClient, path: str, key: str, page: int = 1000, most: int | None = None,
              **params) -> list[dict]:
    """Every row a paged listing (/api/devices, /api/jobs, /api/models, /api/deployments) holds, page
    after page (each at most ``page`` rows, each after the last row's ``key``), or its first ``most``."""
    out: list[dict] = []
    while most is None or len(out) < most:
        size = page if most is None else min(page, most - len(out))
        query = urllib.parse.urlencode({**{k: v for k, v in params.items() if v is not None}, "limit": size,
                                        **({"after": out[-1][key]} if out else {})})
        rows = client.get(f"{path}?{query}")
        out += rows
        if len(rows) < size:
            break
    return out


def all_devices(client: AdminClient, status: str | None = None, page: int = 1000) -> list[dict]:
    """Every device /api/devices lists, page after page (it lists at most ``page`` at a time)."""
    return all_pages(client, "/api/devices", "device_id", page, status=status)
