"""Drives an asynchronous job (``asynchronous = True``, e.g. fedavg-async): no round to wait for.

Each dispatch — one device given the current model version — is a round of one participant to
the round machinery, so storing, acking, retries, deadlines, quarantine and the restart replay
are :class:`~aggregator.service.job_runner.JobRunner`'s own; only the scheduling differs: many such
rounds are open at once, and at every tick each idle online device (up to the job's
concurrency) is given a new one. The job's state is checkpointed at each dispatch's close (the
base runner does that at every round close), which is what lets a restart resume the buffer.
"""

from __future__ import annotations

import math
import time

from protocols.rounds import DeviceLost, RoundCoordinator, RoundState, Tick

from aggregator.service.backoff import Backoff
from aggregator.service.job_runner import JobRunner, RunnerServices
from aggregator.storage.schema import JobState


class DispatchBackoff(Backoff):
    """A device whose dispatch closed without an update (declined, rejected, or silent until its
    deadline) gets its next one only after a wait (``service/backoff.py``: 1 s doubling to 60 s),
    forgotten once an update of it is accepted. Why: a declined dispatch frees the device at once,
    so a device whose task always fails (a broken install, or a hostile client) was given a new
    dispatch every tick — a stored round, the model sent and a checkpoint written each time
    (240 in 10 s for one device). A waiting device is retried with the then current model."""

    def closed(self, act, now: float) -> None:
        for device in act.accepted:
            self.succeeded(device)
        for device in (*act.declined, *act.rejected, *act.dropped):
            self.failed(device, now)


class AsyncJobRunner(JobRunner):
    def __init__(self, a, services: RunnerServices):
        super().__init__(a, services)
        self.backoff, self._now = DispatchBackoff(), time.monotonic()
        if self.store is not None and not self.checkpoints:
            # without a checkpoint per dispatch a restart would replay the updates in round
            # order, not in the arrival order the buffer saw: another model
            raise TypeError(f"{type(a.job).__name__} (asynchronous) needs checkpoints to run with a store")
        self._open: dict[int, RoundCoordinator] = {
            r: c for r, c in a.rounds.items() if c.state is RoundState.OPEN}    # restored after a restart
        a.current = None
        a.job.keep_dispatches({r: next(iter(c.participants)) for r, c in self._open.items()})
        self._evaluated_version: int | None = None

    def device_lost(self, device: str) -> None:
        for coord in [c for c in self._open.values() if device in c.participants]:
            self.handle(coord, DeviceLost(device))

    def resend_tasks(self, devices: set[str]) -> None:
        for round_, coord in list(self._open.items()):
            for dev in sorted(d for d in devices if coord.is_pending(d)):
                self._send_task(round_, dev)

    def _tick(self, now: float) -> None:
        a, self._now = self.a, now
        if a.final_state:
            return
        for coord in list(self._open.values()):
            expired = a.cancelling or not coord.pending_count or a.job.hopeless(coord.round)
            self.handle(coord, Tick(math.inf if expired else now))
            if self.rebuilt:
                return              # a close could not be committed: the job was rebuilt, this runner is void
        if a.cancelling:
            if not self._open:
                a.final_state = JobState.CANCELLED
            return
        if a.state == JobState.PAUSED or not self._ready_to_start():
            return
        if a.job.finished(set(), set()):
            a.final_state = JobState.DONE
            return
        idle = (a.drawable(self.fleet.eligible_online()) - self.backoff.waiting(now)
                - {d for c in self._open.values() for d in c.participants})
        for device in a.job.next_dispatches(idle):
            a.job.open_dispatch(device)
            self._open_round([device], now)          # stores the dispatch, sends the task, sets a.current
            self._open[a.current.round] = a.current
            a.current = None

    def _close_round(self, act) -> None:
        super()._close_round(act)
        self._open.pop(act.round, None)
        self.backoff.closed(act, self._now)

    def _checkpoint(self, act) -> tuple:
        # replayed after a restart: every round above the job's floor (dispatches still open when
        # this one closed may have answered since); the job skips those its state already holds
        state, contributed = super()._checkpoint(act)
        return state, contributed, self.a.job.replay_floor

    def _evaluation(self, job=None) -> dict | None:
        # the model moves only at a server step: evaluate once per version, not per dispatch
        if self._evaluated_version == self.a.job.version and self.a.history:
            return None
        self._evaluated_version = self.a.job.version
        return super()._evaluation(job)
