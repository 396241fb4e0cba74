"""Waits that grow while something keeps failing: a key that failed is not tried again before
``first_s``, then twice as long after each further failure, up to ``max_s``; a success forgets it.

Used where an immediate retry would repeat the same failure as fast as the loop turns: a device
whose dispatches keep closing without an update (``async_runner.DispatchBackoff``), and a stored
job whose end could not be committed, which the service would otherwise rebuild and finish
again on every turn of its loop (``AggregatorService._finish_job``).
"""

from __future__ import annotations


class Backoff:
    def __init__(self, first_s: float = 1.0, max_s: float = 60.0):
        self.first_s, self.max_s = first_s, max_s
        self._until: dict[str, tuple[float, float, int]] = {}     # key -> (retry at, last wait, failures in a row)

    def failed(self, key: str, now: float) -> float:
        """``key`` failed at ``now``: returns how long it now waits."""
        wait = min(self.max_s, 2 * self._until[key][1]) if key in self._until else self.first_s
        self._until[key] = (now + wait, wait, self.failures(key) + 1)
        return wait

    def failures(self, key: str) -> int:
        """How many times in a row ``key`` failed since it last succeeded."""
        return self._until[key][2] if key in self._until else 0

    def succeeded(self, key: str) -> None:
        self._until.pop(key, None)

    def settle(self, key: str, failed: bool, now: float) -> float | None:
        """``key``'s try ended at ``now``: how long it now waits if it ``failed``, else None (forgotten)."""
        if failed:
            return self.failed(key, now)
        self.succeeded(key)
        return None

    def waiting(self, now: float) -> set[str]:
        """The keys whose wait has not ended at ``now``."""
        return {k for k, (until, _, _) in self._until.items() if until > now}
