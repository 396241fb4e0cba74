"""Golden traces of the device's round machine: recorded event sequences and what the machine
answers to each event (its actions and its state), in ``protocols/golden/traces/``.

The device side of the round rules lives twice: :class:`protocols.rounds.DeviceSession` (its
table, ``DEVICE_TABLE``) and the Java library's ``org.fedfleet.device.DeviceSession``. Both are fed
the same traces (tests/test_device_session_traces.py); each must answer every event with the
recorded actions and state. A trace is JSON: ``session`` (the machine's settings), ``steps``, each
an ``event`` with the ``actions`` and ``state`` that follow it. Events and actions name a task by
its ref ``[job, round, task]``; a task event may carry its ``deadline`` (default 0), the device's
clock when it came, ``received_at`` (absent: the deadline is not checked), and its envelope's
``sent_at`` (absent: not compared with the job's last task); a result's message is opaque text (null: a secure task's, whose
protocol messages go out through its own session). The traces are the named scenarios below plus
seeded random walks; together they fire every row of ``DEVICE_TABLE`` in every state it names (the
test checks). Regenerate (only when the round rules change, reviewing the diff) with
``python -m protocols.golden_traces``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from .device_session import (AckArrived, DeviceSession, ResultSent, SendDecline, SendResult, SkipTask, StartWork,
                             TaskArrived, Tick, WorkFailed, WorkFinished, WorkStopped)
from .messages import TaskRef

TRACE_DIR = Path(__file__).resolve().parent / "golden" / "traces"
SESSION = {"retry_after_s": 5.0, "max_retries": 2, "keep_finished": 2}


def _ref(n: int, job: str = "job") -> list:
    return [job, n, f"t{n}"]


def _task(n: int, deadline: float | None = None, received_at: float | None = None, sent_at: float | None = None,
          job: str = "job") -> dict:
    """A task event; with a deadline, the device's clock when it came and its envelope's ts (the
    last two absent: not checked)."""
    return {"type": "task", "ref": _ref(n, job), **({} if deadline is None else {"deadline": deadline}),
            **({} if received_at is None else {"received_at": received_at}),
            **({} if sent_at is None else {"sent_at": sent_at})}


def _stopped(n: int, round_over: bool) -> dict:
    return {"type": "stopped", "ref": _ref(n), "round_over": round_over}


def _finished(n: int, secure: bool = False, job: str = "job") -> dict:
    return {"type": "finished", "ref": _ref(n, job), "message": None if secure else f"R{n}", "message_id": f"r{n}",
            "expects_ack": not secure}


# the named scenarios: one behaviour each, as a reader of docs/protocol.md would try it
SCENARIOS: dict[str, list[dict]] = {
    "task_result_ack": [{"type": "task", "ref": _ref(1)}, _finished(1), {"type": "sent", "now": 1.0},
                        {"type": "ack", "ref_id": "r1"}, {"type": "tick", "now": 60.0}],
    "retries_back_off_then_stop": [{"type": "task", "ref": _ref(1)}, _finished(1), {"type": "sent", "now": 0.5},
                                   *({"type": "tick", "now": t} for t in (4.0, 5.5, 6.0, 15.0, 16.0, 40.0, 99.0))],
    "redelivery_while_busy_and_after": [{"type": "task", "ref": _ref(1)}, {"type": "task", "ref": _ref(1)},
                                        _finished(1), {"type": "task", "ref": _ref(1)},
                                        {"type": "ack", "ref_id": "r1"}, {"type": "task", "ref": _ref(1)}],
    "decline_and_abandoned_work": [{"type": "task", "ref": _ref(1)}, {"type": "task", "ref": _ref(2)},
                                   _finished(1), {"type": "failed", "ref": _ref(1), "reason": "old"},
                                   {"type": "failed", "ref": _ref(2), "reason": "no data"},
                                   {"type": "ack", "ref_id": "r2"}],
    "secure_task_is_never_retried_or_resent": [{"type": "task", "ref": _ref(3)}, _finished(3, secure=True),
                                               {"type": "sent", "now": 1.0}, {"type": "tick", "now": 100.0},
                                               {"type": "task", "ref": _ref(3)}, {"type": "task", "ref": _ref(4)},
                                               {"type": "task", "ref": _ref(3)},
                                               {"type": "failed", "ref": _ref(4), "reason": "no data"},
                                               {"type": "task", "ref": _ref(3)}],
    "only_the_recent_results_are_kept": [*(e for n in (1, 2, 3) for e in ({"type": "task", "ref": _ref(n)},
                                                                          _finished(n), {"type": "ack",
                                                                                         "ref_id": f"r{n}"})),
                                         {"type": "task", "ref": _ref(4)}, {"type": "task", "ref": _ref(3)},
                                         {"type": "task", "ref": _ref(1)}],
    # SESSION's grace is the default 60 s; round 2's task (created at 40) runs; then in each state a
    # task created before it (a replay) is skipped, the first task of a job past its deadline + grace
    # declined (the clock may be ahead), the later ones skipped, without a kept result re-sent; round
    # 2's result keeps its retries; a task at the grace's edge runs, and so does a task of the job
    # created later (a job re-created under the same id: round 1 again). Another job's first expired
    # task is declined a minute after the last such decline (jobs a, b), not sooner (job c)
    "expired_and_replayed_tasks_are_skipped": [
        _task(2, 100.0, 50.0, 40.0), _task(1, 90.0, 60.0, 30.0), _task(4, 100.0, 170.0, 45.0),
        _task(4, 100.0, 170.0, 45.0), _finished(2), {"type": "sent", "now": 1.0}, _task(1, 90.0, 60.0, 30.0),
        _task(5, 100.0, 230.0, 45.0, job="a"), _task(4, 100.0, 161.0, 45.0), _task(2, 100.0, 161.0, 40.0),
        {"type": "tick", "now": 7.0}, {"type": "ack", "ref_id": "r2"}, _task(1, 90.0, 60.0, 30.0),
        _task(5, 100.0, 290.0, 45.0, job="b"), _task(5, 100.0, 349.0, 45.0, job="c"), _task(4, 100.0, 161.0, 45.0),
        _task(4, 100.0, 160.0, 45.0),
        _task(1, 200.0, 170.0, 50.0), {"type": "failed", "ref": _ref(1), "reason": "no data"}],
    # the aggregator's clock ran an hour ahead when round 2's task was created, then was set back:
    # round 3's task (created earlier by that clock) runs, the last start being dated past the
    # device's clock plus the grace; an older replay within the grace is still skipped
    "a_last_start_in_the_devices_future_is_no_evidence": [
        _task(2, 3700.0, 100.0, 3640.0), _finished(2), {"type": "ack", "ref_id": "r2"},
        _task(3, 200.0, 150.0, 140.0), _task(1, 300.0, 150.0, 100.0), _finished(3),
        _task(4, 300.0, 160.0, 150.0), _task(1, 300.0, 160.0, 100.0)],
    # a task answered is answered again when it comes again (the server may have lost the answer: the
    # same decline, the same result), at most max_retries times: a replayer gets nothing more, the
    # task never runs again
    "a_redelivered_task_is_answered_again_at_most_max_retries_times": [
        _task(1), {"type": "failed", "ref": _ref(1), "reason": "no data"}, _task(1), _task(1), _task(1),
        _task(2), _finished(2), {"type": "sent", "now": 1.0}, _task(2), {"type": "ack", "ref_id": "r2"}, _task(2),
        _task(2), _task(1)],
    # work stopped unanswered: the first of a job whose round went over during the work is declined
    # once (the clock may be ahead), a redelivery past its deadline then skipped; a later stop of the
    # job, a drop-out and a stop of abandoned work send nothing; another job is told once too
    "work_stopped_when_its_round_is_over": [
        _task(1, 100.0, 150.0, 10.0), _stopped(1, True), _task(1, 100.0, 170.0, 10.0), _task(2, 200.0, 210.0, 20.0),
        _stopped(2, True), _task(3, 300.0, 250.0, 30.0), _stopped(3, False), _task(1, 100.0, 150.0, 10.0, job="a"),
        _stopped(1, False), _task(2, 100.0, 150.0, 11.0, job="a"), _task(3, 100.0, 150.0, 12.0, job="a"),
        _stopped(2, True), {"type": "stopped", "ref": _ref(3, "a"), "round_over": True}, _task(3, 300.0, 250.0, 31.0),
        _finished(3), _stopped(3, True)],
    # SESSION keeps 2 answers: job's round 1 (answered) is pushed out by a's decline and b's result;
    # then its captured task (created at 10) is skipped, not run, in each state (b's result keeps
    # its retries, c's work goes on), and so is a's once its decline is pushed out too; the
    # aggregator's re-send of round 1 (a new envelope, created at 30) runs
    "a_task_replayed_after_its_answer_was_forgotten_is_skipped": [
        _task(1, 100.0, 10.0, 10.0), _finished(1), {"type": "ack", "ref_id": "r1"},
        _task(2, 100.0, 12.0, 12.0, job="a"), {"type": "failed", "ref": _ref(2, "a"), "reason": "no data"},
        _task(3, 100.0, 13.0, 13.0, job="b"), _finished(3, job="b"), _task(1, 100.0, 20.0, 10.0),
        {"type": "tick", "now": 6.0}, _task(4, 100.0, 21.0, 14.0, job="c"), _task(1, 100.0, 22.0, 10.0),
        {"type": "failed", "ref": _ref(4, "c"), "reason": "no data"}, _task(2, 100.0, 23.0, 12.0, job="a"),
        _task(1, 100.0, 24.0, 30.0), _finished(1), _task(1, 100.0, 25.0, 30.0)],
}


def _random_walk(seed: int, length: int = 60) -> list[dict]:
    """Events drawn at random (refs 1-3, a mostly rising clock), as test_protocol_rounds' walks."""
    rng, now, events = random.Random(seed), 0.0, []
    for _ in range(length):
        now += rng.choice((0.0, 0.5, 2.0, 6.0, 15.0))
        n = rng.randint(1, 3)
        kind = rng.choice(("task", "finished", "failed", "stopped", "sent", "ack", "tick", "tick"))
        events.append({"task": {"type": "task", "ref": _ref(n)},
                       "finished": _finished(n, secure=rng.random() < 0.2),
                       "failed": {"type": "failed", "ref": _ref(n), "reason": "no data"},
                       "stopped": _stopped(n, rng.random() < 0.5),
                       "sent": {"type": "sent", "now": now},
                       "ack": {"type": "ack", "ref_id": f"r{n}"},
                       "tick": {"type": "tick", "now": now}}[kind])
    return events


def traces() -> dict[str, list[dict]]:
    """Every trace's events, by name."""
    return {**SCENARIOS, **{f"random_walk_{seed}": _random_walk(seed) for seed in (1, 2, 3, 4)}}


def event_of(e: dict) -> Any:
    """A trace event as protocols.rounds' event."""
    ref = TaskRef(*e["ref"]) if "ref" in e else None
    return {"task": lambda: TaskArrived(ref, "fed3r.stats", {}, e.get("deadline", 0.0), {}, e.get("received_at"),
                                        e.get("sent_at")),
            "finished": lambda: WorkFinished(ref, e["message"], e["message_id"], e["expects_ack"]),
            "failed": lambda: WorkFailed(ref, e["reason"]),
            "stopped": lambda: WorkStopped(ref, e["round_over"]),
            "sent": lambda: ResultSent(e["now"]),
            "ack": lambda: AckArrived(e["ref_id"], "accepted"),
            "tick": lambda: Tick(e["now"])}[e["type"]]()


def action_json(action: Any) -> dict:
    if isinstance(action, StartWork):
        return {"type": "StartWork", "ref": [action.ref.job, action.ref.round, action.ref.task]}
    if isinstance(action, SendResult):
        return {"type": "SendResult", "message": action.message, "attempt": action.attempt}
    if isinstance(action, SkipTask):
        return {"type": "SkipTask", "ref": [action.ref.job, action.ref.round, action.ref.task], "reason": action.reason}
    if isinstance(action, SendDecline):
        return {"type": "SendDecline", "ref": [action.ref.job, action.ref.round, action.ref.task],
                "reason": action.reason}
    raise TypeError(f"no trace form for {action!r}")


def replay(session: dict, events: list[dict], on_event=None) -> list[dict]:
    """Feed `events` to a fresh Python DeviceSession: the step after each (actions, state).
    ``on_event(machine, event)``: called before each event is handled (the tests' row coverage)."""
    machine = DeviceSession(**session)
    steps = []
    for e in events:
        event = event_of(e)
        if on_event is not None:
            on_event(machine, event)
        actions = [action_json(a) for a in machine.handle(event)]
        steps.append({"event": e, "actions": actions, "state": machine.state.name})
    return steps


def write(directory: Path = TRACE_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, events in traces().items():
        steps = ",\n ".join(json.dumps(step) for step in replay(SESSION, events))     # a step a line: diffs read
        (directory / f"{name}.json").write_text(f'{{"session": {json.dumps(SESSION)},\n "steps": [\n {steps}]}}\n')


if __name__ == "__main__":
    write()
