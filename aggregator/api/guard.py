"""An ASGI layer in front of the admin API that refuses before it reads: a request without the
admin token, or with a body larger than the cap, is answered 401 / 413 while its body is still
unread (FastAPI reads a request's body before it runs the route's dependencies, so the token
check alone would let anyone make the process buffer a 300 MB upload). A body with no
Content-Length (chunked) is counted as it streams and cut off at the cap.

A browser that opens the dashboard (or ``/``) without a valid token gets the sign-in page (HTML,
still status 401) instead of the API's JSON refusal; the page submits the token to
``/dashboard/?token=``, which sets the session cookie.
"""

from __future__ import annotations

import hmac
import html
import json
from http.cookies import SimpleCookie
from importlib import resources
from urllib.parse import parse_qs

MAX_BODY_BYTES = 1024 * 1024          # the largest request the API takes (a job config, a key)
COOKIE = "fedfleet_token"
LOGIN_PATHS = ("/", "/dashboard", "/dashboard/")     # where a browser without the token is asked for it


def presented_token(scope: dict) -> str:
    """The token a request carries: Bearer header, ``/dashboard/?token=`` (the sign-in form: it wins
    over a stale cookie), or the dashboard cookie."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if scope.get("path") == "/dashboard/":
        query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
        if query:
            return query[0]
    cookie = SimpleCookie()
    try:
        cookie.load(headers.get("cookie", ""))
    except Exception:                 # a malformed cookie header is no token
        return ""
    if COOKIE in cookie:
        return cookie[COOKIE].value
    return ""


def token_matches(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


class RequestGuard:
    def __init__(self, app, token: str, max_body: int = MAX_BODY_BYTES):
        self.app, self.token, self.max_body = app, token, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = presented_token(scope)
        if not token_matches(given, self.token):
            if scope["path"] in LOGIN_PATHS and scope.get("method") == "GET":
                return await _login_page(send, "Wrong token, try again." if given else "")
            return await _answer(send, 401, "missing or wrong admin token", {"www-authenticate": "Bearer"})
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _answer(send, 413, f"request body larger than {self.max_body} bytes")
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise ValueError(f"request body larger than {self.max_body} bytes")
            return message

        return await self.app(scope, bounded_receive, send)


async def _login_page(send, error: str) -> None:
    page = resources.files("aggregator.api").joinpath("static", "login.html").read_text()
    body = page.replace("__ERROR__", html.escape(error)).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="fedfleet"'), (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})


async def _answer(send, status: int, detail: str, headers: dict | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
