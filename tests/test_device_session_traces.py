"""The device's round machine, Python and Java, against the same golden traces (issue 36): every
recorded event sequence in protocols/golden/traces/ is replayed through protocols.rounds'
DeviceSession and the Java library's DeviceSession; each must answer every event with the recorded
actions and state, and end with the same memory() (what a device keeps across restarts in
session.json). The traces must fire every row of DEVICE_TABLE in every state it names, so no
rule of the table goes untried on the Java side. Both sessions take back the same memories and
refuse the same malformed ones (recall)."""

from __future__ import annotations

import json
import subprocess

import pytest

import java_build
from protocols.golden_traces import SESSION, TRACE_DIR, replay, traces
from protocols.rounds import DEVICE_TABLE, MAX_JOBS_REMEMBERED, DeviceSession

TRACES = sorted(TRACE_DIR.glob("*.json"))


def recorded(path) -> dict:
    return json.loads(path.read_text())


def test_the_recorded_traces_are_the_ones_the_module_defines():
    assert {p.stem for p in TRACES} == set(traces()), "stale: run `python -m protocols.golden_traces`"
    for path in TRACES:
        trace = recorded(path)
        assert trace["session"] == SESSION and [s["event"] for s in trace["steps"]] == traces()[path.stem]


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_python_answers_every_event_as_recorded(path):
    trace = recorded(path)
    assert replay(trace["session"], [s["event"] for s in trace["steps"]]) == trace["steps"]


def test_the_traces_fire_every_device_row_in_every_state_it_names():
    fired = set()
    for path in TRACES:
        trace = recorded(path)
        replay(trace["session"], [s["event"] for s in trace["steps"]],
               on_event=lambda machine, event: fired.add((machine.state, DEVICE_TABLE.select(machine, event))))
    names = lambda pairs: {(state.name, DEVICE_TABLE.describe(row)) for state, row in pairs}
    assert names(DEVICE_TABLE.entries()) - names(fired) == set()


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_java_answers_every_event_as_recorded():
    proc = subprocess.run(["java", "-cp", java_build.built(), "org.fedfleet.device.SessionTraces", *map(str, TRACES)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = {line["trace"]: line for line in map(json.loads, proc.stdout.splitlines())}
    answers = {name: line["steps"] for name, line in lines.items()}
    assert sorted(answers) == [p.name for p in TRACES]
    for path in TRACES:
        want = [{"actions": s["actions"], "state": s["state"]} for s in recorded(path)["steps"]]
        for i, (got, expected) in enumerate(zip(answers[path.name], want, strict=True)):
            assert got == expected, f"{path.stem} step {i} ({recorded(path)['steps'][i]['event']}): Java {got}"
        machines = []
        replay(recorded(path)["session"], [s["event"] for s in recorded(path)["steps"]],
               on_event=lambda machine, event: machines.append(machine))
        python = machines[-1]
        assert (lines[path.name]["memory"], lines[path.name]["memory_changes"]) == (python.memory(), python.memory_changes), path.stem


def session_memories() -> tuple[dict, list, list]:
    """A valid memory, then memories either device may find in its session.json: the ones taken
    back, the ones refused whole."""
    base = {"version": 1, "started": [["b", 1, "bt", 5.0]], "expired_declined": ["b"]}
    entry = lambda job, r=2, task="t", ts=7.5: {**base, "started": [[job, r, task, ts]]}
    many = {"version": 1, "started": [[f"j{i}", i, f"t{i}", i + 0.5] for i in range(MAX_JOBS_REMEMBERED + 10)],
            "expired_declined": [f"j{i}" for i in range(MAX_JOBS_REMEMBERED + 10)]}
    taken = [
        {"version": 1, "started": [], "expired_declined": []}, many, {**base, "extra": [1]},
        {**base, "started": [["a", 1, "t1", 1.0], ["b", 2, "t2", 2], ["a", 3, "t3", 3.0]]},   # a job twice: the later
        {**many, "started": [["bad"], *many["started"]], "expired_declined": [3, *many["expired_declined"]]},  # not read
        entry("é" * 256), entry("\U0001F600" * 256), entry("j", -(1 << 62)), entry("j", (1 << 62) - 1), entry("j", ts=-1e300)]
    refused = [
        None, [], "session", {**base, "version": 2}, {**base, "version": 1.0}, {**base, "version": True},
        {"started": [], "expired_declined": []}, {**base, "started": {}}, {**base, "expired_declined": None},
        {**base, "started": [["j", 2, "t"]]}, {**base, "started": [["j", 2, "t", 1.0, 0]]}, entry("j", 2.0), entry("j", True),
        entry("j", "2"), entry("j", 1 << 62), entry("j", -(1 << 62) - 1), entry("j", 1 << 64), entry("j", ts=float("nan")),
        entry("j", ts=float("inf")), entry("j", ts=10 ** 400), entry("j", ts="7.5"), entry("j", ts=None), entry(""),
        entry("j" * 257), entry("\U0001F600" * 257), entry(3), entry("j", task=""), entry("j", task=["t"]),
        {**base, "expired_declined": [""]}, {**base, "expired_declined": ["x" * 257]}, {**base, "expired_declined": [["b"]]}]
    return base, taken, refused


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_java_recalls_and_refuses_session_memories_as_python_does():
    """What DeviceSession.recall (Java) and protocols/rounds.py's recall take back from a session.json:
    the same memory, or the same refusal, which leaves the session as it was."""
    base, taken, refused = session_memories()
    lines = [json.dumps(base), *map(json.dumps, taken + refused), '{"version": 1, "started": [', "{'version': 1}"]   # torn, not JSON
    proc = subprocess.run(["java", "-cp", java_build.built(), "org.fedfleet.device.SessionTraces", "--recall"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    java = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(java) == len(lines) - 1
    for text, got in zip(lines[1:], java):
        session = DeviceSession()
        session.recall(base)
        try:
            session.recall(json.loads(text))
            python_refused = False
        except ValueError:          # json's errors too
            python_refused = True
        assert got == {"refused": python_refused, "memory": session.memory(),
                       "memory_changes": session.memory_changes}, text[:300]     # recall is no change to write
    assert [got["refused"] for got in java] == [False] * len(taken) + [True] * (len(refused) + 2)
