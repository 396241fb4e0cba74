"""The sans-IO round machines: every rule in the transition tables of protocols/rounds.py."""

import enum
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from protocols.messages import TaskRef
from protocols.rounds import (COORDINATOR_TABLE, IllegalTransition, render_tables, ApplyResult, Declined, DeviceLost,
                              GroupSettled, RecordDeclined, RecordRejected, RefuseTask, ResultArrived, ResultInvalid,
                              RoundClosed, RoundCoordinator, SendAck, Tick)
from protocols.device_session import (DEVICE_TABLE, AckArrived, ResultSent, DeviceSession, DeviceState, SendDecline,
                                      SendResult, TaskArrived, WorkFailed, WorkFinished, WorkStopped)
from protocols.transition_table import Transition, TransitionTable


def coord(devs=("a", "b", "c"), deadline=100.0, tasks=None):
    return RoundCoordinator(round=3, participants=frozenset(devs), deadline=deadline, tasks=tasks or {})


def kinds(actions):
    return [type(a).__name__ for a in actions]


def test_accepts_each_selected_device_once_and_closes_when_all_answered():
    c = coord()
    out = c.handle(ResultArrived("a", "m1", "payload-a"))
    assert out[0] == ApplyResult("a", "m1", "payload-a") and out[1] == SendAck("a", "m1", "accepted")
    assert c.handle(ResultArrived("a", "m1", "payload-a")) == [SendAck("a", "m1", "duplicate")]   # redelivery
    second = c.handle(ResultArrived("a", "m9", "other"))                                          # new id, same device
    assert kinds(second) == ["SendAck"] and second[0].status == "duplicate"
    c.handle(Declined("b", "no data"))
    out = c.handle(ResultArrived("c", "m3", "payload-c"))
    closed = [a for a in out if isinstance(a, RoundClosed)]
    assert closed == [RoundClosed(3, ("a", "c"), (), ("b",), ())]
    applied = [a for a in out if isinstance(a, ApplyResult)]
    assert [a.device for a in applied] == ["c"]


def test_deadline_closes_and_late_results_are_never_applied():
    c = coord(deadline=10.0)
    c.handle(ResultArrived("a", "m1", 1))
    assert c.handle(Tick(9.9)) == []
    out = c.handle(Tick(10.0))
    assert out == [RoundClosed(3, ("a",), ("b", "c"), (), ())]
    late = c.handle(ResultArrived("b", "m2", 2))
    assert late == [SendAck("b", "m2", "late", "round 3 is closed")] and c.late == 1
    assert all(not isinstance(a, ApplyResult) for a in late)


def test_unselected_and_invalid_results_are_rejected():
    c = coord()
    assert c.handle(ResultArrived("zz", "m1", 1))[0].status == "rejected"
    out = c.handle(ResultInvalid("a", "m2", "NaN in b"))
    # the record comes before the ack, so an adapter persists it before anything depends on it
    assert out[:2] == [RecordRejected("a", "m2", "NaN in b"), SendAck("a", "m2", "rejected", "NaN in b")]
    assert "a" in c.rejected and "a" not in c.accepted and "a" not in c.pending
    # a second invalid result of a device that is no longer pending is acked but not recorded again
    assert c.handle(ResultInvalid("a", "m3", "again")) == [SendAck("a", "m3", "rejected", "again")]


def test_an_answer_naming_another_task_is_refused_and_the_devices_answer_is_not_spent():
    # a job created again under the same id counts its rounds from 1 again: an older run's late
    # result names a live (job, round) but not the task this run gave its device
    c = coord(tasks={"a": "ta", "b": "tb", "c": "tc"})
    why = "task 'old' is not this device's task of round 3"
    assert c.handle(ResultArrived("a", "m1", 1, task="old")) == [RefuseTask("a", "old", why),
                                                                   SendAck("a", "m1", "rejected", why)]
    assert c.handle(ResultInvalid("a", "m2", "NaN", task="old")) == [RefuseTask("a", "old", why),
                                                                    SendAck("a", "m2", "rejected", why)]
    assert c.handle(Declined("a", "busy", task="old")) == [RefuseTask("a", "old", why)]
    assert c.handle(ResultArrived("b", "m3", 1, task="ta"))[0] == RefuseTask("b", "ta", why.replace("'old'", "'ta'"))
    assert c.pending == frozenset("abc") and not c.accepted and not c.rejected and not c.declined and not c.seen_ids
    assert not c.applies("a", "m4", "old") and c.applies("a", "m4", "ta")
    assert kinds(c.handle(ResultArrived("a", "m4", 1, task="ta"))) == ["ApplyResult", "SendAck"]   # its real answer
    assert kinds(c.handle(ResultArrived("b", "m5", 2))) == ["ApplyResult", "SendAck"]    # None: vouched for (restored)
    assert c.handle(ResultArrived("zz", "m6", 1, task="x"))[0] == SendAck("zz", "m6", "rejected", "not selected for round 3")
    c.handle(Tick(100.0))
    assert kinds(c.handle(ResultArrived("c", "m7", 1, task="old"))) == ["RefuseTask", "SendAck"] and c.late == 0
    assert c.handle(ResultArrived("c", "m8", 1, task="tc"))[0].status == "late"


def test_declines_are_recorded_once_and_only_for_pending_devices():
    c = coord()
    assert c.handle(Declined("b", "no data")) == [RecordDeclined("b", "no data")]
    assert c.handle(Declined("b", "again")) == [] and c.handle(Declined("zz", "x")) == []
    assert c.pending == frozenset({"a", "c"})
    with pytest.raises(AttributeError):
        c.pending = frozenset()                      # read-only: the machine owns its bookkeeping


def test_a_secure_round_closes_through_group_settled_without_per_device_results():
    c = coord()
    c.handle(DeviceLost("c"))                        # offline right after sending its masked input
    out = c.handle(GroupSettled(("a", "c", "zz")))   # zz was never selected: never counted
    assert not any(isinstance(a, ApplyResult) for a in out)
    assert out == [RoundClosed(3, ("a", "c"), ("b",), (), ())]
    assert c.snapshot()["accepted"] == ["a", "c"] and c.snapshot()["state"] == "closed"
    assert c.handle(GroupSettled(("b",))) == []      # settles once


def test_a_failed_secure_group_closes_with_nobody_accepted():
    c = coord()
    assert c.handle(GroupSettled(())) == [RoundClosed(3, (), ("a", "b", "c"), (), ())]


def task(r=1, job="j"):
    return TaskArrived(TaskRef(job, r, f"t{r}"), "fed3r.stats", {}, 0.0)


def test_device_works_once_resends_same_result_and_stops_on_ack():
    s = DeviceSession(retry_after_s=5, max_retries=2)
    out = s.handle(task())
    assert kinds(out) == ["StartWork"] and s.state is DeviceState.WORKING
    assert s.handle(task()) == []                                         # redelivered task while busy
    out = s.handle(WorkFinished(TaskRef("j", 1, "t1"), "RESULT", "r1"))
    assert out == [SendResult("RESULT", 1)]
    assert s.handle(Tick(1.0)) == []
    assert s.handle(Tick(5.0)) == [SendResult("RESULT", 2)]              # no ack yet: same message again
    assert s.handle(task()) == [SendResult("RESULT", 3)]                 # server re-sent the task
    assert s.handle(AckArrived("other", "accepted")) == [] and s.state is DeviceState.REPORTED
    s.handle(AckArrived("r1", "accepted"))
    assert s.state is DeviceState.IDLE and s.handle(Tick(100.0)) == []


def test_retries_are_bounded_and_failures_decline():
    s = DeviceSession(retry_after_s=1, max_retries=2)
    s.handle(task())
    s.handle(WorkFinished(TaskRef("j", 1, "t1"), "R", "r1"))
    sends = sum(len(s.handle(Tick(float(t)))) for t in range(1, 100))
    assert sends == 2
    s2 = DeviceSession()
    s2.handle(task(2))
    assert s2.handle(WorkFailed(TaskRef("j", 2, "t2"), "no data")) == [SendDecline(TaskRef("j", 2, "t2"), "no data")]
    assert s2.state is DeviceState.IDLE


def test_newer_task_abandons_older_work():
    s = DeviceSession()
    s.handle(task(1))
    assert kinds(s.handle(task(2))) == ["StartWork"]
    assert s.handle(WorkFinished(TaskRef("j", 1, "t1"), "OLD", "o")) == []   # stale work is dropped


def test_lost_device_closes_the_round_early_but_may_still_answer_in_time():
    c = coord(("a", "b"), deadline=100.0)
    c.handle(ResultArrived("a", "m1", 1))
    assert c.handle(DeviceLost("b")) == [RoundClosed(3, ("a",), ("b",), (), ())]
    c2 = coord(("a", "b", "c"))
    c2.handle(DeviceLost("b"))
    out = c2.handle(ResultArrived("b", "m2", 2))            # reconnected before the round closed
    assert isinstance(out[0], ApplyResult) and "b" in c2.accepted


def test_retry_timer_starts_when_the_upload_ends():
    s = DeviceSession(retry_after_s=5)
    s.handle(Tick(0.0))
    s.handle(task())
    s.handle(WorkFinished(TaskRef("j", 1, "t1"), "R", "r1"))   # work took long; the clock says 0
    s.handle(ResultSent(60.0))                                  # slow upload finished at t=60
    assert s.handle(Tick(61.0)) == []
    assert s.handle(Tick(65.0)) == [SendResult("R", 2)]


def test_a_long_lived_device_keeps_only_recent_results():
    s = DeviceSession(keep_finished=2)
    for r in range(1, 6):
        s.handle(task(r))
        s.handle(WorkFinished(TaskRef("j", r, f"t{r}"), f"R{r}", f"r{r}"))
        s.handle(AckArrived(f"r{r}", "accepted"))
    assert [ref.round for ref in s.finished] == [4, 5]
    assert s.handle(task(5)) == [SendResult("R5", 2)]         # recent: re-sent, not recomputed


def test_a_session_that_forgets_acked_results_holds_none_and_never_resends_them():
    s = DeviceSession(retry_after_s=5, keep_acked_results=False)
    s.handle(task(1))
    s.handle(WorkFinished(TaskRef("j", 1, "t1"), "R1", "r1"))
    assert s.handle(Tick(6.0)) == [SendResult("R1", 2)]                  # kept until acknowledged
    s.handle(AckArrived("r1", "duplicate"))
    assert all(done.message is None for done in s.finished.values())
    assert s.handle(task(1)) == [] and s.state is DeviceState.IDLE        # acknowledged: nothing to send
    assert kinds(s.handle(task(2))) == ["StartWork"]


def test_a_secure_task_goes_through_the_session_without_ack_retries():
    """A secure task's protocol messages: sent once, re-sent (the same ones) only when the server
    re-sends the task, never retried for an ack the protocol does not send."""
    s = DeviceSession(retry_after_s=5, max_retries=3)
    assert kinds(s.handle(task())) == ["StartWork"]
    assert s.handle(WorkFinished(TaskRef("j", 1, "t1"), "KEYS", "t1:protocol", expects_ack=False)) == [SendResult("KEYS", 1)]
    s.handle(ResultSent(1.0))
    assert s.handle(Tick(1000.0)) == []                                   # no retry timer
    assert s.handle(task()) == [SendResult("KEYS", 2)]                   # redelivered task: same messages
    assert kinds(s.handle(task(r=2))) == ["StartWork"]                    # the next round's task starts anew


def test_a_session_recalls_its_replay_guard_and_refuses_a_malformed_memory_whole():
    """What a restarted device reads back (edge_client/session_memory.py): the same skips as before
    the restart; a malformed memory changes nothing; only the newest MAX_JOBS_REMEMBERED jobs."""
    import json
    from protocols.device_session import ANSWERED, MAX_JOBS_REMEMBERED, SkipTask

    def arriving(job, r, ts, received_at=None, deadline=1e12):
        return TaskArrived(TaskRef(job, r, f"{job}-t{r}"), "k", {}, deadline, received_at=received_at, sent_at=ts)

    before = DeviceSession()
    before.handle(arriving("j", 2, 200.0))
    before.handle(WorkFailed(TaskRef("j", 2, "j-t2"), "no"))
    assert kinds(before.handle(arriving("e", 1, 1.0, received_at=500.0, deadline=100.0))) == ["SendDecline"]
    changes = before.memory_changes
    after = DeviceSession()
    after.recall(json.loads(json.dumps(before.memory())))        # through JSON, as the file holds it
    assert after.last_started == before.last_started and after.expired_declined == before.expired_declined
    assert after.handle(arriving("j", 1, 100.0)) == [SkipTask(TaskRef("j", 1, "j-t1"), "created before the last "
                                                               "task of its job this device started")]
    assert kinds(after.handle(arriving("e", 2, 2.0, received_at=500.0, deadline=100.0))) == ["SkipTask"]
    # round 2 was declined before the restart: its replay is skipped, the aggregator's re-send (later) runs
    assert after.handle(arriving("j", 2, 200.0)) == [SkipTask(TaskRef("j", 2, "j-t2"), ANSWERED)]
    assert kinds(after.handle(arriving("j", 2, 210.0))) == ["StartWork"]
    assert before.memory_changes == changes and after.memory_changes == 1     # recall is no change to write

    good = before.memory()
    for bad in (None, [], {**good, "version": 2}, {**good, "started": {}}, {**good, "started": [["j", 2, "t"]]},
                {**good, "started": [["j", 2.0, "t", 1.0]]}, {**good, "started": [["j", True, "t", 1.0]]},
                {**good, "started": [["j", 2, "t", float("nan")]]}, {**good, "started": [["", 2, "t", 1.0]]},
                {**good, "started": [["j" * 257, 2, "t", 1.0]]}, {**good, "expired_declined": [3]},
                {**good, "expired_declined": None}, {**good, "version": 1.0}, {**good, "version": True},
                {**good, "started": [["j", 1 << 62, "t", 1.0]]}, {**good, "started": [["j", 2, "t", 10 ** 400]]}):
        kept = DeviceSession()
        kept.recall(good)
        with pytest.raises(ValueError, match="device session memory"):
            kept.recall(bad)
        assert kept.memory() == good, bad

    many = {"version": 1, "started": [[f"j{i}", i, f"t{i}", float(i)] for i in range(MAX_JOBS_REMEMBERED + 10)],
            "expired_declined": [f"j{i}" for i in range(MAX_JOBS_REMEMBERED + 10)]}
    s = DeviceSession()
    s.recall(many)
    assert list(s.last_started) == [f"j{i}" for i in range(10, MAX_JOBS_REMEMBERED + 10)]
    assert list(s.expired_declined) == list(s.last_started)
    # a job listed twice keeps its first place and drops no other (a full memory lost its oldest to it)
    ids = [f"j{i}" for i in range(MAX_JOBS_REMEMBERED)]
    for again in (ids[0], ids[5]):
        s.recall({"version": 1, "started": [], "expired_declined": [*ids, again]})
        assert list(s.expired_declined) == ids, again


def test_a_last_start_dated_in_the_devices_future_is_no_evidence_of_a_replay():
    """The aggregator's clock ran an hour ahead when round 2's task was created, then was set back:
    before, round 3's task (created earlier by that clock) and every later one were skipped as
    replays until the clock caught up; now only a start within the device's clock plus the grace
    counts, so a replay older than round 3's start is still skipped."""
    from protocols.device_session import STALE, SkipTask

    def arriving(r, sent_at, received_at):
        return TaskArrived(TaskRef("j", r, f"t{r}"), "k", {}, received_at + 100, received_at=received_at, sent_at=sent_at)

    s = DeviceSession()
    assert kinds(s.handle(arriving(2, 3700.0, 100.0))) == ["StartWork"]
    assert kinds(s.handle(arriving(3, 150.0, 160.0))) == ["StartWork"]          # 3700 > 160 + 60: no evidence
    assert s.handle(arriving(1, 120.0, 170.0)) == [SkipTask(TaskRef("j", 1, "t1"), STALE)]
    s2 = DeviceSession()
    s2.handle(arriving(2, 210.0, 150.0))                                        # within the grace: evidence
    assert kinds(s2.handle(arriving(3, 200.0, 160.0))) == ["SkipTask"]


def test_a_task_replayed_after_its_answer_was_forgotten_is_skipped_not_run_again():
    """A review's finding: a device keeps its last ``keep_finished`` answers; the last task of a job
    it started, answered, then re-published (the captured bytes: its signed ts) once answers of
    other jobs had pushed its answer out, started afresh (the work again, a fresh update sent), and
    so after every restart (answers are not kept across one). Now each job remembers whether its
    last start was answered: a task of it signed no later than that start is skipped; the
    aggregator's own re-send (a new envelope, a later ts) still runs, as a device without the
    answer can give nothing else. Across a restart (memory/recall) alike."""
    import json
    from protocols.device_session import ANSWERED, SkipTask

    def arriving(job, ts, task="t1"):
        return TaskArrived(TaskRef(job, 1, task), "k", {}, 1e12, received_at=ts, sent_at=ts)

    s = DeviceSession(keep_finished=2)
    assert kinds(s.handle(arriving("j", 100.0))) == ["StartWork"]
    s.handle(WorkFailed(TaskRef("j", 1, "t1"), "no data"))          # a decline is an answer too
    assert kinds(s.handle(arriving("k", 101.0))) == ["StartWork"]
    s.handle(WorkFinished(TaskRef("k", 1, "t1"), "RK", "rk"))
    s.handle(AckArrived("rk", "accepted"))
    for job, ts in (("a", 102.0), ("b", 103.0)):                        # j's and k's answers pushed out
        s.handle(arriving(job, ts))
        s.handle(WorkFinished(TaskRef(job, 1, "t1"), f"R{job}", f"r{job}"))
        s.handle(AckArrived(f"r{job}", "accepted"))
    assert TaskRef("j", 1, "t1") not in s.finished and TaskRef("k", 1, "t1") not in s.finished
    for job in ("j", "k"):
        assert s.handle(arriving(job, 100.0 if job == "j" else 101.0)) == [SkipTask(TaskRef(job, 1, "t1"), ANSWERED)]
    assert s.state is DeviceState.IDLE
    # restarted: no answer kept at all, the memory says which last starts were answered
    after = DeviceSession()
    after.recall(json.loads(json.dumps(s.memory())), now=200.0)
    for job, ts in (("j", 100.0), ("k", 101.0), ("b", 103.0)):
        assert kinds(after.handle(arriving(job, ts))) == ["SkipTask"], job
    assert after.memory_changes == 0
    # the aggregator re-sends a task it still waits for in a new envelope: later ts, runs
    assert kinds(after.handle(arriving("k", 150.0))) == ["StartWork"]
    # a started task not yet answered (the work cut short by a restart) runs when it comes again
    s.handle(arriving("c", 104.0))
    again = DeviceSession()
    again.recall(s.memory())
    assert kinds(again.handle(arriving("c", 104.0))) == ["StartWork"]


# ---- the tables themselves --------------------------------------------------------------------
def test_docs_show_the_tables_rendered_from_the_data():
    text = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    block = re.search(r"<!-- BEGIN rounds tables \(generated\) -->\n```text\n(.*?)\n```\n<!-- END rounds tables -->",
                      text, re.S)
    assert block is not None, "docs/protocol.md lost its generated rounds tables"
    assert block.group(1) == render_tables(), "stale: paste `python -m protocols.rounds` into docs/protocol.md"


def test_an_event_foreign_to_a_machine_is_refused_from_the_table_and_changes_nothing():
    c = coord()
    c.handle(ResultArrived("a", "m1", 1))
    before = c.snapshot()
    with pytest.raises(IllegalTransition, match="OPEN has no transition for TaskArrived"):
        c.handle(task())
    assert c.snapshot() == before and c.seen_ids == {"m1"}
    s = DeviceSession()
    s.handle(task())
    with pytest.raises(IllegalTransition, match="WORKING has no transition for ResultArrived"):
        s.handle(ResultArrived("a", "m1", 1))
    assert s.state is DeviceState.WORKING and s.current == TaskRef("j", 1, "t1")


class Door(enum.Enum):
    SHUT = "shut"
    OPEN = "open"


@dataclass(frozen=True)
class Push:
    pass


@dataclass
class DoorMachine:
    """A two-state machine whose table leaves (OPEN, Push) out."""
    state: Door = Door.SHUT
    pushes: int = 0

    def open(self, ev):
        self.pushes += 1
        self.state = Door.OPEN
        return ["opened"]


def test_a_pair_missing_from_a_table_is_refused_while_its_other_states_fire():
    table = TransitionTable(Door, [Transition(Door.SHUT, Push, "", DoorMachine.open, (str,), (Door.OPEN,))])
    door = DoorMachine()
    assert table.fire(door, Push()) == ["opened"] and door.state is Door.OPEN
    with pytest.raises(IllegalTransition, match="DoorMachine in state OPEN has no transition for Push"):
        table.fire(door, Push())
    assert door.pushes == 1 and door.state is Door.OPEN


def test_a_row_that_breaks_its_declaration_is_caught():
    moves_elsewhere = TransitionTable(Door, [Transition(Door.SHUT, Push, "", DoorMachine.open, (str,))])
    with pytest.raises(AssertionError, match="SHUT -> OPEN"):
        moves_elsewhere.fire(DoorMachine(), Push())
    emits_other = TransitionTable(Door, [Transition(Door.SHUT, Push, "", DoorMachine.open, (int,), (Door.OPEN,))])
    with pytest.raises(AssertionError, match="emitted"):
        emits_other.fire(DoorMachine(), Push())
    with pytest.raises(ValueError, match="last row must be unguarded"):
        TransitionTable(Door, [Transition(Door.SHUT, Push, "never", DoorMachine.open, guard=lambda m, ev: False)])


def _walk(make, events, table, steps, seed):
    """Random event sequences through fresh machines; the (state, row) pairs that fired."""
    rng = random.Random(seed)
    fired = set()
    for _ in range(steps):
        machine = make()
        for _ in range(rng.randint(1, 30)):
            event = rng.choice(events)(rng, machine)
            fired.add((machine.state, table.select(machine, event)))
            machine.handle(event)
    return fired


def test_every_coordinator_row_fires_in_every_state_it_names():
    devs = ("a", "b", "c", "zz")
    task = lambda r: r.choice([None, "t", "old"])      # "t": every participant's own task here
    events = [lambda r, c: ResultArrived(r.choice(devs), f"m{r.randint(0, 4)}", 0, task(r)),
              lambda r, c: ResultInvalid(r.choice(devs), f"m{r.randint(0, 4)}", "bad", task(r)),
              lambda r, c: Declined(r.choice(devs), "no data", task(r)), lambda r, c: DeviceLost(r.choice(devs)),
              lambda r, c: GroupSettled(tuple(r.sample(devs, 2))), lambda r, c: Tick(r.uniform(0, 12))]
    fired = _walk(lambda: coord(deadline=10.0, tasks=dict.fromkeys("abc", "t")), events, COORDINATOR_TABLE, 400, seed=1)
    names = lambda pairs: {(s.name, COORDINATOR_TABLE.describe(row)) for s, row in pairs}
    assert names(COORDINATOR_TABLE.entries()) - names(fired) == set()


def test_every_device_row_fires_in_every_state_it_names():
    def ref(r):
        n = r.randint(1, 3)
        return TaskRef("j", n, f"t{n}")

    def finished(r, s):
        done = s.current if s.current and r.random() < 0.7 else ref(r)
        return WorkFinished(done, f"R{done.round}", f"r{done.round}", expects_ack=r.random() < 0.8)

    def task(r, s):     # deadlines before, at and after; received in time, late or unchecked; created
        # before or after the job's last task started (or unknown); several jobs, each declined once expired
        job = r.choice(("j",) * 8 + tuple("abcdefghkm"))
        ref_ = ref(r)
        if s.last_started and r.random() < 0.2:     # a job's last task started, replayed: its ts, its ref
            last = r.choice(list(s.last_started.values()))
            return TaskArrived(last.ref, "fed3r.stats", {}, 200.0, {}, r.choice((None, 150.0)), last.ts)
        return TaskArrived(TaskRef(job, ref_.round, ref_.task), "fed3r.stats", {}, r.choice((0.0, 100.0, 200.0)), {},
                           r.choice((None, 50.0, 150.0, 500.0)), r.choice((None, 10.0, 20.0, 30.0)))

    events = [task, finished,
              lambda r, s: WorkFailed(s.current if s.current and r.random() < 0.5 else ref(r), "no data"),
              lambda r, s: WorkStopped(s.current if s.current and r.random() < 0.5 else ref(r), r.random() < 0.5),
              lambda r, s: ResultSent(r.uniform(0, 30)), lambda r, s: AckArrived(f"r{r.randint(1, 3)}", "accepted"),
              lambda r, s: Tick(r.uniform(0, 60))]
    # one answer kept: a walk pushes answers out, and replays a job's last task after that
    fired = _walk(lambda: DeviceSession(retry_after_s=2, max_retries=2, keep_finished=1, keep_acked_results=False), events,
                  DEVICE_TABLE, 6000, seed=2)
    names = lambda pairs: {(s.name, DEVICE_TABLE.describe(row)) for s, row in pairs}
    assert names(DEVICE_TABLE.entries()) - names(fired) == set()
