"""How long a task's work may run on the device: until its round is surely over.

A device skips a task that arrives after its deadline plus the clocks' grace
(:class:`protocols.device_session.DeviceSession`); a task that arrived in time may still outlast that
moment (a slow device, a long recipe). Its result would then be answered ``late`` and dropped, so
the rest of the work is waste: battery on a phone, a compute slot on an emulation host. The agent
runs each task's handler under :func:`working_until` (the deadline plus the grace, the
aggregator's clock read on the device's, as the arrival check reads it), and every local-training
loop checks it once per step (:func:`each_checked`: the batch schedule's iterator for the head,
tail, Scaffold, Ditto, FedSim/FedAlt and FedGloSS loops, LADD's own loop); an emulated slower
device's extra time sleeps within it (:func:`sleep_within`). Past the moment :class:`PastDeadline`
is raised: the session's ``WorkStopped`` sends no result (the job's first such stop is declined
once, saying the clock may be ahead) and the device is free for its next task.

A context variable, not a parameter: the loops are the same code the benches and the server's
simulations call outside any agent, where nothing is set and nothing is checked. The same context
names the task under way (:func:`task_at_work`): a secure task's SecAgg session keeps it, so the
device can decline that task when it leaves the round later, at the round's start
(``edge_client/tasks/secure_update.py``); outside an agent there is none, and nothing is declined.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterable, Iterator, TypeVar

from protocols.messages import TaskRef

T = TypeVar("T")

_UNTIL: ContextVar[float | None] = ContextVar("fedfleet_work_until", default=None)


def wall_clock() -> float:
    """time.time(), looked up at each call (a test's patched time.time is read too): the clock a
    device reads by default."""
    return time.time()


_CLOCK: ContextVar[Callable[[], float]] = ContextVar("fedfleet_work_clock", default=wall_clock)
_TASK: ContextVar[TaskRef | None] = ContextVar("fedfleet_task_at_work", default=None)


class PastDeadline(Exception):
    """The task's round is over (its deadline and the grace passed during its work): stop, send nothing."""


@contextmanager
def working_until(unix_s: float, task: TaskRef | None = None, clock: Callable[[], float] = wall_clock):
    """Run the body's work until ``unix_s`` (the device's clock, read by ``clock``) at the latest;
    ``task``: the task it answers (None: none named)."""
    token, named, read_by = _UNTIL.set(float(unix_s)), _TASK.set(task), _CLOCK.set(clock)
    try:
        yield
    finally:
        _CLOCK.reset(read_by)
        _TASK.reset(named)
        _UNTIL.reset(token)


def round_over_at() -> float | None:
    """The moment (unix s, the device's clock) the work under way's round is surely over; None
    outside a task. A secure task's SecAgg session ends there (``edge_client/tasks/secure_update.py``)."""
    return _UNTIL.get()


def task_at_work() -> TaskRef | None:
    """The task the work under way answers; None outside a task (or one the caller did not name)."""
    return _TASK.get()


def seconds_left() -> float | None:
    """How long the work under way may still run (0 once past its moment); None outside a task."""
    until = _UNTIL.get()
    return None if until is None else max(0.0, until - _CLOCK.get()())


def stop_if_past() -> None:
    """Raise :class:`PastDeadline` when the work under way has run past its moment."""
    until = _UNTIL.get()
    if until is None:
        return
    now = _CLOCK.get()()
    if now > until:
        raise PastDeadline(f"its deadline passed during the work ({now - until:.1f} s past it and the grace)")


def sleep_within(seconds: float) -> None:
    """Sleep ``seconds``, or until the work's moment if that comes first and then raise
    :class:`PastDeadline`: an emulated slower device's extra compute time (fedfleet/emulation),
    which a real device would spend inside its training loop, stops with its round too."""
    until = _UNTIL.get()
    if until is None or _CLOCK.get()() + seconds <= until:
        time.sleep(max(0.0, seconds))
        return
    time.sleep(max(0.0, until - _CLOCK.get()()))
    stop_if_past()
    raise PastDeadline("its deadline passed during the work")


def each_checked(steps: Iterable[T]) -> Iterator[T]:
    """``steps``, checking the moment before each one."""
    for step in steps:
        stop_if_past()
        yield step
