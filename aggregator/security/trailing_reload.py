"""A broker reload, made once more after a burst of them ends.

mosquitto re-reads its password and ACL files on SIGHUP, in its main loop, and clears its reload
flag only *after* reading them: a SIGHUP that arrives while it reads (the next enrolment's, a
moment after the one before) sets a flag that is then cleared, and is lost. The broker then keeps
the files of the change before until the next change comes: seen in the suite, the last of three
devices enrolled back to back refused at CONNECT although its account was written. So each reload
is followed, ``delay_s`` after the last one of a burst, by one more: by then any reload in progress
has ended, and the broker reads the newest files. (Any broker reloaded by a signal or a hook that
may coalesce gets the same.)
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("fedfleet.aggregator.broker")

TRAILING_RELOAD_S = 1.0


class TrailingReload:
    def __init__(self, reload_now: Callable[[], None], delay_s: float = TRAILING_RELOAD_S):
        self._reload_now, self.delay_s = reload_now, delay_s
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __call__(self) -> None:
        """Reload now (its error is the caller's), then once more ``delay_s`` after the last call
        (on a timer thread; its error is logged)."""
        self._reload_now()
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.delay_s, self._trailing)
            self._timer.daemon = True
            self._timer.start()

    def _trailing(self) -> None:
        try:
            self._reload_now()
        except (OSError, RuntimeError) as exc:
            log.warning("the broker's trailing reload failed: %s", exc)
