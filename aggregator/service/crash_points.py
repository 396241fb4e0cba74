"""Crash-point injection for the crash tests: SIGKILL this process at a named point.

``FEDFLEET_CRASH_AT=point[:n]`` makes the aggregator kill itself the n-th time it passes
``point`` (one of :data:`CRASH_POINTS`), so a test can check that a restart resumes to the same
result from every place where a commit and the thing depending on it could be torn apart. n counts
passes from 1 (the default); any other value (0, which named no pass and so never fired, a word, an
unknown point) is a ValueError naming the variable, which ``aggregator serve`` says at its start.
``tests/test_crash_recovery.py`` also kills the process at random times, not only here.
"""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter

log = logging.getLogger("fedfleet.aggregator")

CRASH_ENV = "FEDFLEET_CRASH_AT"
CRASH_POINTS = ("restored", "presence", "round_opened", "task_sent", "result_received", "contribution_file_written",
                "contribution_stored", "evaluation_stored", "ack_sent", "round_closing", "round_closed",
                "job_finishing", "job_finalized", "job_finished")


class CrashPoints:
    """SIGKILL this process the n-th time it passes a named point (crash tests only)."""

    def __init__(self, spec: str | None = None):
        self.point, self.nth, self.passed = None, 1, Counter()
        if spec:
            name, colon, nth = spec.partition(":")
            if name not in CRASH_POINTS:
                raise ValueError(f"{CRASH_ENV}={spec[:100]}: unknown crash point {name[:100]!r} "
                                 f"(known: {', '.join(CRASH_POINTS)})")
            if colon and not (nth.isascii() and nth.isdigit() and int(nth) >= 1):
                raise ValueError(f"{CRASH_ENV}={spec[:100]}: n counts passes from 1 (point:n kills at the "
                                 f"n-th pass), not {nth[:100]!r}")
            self.point, self.nth = name, int(nth or 1)

    @classmethod
    def from_env(cls) -> "CrashPoints":
        return cls(os.environ.get(CRASH_ENV))

    def __call__(self, name: str) -> None:
        self.passed[name] += 1
        if name == self.point and self.passed[name] == self.nth:
            log.warning("crash point %s reached (%d): SIGKILL", name, self.nth)
            os.kill(os.getpid(), signal.SIGKILL)
