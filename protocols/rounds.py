"""The round protocol as two sans-IO state machines, one per side: the aggregator's here, the
device's in ``device_session.py``.

Theory of operation
-------------------
A *round* is one unit of federated work: the aggregator picks participants, sends each a
``task``, and collects one ``result`` (or a ``decline``) per participant until everybody answered
or the round deadline passes. Both sides are pure state machines in the h11 style: the caller
feeds events (a decoded message, a clock tick) and gets back a list of actions (messages to
send, work to start, results to apply). No sockets, threads or clocks live here, so every rule
below is tested without a broker and the MQTT adapters stay thin.

The rules are data: :data:`COORDINATOR_TABLE` (aggregator side, one :class:`RoundCoordinator` per
round) and ``DEVICE_TABLE`` (device side, one ``DeviceSession`` per device, ``device_session.py``)
list, per (state, event type), the guarded rows that apply in order; ``handle`` fires the first row
whose guard holds and refuses an event its state has no row for (:class:`IllegalTransition`,
nothing changed). ``docs/protocol.md`` prints both tables as :func:`render_tables` renders them (a
test keeps the two equal; ``python -m protocols.rounds`` prints them).

Every action that changes what the round will report comes out of the machine *before* the
actions that depend on it (``RecordRejected``/``RecordDeclined``/``ApplyResult`` before the ack and
before ``RoundClosed``), so an adapter that persists the record actions as it meets them never
has to guess what the machine will count. ``GroupSettled`` is how a round summed under secure
aggregation ends: the aggregator only ever holds the group's sum, so there is no per-device result
to apply; the job already applied the sum and names the devices it holds.

Late results are never carried into a later round: a result names its (job, round) and the
server routes it only to that round's coordinator (closed rounds answer ``late``). Within the
round it must also name the task its device was given there (``RoundCoordinator.tasks``): a job
created again under the same id counts its rounds from 1 again, so an older run's late result
names a live (job, round). It is refused (``RefuseTask``, ack ``rejected``) without spending the
device's answer; taken, it would have been the device's answer and its real one acked
``duplicate``. Re-sending the *same* message id makes retries idempotent end to end: the
aggregator applies an id at most once and answers duplicates with ``duplicate``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .device_session import DEVICE_TABLE, Tick
from .transition_table import ANY, IllegalTransition, Transition, TransitionTable  # noqa: F401 (handle raises it)

# ----------------------------------------------------------------------------- aggregator side
class RoundState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


# ``task`` of the three answers below: the task id the message names; None where the adapter
# vouches for it (a restored event, a round that keeps no task ids)
@dataclass(frozen=True)
class ResultArrived:
    device: str
    message_id: str
    result: Any  # the validated payload, opaque to the state machine
    task: str | None = None


@dataclass(frozen=True)
class ResultInvalid:
    device: str
    message_id: str
    reason: str
    task: str | None = None


@dataclass(frozen=True)
class Declined:
    device: str
    reason: str
    task: str | None = None


@dataclass(frozen=True)
class DeviceLost:
    device: str


@dataclass(frozen=True)
class GroupSettled:
    """A secure round's sum is in: exactly these devices' data is in it (empty: the group failed)."""
    survivors: tuple[str, ...]


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
class RefuseTask:
    """An answer naming a task its device was not given in this round: counted as refused (class
    ``unknown task``), never as the device's answer."""
    device: str
    task: str
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
    tasks: dict[str, str] = field(default_factory=dict)         # device -> the task id it was given (empty: unchecked)
    accepted: dict[str, str] = field(default_factory=dict)      # device -> message id applied
    declined: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    seen_ids: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    late: int = 0
    # participants − accepted − declined − rejected − lost, kept as the rows change them: read on
    # every event, where recomputing it was O(κ) per result (313x fewer results/s at κ = 10,000,
    # bench/service_hot_paths.py)
    _waiting: set[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self._waiting = set(self.participants) - set(self.accepted) - set(self.declined) - set(self.rejected) - self.lost

    def handle(self, event) -> list:
        """The actions for `event`, by COORDINATOR_TABLE (IllegalTransition for an event it lacks)."""
        return COORDINATOR_TABLE.fire(self, event)

    @property
    def pending(self) -> frozenset[str]:
        """Participants the round still waits for (a copy, O(κ): the machine owns this bookkeeping;
        :meth:`is_pending` and :attr:`pending_count` are the per-event reads)."""
        return frozenset(self._waiting)

    def is_pending(self, device: str) -> bool:
        return device in self._waiting

    @property
    def pending_count(self) -> int:
        return len(self._waiting)

    def snapshot(self) -> dict:
        """A JSON-able view of the round for status pages."""
        return {"round": self.round, "state": self.state.value, "participants": sorted(self.participants),
                "accepted": sorted(self.accepted), "declined": sorted(self.declined),
                "rejected": sorted(self.rejected), "lost": sorted(self.lost), "pending": sorted(self._waiting)}

    def restore(self, device: str, message_id: str) -> None:
        """Re-apply bookkeeping for a result already durably applied (after a restart)."""
        self.accepted[device] = message_id
        self.seen_ids.add(message_id)
        self._waiting.discard(device)

    def applies(self, device: str, message_id: str, task: str | None = None) -> bool:
        """Whether a result (device, message_id, task) would be applied now: only then is its
        payload worth validating. A duplicate, late, unselected or foreign-task one is answered by
        the table alone, so a device re-sending a 6.6 MB result costs the server no second validation."""
        return COORDINATOR_TABLE.select(self, ResultArrived(device, message_id, None, task)).effect is RoundCoordinator._accept

    # -- effects of COORDINATOR_TABLE's rows -------------------------------------------------
    def _refuse_task(self, ev) -> list:
        refused = RefuseTask(ev.device, ev.task, f"task {ev.task[:64]!r} is not this device's task of round {self.round}")
        return [refused] if isinstance(ev, Declined) else [refused, SendAck(ev.device, ev.message_id, "rejected", refused.reason)]

    def _ack_duplicate(self, ev: ResultArrived) -> list:
        return [SendAck(ev.device, ev.message_id, "duplicate")]

    def _ack_late(self, ev: ResultArrived) -> list:
        self.late += 1
        return [SendAck(ev.device, ev.message_id, "late", f"round {self.round} is closed")]

    def _ack_not_selected(self, ev: ResultArrived) -> list:
        return [SendAck(ev.device, ev.message_id, "rejected", f"not selected for round {self.round}")]

    def _ack_already_answered(self, ev: ResultArrived) -> list:
        return [SendAck(ev.device, ev.message_id, "duplicate", "device already answered this round")]

    def _accept(self, ev: ResultArrived) -> list:
        self.lost.discard(ev.device)   # a device that reconnected in time and answers is welcome
        self.seen_ids.add(ev.message_id)
        self.accepted[ev.device] = ev.message_id
        self._waiting.discard(ev.device)
        return [ApplyResult(ev.device, ev.message_id, ev.result),
                SendAck(ev.device, ev.message_id, "accepted")] + self._maybe_close()

    def _reject(self, ev: ResultInvalid) -> list:
        self.rejected[ev.device] = ev.reason
        self._waiting.discard(ev.device)
        return [RecordRejected(ev.device, ev.message_id, ev.reason)] + self._ack_rejected(ev) + self._maybe_close()

    def _ack_rejected(self, ev: ResultInvalid) -> list:
        return [SendAck(ev.device, ev.message_id, "rejected", ev.reason)]

    def _decline(self, ev: Declined) -> list:
        self.declined[ev.device] = ev.reason
        self._waiting.discard(ev.device)
        return [RecordDeclined(ev.device, ev.reason)] + self._maybe_close()

    def _lose(self, ev: DeviceLost) -> list:
        self.lost.add(ev.device)
        self._waiting.discard(ev.device)
        return self._maybe_close()

    def _settle(self, ev: GroupSettled) -> list:
        for device in sorted(set(ev.survivors) & self.participants):
            self.lost.discard(device)        # offline right after its masked input: its data IS in the sum
            self.accepted[device] = f"group-{self.round}"
            self._waiting.discard(device)
        return self._close()

    def _expire(self, ev: Tick) -> list:
        return self._close()

    def _ignore(self, ev) -> list:
        return []

    def _maybe_close(self) -> list:
        return self._close() if not self._waiting else []

    def _close(self) -> list:
        self.state = RoundState.CLOSED
        return [RoundClosed(self.round, tuple(sorted(self.accepted)), tuple(sorted(self._waiting | self.lost)),
                            tuple(sorted(self.declined)), tuple(sorted(self.rejected)))]


def _is_pending(coord: RoundCoordinator, ev) -> bool:
    return coord.is_pending(ev.device)


def _names_another_task(coord: RoundCoordinator, ev) -> bool:
    return ev.task is not None and coord.tasks.get(ev.device, ev.task) != ev.task


_C, _OPEN, _CLOSED = RoundCoordinator, RoundState.OPEN, RoundState.CLOSED
_ANOTHER_TASK = "task not the device's"
COORDINATOR_TABLE = TransitionTable(RoundState, [
    Transition(ANY, ResultArrived, _ANOTHER_TASK, _C._refuse_task, (RefuseTask, SendAck),
               note="ack rejected; the device's answer not spent", guard=_names_another_task),
    Transition(ANY, ResultArrived, "id seen before", _C._ack_duplicate, (SendAck,),
               note="ack duplicate: idempotent redelivery", guard=lambda c, ev: ev.message_id in c.seen_ids),
    Transition(_CLOSED, ResultArrived, "", _C._ack_late, (SendAck,), note="ack late; counted, never applied"),
    Transition(_OPEN, ResultArrived, "device not selected", _C._ack_not_selected, (SendAck,),
               note="ack rejected", guard=lambda c, ev: ev.device not in c.participants),
    Transition(_OPEN, ResultArrived, "device already answered", _C._ack_already_answered, (SendAck,),
               note="ack duplicate: a second result is never applied",
               guard=lambda c, ev: ev.device in c.accepted or ev.device in c.declined or ev.device in c.rejected),
    Transition(_OPEN, ResultArrived, "", _C._accept, (ApplyResult, SendAck, RoundClosed), (_CLOSED,),
               note="ack accepted (a lost device came back in time); closes when nobody is pending"),
    Transition(ANY, ResultInvalid, _ANOTHER_TASK, _C._refuse_task, (RefuseTask, SendAck),
               note="ack rejected; the device's answer not spent", guard=_names_another_task),
    Transition(_OPEN, ResultInvalid, "device pending", _C._reject, (RecordRejected, SendAck, RoundClosed),
               (_CLOSED,), note="ack rejected; device counted as rejected", guard=_is_pending),
    Transition(ANY, ResultInvalid, "", _C._ack_rejected, (SendAck,), note="ack rejected, nothing recorded"),
    Transition(ANY, Declined, _ANOTHER_TASK, _C._refuse_task, (RefuseTask,),
               note="the device's answer not spent", guard=_names_another_task),
    Transition(_OPEN, Declined, "device pending", _C._decline, (RecordDeclined, RoundClosed), (_CLOSED,),
               note="device counted as declined", guard=_is_pending),
    Transition(ANY, Declined, "", _C._ignore, note="repeated or late decline"),
    Transition(_OPEN, DeviceLost, "device pending", _C._lose, (RoundClosed,), (_CLOSED,),
               note="counted as dropped (offline mid-task) unless it answers in time", guard=_is_pending),
    Transition(ANY, DeviceLost, "", _C._ignore),
    Transition(_OPEN, GroupSettled, "", _C._settle, (RoundClosed,), (_CLOSED,),
               note="the survivors (selected ones) counted as accepted"),
    Transition(_CLOSED, GroupSettled, "", _C._ignore, note="a round settles once"),
    Transition(_OPEN, Tick, "now >= deadline", _C._expire, (RoundClosed,), (_CLOSED,),
               guard=lambda c, ev: ev.now >= c.deadline),
    Transition(ANY, Tick, "", _C._ignore),
])


def render_tables() -> str:
    """Both machines' tables as the text docs/protocol.md shows."""
    return (f"Aggregator side, one RoundCoordinator per round:\n\n{COORDINATOR_TABLE.render()}\n\n"
            f"Device side, one DeviceSession per device:\n\n{DEVICE_TABLE.render()}")


if __name__ == "__main__":
    print(render_tables())
