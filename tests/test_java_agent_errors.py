"""What the Java device's MqttAgent does when a message's handling throws something that is not a
RuntimeException (tests/java_device/AgentTurns.java drives MqttAgent.turn):

* an Error a task's handler throws (an AssertionError, a NoClassDefFoundError or an
  ExceptionInInitializerError of a class loaded lazily, an application's own Error) is that task's
  failure: declined, logged with the task, and the next task runs. It used to end the agent's thread
  (only RuntimeException, OutOfMemoryError and StackOverflowError were caught), the device silent;
* an error that leaves the JVM in doubt (an InternalError) ends the agent cleanly: one log line
  naming the message, nothing more handled, the cause in MqttAgent.stoppedBy().

The Python agent's policy is the same in kind (tests/test_agent_loop_errors.py)."""

from __future__ import annotations

import time

import pytest

import java_build
from java_agent_turns import AgentTurns
from protocols import messages as M

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

APPLICATION_ERRORS = ("assertion", "no-class", "initializer", "application")


def task(job: str, throw: str | None = None):
    return M.task_message("aggregator", job, 1, "test.throws", {} if throw is None else {"throw": throw},
                          time.time() + 600)


def test_java_agent_declines_a_task_whose_handler_throws_an_error_and_runs_the_next():
    agent = AgentTurns()
    try:
        for n, throw in enumerate(APPLICATION_ERRORS):
            failed = agent.turn(task(f"job-{throw}", throw))
            assert (failed.done, failed.declined, failed.stopped_by) == (n, n + 1, None)
            after = agent.turn(task(f"job-after-{throw}"))
            assert (after.done, after.declined, after.stopped_by) == (n + 1, n + 1, None)
    finally:
        log = agent.close()
    for throw in APPLICATION_ERRORS:            # each failure logged with its task
        assert f"task job-{throw}/1/" in log, log[-3000:]
    assert "AssertionError: a handler's assert failed" in log and "the agent stopped" not in log


def test_java_agent_stops_cleanly_on_an_error_that_leaves_the_jvm_in_doubt():
    agent = AgentTurns()
    try:
        assert agent.turn(task("job-first")).done == 1
        broken = agent.turn(task("job-broken", "internal"))
        assert (broken.done, broken.declined, broken.stopped_by) == (1, 0, "java.lang.InternalError")
        later = agent.turn(task("job-later"))   # the bridge turns on, as the agent's thread would not: nothing
        assert (later.done, later.declined, later.stopped_by) == (1, 0, "java.lang.InternalError")
    finally:
        log = agent.close()
    stopped = [line for line in log.splitlines() if "the agent stopped" in line]
    assert len(stopped) == 1 and "InternalError: the JVM's own error" in stopped[0], log[-3000:]
    assert "a task message" in stopped[0] and "stoppedBy" in stopped[0]
