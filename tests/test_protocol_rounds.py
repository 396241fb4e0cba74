"""The sans-IO round machines: every rule in the transition tables of protocols/rounds.py."""

import pytest

from protocols.messages import TaskRef
from protocols.rounds import (AckArrived, ResultSent, ApplyResult, Declined, DeviceLost, DeviceSession, DeviceState, GroupSettled,
                              RecordDeclined, RecordRejected, ResultArrived,
                              ResultInvalid, RoundClosed, RoundCoordinator, SendAck, SendDecline, SendResult,
                              TaskArrived, Tick, WorkFailed, WorkFinished)


def coord(devs=("a", "b", "c"), deadline=100.0):
    return RoundCoordinator(round=3, participants=frozenset(devs), deadline=deadline)


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
