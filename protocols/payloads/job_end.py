"""``job.ended``: the aggregator tells its devices which jobs have ended, so each drops the state it
keeps for them (``edge_client.state``: personal parts, Scaffold controls, FedGloSS duals) at once
instead of at the job's horizon.

* ``job.ended``  aggregator -> the retained topic ``{root}/v1/jobs/ended`` (``Topics.job_ends``).
                 body ``{"ended": [{"job": id, "run": hex, "reason": done|cancelled|failed}, ...]}``:
                 the last :data:`MAX_NOTICES` ended stateful jobs, newest last; signed like every
                 aggregator message.

Why one retained topic holding a bounded list, not a message per device inbox: a job's devices
may be a fleet of 100,000 (one message, not one per device), and a device that is offline when
the job ends still learns it: the broker hands every (re)connecting device the retained list, so
it learns every job among the last :data:`MAX_NOTICES` to end. The broker holds one message for
all jobs (replaced at each job's end, never more than :data:`MAX_NOTICES` entries, 50 KB at most).
A device that was away while more than :data:`MAX_NOTICES` jobs ended, or behind a broker that
lost its retained messages, keeps the older jobs' state until their horizon (the ``ttl_s`` of
the job's last task): the fallback every device always had.

Each entry names the job's **run** (``StateBinding.run``): a device drops a job's state only when
the run it holds is the one that ended, so a notice replayed from an older run of a reused job id
never wipes a newer run's state; an entry for a job the device holds nothing of changes nothing.
The message carries no round and no timestamp a device must trust: re-sending it (after an
aggregator restart, on every reconnect of the aggregator) is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..envelope import Envelope, EnvelopeError, body_field
from .stateful import RUN_PATTERN

JOB_ENDED = "job.ended"
REASONS = ("done", "cancelled", "failed")
MAX_NOTICES = 64
MAX_JOB_ID_CHARS = 128


@dataclass(frozen=True)
class JobEnded:
    """One ended job: its id, the run whose device state goes, and how it ended."""

    job: str
    run: str
    reason: str

    def __post_init__(self):
        if not isinstance(self.job, str) or not 0 < len(self.job) <= MAX_JOB_ID_CHARS:
            raise ValueError(f"job.ended: job must be a string of 1-{MAX_JOB_ID_CHARS} characters, got {self.job!r:.80}")
        if not isinstance(self.run, str) or not RUN_PATTERN.fullmatch(self.run):
            raise ValueError(f"job.ended: run must be 8-64 lowercase hex digits, got {self.run!r:.80}")
        if self.reason not in REASONS:
            raise ValueError(f"job.ended: reason must be one of {'/'.join(REASONS)}, got {self.reason!r:.40}")

    def to_wire(self) -> dict:
        return {"job": self.job, "run": self.run, "reason": self.reason}

    @classmethod
    def from_wire(cls, entry) -> "JobEnded":
        if not isinstance(entry, dict) or set(entry) != {"job", "run", "reason"}:
            raise ValueError("job.ended: each entry is an object of exactly job, run, reason")
        return cls(entry["job"], entry["run"], entry["reason"])


def job_ended_message(sender: str, notices: list[JobEnded]) -> Envelope:
    if len(notices) > MAX_NOTICES:
        raise ValueError(f"job.ended carries at most {MAX_NOTICES} jobs, got {len(notices)}")
    return Envelope(type=JOB_ENDED, sender=sender, body={"ended": [n.to_wire() for n in notices]})


def parse_job_ended(env: Envelope) -> list[JobEnded]:
    """The notices of a ``job.ended`` message; EnvelopeError for any malformed part (the whole
    message is refused: a half-read list could drop what it should not)."""
    if env.type != JOB_ENDED:
        raise EnvelopeError(f"expected {JOB_ENDED}, got {env.type!r}")
    entries = body_field(env, "ended", list)
    if len(entries) > MAX_NOTICES:
        raise EnvelopeError(f"job.ended carries at most {MAX_NOTICES} jobs, got {len(entries)}")
    try:
        return [JobEnded.from_wire(e) for e in entries]
    except ValueError as exc:
        raise EnvelopeError(str(exc)) from None


def with_ended(notices: list[JobEnded], ended: JobEnded) -> list[JobEnded]:
    """The list after ``ended`` (newest last, an earlier entry of the same job replaced, at most
    :data:`MAX_NOTICES`: the oldest fall off)."""
    kept = [n for n in notices if n.job != ended.job]
    return (kept + [ended])[-MAX_NOTICES:]
