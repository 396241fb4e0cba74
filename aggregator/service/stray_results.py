"""What the aggregator answers a result (or a decline) for a round that is neither open here nor
one its job closed and let go (those ``JobRunner.answer_closed`` answers, as the round's own
machine would have; a round's machine also refuses a task its device was not given there).

A device whose result gets no ack re-sends the whole upload, with back-off, up to ``max_retries``
times (``protocols/rounds.py``, ``DeviceSession``). So such a result is acknowledged whenever its
round can never take it: ``late`` when its job has ended (a straggler, as for a closed round),
``rejected`` when neither its job nor that round of the running job exists here. A job the store
holds unfinished (queued, paused, stopped, held back after a failure) is not answered: it may run
again, and the device's next retry then reaches it. Declines are never acknowledged, only counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.messages import TaskRef

from aggregator.storage.schema import FINAL_JOB_STATES


@dataclass(frozen=True)
class StrayAnswer:
    ack: str | None              # the ack's status ("late", "rejected"), None: no ack
    reason: str                  # the ack's reason
    rejection: str | None        # the service's rejection class; None: counted late
    detail: str                  # what the log line says


class StrayResults:
    """Where the service looks up what it answers: its store (the job's state) and the jobs it saw
    end lately (``JobEndNotices``, also without a store)."""

    def __init__(self, store, job_ends):
        self.store, self.job_ends = store, job_ends

    def answer(self, ref: TaskRef, running_job: str | None) -> StrayAnswer:
        running = ref.job == running_job
        stored = None if running or self.store is None else (self.store.job(ref.job) or {}).get("state")
        return stray_answer(ref, running, not running and self.job_ends.ended_lately(ref.job), stored)


def stray_answer(ref: TaskRef, running: bool, ended_lately: bool, stored_state: str | None) -> StrayAnswer:
    """``running``: ``ref.job`` is the running job (so its round is the unknown part);
    ``ended_lately``: it is one of the jobs the service saw end lately (``JobEndNotices``);
    ``stored_state``: the store's state of the job (None: no store, or no such job)."""
    job = repr(ref.job[:80])
    if running:
        return StrayAnswer("rejected", f"job {job} has no round {ref.round}", "unknown round", f"round {ref.round}")
    if ended_lately or stored_state in FINAL_JOB_STATES:
        return StrayAnswer("late", f"job {job} has ended", None, "")
    if stored_state is None:
        return StrayAnswer("rejected", f"unknown job {job}", "unknown job", repr(ref.job)[:80])
    return StrayAnswer(None, "", "unknown job", f"{job} is {stored_state}, not running")
