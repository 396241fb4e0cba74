"""``FEDFLEET_CRASH_AT=point[:n]`` (aggregator/service/crash_points.py), the crash tests' switch: the
n-th pass of ``point`` is the one that kills, n counting from 1, and a value that names no point
or no such n is one line when ``aggregator serve`` starts, before the broker or the state file."""

import os
import signal

import pytest

from aggregator.service import crash_points
from aggregator.service.crash_points import CRASH_ENV, CrashPoints


def kills_at(spec: str, passes: list[str], monkeypatch) -> list[int]:
    """The pass numbers (1-based, over ``passes``) at which ``spec`` sent this process a SIGKILL
    (recorded, not sent)."""
    kills = []
    monkeypatch.setattr(crash_points.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    crash, fired = CrashPoints(spec), []
    for i, name in enumerate(passes, 1):
        before = len(kills)
        crash(name)
        if len(kills) > before:
            fired.append(i)
    assert all(k == (os.getpid(), signal.SIGKILL) for k in kills)
    return fired


def test_the_nth_pass_of_the_point_kills_counting_from_one(monkeypatch):
    passes = ["round_opened", "task_sent", "round_opened", "round_opened", "task_sent"]
    assert kills_at("round_opened", passes, monkeypatch) == [1]
    assert kills_at("round_opened:1", passes, monkeypatch) == [1]
    assert kills_at("round_opened:3", passes, monkeypatch) == [4]
    assert kills_at("task_sent:2", passes, monkeypatch) == [5]
    assert kills_at("task_sent:3", passes, monkeypatch) == []
    assert kills_at("", passes, monkeypatch) == []


BAD_VALUES = [("round_opened:0", "n counts passes from 1"), ("round_opened:x", "n counts passes from 1"),
              ("round_opened:", "n counts passes from 1"), ("round_opened:-1", "n counts passes from 1"),
              ("round_opend:2", "unknown crash point 'round_opend'")]


@pytest.mark.parametrize("spec, words", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_a_bad_value_is_one_line_when_serve_starts(tmp_path, monkeypatch, capsys, spec, words):
    """A review's finding: ``point:0`` never fired (the crash test it drove passed without a
    crash) and ``point:x`` was a ValueError of int() from deep inside the store's opening."""
    from fedfleet.cli import main

    with pytest.raises(ValueError, match=words):
        CrashPoints(spec)
    (tmp_path / "job.json").write_text('{"num_classes": 10}')
    monkeypatch.setenv(CRASH_ENV, spec)
    code = main(["aggregator", "serve", "--out", str(tmp_path / "out"), "--config", str(tmp_path / "job.json"),
                 "--state", str(tmp_path / "state.db"), "--broker", "mqtt://127.0.0.1:1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and f"{CRASH_ENV}={spec}" in lines[0] and words in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.json"]          # nothing made before the check
