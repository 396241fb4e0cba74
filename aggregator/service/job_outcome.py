"""Whether a job that ran out of work succeeded: a job no device contributed to has failed, and
says why in the words its devices used (their decline and rejection reasons), where an operator
looks first (``admin jobs``, the dashboard, ``results.json``). A pure function of the job's state
and its durable round events; the runner calls it once, when the job is over."""

from __future__ import annotations

from aggregator.service.active_job import ActiveJob
from aggregator.storage.store import Store
from aggregator.storage.schema import JobState

MAX_REASON_CHARS = 1000


def judged_state(a: ActiveJob, store: Store | None) -> tuple[str, str | None]:
    """("done", None) when some device contributed, else ("failed", why)."""
    if a.job.contributions > 0:
        return JobState.DONE, None
    answers = device_answers(a, store)
    for entry in a.round_log:   # asked, but never answered before the round's deadline (the latest rounds')
        for device in entry.get("dropped", ()):
            answers.setdefault(device, ("dropped", "no answer before the round's deadline"))
    if not answers:
        return JobState.FAILED, "no device contributed: none was asked (no eligible device online)"
    by_reason: dict[str, list[str]] = {}
    for device, (event, reason) in sorted(answers.items()):
        by_reason.setdefault(f"{event}: {reason or 'no reason given'}", []).append(device)
    parts = [f"{why} ({', '.join(devices)})" for why, devices in sorted(by_reason.items(), key=lambda kv: -len(kv[1]))]
    text = f"no device contributed in {a.job.round} round(s); " + "; ".join(parts)
    return JobState.FAILED, text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 1] + "…"


def device_answers(a: ActiveJob, store: Store | None) -> dict[str, tuple[str, str]]:
    """device -> (declined | rejected, its last reason), over every round of the job: the durable
    round events when there is a store (rounds before a restart included), else the round machines."""
    answers: dict[str, tuple[str, str]] = {}
    if store is not None:
        for r in store.rounds(a.job_id):
            for e in store.round_events(a.job_id, r.round):
                answers[e["device"]] = (e["event"], e["reason"])
        return answers
    answers.update(a.closed.answers)                # the rounds let go (closed_rounds.py), then the open ones
    for _, coord in sorted(a.rounds.items()):
        answers.update({d: ("declined", why) for d, why in coord.declined.items()})
        answers.update({d: ("rejected", why) for d, why in coord.rejected.items()})
    return answers
