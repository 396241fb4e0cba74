"""What a stateful task tells its device about the state the job keeps there.

Tasks of stateful job kinds (partial personalization ``pp.head``, Scaffold ``scaffold.head`` and
``scaffold.tail``)
carry in ``params`` a ``state`` object: the binding under which the device stores its per-job
state (``edge_client.state.DeviceStateStore``):

* ``run``            the job's run (hex): a job created again under the same id has another run,
                     and a device never reuses an earlier run's state
* ``round``          the task's round; the device writes its state at this round
* ``max_staleness``  state written more than this many rounds before ``round`` is not trusted
                     (FedSim/FedAlt restart the personal part from the global value, Scaffold
                     restarts c_k from 0)
* ``ttl_s``          how long the device keeps the state after this task (the job's horizon):
                     it is dropped then, whether or not the job says so
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from .fedavg import HeadTrainingParams
from .task_params import WireParams, check_str, nested

RUN_PATTERN = re.compile(r"[0-9a-f]{8,64}")
MAX_TTL_S = 365 * 24 * 3600.0


@dataclass(frozen=True)
class StateBinding(WireParams):
    run: str
    round: int
    max_staleness: int = 50
    ttl_s: float = 7 * 24 * 3600.0

    def __post_init__(self):
        if not isinstance(self.run, str) or not RUN_PATTERN.fullmatch(self.run):
            raise ValueError(f"state run must be 8-64 lowercase hex digits, got {self.run!r}")
        for name in ("round", "max_staleness"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10**9:
                raise ValueError(f"state {name} must be an integer in 0..1e9, got {value!r}")
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float)) \
                or not math.isfinite(self.ttl_s) or not 0 < self.ttl_s <= MAX_TTL_S:
            raise ValueError(f"state ttl_s must be in (0, {MAX_TTL_S:g}] seconds, got {self.ttl_s!r}")

    @classmethod
    def from_params(cls, state: dict[str, Any]) -> "StateBinding":
        """The binding from the task's ``state`` object (unknown fields refused: a binding the device
        half understands could make it continue another run's state)."""
        if not isinstance(state, dict):
            raise ValueError("a stateful task needs a 'state' object in its params")
        unknown = set(state) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown state fields {sorted(unknown)}")
        try:
            return cls(**state)
        except TypeError as exc:
            raise ValueError(f"state: {exc}") from None

    def to_params(self) -> dict[str, Any]:
        return asdict(self)


def bound_run(params: Any) -> str | None:
    """The run a stateful task's params bind its state to (``state.run``), None where they name none
    (a plain task, or params too malformed to bind anything: the handler declines those). What a
    device matches against the runs ``job.ended`` named; the Java ``StatefulHeadParams.boundRun``
    is the same rule."""
    state = params.get("state") if isinstance(params, dict) else None
    run = state.get("run") if isinstance(state, dict) else None
    return run if isinstance(run, str) else None


def foreign_job(params: Any, job: str) -> str | None:
    """Why a task of job ``job`` whose params name another ``job_id`` is declined (None: they do not).
    A stateful task keys the device's state by that param, so one naming another job would read or
    overwrite that job's state; the aggregator always sets it to the task's own job. The Java
    ``StatefulHeadParams.foreignJob`` is the same rule."""
    named = params.get("job_id", job) if isinstance(params, dict) else job
    if named == job:
        return None
    if not isinstance(named, str):
        return "the task's job_id param is not a string"
    return f"the task's job_id param '{named[:64]}' is not its job '{job}'"


@dataclass(frozen=True)
class StatefulHeadParams(HeadTrainingParams):
    """A stateful head task's params (``pp.head``, ``scaffold.head``, ``fedgloss.head``):
    ``fedavg.head``'s plus the job whose state the device keeps and the state binding."""

    REQUIRED_KEYS = ("job_id", "state")
    job_id: str = ""
    state: StateBinding | None = nested(StateBinding)

    def __post_init__(self):
        super().__post_init__()
        check_str("job_id", self.job_id, max_len=128)
        if not self.job_id:
            raise ValueError("a stateful task needs a job_id")
        if not isinstance(self.state, StateBinding):
            raise ValueError("a stateful task needs a 'state' object in its params")
