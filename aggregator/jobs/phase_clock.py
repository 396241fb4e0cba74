"""When a secure round's open phase stops waiting for its missing members.

A phase closes when every member expected in it has answered, or when this clock says so:

* **idle**: ``idle_s`` (the job's ``phase_timeout_s``) without progress. Every accepted answer is
  progress, so a group of 1,000 members that keep answering for minutes (statistics computed,
  megabytes uploaded a window at a time) is not cut off while it progresses;
* **the first phase has no idle limit**: a device does its local work (trains, computes its
  statistics) on the task before it reads the RoundStart behind it, so the first phase holds every
  member's local work, which the round's deadline bounds as in a plain round. With an idle limit a
  fleet whose training takes longer than ``phase_timeout_s`` (a tail trained on a phone or a Jetson:
  minutes; the default is 30 s) lost every member at the first phase and failed every round, and a
  member slower than the others by that much was left out (the CI flake of
  ``tests/test_crash_resume_kinds.py``, where a loaded machine slowed one device's training past 5 s);
* **budget**: the phase's share of the time left before the round's deadline. Without it one member
  that sat on each of its answers for just under ``idle_s`` held each of the round's five phases
  open that long: 5 × 30 s with the defaults, past the round's 120 s deadline, which then failed the
  round for everyone with nothing applied and nobody named, every round that member was drawn into
  (a review's finding, ``tests/test_secagg_slow_member.py``); dropping out costs one phase timeout.

The budget: when a phase opens with ``later`` phases after it and ``remaining`` seconds to the
round's target, each later phase is kept ``min(idle_s, remaining / (2 · later))`` and this one may
use the rest, at least half of ``remaining``: the masked phase, where a large group computes and
uploads for minutes, keeps most of the round (the later phases' messages are small). A phase that
closes early (every answer in) hands its unused time on to the later ones, so honest rounds never
meet the budget; one that a slow member stretches ends at it, the slow member left out as a
dropout, and the round ends by its target. The target is the round's deadline less a tenth of the
round's time, kept for the unmasking and the service's tick. The clock runs on the host's clock
from the round's start: on a shard that is a little after the coordinator opened the round, which
the tenth covers.
"""

from __future__ import annotations

import math

FINISH_SHARE = 0.1       # of the round's time, kept after the last phase's budget for the unmasking


class PhaseClock:
    def __init__(self, idle_s: float, round_s: float, phases: int):
        if not idle_s > 0 or not round_s > 0 or phases < 1:
            raise ValueError(f"a phase clock needs positive times and phases, got {idle_s}, {round_s}, {phases}")
        self.idle_s, self.round_s, self.phases = float(idle_s), float(round_s), int(phases)
        self._target = math.inf
        self._left = self.phases
        self._progress_at = 0.0
        self._closes_at = math.inf
        self._idle_limited = True

    def start(self, now: float) -> None:
        """The round's first phase opens now."""
        self._target = now + self.round_s * (1.0 - FINISH_SHARE)
        self._left = self.phases
        self.opened(now)
        self._idle_limited = False          # the first phase holds the members' local work

    def opened(self, now: float) -> None:
        """The next phase opened now (the previous one closed)."""
        self._progress_at = now
        remaining = max(0.0, self._target - now)
        later = max(self._left - 1, 0)
        kept = later * min(self.idle_s, remaining / (2 * later)) if later else 0.0
        self._closes_at = self._target - kept
        self._left = later
        self._idle_limited = True

    def progress(self, now: float) -> None:
        """An answer was accepted now: the idle timer starts again (the budget does not move)."""
        self._progress_at = now

    def due(self, now: float) -> bool:
        """Whether the open phase is over: idle too long (not the first phase), or its budget spent."""
        return (self._idle_limited and now - self._progress_at > self.idle_s) or now >= self._closes_at

    @property
    def closes_at(self) -> float:
        """When the open phase's budget runs out (the round's clock)."""
        return self._closes_at
