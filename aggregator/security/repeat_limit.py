"""At most a few answers per (device, request) per time window: the guard on requests whose
answer is much larger than the ask.

A device asks for an artifact (a bundle file, a deployment's head) in a few hundred bytes and gets
megabytes back. Answering every ask would let one device make the aggregator read, sign and
publish a large file as often as it can send small messages (a bandwidth and CPU amplifier). An
honest device asks again only when an answer did not come or its copy was refused, so a couple
of answers per window serve it; asks beyond them within the window are dropped, and after the
window the request is answered again. Memory is bounded by the requests of one window, which are
forgotten as it passes.
"""

from __future__ import annotations

import time
from collections.abc import Hashable


class RepeatLimiter:
    def __init__(self, window_s: float, answers: int = 2):
        if not window_s > 0 or answers < 1:
            raise ValueError("the window must be positive and allow at least one answer")
        self.window_s, self.answers = float(window_s), int(answers)
        self._first: dict[tuple[str, Hashable], list] = {}      # [first answer's time, answers]; oldest first
        self.dropped = 0

    def allow(self, device: str, request: Hashable, now: float | None = None) -> bool:
        """Whether to answer ``device``'s ``request`` now (if so, it counts as an answer)."""
        now = time.monotonic() if now is None else now
        while self._first and now - next(iter(self._first.values()))[0] >= self.window_s:
            del self._first[next(iter(self._first))]
        entry = self._first.setdefault((device, request), [now, 0])
        if entry[1] >= self.answers:
            self.dropped += 1
            return False
        entry[1] += 1
        return True
