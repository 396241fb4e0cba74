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
    if not answers:
        return JobState.FAILED, "no device contributed: none was asked (no eligible device online)"
    by_reason: dict[str, list[str]] = {}
    for device, (event, reason) in sorted(answers.items()):
        by_reason.setdefault(f"{event}: {reason or 'no reason given'}", []).append(device)
    parts = [f"{why} ({', '.join(devices)})" for why, devices in sorted(by_reason.items(), key=lambda kv: -len(kv[1]))]
    text = f"no device contributed in {a.job.round} round(s); " + "; ".join(parts)
    return JobState.FAILED, text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 1] + "…"


def device_answers(a: ActiveJob, store: Store | None) -> dict[str, tuple[str, str]]:
    """device -> (declined | rejected, its last reason, or dropped: asked but never answered before
    a round's deadline), over every round of the job: the durable rounds and their events when there
    is a store (rounds before a restart included), else the round machines and the rounds in memory
    (the latest: ``a.round_log`` keeps 1,000)."""
    answers: dict[str, tuple[str, str]] = {}
    if store is not None:
        rounds = store.rounds(a.job_id)
        for r in rounds:
            for e in store.round_events(a.job_id, r.round):
                answers[e["device"]] = (e["event"], e["reason"])
        dropped = [d for r in rounds for d in (r.outcome or {}).get("dropped", ())]
    else:
        answers.update(a.closed.answers)            # the rounds let go (closed_rounds.py), then the open ones
        for _, coord in sorted(a.rounds.items()):
            answers.update({d: ("declined", why) for d, why in coord.declined.items()})
            answers.update({d: ("rejected", why) for d, why in coord.rejected.items()})
        dropped = [d for entry in a.round_log for d in entry.get("dropped", ())]
    for device in dropped:
        answers.setdefault(device, ("dropped", "no answer before the round's deadline"))
    return answers
