"""The job lifecycle's transition table (aggregator/service/job_lifecycle.py) against the rules the
operator's guide states, through a real SQLite store, and against the copy docs/operations.md shows."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from protocols.transition_table import IllegalTransition

from aggregator.service.job_lifecycle import (OPERATOR_EVENTS, CancelAfterRound, EndServed, GivenUp, JobLifecycle,
                                              PickedUp, RecordOnly, ServeAs, StoreState, control_job, give_up,
                                              render_table, take_up)
from aggregator.storage.schema import FINAL_JOB_STATES, JobState
from aggregator.storage.store import Store, StoreError

ROOT = Path(__file__).resolve().parents[1]

# The operator's guide, written out independently of the table: action -> {from state: stored state
# after it, for a job this service does not serve now}.
GUIDE = {"start": {"created": "queued", "stopped": "queued"},
         "pause": {"running": "paused"},
         "resume": {"paused": "queued", "stopped": "queued"},
         "cancel": {s: "cancelled" for s in ("created", "queued", "running", "paused", "cancelling", "stopped")}}


@pytest.mark.parametrize("action", sorted(GUIDE))
@pytest.mark.parametrize("state", [s.value for s in JobState])
def test_an_unserved_job_moves_as_the_guide_says(state, action):
    machine = JobLifecycle(state, served=False)
    if state not in GUIDE[action]:
        with pytest.raises(IllegalTransition):
            machine.handle(OPERATOR_EVENTS[action]())
        assert machine.state == state                      # refused before anything changed
        return
    assert machine.handle(OPERATOR_EVENTS[action]()) == [StoreState(JobState(GUIDE[action][state]))]
    assert machine.state == GUIDE[action][state]


def test_a_served_job_pauses_resumes_and_cancels_after_its_round():
    m = JobLifecycle("running", served=True)
    assert m.handle(OPERATOR_EVENTS["pause"]()) == [StoreState(JobState.PAUSED), ServeAs(JobState.PAUSED)]
    assert m.handle(OPERATOR_EVENTS["resume"]()) == [StoreState(JobState.RUNNING), ServeAs(JobState.RUNNING)]
    # stored at once (a restart ends it cancelled too); the runner writes cancelled after the round
    assert m.handle(OPERATOR_EVENTS["cancel"]()) == [StoreState(JobState.CANCELLING), CancelAfterRound()]
    assert m.state is JobState.CANCELLING
    assert m.handle(OPERATOR_EVENTS["cancel"]()) == [StoreState(JobState.CANCELLING), CancelAfterRound()]   # again
    for action in ("start", "pause", "resume"):
        with pytest.raises(IllegalTransition):
            m.handle(OPERATOR_EVENTS[action]())
    assert m.state is JobState.CANCELLING


# What the service's giving a job up leaves (it cannot go on, nor be built again), as the guide says:
# stopped, to be started again once mended; but a job the operator cancelled ends cancelled.
GIVEN_UP = {"queued": "stopped", "running": "stopped", "paused": "stopped", "cancelling": "cancelled"}


@pytest.mark.parametrize("state", [s.value for s in JobState])
def test_a_job_given_up_stops_unless_its_operator_cancelled_it(state):
    for served in (False, True) if state in ("running", "paused", "cancelling") else (False,):
        machine = JobLifecycle(state, served=served)
        if state not in GIVEN_UP:
            with pytest.raises(IllegalTransition):
                machine.handle(GivenUp("its input file is gone"))
            continue
        ended = JobState(GIVEN_UP[state])
        served_end = [EndServed(ended)] + [RecordOnly("its input file is gone")] * (ended == "cancelled")
        assert machine.handle(GivenUp("its input file is gone")) == \
            [StoreState(ended, "its input file is gone")] + served_end * served
        assert machine.state == ended


def test_giving_up_through_the_store(tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        for job_id, state in (("c", "cancelling"), ("r", "running")):
            store.create_job(job_id, "fed3r", {"job_id": job_id}, state=JobState(state))
        served = SimpleNamespace(job_id="c", final_state=None, record_only=None)
        assert give_up(store, "c", "cancelling", "its state broke", served) == "cancelled"
        assert (served.final_state, served.record_only) == ("cancelled", "its state broke")
        assert give_up(store, "r", "running", "its input file is gone") == "stopped"
        assert {j["job_id"]: (j["state"], j["summary"]) for j in store.jobs()} == {
            "c": ("cancelled", {"error": "its state broke"}), "r": ("stopped", {"error": "its input file is gone"})}
        with pytest.raises(IllegalTransition):
            give_up(store, "r", "stopped", "again")
    finally:
        store.close()


def test_final_states_have_no_way_out():
    for state in FINAL_JOB_STATES:
        for event in (*OPERATOR_EVENTS.values(), PickedUp, lambda: GivenUp("why")):
            with pytest.raises(IllegalTransition):
                JobLifecycle(state, served=False).handle(event())


def test_an_unknown_stored_state_is_refused():
    with pytest.raises(ValueError):
        JobLifecycle("half-done", served=False)


def test_actions_through_the_store(tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        store.create_job("j", "fed3r", {"job_id": "j"})
        with pytest.raises(StoreError, match="cannot pause job j in state 'created'"):
            control_job(store, None, "j", "pause")
        assert store.job("j")["state"] == "created"
        with pytest.raises(ValueError, match="unknown action"):
            control_job(store, None, "j", "explode")
        with pytest.raises(KeyError):
            control_job(store, None, "nobody", "start")
        assert control_job(store, None, "j", "start")["state"] == "queued"
        take_up(store, "j")
        assert store.job("j")["state"] == "running"
        served = SimpleNamespace(job_id="j", state=JobState.RUNNING, cancelling=False)
        assert control_job(store, served, "j", "pause")["state"] == "paused" and served.state == "paused"
        assert control_job(store, served, "j", "cancel")["state"] == "cancelling" and served.cancelling
        with pytest.raises(StoreError, match="cannot resume job j in state 'cancelling'"):
            control_job(store, served, "j", "resume")
        assert store.job("j")["state"] == "cancelling" and served.state == "paused"
        other = SimpleNamespace(job_id="k", state=JobState.RUNNING, cancelling=False)
        assert control_job(store, other, "j", "cancel")["state"] == "cancelled" and not other.cancelling
    finally:
        store.close()


def test_docs_show_the_table_the_code_runs():
    block = re.search(r"```job-lifecycle\n(.*?)\n```", (ROOT / "docs" / "operations.md").read_text(), re.S)
    assert block and block.group(1) == render_table(), \
        "stale: paste `python -m aggregator.service.job_lifecycle` into docs/operations.md"
