"""The device's side of the round protocol as a sans-IO state machine: :class:`DeviceSession`
and its rules, :data:`DEVICE_TABLE` (the aggregator's side and the theory both share:
``rounds.py``; the Java device's mirror: ``clients/java/.../DeviceSession.java``, held to the same
golden traces, ``golden_traces.py``).

Theory of operation
-------------------
A device runs a task only while its round may still be open: one received after its deadline
(plus ``deadline_grace_s`` for the two clocks), or created (its envelope's signed ``ts``) before the
last task of its job the device started, is skipped, not answered (``SkipTask``), before the rows
that would re-send a kept result. So a captured task re-published later costs the device nothing
and takes nothing from it: before, it started afresh and the result awaiting its ack lost its
retries. A last start dated past the device's clock plus the grace is no evidence (the
aggregator's clock ran ahead and was set back): skipping by it would cost the job's tasks until
that clock caught up; so a clock set back costs at most the grace's worth of tasks. The first
expired task of a job is declined instead, once, saying the device's clock may be ahead: without
it such a device looks like a straggler (so is the first task of a job whose round went over
during its work, ``WorkStopped``). The session remembers its last
``MAX_JOBS_REMEMBERED`` jobs; :meth:`DeviceSession.memory` is what a device keeps of them across
restarts (the agent writes it beside its state store), so a restarted device skips a replay too.
A device without a state folder keeps them in memory only: restarted, it runs a replay within the
task's deadline once more.

A task delivered again after it was answered gets the same answer (its kept result, same
message id, or its decline: a declined task never runs again), at most ``max_retries`` times: the
aggregator re-sends a task only to a device it still waits for, so more is a replayer's, and each
replay re-sent a 6.6 MB result before. Answers are kept for the last ``keep_finished`` tasks only
(and not across a restart); what outlives them is one flag per job, in its memory: its last task
started was answered. That task, signed no later than when it started (the captured message), is
then skipped; before, it ran again, each replay the work and a fresh update. The aggregator's own
re-send comes in a new envelope, signed later, and runs: the device has no answer left to give. Expired declines are at most one per
``EXPIRED_DECLINE_GAP_S`` of the device's clock, whatever the job.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

from .messages import TaskRef
from .replay_guard import LastStart, memory_layout, parse_memory
from .transition_table import ANY, Transition, TransitionTable

@dataclass(frozen=True)
class Tick:
    """The clock moved (both machines read it: the device's retries, the aggregator's deadlines)."""
    now: float


class DeviceState(enum.Enum):
    IDLE = "idle"
    WORKING = "working"
    REPORTED = "reported"


@dataclass(frozen=True)
class TaskArrived:
    ref: TaskRef
    kind: str
    params: dict
    deadline: float                                # unix seconds, the aggregator's clock
    tensors: dict = field(default_factory=dict)   # e.g. the global model the task starts from
    received_at: float | None = None              # unix seconds, the device's clock; None: not checked
    sent_at: float | None = None                  # the task envelope's signed ts (aggregator's clock); None: not checked


@dataclass(frozen=True)
class WorkFinished:
    ref: TaskRef
    message: Any  # the encoded result message (bytes or envelope), opaque here
    message_id: str
    expects_ack: bool = True      # False: a secure task's protocol messages (never acked, never retried)


@dataclass(frozen=True)
class WorkFailed:
    ref: TaskRef
    reason: str


@dataclass(frozen=True)
class WorkStopped:
    """The task at work stopped unanswered: its round went over during the work (``round_over``:
    the deadline plus the grace passed by the device's clock, edge_client/work_deadline.py) or the
    device dropped out (an emulated fleet's hooks)."""
    ref: TaskRef
    round_over: bool


@dataclass(frozen=True)
class ResultSent:
    now: float


@dataclass(frozen=True)
class AckArrived:
    ref_id: str
    status: str


@dataclass(frozen=True)
class StartWork:
    ref: TaskRef
    kind: str
    params: dict
    deadline: float
    tensors: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SendResult:
    message: Any
    attempt: int


@dataclass(frozen=True)
class SkipTask:
    """A task not run and not answered: its round is over (a replay, or a message that lost its
    way). Nothing is sent: the aggregator no longer waits, and a replayer gets no traffic out of it."""
    ref: TaskRef
    reason: str


# SkipTask's reasons and the expired task's decline, fixed words (the Java device's session says the
# same; the agent logs the numbers)
EXPIRED = "its deadline has passed"
STALE = "created before the last task of its job this device started"
ANSWERED = "answered already by this device, its answer no longer kept"
EXPIRED_DECLINE = ("received after its deadline by this device's clock: is the clock ahead? (devices need "
                   "NTP-close clocks; later expired tasks of this job are skipped silently)")
EXPIRED_AT_WORK_DECLINE = ("its deadline passed during the work by this device's clock: is the clock ahead? (devices "
                           "need NTP-close clocks; later expired tasks of this job are skipped silently)")
MAX_JOBS_REMEMBERED = 64        # the jobs whose last task started (and expired decline) a session keeps
# At most one expired decline per this many seconds of the device's clock, whatever the job: tasks
# of more than MAX_JOBS_REMEMBERED jobs, captured and replayed in turn, each looked like a job's
# first (its memory had let the oldest go), so every message cost a decline and a durable write
EXPIRED_DECLINE_GAP_S = 60.0


@dataclass(frozen=True)
class SendDecline:
    ref: TaskRef
    reason: str


@dataclass
class DeviceSession:
    retry_after_s: float = 10.0
    max_retries: int = 5
    keep_finished: int = 4
    # A task is run until received_at > deadline + this: device and aggregator clocks are NTP-close,
    # not equal, and a task the aggregator still waits for must not be skipped.
    deadline_grace_s: float = 60.0
    # False: forget a result's payload once it is acknowledged (a redelivered task of that round is
    # then answered with nothing): what a host of thousands of emulated devices needs, whose idle
    # devices must not each hold their last results (megabytes of Fed3R statistics).
    keep_acked_results: bool = True
    state: DeviceState = DeviceState.IDLE
    current: TaskRef | None = None
    # job -> its last task started, that task's signed ts, whether it was answered: another task of
    # the job created before it is a replay (a job re-created under the same id creates its tasks
    # later, and runs), and so is that task again, once answered, unless the aggregator sent it anew
    last_started: dict[str, LastStart] = field(default_factory=dict)
    expired_declined: dict[str, bool] = field(default_factory=dict)   # jobs told once that a task came expired
    expired_told_at: float | None = None         # the device's clock at the last expired decline (not kept)
    # tasks answered (a result or a decline), for redelivery, and how often each was answered again:
    # a redelivered task re-sends its answer at most max_retries times (a replayer re-sent a 6.6 MB
    # result per replay, and a declined task ran again per replay, a review found)
    finished: dict[TaskRef, WorkFinished | WorkFailed] = field(default_factory=dict)
    answered_again: dict[TaskRef, int] = field(default_factory=dict)
    memory_changes: int = 0         # how often memory() changed: an adapter that persists it writes on change
    attempts: int = 0
    next_retry: float = 0.0
    now: float = 0.0

    def handle(self, event) -> list:
        """The actions for `event`, by DEVICE_TABLE (IllegalTransition for an event it lacks)."""
        return DEVICE_TABLE.fire(self, event)

    # -- what a device keeps across restarts (its replay guard) ----------------------------------
    def memory(self) -> dict:
        """The per-job memory the replay rows read, as JSON data (oldest job first): each job's last
        task started with its signed ts, the jobs told once that a task came expired, and the jobs
        whose last task started was answered."""
        return memory_layout(self.last_started, self.expired_declined)

    def recall(self, memory, now: float | None = None) -> None:
        """Take back what :meth:`memory` gave (a restarted device). A malformed one (any entry)
        raises ValueError and changes nothing; of more than MAX_JOBS_REMEMBERED jobs the newest are
        kept. With ``now`` (the device's clock), a job's last start created later than now plus the
        grace is forgotten: written while the aggregator's clock ran ahead (or edited), it would
        have the job's every later task skipped as a replay, across restarts."""
        started, declined = parse_memory(memory)
        self.last_started.clear()
        self.expired_declined.clear()
        for job, last in started.items():
            if self._believable(last.ts, now):
                _remember(self.last_started, job, last)
        for job in declined:
            _remember(self.expired_declined, job, True)

    def _retry_delay(self) -> float:
        return self.retry_after_s * 2 ** (self.attempts - 1)   # back-off doubles per attempt

    @property
    def resend_pending(self) -> bool:
        """Whether a later Tick may still resend the reported result (DEVICE_TABLE's retry row): one
        awaiting its ack with retries left. A secure task's result expects no ack (its retry timer is
        off) and one out of retries is never resent: in REPORTED until the next task, a tick only
        moves their clock."""
        return self.state is DeviceState.REPORTED and self.next_retry != float("inf") \
            and self.attempts <= self.max_retries

    # -- guards and effects of DEVICE_TABLE's rows -----------------------------------------------
    def _is_current(self, ev) -> bool:
        return ev.ref == self.current

    def _acks_current_result(self, ev: AckArrived) -> bool:
        done = self.finished.get(self.current) if self.current else None
        return isinstance(done, WorkFinished) and done.message_id == ev.ref_id

    def _retry_due(self, ev: Tick) -> bool:
        return ev.now >= self.next_retry and self.attempts <= self.max_retries

    def _expired(self, ev: TaskArrived) -> bool:
        return ev.received_at is not None and ev.received_at > ev.deadline + self.deadline_grace_s

    def _stale(self, ev: TaskArrived) -> bool:
        last = self.last_started.get(ev.ref.job)
        return (ev.sent_at is not None and last is not None and ev.ref != last.ref and ev.sent_at < last.ts
                and self._believable(last.ts, ev.received_at))

    def _answered_before(self, ev: TaskArrived) -> bool:
        """The job's last task started, answered, sent no later than when it started: the captured
        message (or an older send of it) whose answer the device no longer keeps (pushed out by
        later answers, or lost in a restart). Before, it ran again: the work and a fresh update per
        replay. The aggregator re-sends a task it still waits for in a new envelope, signed later: that
        runs, a device without the answer having nothing else to give. No clock check as _stale's:
        a start dated in the device's future can stop this one task only."""
        last = self.last_started.get(ev.ref.job)
        return (ev.sent_at is not None and last is not None and last.answered and ev.ref == last.ref
                and ev.sent_at <= last.ts)

    def _believable(self, sent_at: float, now: float | None) -> bool:
        """Whether a remembered start's ts is evidence by the device's clock ``now`` (None: not
        checked): one dated past now plus the grace was made while the aggregator's clock ran ahead,
        since set back; trusted, it would have the job's every later task skipped until that clock
        caught up again (at most the grace's worth is skipped now)."""
        return now is None or sent_at <= now + self.deadline_grace_s

    def _first_expired(self, ev: TaskArrived) -> bool:
        told = self.expired_told_at
        return (self._expired(ev) and ev.ref.job not in self.expired_declined
                and (told is None or ev.received_at >= told + EXPIRED_DECLINE_GAP_S))

    def _decline_expired(self, ev: TaskArrived) -> list:
        self.expired_told_at = ev.received_at
        return self._tell_expired(ev.ref, EXPIRED_DECLINE)

    def _tell_expired(self, ref: TaskRef, reason: str) -> list:
        # once per job: what the operator sees of a device whose clock runs ahead (else only "dropped")
        _remember(self.expired_declined, ref.job, True)
        self.memory_changes += 1
        return [SendDecline(ref, reason)]

    def _skip(self, ev: TaskArrived) -> list:
        return [SkipTask(ev.ref, EXPIRED if self._expired(ev) else STALE)]

    def _skip_answered(self, ev: TaskArrived) -> list:
        return [SkipTask(ev.ref, ANSWERED)]

    def _may_answer_again(self, ev: TaskArrived) -> bool:
        done = self.finished.get(ev.ref)
        kept = isinstance(done, WorkFailed) or (done is not None and done.message is not None)
        return kept and self.answered_again.get(ev.ref, 0) < self.max_retries

    def _answer_again(self, ev: TaskArrived) -> list:
        self.answered_again[ev.ref] = self.answered_again.get(ev.ref, 0) + 1
        done = self.finished[ev.ref]
        if isinstance(done, WorkFailed):
            return [SendDecline(ev.ref, done.reason)]
        return [SendResult(done.message, self.attempts + 1)]

    def _start(self, ev: TaskArrived) -> list:
        self.current, self.state = ev.ref, DeviceState.WORKING
        if ev.sent_at is not None:
            self.last_started.pop(ev.ref.job, None)
            _remember(self.last_started, ev.ref.job, LastStart(ev.ref, ev.sent_at))
            self.memory_changes += 1
        return [StartWork(ev.ref, ev.kind, ev.params, ev.deadline, ev.tensors)]

    def _keep_answer(self, ev: WorkFinished | WorkFailed) -> None:
        self.finished[ev.ref] = ev
        self.answered_again.pop(ev.ref, None)
        while len(self.finished) > self.keep_finished:      # a long-lived device keeps only recent answers
            self.answered_again.pop(oldest := next(iter(self.finished)), None)
            del self.finished[oldest]
        # what outlives the answer (and a restart): that the job's last start was answered
        last = self.last_started.get(ev.ref.job)
        if last is not None and last.ref == ev.ref and not last.answered:
            self.last_started[ev.ref.job] = replace(last, answered=True)     # in its place: the order is age
            self.memory_changes += 1

    def _report(self, ev: WorkFinished) -> list:
        self._keep_answer(ev)
        self.state, self.attempts = DeviceState.REPORTED, 1
        self.next_retry = self.now + self.retry_after_s if ev.expects_ack else float("inf")
        return [SendResult(ev.message, 1)]

    def _decline(self, ev: WorkFailed) -> list:
        self._keep_answer(ev)
        self.state, self.current = DeviceState.IDLE, None
        return [SendDecline(ev.ref, ev.reason)]

    def _first_over_at_work(self, ev: WorkStopped) -> bool:
        return self._is_current(ev) and ev.round_over and ev.ref.job not in self.expired_declined

    def _stopped_first_of_job(self, ev: WorkStopped) -> list:
        # as an expired arrival (a device whose clock runs ahead stops its work early)
        return self._stopped(ev) + self._tell_expired(ev.ref, EXPIRED_AT_WORK_DECLINE)

    def _stopped(self, ev: WorkStopped) -> list:
        self.state, self.current = DeviceState.IDLE, None
        return []

    def _upload_ended(self, ev: ResultSent) -> list:
        # A slow upload must not count against the ack timeout.
        self.now = ev.now
        self.next_retry = ev.now + self._retry_delay()
        return []

    def _acknowledged(self, ev: AckArrived) -> list:
        self.state = DeviceState.IDLE
        if not self.keep_acked_results:
            self.finished[self.current] = replace(self.finished[self.current], message=None)
        return []

    def _retry(self, ev: Tick) -> list:
        self.now = ev.now
        self.attempts += 1
        self.next_retry = ev.now + self._retry_delay()
        return [SendResult(self.finished[self.current].message, self.attempts)]

    def _clock(self, ev: Tick | ResultSent) -> list:
        self.now = ev.now
        return []

    def _ignore(self, ev) -> list:
        return []


def _remember(memory: dict, key: str, value) -> None:
    """``memory[key] = value`` in a session's per-job memory, the oldest entry dropped past
    MAX_JOBS_REMEMBERED (whoever sends tasks of new job ids, it stays bounded). A key already there
    keeps its place and drops nothing (a job listed twice in a recalled 'expired_declined': before,
    a full memory lost its oldest job to it, which the Java device's LinkedHashMap keeps)."""
    if key not in memory:
        while len(memory) >= MAX_JOBS_REMEMBERED:
            del memory[next(iter(memory))]
    memory[key] = value


_D, _IDLE, _WORKING, _REPORTED = DeviceSession, DeviceState.IDLE, DeviceState.WORKING, DeviceState.REPORTED
DEVICE_TABLE = TransitionTable(DeviceState, [
    Transition(ANY, TaskArrived, "received after deadline + grace, first of its job, none told for a minute",
               _D._decline_expired, (SendDecline,),
               note="once per job, at most one a minute: the device's clock may be ahead", guard=_D._first_expired),
    Transition(ANY, TaskArrived, "received after deadline + grace", _D._skip, (SkipTask,),
               note="its round is over: nothing run, nothing sent", guard=_D._expired),
    Transition(ANY, TaskArrived, "created before its job's last task started", _D._skip, (SkipTask,),
               note="a replay (by signed ts; not against a start dated past the device's clock + grace): "
                    "a pending result keeps its retries", guard=_D._stale),
    Transition(ANY, TaskArrived, "task answered, answer kept, answered again < max_retries times", _D._answer_again,
               (SendResult, SendDecline), note="the same result (message id) or decline: the server may have lost it",
               guard=_D._may_answer_again),
    Transition(ANY, TaskArrived, "task answered", _D._ignore,
               note="its result forgotten (acknowledged, keep_acked_results off; a secure task's) or answered "
                    "again max_retries times: a replay costs nothing more", guard=lambda d, ev: ev.ref in d.finished),
    Transition(ANY, TaskArrived, "its job's last task started, answered, answer not kept, created no later",
               _D._skip_answered, (SkipTask,),
               note="a replay once its answer was pushed out or lost in a restart (by signed ts: the aggregator's "
                    "re-send, signed later, runs)", guard=_D._answered_before),
    Transition(_WORKING, TaskArrived, "the task at work", _D._ignore, note="redelivery while busy",
               guard=_D._is_current),
    Transition(ANY, TaskArrived, "", _D._start, (StartWork,), (_WORKING,),
               note="a new task: older work is abandoned"),
    Transition(_WORKING, WorkFinished, "the task at work", _D._report, (SendResult,), (_REPORTED,),
               note="retry timer off when no ack is expected (a secure task's protocol message)",
               guard=_D._is_current),
    Transition(ANY, WorkFinished, "", _D._ignore, note="work for an abandoned task"),
    Transition(_WORKING, WorkFailed, "the task at work", _D._decline, (SendDecline,), (_IDLE,),
               guard=_D._is_current),
    Transition(ANY, WorkFailed, "", _D._ignore, note="failure of an abandoned task"),
    Transition(_WORKING, WorkStopped, "the task at work, its round over, first of its job", _D._stopped_first_of_job,
               (SendDecline,), (_IDLE,), note="once per job, as an expired arrival: the clock may be ahead",
               guard=_D._first_over_at_work),
    Transition(_WORKING, WorkStopped, "the task at work", _D._stopped, goes_to=(_IDLE,),
               note="round over (told already) or dropped out: nothing sent", guard=_D._is_current),
    Transition(ANY, WorkStopped, "", _D._ignore, note="an abandoned task"),
    Transition(_REPORTED, ResultSent, "an ack is expected", _D._upload_ended,
               note="retry timer starts when the upload ends",
               guard=lambda d, ev: d.finished[d.current].expects_ack),
    Transition(ANY, ResultSent, "", _D._clock),
    Transition(_REPORTED, AckArrived, "ref = the result's id", _D._acknowledged, goes_to=(_IDLE,),
               guard=_D._acks_current_result),
    Transition(ANY, AckArrived, "", _D._ignore, note="ack of an older or unknown message"),
    Transition(_REPORTED, Tick, "now >= next retry, retries left", _D._retry, (SendResult,),
               note="same message id, back-off doubling, up to max_retries", guard=_D._retry_due),
    Transition(ANY, Tick, "", _D._clock),
])
