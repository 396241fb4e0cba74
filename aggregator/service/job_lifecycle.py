"""The job lifecycle an operator drives (admin API, ``fedfleet admin job ...``) and the service
follows, as a sans-IO machine on a :class:`~protocols.transition_table.TransitionTable`.

Theory of operation. A job's state lives in the store (``JobState``, one enum; the store refuses
any other value). :class:`JobLifecycle` is built from that stored state and one fact about the
process — whether this service is serving the job right now — and is fed one event: an operator
action (:class:`Start`, :class:`Pause`, :class:`Resume`, :class:`Cancel`) or the service taking a
queued job up (:class:`PickedUp`), or giving one up (:class:`GivenUp`: it cannot go on, nor be
built again). It answers with actions, which the adapter (:func:`control_job`, :func:`give_up`, on
the service thread: the store's single writer) carries out in order:
:class:`StoreState` writes the state, :class:`ServeAs` switches the served job between running and
paused, :class:`CancelAfterRound` lets the served job finish its open round first (stored as
``cancelling`` beforehand, so that a service restarted meanwhile ends it cancelled too, rather than
resuming it running), :class:`EndServed` ends the served job (:class:`RecordOnly`: its end reports
its record only, nothing made from the state it was given up in). An action the
table has no row for in the stored state is refused (:class:`IllegalTransition`, the API's 409)
before anything changes. ``python -m aggregator.service.job_lifecycle`` prints the table that
docs/operations.md shows (a test keeps the two equal).

The ends of a job (done, failed, stopped for a reason) are written by the round runners when the
work runs out; they are states of the same enum.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.transition_table import ANY, IllegalTransition, Transition, TransitionTable

from aggregator.service.active_job import ActiveJob
from aggregator.jobs.registry import full_config
from aggregator.storage.schema import JobState
from aggregator.storage.store import Store, StoreError

_CREATED, _QUEUED, _RUNNING, _PAUSED, _CANCELLING, _STOPPED, _CANCELLED = (
    JobState.CREATED, JobState.QUEUED, JobState.RUNNING, JobState.PAUSED, JobState.CANCELLING, JobState.STOPPED,
    JobState.CANCELLED)
# what a service takes up again after a restart (before any queued job): the jobs it was serving
INTERRUPTED = (_RUNNING, _PAUSED, _CANCELLING)


# -- events --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """Operator: queue a created or stopped job."""


@dataclass(frozen=True)
class Pause:
    """Operator: open no new round."""


@dataclass(frozen=True)
class Resume:
    """Operator: open rounds again (a job not served now goes back to the queue)."""


@dataclass(frozen=True)
class Cancel:
    """Operator: end the job for good."""


@dataclass(frozen=True)
class PickedUp:
    """Service: the oldest queued job is now served."""


@dataclass(frozen=True)
class GivenUp:
    """Service: the job cannot go on, nor be built again (its config refused, an input file gone, its
    state broken while served: ``AggregatorService._job_broken``); ``reason`` says why."""
    reason: str


OPERATOR_EVENTS = {"start": Start, "pause": Pause, "resume": Resume, "cancel": Cancel}


# -- actions -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreState:
    state: JobState
    error: str | None = None        # stored in the job's summary: why


@dataclass(frozen=True)
class EndServed:
    """The served job is over, in this state (the service finishes it: ``JobRunner.finish``)."""
    state: JobState


@dataclass(frozen=True)
class RecordOnly:
    """The served job's end reports its record only, saying ``reason``: no model, nothing made from
    the state it was given up in."""
    reason: str


@dataclass(frozen=True)
class ServeAs:
    """The served job's runtime state: running or paused."""
    state: JobState


@dataclass(frozen=True)
class CancelAfterRound:
    """The served job ends as cancelled once its open round closes."""


class JobLifecycle:
    """One job's lifecycle: its stored state and whether this service serves it now."""

    def __init__(self, state: JobState | str, served: bool) -> None:
        self.state = JobState(state)
        self.served = served

    def handle(self, event) -> list:
        return LIFECYCLE_TABLE.fire(self, event)

    def _is_served(self, _ev) -> bool:
        return self.served

    def _cancel_after_round(self, _ev) -> list:
        # stored first: a restart before the round closes takes the job up cancelling (job_to_serve)
        self.state = _CANCELLING
        return [StoreState(_CANCELLING), CancelAfterRound()]


def _given_up(state: JobState, served: bool):
    """A GivenUp row's effect: store `state` with the reason (and end the served job in it; a
    cancelled one with its record only: the operator asked for its end, not for a model of it)."""
    def effect(machine: JobLifecycle, ev: GivenUp) -> list:
        machine.state = state
        ending = [EndServed(state), *([RecordOnly(ev.reason)] if state == _CANCELLED else [])] if served else []
        return [StoreState(state, ev.reason), *ending]
    return effect


def _to(state: JobState, *serve: JobState):
    """A row's effect: store `state` (and switch the served job to `serve`)."""
    def effect(machine: JobLifecycle, _ev) -> list:
        machine.state = state
        return [StoreState(state), *(ServeAs(s) for s in serve)]
    return effect


_L = JobLifecycle
_SERVED = "served now"
LIFECYCLE_TABLE = TransitionTable(JobState, [
    Transition(_CREATED, Start, "", _to(_QUEUED), (StoreState,), (_QUEUED,)),
    Transition(_STOPPED, Start, "", _to(_QUEUED), (StoreState,), (_QUEUED,)),
    Transition(_QUEUED, PickedUp, "", _to(_RUNNING), (StoreState,), (_RUNNING,)),
    Transition(_RUNNING, Pause, _SERVED, _to(_PAUSED, _PAUSED), (StoreState, ServeAs), (_PAUSED,),
               guard=_L._is_served),
    Transition(_RUNNING, Pause, "", _to(_PAUSED), (StoreState,), (_PAUSED,),
               note="interrupted: paused when the service resumes it"),
    Transition(_PAUSED, Resume, _SERVED, _to(_RUNNING, _RUNNING), (StoreState, ServeAs), (_RUNNING,),
               guard=_L._is_served),
    Transition(_PAUSED, Resume, "", _to(_QUEUED), (StoreState,), (_QUEUED,)),
    Transition(_STOPPED, Resume, "", _to(_QUEUED), (StoreState,), (_QUEUED,)),
    *(Transition(state, Cancel, _SERVED, _L._cancel_after_round, (StoreState, CancelAfterRound), (_CANCELLING,),
                 note="cancelled when its open round closes", guard=_L._is_served)
      for state in (_RUNNING, _PAUSED, _CANCELLING)),
    *(Transition(state, Cancel, "", _to(_CANCELLED), (StoreState,), (_CANCELLED,))
      for state in (_CREATED, _QUEUED, _RUNNING, _PAUSED, _CANCELLING, _STOPPED)),
    # the service gives a job up: stopped (to be started again once mended), but the operator's cancel stands
    *(Transition(state, GivenUp, _SERVED, _given_up(_STOPPED, served=True), (StoreState, EndServed), (_STOPPED,),
                 guard=_L._is_served) for state in (_RUNNING, _PAUSED)),
    Transition(_CANCELLING, GivenUp, _SERVED, _given_up(_CANCELLED, served=True), (StoreState, EndServed, RecordOnly),
               (_CANCELLED,), note="the cancel stands: its record only, no model", guard=_L._is_served),
    *(Transition(state, GivenUp, "", _given_up(_STOPPED, served=False), (StoreState,), (_STOPPED,),
                 note="started again once mended") for state in (_QUEUED, _RUNNING, _PAUSED)),
    Transition(_CANCELLING, GivenUp, "", _given_up(_CANCELLED, served=False), (StoreState,), (_CANCELLED,),
               note="the cancel stands"),
])
assert all(row.state is not ANY for row in LIFECYCLE_TABLE.rows)   # every state is named: a final state has no row


def render_table() -> str:
    return LIFECYCLE_TABLE.render()


# -- the adapter: the store and the served job ------------------------------------------------------
def create_job(store: Store | None, kind: str, config: dict) -> dict:
    config = full_config(kind, config)              # validated, defaults made explicit
    if store is None:
        raise StoreError("creating jobs needs a store")
    store.create_job(config["job_id"], kind, config)
    return store.job(config["job_id"])


def control_job(store: Store | None, served: ActiveJob | None, job_id: str, action: str) -> dict:
    """Carry out an operator action on a stored job (StoreError when its state forbids it)."""
    row = store.job(job_id) if store else None
    if row is None:
        raise KeyError(job_id)
    if action not in OPERATOR_EVENTS:
        raise ValueError(f"unknown action {action!r}")
    active = served if served is not None and served.job_id == job_id else None
    try:
        actions = JobLifecycle(row["state"], served=active is not None).handle(OPERATOR_EVENTS[action]())
    except IllegalTransition:
        raise StoreError(f"cannot {action} job {job_id} in state {row['state']!r}") from None
    apply_actions(store, active, job_id, actions)
    return store.job(job_id)


def take_up(store: Store, job_id: str) -> None:
    """The service serves the queued job `job_id` from now on."""
    apply_actions(store, None, job_id, JobLifecycle(store.job(job_id)["state"], served=False).handle(PickedUp()))


def give_up(store: Store | None, job_id: str, state: JobState | str, reason: str,
            served: ActiveJob | None = None) -> JobState:
    """The service cannot go on with the job `job_id`, stored in `state` (nor build it again):
    end it as the table says, the reason stored; the state it ends in."""
    machine = JobLifecycle(state, served=served is not None)
    apply_actions(store, served, job_id, machine.handle(GivenUp(reason)))
    return machine.state


def apply_actions(store: Store | None, active: ActiveJob | None, job_id: str, actions: list) -> None:
    for act in actions:
        if isinstance(act, StoreState):
            if store is not None:                   # a job served without a store: its state is the served one's
                store.set_job_state(job_id, act.state, {"error": act.error} if act.error else None)
        elif isinstance(act, ServeAs):
            active.state = act.state
        elif isinstance(act, EndServed):
            active.final_state = act.state
        elif isinstance(act, RecordOnly):
            active.record_only = act.reason
        else:                                        # CancelAfterRound
            active.cancelling = True


if __name__ == "__main__":
    print(render_table())


def job_to_serve(store: Store, held_back: set[str]) -> dict | None:
    """The stored job the service takes up next: an interrupted one (running, paused, cancelling)
    before the oldest queued; none held back (its end could not be committed lately: it waits,
    rather than being rebuilt and finished again on every turn of the service's loop)."""
    rows = [j for j in store.jobs() if j["state"] in INTERRUPTED] or \
        ([store.next_queued_job()] if store.next_queued_job() else [])
    return next((row for row in rows if row["job_id"] not in held_back), None)

