"""A deployment's life, sans-IO: events in (with the time), actions out; the controller
(``aggregator/deployments/controller.py``) does the I/O and stores every state change.

The rules are one :class:`~protocols.transition_table.TransitionTable`, :data:`DEPLOYMENT_TABLE`:
per (state, event type) the guarded rows, tried in order; ``handle`` fires the first whose guard
holds. Any other (state, event) is refused with :class:`DeploymentError` and changes nothing.
``python -m aggregator.deployments.machine`` prints the table docs/operations.md shows (a test
keeps the two equal):

{table}

``Halt``: the model's stored head no longer hashes to the deployment's (a fault at rest): nothing
more is sent or judged, devices keep what they run, the reason is kept; the service goes on.

A stage's devices are its cohort (``cohort.py``): stage 0 the canary, stage i the canary plus the
seeded fraction ``stages[i-1]``; the last stage is 100 %. ``Tick`` carries the reports of the
current stage's devices on the candidate (``guard.DeviceReport``); the guards of one tick's rows
read one ``stage_metrics`` of them.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field

from protocols.transition_table import IllegalTransition, Transition, TransitionTable

from aggregator.deployments.cohort import CohortRule
from aggregator.deployments.guard import DeviceReport, Guard, stage_metrics


class DeploymentState(enum.StrEnum):
    """A deployment's stored state. A StrEnum: the stored text, the API's JSON and comparisons with
    the plain strings stay as they were."""
    DRAFT = "draft"
    CANARY = "canary"
    WIDENING = "widening"
    COMPLETE = "complete"
    ROLLED_BACK = "rolled_back"
    HALTED = "halted"


_S = DeploymentState
ACTIVE = (_S.CANARY, _S.WIDENING)
STATES = tuple(DeploymentState)


class DeploymentError(ValueError):
    """An event the deployment's state does not allow (e.g. promoting a completed deployment)."""


@dataclass(frozen=True)
class Start:
    now: float


@dataclass(frozen=True)
class Tick:
    now: float
    reports: dict[str, DeviceReport]
    caps: dict[str, int] = field(default_factory=dict)     # per device, the most samples its report may weigh


@dataclass(frozen=True)
class Promote:
    now: float


@dataclass(frozen=True)
class RollBack:
    now: float
    reason: str


@dataclass(frozen=True)
class Halt:
    now: float
    reason: str


@dataclass(frozen=True)
class Assign:
    stage: int


@dataclass(frozen=True)
class Complete:
    pass


@dataclass(frozen=True)
class RolledBack:
    reason: str


@dataclass
class Deployment:
    deployment_id: str
    model_id: int
    model_sha256: str                       # sha256 of the head file devices fetch (the model's .npz)
    cohort: CohortRule
    stages: tuple[float, ...]               # widening fractions after the canary; the last is 1.0
    guard: Guard
    bake_s: float
    min_reports: int = 1
    patience_s: float = 60.0                # after the bake time: how long to wait for min_reports
    replaces: int | None = None             # the model id it replaces (None: what devices run now)
    state: DeploymentState = DeploymentState.DRAFT
    stage: int = 0
    stage_started_at: float | None = None
    reason: str = ""
    history: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if not self.stages or self.stages[-1] != 1.0 or any(not 0 < f <= 1 for f in self.stages) \
                or list(self.stages) != sorted(self.stages):
            raise ValueError(f"stages {list(self.stages)}: increasing fractions in (0, 1] ending at 1.0 (100 %)")
        if self.bake_s < 0 or self.min_reports < 0 or self.patience_s < 0:
            raise ValueError("bake time, patience and min_reports cannot be negative")
        self.state = DeploymentState(self.state)          # a stored row holds the plain text
        self._judged: tuple[Tick, dict] | None = None      # the tick being handled and its metrics (not stored)

    @property
    def stage_fraction(self) -> float | None:
        """None for the canary, else the seeded fraction the current stage adds."""
        return None if self.stage == 0 else self.stages[self.stage - 1]

    @property
    def last_stage(self) -> bool:
        return self.stage == len(self.stages)

    def handle(self, event) -> list:
        """The actions for `event`, by DEPLOYMENT_TABLE (DeploymentError for an event it lacks)."""
        try:
            return DEPLOYMENT_TABLE.fire(self, event)
        except IllegalTransition:
            raise DeploymentError(f"deployment {self.deployment_id} is {self.state}: "
                                  f"cannot {type(event).__name__.lower()}") from None
        finally:
            self._judged = None

    # -- guards of DEPLOYMENT_TABLE's Tick rows, in the order the table tries them --------------------
    def _metrics(self, tick: Tick) -> dict:
        """The stage's metrics over `tick`'s reports, computed once however many guards read them."""
        if self._judged is None or self._judged[0] is not tick:
            self._judged = (tick, stage_metrics(tick.reports, tick.caps))
        return self._judged[1]

    def _baking(self, tick: Tick) -> bool:
        return tick.now - self.stage_started_at < self.bake_s

    def _too_few_reports(self, tick: Tick) -> bool:
        return self._metrics(tick)["reports"] < self.min_reports

    def _patient(self, tick: Tick) -> bool:
        return self._too_few_reports(tick) and tick.now - self.stage_started_at < self.bake_s + self.patience_s

    def _guard_fails(self, tick: Tick) -> bool:
        return bool(self.guard.failures(self._metrics(tick)))

    def half_patience_spent(self, tick: Tick) -> bool:
        """Whether ``tick`` finds too few reports and half the patience after the bake time spent, the
        other half not (the table's row that waits for reports fires)."""
        return self._patient(tick) and tick.now - self.stage_started_at >= self.bake_s + self.patience_s / 2

    def _stages_left(self, _ev) -> bool:
        return not self.last_stage

    # -- effects of DEPLOYMENT_TABLE's rows -------------------------------------------------------------
    def _start(self, ev: Start) -> list:
        return self._enter(_S.CANARY, 0, ev.now, "started")

    def _wait(self, _ev) -> list:
        return []

    def _roll_back_too_few(self, tick: Tick) -> list:
        metrics = self._metrics(tick)
        return self._roll_back_on(tick.now, f"stage {self.stage}: {metrics['reports']:.0f} report(s) after the bake "
                                            f"time and {self.patience_s:g} s more, fewer than {self.min_reports}",
                                  metrics)

    def _roll_back_failed(self, tick: Tick) -> list:
        metrics = self._metrics(tick)
        failed = self.guard.failures(metrics)
        return self._roll_back_on(tick.now, f"stage {self.stage}: guard {self.guard.text} failed: {'; '.join(failed)}",
                                  metrics)

    def _pass(self, tick: Tick) -> list:
        return self._widen(tick.now, f"stage {self.stage} passed {self.guard.text}", self._metrics(tick))

    def _promote(self, ev: Promote) -> list:
        return self._widen(ev.now, "promoted by the operator")

    def _roll_back(self, ev: RollBack) -> list:
        return self._roll_back_on(ev.now, ev.reason)

    def _halt(self, ev: Halt) -> list:
        self._go(_S.HALTED, ev.now, ev.reason)
        return []

    def _roll_back_on(self, now: float, why: str, metrics: dict | None = None) -> list:
        self._go(_S.ROLLED_BACK, now, why, metrics)
        return [RolledBack(why)]

    def _widen(self, now: float, why: str, metrics: dict | None = None) -> list:
        if self.last_stage:
            self._go(_S.COMPLETE, now, why, metrics)
            return [Complete()]
        return self._enter(_S.WIDENING, self.stage + 1, now, why, metrics)

    def _enter(self, state: DeploymentState, stage: int, now: float, why: str, metrics: dict | None = None) -> list:
        self.stage, self.stage_started_at = stage, now
        self._go(state, now, why, metrics)
        return [Assign(stage)]

    def _go(self, state: DeploymentState, now: float, why: str, metrics: dict | None = None) -> None:
        self.history.append({"t": now, "from": self.state.value, "to": state.value, "stage": self.stage, "why": why,
                             **({"metrics": metrics} if metrics else {})})
        self.state = state
        if state in (_S.ROLLED_BACK, _S.HALTED):
            self.reason = why

    # ------------------------------------------------------------------ storage
    def to_dict(self) -> dict:
        d = asdict(self)
        d["state"] = self.state.value
        d["cohort"], d["guard"], d["stages"] = self.cohort.text(), self.guard.text, list(self.stages)
        d["cohort_seed"] = self.cohort.seed
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Deployment":
        d = dict(d)
        d["cohort"] = CohortRule.parse(d["cohort"], d.pop("cohort_seed", 0))
        d["guard"], d["stages"] = Guard.parse(d["guard"]), tuple(d["stages"])
        return cls(**d)


_D = Deployment
_OPERABLE = (_S.DRAFT, *ACTIVE, _S.COMPLETE)        # what the operator may still roll back or the service halt
DEPLOYMENT_TABLE = TransitionTable(DeploymentState, [
    Transition(_S.DRAFT, Start, "", _D._start, (Assign,), (_S.CANARY,), note="stage 0: the canary"),
    Transition(ACTIVE, Tick, "bake time not over", _D._wait, guard=_D._baking),
    Transition(ACTIVE, Tick, "too few reports, patience not over", _D._wait, guard=_D._patient),
    Transition(ACTIVE, Tick, "too few reports after bake + patience", _D._roll_back_too_few, (RolledBack,),
               (_S.ROLLED_BACK,), guard=_D._too_few_reports),
    Transition(ACTIVE, Tick, "guard fails", _D._roll_back_failed, (RolledBack,), (_S.ROLLED_BACK,),
               note="the guard's failures are the reason", guard=_D._guard_fails),
    # the canary (stage 0) always has stages after it; a widening stage may be the last
    Transition(_S.CANARY, Tick, "guard passes", _D._pass, (Assign,), (_S.WIDENING,), note="stage 1"),
    Transition(_S.WIDENING, Tick, "guard passes, stages left", _D._pass, (Assign,), (_S.WIDENING,),
               note="the next stage", guard=_D._stages_left),
    Transition(_S.WIDENING, Tick, "guard passes, last stage", _D._pass, (Complete,), (_S.COMPLETE,)),
    Transition((_S.DRAFT, _S.COMPLETE, _S.ROLLED_BACK, _S.HALTED), Tick, "", _D._wait, note="nothing to judge"),
    Transition(_S.CANARY, Promote, "", _D._promote, (Assign,), (_S.WIDENING,), note="stage 1, no bake wait"),
    Transition(_S.WIDENING, Promote, "stages left", _D._promote, (Assign,), (_S.WIDENING,),
               note="the next stage, no bake wait", guard=_D._stages_left),
    Transition(_S.WIDENING, Promote, "last stage", _D._promote, (Complete,), (_S.COMPLETE,)),
    Transition(_OPERABLE, RollBack, "", _D._roll_back, (RolledBack,), (_S.ROLLED_BACK,), note="the operator's reason"),
    Transition(_OPERABLE, Halt, "", _D._halt, (), (_S.HALTED,), note="the reason is kept"),
])


def render_table() -> str:
    return DEPLOYMENT_TABLE.render()


__doc__ = __doc__.replace("{table}", render_table())


if __name__ == "__main__":
    print(render_table())
