"""What a device remembers to skip replayed tasks, as data: the layout of
:meth:`protocols.rounds.DeviceSession.memory` and the checks a memory read back passes.

A device skips a task created before the last task of its job it started, and declines the first
expired task of a job once (docs/protocol.md, "Round rules"). Both need a little memory per job;
a device with a state folder keeps it across restarts (``edge_client/session_memory.py``, Java
``SessionMemoryFile.java``), so what it reads back is a file on its disk: torn, edited or foreign,
never trusted. The layout, which the Python and the Java device share (Java:
``DeviceSession.memory()``/``recall``, checked alike by ``tests/test_device_session_traces.py``)::

    {"version": 1, "started": [[job, round, task id, signed ts], ...], "expired_declined": [job, ...],
     "answered": [job, ...]}

oldest first; ids non-empty strings of at most ``MAX_MEMORY_ID_CHARS``, a round within a task's
range (±2^62), a ts a finite number; a malformed entry anywhere refuses the whole memory.
``answered`` lists the jobs whose last task started was answered (a result or a decline): a
replay of that task is skipped once its answer is no longer kept (a review's finding: it ran
again). It is absent from a file a device wrote before it was added (read as none answered), and
a device that predates it ignores it, so the version stays 1 both ways; a job it names that
``started`` does not is ignored (its start was forgotten: nothing to mark).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .messages import TaskRef

MEMORY_VERSION = 1              # DeviceSession.memory()'s layout
MAX_MEMORY_ID_CHARS = 256       # a remembered job or task id (the wire's: 1 to 64 characters and 32 hex digits)


@dataclass(frozen=True, slots=True)      # one per job remembered, on every emulated device
class LastStart:
    """A job's last task the device started: its ref, its envelope's signed ts (the aggregator's
    clock), and whether the device answered it. Another task of the job created before ``ts`` is a
    replay; so is this task signed no later than ``ts`` once answered (constant size per job)."""
    ref: TaskRef
    ts: float
    answered: bool = False


def memory_layout(last_started: dict[str, LastStart], expired_declined) -> dict:
    """A session's per-job memory as JSON data, oldest job first."""
    return {"version": MEMORY_VERSION,
            "started": [[s.ref.job, s.ref.round, s.ref.task, s.ts] for s in last_started.values()],
            "expired_declined": list(expired_declined),
            "answered": [job for job, s in last_started.items() if s.answered]}


def parse_memory(memory) -> tuple[dict[str, LastStart], list[str]]:
    """DeviceSession.memory()'s data, every entry checked (a file on the device's disk, torn or
    edited: never trusted), a round within parse_task's range, as the Java device's
    DeviceSession.recall checks it too; the caller keeps the newest MAX_JOBS_REMEMBERED jobs."""
    if not isinstance(memory, dict) or not _is_int(memory.get("version")) or memory["version"] != MEMORY_VERSION:
        raise ValueError(f"device session memory: not a version {MEMORY_VERSION} object")
    started, declined = memory.get("started"), memory.get("expired_declined")
    answered = memory.get("answered", [])          # absent: written before it was kept
    if not isinstance(started, list) or not isinstance(declined, list):
        raise ValueError("device session memory: 'started' and 'expired_declined' must be lists")
    if not isinstance(answered, list) or not all(_is_id(job) for job in answered):
        raise ValueError("device session memory: 'answered' must list job ids")
    out: dict[str, LastStart] = {}
    for entry in started:
        if not (isinstance(entry, list) and len(entry) == 4 and _is_id(entry[0]) and _is_id(entry[2])
                and _is_int(entry[1]) and -(1 << 62) <= entry[1] < 1 << 62 and _is_finite_number(entry[3])):
            raise ValueError(f"device session memory: a started entry is not [job, round, task, ts]: {entry!r:.200}")
        out.pop(entry[0], None)
        out[entry[0]] = LastStart(TaskRef(entry[0], entry[1], entry[2]), float(entry[3]))
    if not all(_is_id(job) for job in declined):
        raise ValueError("device session memory: 'expired_declined' must list job ids")
    for job in answered:
        if job in out:
            out[job] = LastStart(out[job].ref, out[job].ts, answered=True)    # in its place: dict order kept
    return out, declined


def _is_id(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_MEMORY_ID_CHARS


def _is_int(value) -> bool:
    return type(value) is int       # not True, not 1.0 (both == 1): the Java device refuses them too


def _is_finite_number(value) -> bool:
    try:
        return type(value) in (int, float) and math.isfinite(value)
    except OverflowError:           # an integer past float's range (400 digits): a ValueError, not a crash
        return False
