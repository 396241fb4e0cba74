"""The round protocol as two sans-IO state machines (one per side).

Theory of operation
-------------------
A *round* is one unit of federated work: the aggregator picks participants, sends each a
``task``, and collects one ``result`` (or a ``decline``) per participant until everybody answered
or the round deadline passes. Both sides are pure state machines in the h11 style: the caller
feeds events (a decoded message, a clock tick) and gets back a list of actions (messages to
send, work to start, results to apply). No sockets, threads or clocks live here, so every rule
below is tested without a broker and the MQTT adapters stay thin.

Aggregator side, one :class:`RoundCoordinator` per round::

    state     event                               actions / next state
    OPEN      ResultArrived(selected, new id)     ApplyResult, SendAck(accepted)     -> OPEN / CLOSED when all answered
    OPEN      ResultArrived(id seen before)       SendAck(duplicate)                 (idempotent redelivery)
    OPEN      ResultArrived(not selected)         SendAck(rejected)
    OPEN      ResultArrived(device already done)  SendAck(duplicate)                 (second result never applied)
    OPEN      ResultArrived(device lost)          ApplyResult, SendAck(accepted)     (it came back in time)
    OPEN      ResultInvalid(pending device)       RecordRejected, SendAck(rejected)  (device counted as failed)
    OPEN      ResultInvalid(anyone else)          SendAck(rejected)
    OPEN      Declined(pending device)            RecordDeclined                     (device counted as declined)
    OPEN      DeviceLost(device)                  device counted as dropped (went offline mid-task)
    OPEN      GroupSettled(survivors)             survivors counted as accepted, RoundClosed -> CLOSED
    OPEN      Tick(now >= deadline)               RoundClosed                          -> CLOSED
    CLOSED    ResultArrived(anything)             SendAck(late) ; counted, never applied

Every action that changes what the round will report comes out of the machine *before* the
actions that depend on it (``RecordRejected``/``RecordDeclined``/``ApplyResult`` before the ack and
before ``RoundClosed``), so an adapter that persists the record actions as it meets them never
has to guess what the machine will count. ``GroupSettled`` is how a round summed under secure
aggregation ends: the aggregator only ever holds the group's sum, so there is no per-device result
to apply; the job already applied the sum and names the devices it holds.

Late results are never carried into a later round: a result names its (job, round) and the
server routes it only to that round's coordinator (closed rounds answer ``late``).

Device side, one :class:`DeviceSession` per device::

    state     event                          actions / next state
    IDLE      TaskArrived(new task)          StartWork                      -> WORKING
    WORKING   TaskArrived(same task)         -                              (redelivery while busy)
    WORKING   WorkFinished(result)           SendResult                     -> REPORTED
    WORKING   WorkFailed(reason)             SendDecline                    -> IDLE
    REPORTED  ResultSent(now)                -                              (retry timer starts when the upload ends)
    REPORTED  TaskArrived(same task)         SendResult (same message id)   (server may have lost it)
    REPORTED  Tick (no ack expected)         -                              (a secure task's first protocol
                                                                             message: the protocol's own
                                                                             phases and timers follow)
    REPORTED  Tick(now > next retry)         SendResult (same message id)   until max_retries
    REPORTED  AckArrived(ref = result id)    -                              -> IDLE
    any       TaskArrived(newer task)        StartWork                      -> WORKING (older work abandoned)

Re-sending the *same* message id makes retries idempotent end to end: the aggregator applies an
id at most once and answers duplicates with ``duplicate``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from .messages import TaskRef


# ----------------------------------------------------------------------------- aggregator side
class RoundState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class ResultArrived:
    device: str
    message_id: str
    result: Any  # the validated payload, opaque to the state machine


@dataclass(frozen=True)
class ResultInvalid:
    device: str
    message_id: str
    reason: str


@dataclass(frozen=True)
class Declined:
    device: str
    reason: str


@dataclass(frozen=True)
class DeviceLost:
    device: str


@dataclass(frozen=True)
class GroupSettled:
    """A secure round's sum is in: exactly these devices' data is in it (empty: the group failed)."""
    survivors: tuple[str, ...]


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class ApplyResult:
    device: str
    message_id: str
    result: Any


@dataclass(frozen=True)
class RecordRejected:
    """A participant's result was invalid: it counts as rejected (persist before acking)."""
    device: str
    message_id: str
    reason: str


@dataclass(frozen=True)
class RecordDeclined:
    """A participant declined its task: it counts as declined (persist before anything else)."""
    device: str
    reason: str


@dataclass(frozen=True)
class SendAck:
    device: str
    ref: str
    status: str
    reason: str = ""


@dataclass(frozen=True)
class RoundClosed:
    round: int
    accepted: tuple[str, ...]
    dropped: tuple[str, ...]     # selected but never answered
    declined: tuple[str, ...]
    rejected: tuple[str, ...]


@dataclass
class RoundCoordinator:
    round: int
    participants: frozenset[str]
    deadline: float
    state: RoundState = RoundState.OPEN
    accepted: dict[str, str] = field(default_factory=dict)      # device -> message id applied
    declined: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    seen_ids: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    late: int = 0

    def handle(self, event) -> list:
        if isinstance(event, ResultArrived):
            return self._on_result(event)
        if isinstance(event, ResultInvalid):
            if self.state is RoundState.OPEN and event.device in self.pending:
                self.rejected[event.device] = event.reason
                return [RecordRejected(event.device, event.message_id, event.reason),
                        SendAck(event.device, event.message_id, "rejected", event.reason)] + self._maybe_close()
            return [SendAck(event.device, event.message_id, "rejected", event.reason)]
        if isinstance(event, Declined):
            if self.state is RoundState.OPEN and event.device in self.pending:
                self.declined[event.device] = event.reason
                return [RecordDeclined(event.device, event.reason)] + self._maybe_close()
            return []
        if isinstance(event, DeviceLost):
            if self.state is RoundState.OPEN and event.device in self.pending:
                self.lost.add(event.device)
                return self._maybe_close()
            return []
        if isinstance(event, GroupSettled):
            if self.state is not RoundState.OPEN:
                return []
            for device in sorted(set(event.survivors) & self.participants):
                self.lost.discard(device)        # offline right after its masked input: its data IS in the sum
                self.accepted[device] = f"group-{self.round}"
            return self._close()
        if isinstance(event, Tick):
            if self.state is RoundState.OPEN and event.now >= self.deadline:
                return self._close()
            return []
        raise TypeError(f"unknown event {event!r}")

    @property
    def pending(self) -> frozenset[str]:
        """Participants the round still waits for (read-only: the machine owns this bookkeeping)."""
        return frozenset(self.participants - set(self.accepted) - set(self.declined) - set(self.rejected)
                         - self.lost)

    def snapshot(self) -> dict:
        """A JSON-able view of the round for status pages."""
        return {"round": self.round, "state": self.state.value, "participants": sorted(self.participants),
                "accepted": sorted(self.accepted), "declined": sorted(self.declined),
                "rejected": sorted(self.rejected), "lost": sorted(self.lost), "pending": sorted(self.pending)}

    def restore(self, device: str, message_id: str) -> None:
        """Re-apply bookkeeping for a result already durably applied (after a restart)."""
        self.accepted[device] = message_id
        self.seen_ids.add(message_id)

    def _on_result(self, ev: ResultArrived) -> list:
        if ev.message_id in self.seen_ids:
            return [SendAck(ev.device, ev.message_id, "duplicate")]
        if self.state is RoundState.CLOSED:
            self.late += 1
            return [SendAck(ev.device, ev.message_id, "late", f"round {self.round} is closed")]
        if ev.device not in self.participants:
            return [SendAck(ev.device, ev.message_id, "rejected", f"not selected for round {self.round}")]
        self.lost.discard(ev.device)   # a device that reconnected in time and answers is welcome
        if ev.device not in self.pending:
            return [SendAck(ev.device, ev.message_id, "duplicate", "device already answered this round")]
        self.seen_ids.add(ev.message_id)
        self.accepted[ev.device] = ev.message_id
        return [ApplyResult(ev.device, ev.message_id, ev.result),
                SendAck(ev.device, ev.message_id, "accepted")] + self._maybe_close()

    def _maybe_close(self) -> list:
        return self._close() if not self.pending else []

    def _close(self) -> list:
        self.state = RoundState.CLOSED
        return [RoundClosed(self.round, tuple(sorted(self.accepted)), tuple(sorted(self.pending | self.lost)),
                            tuple(sorted(self.declined)), tuple(sorted(self.rejected)))]


# ----------------------------------------------------------------------------- device side
class DeviceState(enum.Enum):
    IDLE = "idle"
    WORKING = "working"
    REPORTED = "reported"


@dataclass(frozen=True)
class TaskArrived:
    ref: TaskRef
    kind: str
    params: dict
    deadline: float
    tensors: dict = field(default_factory=dict)   # e.g. the global model the task starts from


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
class SendDecline:
    ref: TaskRef
    reason: str


@dataclass
class DeviceSession:
    retry_after_s: float = 10.0
    max_retries: int = 5
    keep_finished: int = 4
    # False: forget a result's payload once it is acknowledged (a redelivered task of that round is
    # then answered with nothing): what a host of thousands of emulated devices needs, whose idle
    # devices must not each hold their last results (megabytes of Fed3R statistics).
    keep_acked_results: bool = True
    state: DeviceState = DeviceState.IDLE
    current: TaskRef | None = None
    finished: dict[TaskRef, WorkFinished] = field(default_factory=dict)   # tasks answered (for redelivery)
    attempts: int = 0
    next_retry: float = 0.0
    now: float = 0.0

    def handle(self, event) -> list:
        if isinstance(event, TaskArrived):
            return self._on_task(event)
        if isinstance(event, WorkFinished):
            if self.state is not DeviceState.WORKING or event.ref != self.current:
                return []  # work for an abandoned task
            self.finished[event.ref] = event
            while len(self.finished) > self.keep_finished:      # a long-lived device keeps only recent results
                del self.finished[next(iter(self.finished))]
            self.state, self.attempts = DeviceState.REPORTED, 1
            self.next_retry = self.now + self.retry_after_s if event.expects_ack else float("inf")
            return [SendResult(event.message, 1)]
        if isinstance(event, WorkFailed):
            if self.state is DeviceState.WORKING and event.ref == self.current:
                self.state, self.current = DeviceState.IDLE, None
                return [SendDecline(event.ref, event.reason)]
            return []
        if isinstance(event, ResultSent):
            # A slow upload must not count against the ack timeout (back-off doubles per attempt).
            self.now = event.now
            if self.state is DeviceState.REPORTED and self.finished[self.current].expects_ack:
                self.next_retry = event.now + self.retry_after_s * 2 ** (self.attempts - 1)
            return []
        if isinstance(event, AckArrived):
            done = self.finished.get(self.current) if self.current else None
            if self.state is DeviceState.REPORTED and done is not None and done.message_id == event.ref_id:
                self.state = DeviceState.IDLE
                if not self.keep_acked_results:
                    self.finished[self.current] = replace(done, message=None)
            return []
        if isinstance(event, Tick):
            self.now = event.now
            if (self.state is DeviceState.REPORTED and event.now >= self.next_retry
                    and self.attempts <= self.max_retries):
                self.attempts += 1
                self.next_retry = event.now + self.retry_after_s * 2 ** (self.attempts - 1)
                return [SendResult(self.finished[self.current].message, self.attempts)]
            return []
        raise TypeError(f"unknown event {event!r}")

    def _on_task(self, ev: TaskArrived) -> list:
        if ev.ref in self.finished:
            message = self.finished[ev.ref].message
            return [] if message is None else [SendResult(message, self.attempts + 1)]
        if self.state is DeviceState.WORKING and ev.ref == self.current:
            return []
        self.current, self.state = ev.ref, DeviceState.WORKING
        return [StartWork(ev.ref, ev.kind, ev.params, ev.deadline, ev.tensors)]


def drain(machine, events: Iterable) -> list:
    """Feed several events, concatenating the actions (convenience for tests and adapters)."""
    out: list = []
    for ev in events:
        out.extend(machine.handle(ev))
    return out
