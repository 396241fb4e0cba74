"""A deployment's life, sans-IO: events in (with the time), actions out; the controller
(``aggregator/deployments/controller.py``) does the I/O and stores every state change.

    state                          event     condition                                   next         actions
{table}

``Halt``: the model's stored head no longer hashes to the deployment's (a fault at rest): nothing
more is sent or judged, devices keep what they run, the reason is kept; the service goes on.

A stage's devices are its cohort (``cohort.py``): stage 0 the canary, stage i the canary plus the
seeded fraction ``stages[i-1]``; the last stage is 100 %. ``Tick`` carries the reports of the
current stage's devices on the candidate (``guard.DeviceReport``). Any other (state, event) is
refused with :class:`DeploymentError` and changes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from aggregator.deployments.cohort import CohortRule
from aggregator.deployments.guard import DeviceReport, Guard, stage_metrics

ACTIVE = ("canary", "widening")
STATES = ("draft", *ACTIVE, "complete", "rolled_back", "halted")

# (states, event, condition, next state ("=": unchanged), actions): the rules, in the order checked
TRANSITIONS = (
    (("draft",), "Start", "-", "canary", "Assign(stage 0)"),
    (ACTIVE, "Tick", "bake time not over", "=", "-"),
    (ACTIVE, "Tick", "too few reports, patience not over", "=", "-"),
    (ACTIVE, "Tick", "too few reports after bake + patience", "rolled_back", "RolledBack(reason)"),
    (ACTIVE, "Tick", "guard fails", "rolled_back", "RolledBack(reason)"),
    (ACTIVE, "Tick", "guard passes, stages left", "widening", "Assign(next stage)"),
    (ACTIVE, "Tick", "guard passes, last stage", "complete", "Complete"),
    (("draft", "complete", "rolled_back", "halted"), "Tick", "-", "=", "-"),
    (ACTIVE, "Promote", "stages left", "widening", "Assign(next stage)"),
    (ACTIVE, "Promote", "last stage", "complete", "Complete"),
    (("draft", *ACTIVE, "complete"), "RollBack", "-", "rolled_back", "RolledBack(reason)"),
    (("draft", *ACTIVE, "complete"), "Halt", "-", "halted", "-"),
)


def transition_table() -> str:
    return "\n".join(f"    {'|'.join(s):<31}{e:<10}{c:<44}{n:<13}{a}".rstrip() for s, e, c, n, a in TRANSITIONS)


__doc__ = __doc__.replace("{table}", transition_table())


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
    state: str = "draft"
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

    @property
    def stage_fraction(self) -> float | None:
        """None for the canary, else the seeded fraction the current stage adds."""
        return None if self.stage == 0 else self.stages[self.stage - 1]

    @property
    def last_stage(self) -> bool:
        return self.stage == len(self.stages)

    def handle(self, event) -> list:
        name, before = type(event).__name__, self.state
        if not any(before in s and e == name for s, e, *_ in TRANSITIONS):
            raise DeploymentError(f"deployment {self.deployment_id} is {before}: cannot {name.lower()}")
        actions = self._handle(event)
        # the table is the rule: a transition it does not list is a bug here, not a new behaviour
        assert any(before in s and e == name and n in ("=" if self.state == before else "", self.state)
                   for s, e, _, n, _ in TRANSITIONS), (before, name, self.state)
        return actions

    def _handle(self, event) -> list:
        if isinstance(event, Start):
            return self._enter("canary", 0, event.now, "started")
        if isinstance(event, Halt):
            self._go("halted", event.now, event.reason)
            return []
        if isinstance(event, RollBack):
            self._go("rolled_back", event.now, event.reason)
            return [RolledBack(event.reason)]
        if isinstance(event, Promote):
            return self._widen(event.now, "promoted by the operator")
        if self.state not in ACTIVE or event.now - self.stage_started_at < self.bake_s:
            return []
        return self._judge(event)

    def _judge(self, tick: Tick) -> list:
        metrics = stage_metrics(tick.reports, tick.caps)
        if metrics["reports"] < self.min_reports:
            if tick.now - self.stage_started_at < self.bake_s + self.patience_s:
                return []
            why = (f"stage {self.stage}: {metrics['reports']:.0f} report(s) after the bake time and "
                   f"{self.patience_s:g} s more, fewer than {self.min_reports}")
        else:
            failed = self.guard.failures(metrics)
            if not failed:
                return self._widen(tick.now, f"stage {self.stage} passed {self.guard.text}", metrics)
            why = f"stage {self.stage}: guard {self.guard.text} failed: {'; '.join(failed)}"
        self._go("rolled_back", tick.now, why, metrics)
        return [RolledBack(why)]

    def _widen(self, now: float, why: str, metrics: dict | None = None) -> list:
        if self.last_stage:
            self._go("complete", now, why, metrics)
            return [Complete()]
        return self._enter("widening", self.stage + 1, now, why, metrics)

    def _enter(self, state: str, stage: int, now: float, why: str, metrics: dict | None = None) -> list:
        self.stage, self.stage_started_at = stage, now
        self._go(state, now, why, metrics)
        return [Assign(stage)]

    def _go(self, state: str, now: float, why: str, metrics: dict | None = None) -> None:
        self.history.append({"t": now, "from": self.state, "to": state, "stage": self.stage, "why": why,
                             **({"metrics": metrics} if metrics else {})})
        self.state = state
        if state in ("rolled_back", "halted"):
            self.reason = why

    # ------------------------------------------------------------------ storage
    def to_dict(self) -> dict:
        d = asdict(self)
        d["cohort"], d["guard"], d["stages"] = self.cohort.text(), self.guard.text, list(self.stages)
        d["cohort_seed"] = self.cohort.seed
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Deployment":
        d = dict(d)
        d["cohort"] = CohortRule.parse(d["cohort"], d.pop("cohort_seed", 0))
        d["guard"], d["stages"] = Guard.parse(d["guard"]), tuple(d["stages"])
        return cls(**d)
