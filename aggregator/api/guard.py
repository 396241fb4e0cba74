"""An ASGI layer in front of the admin API that refuses before it reads: a request without the
admin token, or with a body larger than the cap, is answered 401 / 413 while its body is still
unread (FastAPI reads a request's body before it runs the route's dependencies, so the token
check alone would let anyone make the process buffer a 300 MB upload). A body with no
Content-Length (chunked) is counted as it streams and cut off at the cap.

A browser that opens the dashboard (or ``/``) without a valid session gets the sign-in page
(HTML, still status 401) instead of the API's JSON refusal. The page POSTs the token to
``/dashboard/login`` (the one path open without it; its body at most 4 KiB), which answers with a
session cookie and a redirect to the dashboard. The token never appears in a URL (where history,
proxy logs and Referer headers keep it), and the cookie is not the token: it is an opaque
session, ``issued.nonce.HMAC-SHA256(token, issued.nonce)``, valid for 12 hours and only as a
cookie (never as a Bearer token), so a cookie that leaks gives neither the token nor lasting
access, and a new token ends every session. Being read without the token, the sign-in form must
also be in within ``LOGIN_BODY_TIMEOUT_S`` (else 408 and the connection closed): uvicorn has no
deadline for a body, and sign-ins that sent their head and then nothing held every one of its
connection slots for good, the operator answered 503 (a review's finding).

A change made with the session cookie (any method but GET, HEAD and OPTIONS) must come from the
dashboard's own origin: the browser says where a request comes from (``Sec-Fetch-Site``, else
``Origin``), and one from another origin is refused (403) before anything runs; behind a reverse
proxy that rewrites Host the operator names the dashboard's public origins (``origins.py``). ``SameSite=Strict``
keeps the cookie from other sites, not from another port or subdomain of the same site, where a
form could POST to ``/api/jobs/{id}/cancel`` with it (a review's finding). Bearer requests (the CLI,
scripts) carry no cookie and are not affected.

The cookie is ``Secure`` when the dashboard is at https for the sign-in request (``origins.py``'s
``scheme``: uvicorn's TLS or a trusted proxy's X-Forwarded-Proto, or Host naming a public origin
given only as https): without it a browser signed in at https://fleet.example.com would send the
session to http://fleet.example.com too.

The guard also holds the API's request slots (``connections.RequestSlots``), decided here, where
the request's head has been read: a request takes a slot of the pool its token (or session) says
before anything else runs, and one that finds its pool full is answered 503 with its connection
closed. Every answer to a request without the token closes its connection (``Connection: close``):
a client without the token keeps no connection alive between requests, and the operator's share of
the slots is never anyone else's (``connections.py`` says why).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import html
import json
import re
import secrets
import time
from http.cookies import SimpleCookie
from importlib import resources
from urllib.parse import parse_qs, parse_qsl

from starlette.requests import cookie_parser

from aggregator.api.connections import RequestSlots
from aggregator.api.origins import DashboardOrigins

MAX_BODY_BYTES = 1024 * 1024          # the largest request the API takes (a job config, a key)
MAX_LOGIN_BYTES = 4096                # the sign-in form: one token
LOGIN_BODY_TIMEOUT_S = 10.0           # ... sent within this of its head (a browser sends it at once)
COOKIE = "fedfleet_session"
SESSION_TTL_S = 12 * 3600
LOGIN_PATH = "/dashboard/login"
LOGIN_PATHS = ("/", "/dashboard", "/dashboard/")     # where a browser without a session is asked for the token
_ISSUED = re.compile(r"[0-9]{1,12}")
# The dashboard shows what devices wrote (profiles, decline reasons) and app.js writes it as text
# only; its policy is the second line: no inline script or handler runs, nothing loads from
# elsewhere, no other site frames it. The sign-in page has no script and one inline style.
_FRAMING = "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
DASHBOARD_HEADERS = {"content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                                f"img-src 'self'; connect-src 'self'; {_FRAMING}",
                     "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}
LOGIN_HEADERS = {**DASHBOARD_HEADERS,
                 "content-security-policy": f"default-src 'none'; style-src 'unsafe-inline'; {_FRAMING}"}


def token_matches(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


def _session_mac(token: str, body: str) -> str:
    mac = hmac.new(token.encode(), b"fedfleet-dashboard-session|" + body.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def new_session(token: str, now: float | None = None) -> str:
    body = f"{int(time.time() if now is None else now)}.{secrets.token_urlsafe(18)}"
    return f"{body}.{_session_mac(token, body)}"


def session_valid(value: str, token: str, now: float | None = None) -> bool:
    issued, _, rest = value.partition(".")
    nonce, _, mac = rest.partition(".")
    # ASCII digits only: str.isdigit() takes '²', which int() refuses (a 500 before any check)
    if not (_ISSUED.fullmatch(issued) and nonce and mac) or len(value) > 256:
        return False
    age = (time.time() if now is None else now) - int(issued)
    return 0 <= age <= SESSION_TTL_S and hmac.compare_digest(mac.encode(), _session_mac(token, f"{issued}.{nonce}").encode())


def _headers(scope: dict) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}


def _session_cookie(headers: dict[str, str]) -> str | None:
    # starlette's parser, as browsers send cookies: SimpleCookie stops at the first value it cannot
    # parse, so another application's cookie on the same host (a JSON value, a space) hid the session
    return cookie_parser(headers.get("cookie", "")).get(COOKIE)


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def cross_origin_change(scope: dict, origins: DashboardOrigins) -> bool:
    """Whether a cookie-authenticated change comes from another origin than the dashboard's, by what
    the browser says (a browser that says nothing keeps SameSite=Strict's protection alone).
    ``Sec-Fetch-Site`` comes first: the browser computes it from the page's URL and the request's,
    whatever a proxy does to Host, and a page cannot set it."""
    headers = _headers(scope)
    if scope.get("method") in SAFE_METHODS or headers.get("authorization", "")[:7].lower() == "bearer ":
        return False
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site not in ("same-origin", "none")
    origin = headers.get("origin")
    if origin is None:
        return False
    return not origins.allows(origin, headers.get("host", ""), scope.get("scheme", "http"))


def _repeated_query_parameter(scope: dict) -> str | None:
    """A query parameter named twice (the framework takes the last one silently: a review found
    ``forget?job_id=a&job_id=b`` acting on b, as a JSON body's repeated key did before)."""
    seen: set[str] = set()
    for name, _ in parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True):
        if name in seen:
            return name
        seen.add(name)
    return None


def authenticated(scope: dict, token: str) -> bool:
    """Whether a request carries the admin token as a Bearer header, or a valid dashboard session."""
    headers = _headers(scope)
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return token_matches(auth[7:].strip(), token)
    session = _session_cookie(headers)
    return session is not None and session_valid(session, token)


class RequestGuard:
    def __init__(self, app, token: str, max_body: int = MAX_BODY_BYTES, origins: DashboardOrigins | None = None):
        self.app, self.token, self.max_body = app, token, max_body
        self.origins = origins or DashboardOrigins()
        self.slots = RequestSlots()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        with_token = authenticated(scope, self.token)
        if not self.slots.take(with_token):
            return await _answer(send, 503, "the admin API is answering as many requests as it takes; try again",
                                 {"connection": "close", "retry-after": "1"})
        try:
            await self._guarded(scope, receive, send if with_token else _closing(send), with_token)
        finally:
            self.slots.give_back(with_token)

    async def _guarded(self, scope, receive, send, with_token: bool) -> None:
        if scope["path"] == LOGIN_PATH and scope.get("method") == "POST":
            return await self._sign_in(scope, receive, send)
        if not with_token:
            if scope["path"] in LOGIN_PATHS and scope.get("method") == "GET":
                expired = _session_cookie(_headers(scope)) is not None
                return await _login_page(send, "Your session has ended; sign in again." if expired else "")
            return await _answer(send, 401, "missing or wrong admin token", {"www-authenticate": "Bearer"})
        if cross_origin_change(scope, self.origins):
            return await _answer(send, 403, "a change with the dashboard's session must come from the dashboard's origin")
        if (repeated := _repeated_query_parameter(scope)) is not None:
            return await _answer(send, 400, f"query parameter {repeated[:64]!r} given more than once")
        length = dict(scope.get("headers", ())).get(b"content-length")
        # (a length of more digits than any body could have is refused before int() is asked to read it)
        if length is not None and (not length.isdigit() or len(length) > 18 or int(length) > self.max_body):
            return await _answer(send, 413, f"request body larger than {self.max_body} bytes")
        return await self._bounded(scope, receive, send)

    async def _bounded(self, scope, receive, send) -> None:
        """The app, its body cut at max_body however it is sent (a chunked body has no length): past
        it the app reads a disconnect and the guard answers 413 itself, unless the app has already
        begun its answer (before, the app's own parse error said only "error parsing the body")."""
        seen, too_large, started = 0, False, False

        async def bounded_receive():
            nonlocal seen, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                too_large = True
                return {"type": "http.disconnect"}
            return message

        async def tracked_send(message):
            nonlocal started
            if too_large and not started:
                return                                  # the guard's 413 instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not started:
            await _answer(send, 413, f"request body larger than {self.max_body} bytes")

    async def _sign_in(self, scope, receive, send) -> None:
        """The sign-in form's POST: the token in a urlencoded body of at most MAX_LOGIN_BYTES, sent
        within LOGIN_BODY_TIMEOUT_S."""
        try:
            async with asyncio.timeout(LOGIN_BODY_TIMEOUT_S):
                body = await _login_body(receive)
        except TimeoutError:
            return await _answer(send, 408, f"the sign-in form did not arrive within {LOGIN_BODY_TIMEOUT_S:g} s",
                                 {"connection": "close"})
        if body is None:                                # the client went away
            return
        if len(body) > MAX_LOGIN_BYTES:
            return await _answer(send, 413, f"sign-in body larger than {MAX_LOGIN_BYTES} bytes")
        given = parse_qs(body.decode("latin-1")).get("token", [""])[0]
        if not token_matches(given, self.token):
            return await _login_page(send, "Wrong token, try again.")
        cookie = SimpleCookie()
        cookie[COOKIE] = new_session(self.token)
        cookie[COOKIE].update({"path": "/", "httponly": True, "samesite": "Strict", "max-age": SESSION_TTL_S})
        # Secure where the browser signs in over https, so it never sends the session to the same
        # name over plain HTTP; not over http://127.0.0.1, where a browser would drop such a cookie
        if self.origins.scheme(scope.get("scheme", "http"), _headers(scope).get("host", "")) == "https":
            cookie[COOKIE]["secure"] = True
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", b"/dashboard/"), (b"content-length", b"0"), (b"cache-control", b"no-store"),
                                (b"set-cookie", cookie[COOKIE].OutputString().encode())]})
        await send({"type": "http.response.body", "body": b""})


def _closing(send):
    """``send``, its answer closing the connection (uvicorn closes it once the answer is out)."""
    async def closing_send(message):
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)
    return closing_send


async def _login_body(receive) -> bytes | None:
    """The sign-in request's body, read until it ends or passes MAX_LOGIN_BYTES; None when the
    client went away."""
    body, more = b"", True
    while more and len(body) <= MAX_LOGIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def _login_page(send, error: str) -> None:
    page = resources.files("aggregator.api").joinpath("static", "login.html").read_text()
    body = page.replace("__ERROR__", html.escape(error)).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="fedfleet"'), (b"cache-control", b"no-store"),
                            *((k.encode(), v.encode()) for k, v in LOGIN_HEADERS.items())]})
    await send({"type": "http.response.body", "body": body})


async def _answer(send, status: int, detail: str, headers: dict | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
