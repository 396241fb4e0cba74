"""Bounds on the admin API's connections, whoever opens them (no token is needed to connect).

uvicorn closes a connection idle between requests (``timeout_keep_alive``) but waits for ever for a
connection's first request, and for headers that arrive a byte at a time: a review found 1,100
idle sockets, opened without a token, made the API unreachable (every file descriptor taken) and
the event loop log a traceback thousands of times a second. Here each request's head must be
complete within ``REQUEST_HEAD_TIMEOUT_S`` of the connection's start or of the previous response
(:class:`BoundedH11Protocol`, uvicorn's own protocol with that deadline), at most
``MAX_REQUESTS`` requests run at once, ``OPERATOR_SLOTS`` of them only for requests that present
the admin token (:class:`RequestSlots`, held by ``guard.py``; 503 beyond), and the process may open
as many files as its hard limit allows.

Why slots per request, split by the token, and not uvicorn's ``limit_concurrency``: uvicorn counts
every open connection against its limit, token or not, including one that has sent nothing yet and
one kept alive after its answer, so a client without the token that held 256 of them (cheap
requests answered 401 on keep-alive connections, or connections that never send a head, reopened
every 10 s) had the operator's request answered 503 (a review's finding). No count of connections
can tell the operator's from the flood's before a request's head is read, so the slots are taken
once it is (as PostgreSQL keeps ``superuser_reserved_connections`` for after authentication): a
request without the token takes one of ``MAX_REQUESTS - OPERATOR_SLOTS``, one with it any free
one, and a connection with no request running holds none. Open connections are bounded by the
head deadline, the keep-alive timeout and the file limit; and since the guard closes the
connection after every answer to a request without the token (``Connection: close``), such a
client keeps no connection alive to send its next request on. Per-address limits would not help
here: behind one NAT or proxy the operator and the flood share an address.
"""

from __future__ import annotations

import asyncio
import logging
import resource

from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_HEAD_TIMEOUT_S = 10.0
MAX_REQUESTS = 256              # requests running at once ...
OPERATOR_SLOTS = 32             # ... this many of them only for requests with the admin token

log = logging.getLogger("fedfleet.aggregator.api")


def bounded_protocol(head_timeout_s: float = REQUEST_HEAD_TIMEOUT_S) -> type:
    """uvicorn's HTTP/1.1 protocol, closing a connection whose next request's head is not in within
    ``head_timeout_s``."""

    class BoundedH11Protocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            waiting_for = self.cycle        # a new request replaces the cycle: its head came in
            self._head_deadline = self.loop.call_later(head_timeout_s, self._overdue, waiting_for)

        def _overdue(self, waiting_for) -> None:
            idle = self.cycle is waiting_for and (self.cycle is None or self.cycle.response_complete)
            if idle and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol


class RequestSlots:
    """The requests running at once: at most ``total``, of which at most ``total - operator_only``
    without the token, so ``operator_only`` stay free for the operator however many requests
    without it arrive. Taken and given back on the server's event loop (one thread)."""

    def __init__(self, total: int | None = None, operator_only: int | None = None):
        # read when the guard is built, so a test may set the module's bounds first
        self.total = MAX_REQUESTS if total is None else total
        self.operator_only = OPERATOR_SLOTS if operator_only is None else operator_only
        self.running = self.running_without_token = 0

    def take(self, with_token: bool) -> bool:
        """Whether a request may run now (then :meth:`give_back` when it ends)."""
        if self.running >= self.total:
            return False
        if not with_token and self.running_without_token >= self.total - self.operator_only:
            return False
        self.running += 1
        self.running_without_token += not with_token
        return True

    def give_back(self, with_token: bool) -> None:
        self.running -= 1
        self.running_without_token -= not with_token


def raise_open_files_limit() -> None:
    """The soft limit on open files up to the hard one (a connection is a file)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d: %s", soft, exc)
