"""Bounds on the admin API's connections, whoever opens them (no token is needed to connect).

uvicorn closes a connection idle between requests (``timeout_keep_alive``) but waits for ever for a
connection's first request, and for headers that arrive a byte at a time: a review found 1,100
idle sockets, opened without a token, made the API unreachable (every file descriptor taken) and
the event loop log a traceback thousands of times a second. Here each request's headers must be
complete within ``REQUEST_HEAD_TIMEOUT_S`` of the connection's start or of the previous response
(:class:`BoundedH11Protocol`, uvicorn's own protocol with that deadline), at most
``MAX_CONNECTIONS`` requests run at once (uvicorn answers 503 beyond), and the process may open
as many files as its hard limit allows."""

from __future__ import annotations

import asyncio
import logging
import resource

from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_HEAD_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 256

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


def raise_open_files_limit() -> None:
    """The soft limit on open files up to the hard one (a connection is a file)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d: %s", soft, exc)
