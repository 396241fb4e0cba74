"""The runtime state of the job a service is serving, and its counters.

Everything here is rebuilt from the store after a restart (``aggregator/service/recovery.py``); the
service loop (``aggregator/service/loop.py``) is its only writer.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from protocols.rounds import RoundClosed, RoundCoordinator

from aggregator.service.canonical import AppliedContributions
from aggregator.service.clock_ahead import ClockAhead
from aggregator.service.closed_rounds import ClosedRounds
from aggregator.jobs.base import Job
from aggregator.jobs.recent_log import RecentLog
from aggregator.storage.schema import JobState

# Why a message was refused: a fixed set, so metrics labels and counters stay bounded whatever
# devices send (the detail goes to the log, never into a label).
REJECTION_CLASSES = ("bad topic", "revoked device", "malformed", "bad signature", "wrong sender", "not enrolled", "result",
                     "unknown job", "unknown round", "invalid payload", "unexpected type", "presence", "artifact",
                     "protocol", "quarantined", "unknown task")


@dataclass
class ServiceStats:
    bytes_in: int = 0
    results_accepted: int = 0
    rejections: Counter = field(default_factory=Counter)
    late: int = 0
    duplicates: int = 0

    def count_late(self) -> None:
        self.late += 1

    def reject(self, reason_class: str) -> None:
        if reason_class not in REJECTION_CLASSES:
            raise ValueError(f"unknown rejection class {reason_class!r}")
        self.rejections[reason_class] += 1

    def count_refusal(self, reason_class: str) -> int:
        """A refused message: "late" (a secure-aggregation message after its phase or round closed,
        answered with silence) counts as a late result does, any other class as a rejection. The
        level to log it at: a late message is routine (a slow device), a rejection is not."""
        if reason_class == "late":
            self.count_late()
            return logging.INFO
        self.reject(reason_class)
        return logging.WARNING

    def to_dict(self) -> dict:
        return {**asdict(self), "rejections": dict(self.rejections)}

    @classmethod
    def from_dict(cls, d: dict) -> "ServiceStats":
        return cls(d.get("bytes_in", 0), d.get("results_accepted", 0), Counter(d.get("rejections", {})),
                   d.get("late", 0), d.get("duplicates", 0))


@dataclass(frozen=True)
class ValidatedResult:
    """What the round machine carries for a result: the parsed payload and its raw bytes."""
    payload: Any
    raw: bytes


@dataclass
class ActiveJob:
    """Runtime state of the job being served (everything here is rebuilt from the store)."""
    job: Job
    kind: str
    out_dir: Path
    state: JobState = JobState.RUNNING                 # running | paused
    rounds: dict[int, RoundCoordinator] = field(default_factory=dict)     # open rounds (and closing)
    closed: ClosedRounds = field(default_factory=ClosedRounds)   # what rounds let go still answer
    current: RoundCoordinator | None = None
    deadlines: dict[int, float] = field(default_factory=dict)          # round -> wall-clock deadline
    opened_at: dict[int, float] = field(default_factory=dict)
    round_bytes: Counter = field(default_factory=Counter)
    history: RecentLog = field(default_factory=RecentLog)       # the latest evaluations (all in the store)
    round_log: RecentLog = field(default_factory=RecentLog)     # the latest closed rounds (all in the store)
    stats: ServiceStats = field(default_factory=ServiceStats)
    started_at: float = field(default_factory=time.time)                # the job's start (survives restarts)
    waiting_since: float | None = None          # when the job first asked for devices in this process
    started: bool = False                       # enough devices seen to open a round after (re)start
    cancelling: bool = False                    # cancelled by the operator (stored: cancelling): over after its open round
    final_state: str | None = None              # done | cancelled once the job is over
    quarantined: set[str] = field(default_factory=set)   # devices whose contribution broke the job: not asked again
    clock_ahead: ClockAhead = field(default_factory=ClockAhead)   # devices whose decline said so: not asked again
    applied: AppliedContributions = field(default_factory=AppliedContributions)   # what the live job summed, in order
    uncommitted: str | None = None      # what the live job holds that its commit failed to store: publish nothing
    close_failures: int = 0             # round closes whose commit failed in a row (kept across rebuilds)
    # tries of its end that failed in a row before this one: the store's count (kept across restarts), or
    # this service's where the store could not count one (service/end_failures.py)
    end_failures: int = 0
    record_only: str | None = None      # why its end reports its record only (given up while cancelling: job_lifecycle)

    @property
    def job_id(self) -> str:
        return self.job.config.job_id

    @property
    def shown_state(self) -> str:
        """The state the operator sees: its end once over, else cancelling, running or paused (as the store's)."""
        return self.final_state or (JobState.CANCELLING if self.cancelling else self.state)

    def drawable(self, devices: set[str]) -> set[str]:
        """Those of ``devices`` the job may still ask: neither quarantined (or forgotten) nor one whose
        own decline said its clock runs ahead (``clock_ahead.py``)."""
        return devices.difference(self.quarantined, self.clock_ahead.rounds)

    def let_go(self, round_: int, now: float) -> None:
        """Drop a closed round's machine and bookkeeping once its close is committed, keeping what
        it still answers (``closed_rounds.py``: the service grew ~2 KB a round otherwise)."""
        coord = self.rounds.pop(round_, None)
        if coord is not None:
            self.closed.let_go(coord, now)
        for per_round in (self.deadlines, self.opened_at, self.round_bytes):
            per_round.pop(round_, None)

    def round_entry(self, closed: RoundClosed, opened_at: float | None, closed_at: float | None) -> dict:
        """One line of the job's round log (results.json, the API, the report)."""
        t = (closed_at - self.started_at) if closed_at else None
        entry = {"round": closed.round, "accepted": list(closed.accepted), "dropped": list(closed.dropped),
                 "declined": list(closed.declined), "rejected": list(closed.rejected), "t": t,
                 "opened_at": opened_at, "closed_at": closed_at}
        failure = self.job.secure_failure(closed.round) if self.job.secure_rounds else None
        if failure is not None:      # a secure round that produced no sum says why
            entry["secure_failure"] = failure
        phases = self.job.secure_phase_times(closed.round) if self.job.secure_rounds else None
        if phases:
            entry["secure_phase_s"] = phases
        refused = self.job.secure_refusals(closed.round) if self.job.secure_rounds else None
        if refused:                  # members the group left out, each with why (a copied key)
            entry["secure_refused"] = refused
        ahead = self.clock_ahead.declined_in(closed.round)
        if ahead:                    # declined saying their clock runs ahead: not asked again in this job
            entry["clock_ahead"] = ahead
        return entry
