"""The device's round machine, Python and Java, against the same golden traces (issue 36): every
recorded event sequence in protocols/golden/traces/ is replayed through protocols.rounds'
DeviceSession and the Java library's DeviceSession; each must answer every event with the recorded
actions and state. The traces must fire every row of DEVICE_TABLE in every state it names, so no
rule of the table goes untried on the Java side."""

from __future__ import annotations

import json
import subprocess

import pytest

import java_build
from protocols.golden_traces import SESSION, TRACE_DIR, replay, traces
from protocols.rounds import DEVICE_TABLE

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
    answers = {line["trace"]: line["steps"] for line in map(json.loads, proc.stdout.splitlines())}
    assert sorted(answers) == [p.name for p in TRACES]
    for path in TRACES:
        want = [{"actions": s["actions"], "state": s["state"]} for s in recorded(path)["steps"]]
        for i, (got, expected) in enumerate(zip(answers[path.name], want, strict=True)):
            assert got == expected, f"{path.stem} step {i} ({recorded(path)['steps'][i]['event']}): Java {got}"
