"""The Java task tests' one TaskRunner JVM per worker (tests/java_tasks.py ServedTaskRunner, TaskRunner
--serve): a run's answer is that run's, whatever happened to the run before it, and the JVM ends as a
JVM ends, its exit hooks run."""

from __future__ import annotations

import pytest

import java_tasks
from java_tasks import ServedTaskRunner, java, java_cp  # noqa: F401 (java_cp: a fixture)


class Interrupted(Exception):
    """What pytest-timeout's signal or a ^C raises in the middle of a run."""


def draws(answer: str) -> int:
    """How many noise draws a ``--skellam MU COUNT`` answer ("NOISE d1 d2 ...") holds."""
    assert answer.startswith("NOISE"), answer
    return len(answer.split()) - 1


def test_a_run_left_unread_never_answers_the_next(java_cp):
    """A run interrupted before its answer was read left that answer in the pipe, and the worker's
    next run read it as its own: a test failing (or passing) on another test's answer."""
    saved = java_tasks._SERVED.pop(java_cp, None)
    runner = java_tasks._SERVED[java_cp] = ServedTaskRunner(java_cp)
    read_until = runner._read_until

    def interrupted(enough, deadline):
        runner._read_until = read_until
        raise Interrupted()

    runner._read_until = interrupted
    try:
        with pytest.raises(Interrupted):
            runner.run(["--skellam", "1.0", "3"])
        assert draws(java(java_cp, "--skellam", 1.0, 5)) == 5
    finally:
        for left in {runner, java_tasks._SERVED.pop(java_cp)}:
            left.close()
        if saved is not None:
            java_tasks._SERVED[java_cp] = saved


def test_a_closed_runner_ends_its_jvm_as_a_jvm_ends(java_cp):
    """close() killed the JVM (SIGKILL): its exit hooks never ran, so the fresh sample-window
    folders of a served --batch's Fed3R cases (TaskRunner.freshWindows, deleted on exit) would stay
    in the temporary folder. Its stdin closed, the serve loop ends and the JVM exits 0."""
    runner = ServedTaskRunner(java_cp)
    try:
        assert runner.run(["--skellam", "1.0", "2"])[0] == "OK"
    finally:
        runner.close()
    assert runner.proc.returncode == 0
