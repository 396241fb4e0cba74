"""Payload of ``pp.head`` tasks and results: partial personalization of the linear head.

FedSim and FedAlt (Pillutla et al. 2022; the Fed3R paper's Phase 3) split the model into a shared
part u, averaged by the server, and a personal part v_k that never leaves device k. Here the
split is inside the head ψ = (weight, bias): u = ``weight`` (C, d), shared; v_k = ``bias`` (C,),
personal, the device's own class prior over the shared features (under label skew, what most
differs between devices). The device keeps v_k in its state store between rounds (first time, or
when its stored v_k is stale: v_k = the task's ``bias``, the global value).

Task (aggregator -> device): tensors ``weight`` (C, d) = u and ``bias`` (C,) = the global v;
``params``: the model fields, ``feature_dim``, the recipe (:class:`PartialRecipe`, flat) and the
state binding (``protocols.payloads.stateful``).

Result (device -> aggregator): tensors: ``weight`` only (u after local training; v_k is never
sent); body: ``n`` (training samples, the averaging weight), ``num_classes``, ``feature_dim``,
and on the device's held-out split (``n_test`` 0 when it has none): ``correct`` with (the task's
u, v_k after this round) and ``correct_global`` with (the task's u, the global v), and
``restarted`` (true when v_k started from the global value this round).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..envelope import Envelope, EnvelopeError, body_field
from .fedavg import parse_model_update
from .stateful import StatefulHeadParams
from .task_params import check_choices, choice

KIND = "pp.head"
ALGORITHMS = ("fedsim", "fedalt")
SHARED = ("weight",)
PERSONAL = ("bias",)


MAX_RECIPE_COUNT = 10_000      # a recipe's epochs and batch size at most (a job's config is held to it)


@dataclass(frozen=True)
class PartialRecipe:
    """FedSim: ``epochs`` epochs updating u and v_k together. FedAlt: ``personal_epochs`` epochs
    on v_k with u fixed, then ``epochs`` epochs on u with v_k fixed. Same SGD step as
    ``fedavg.head`` (temperature-scaled cross-entropy, L2 weight decay)."""

    algorithm: str = "fedalt"
    epochs: int = 1
    personal_epochs: int = 1
    batch_size: int = 50
    lr: float = 0.01
    weight_decay: float = 4e-5
    temperature: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        for name, low in (("epochs", 1), ("personal_epochs", 0), ("batch_size", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not low <= v <= MAX_RECIPE_COUNT:
                raise ValueError(f"{name} must be an integer in {low}..{MAX_RECIPE_COUNT}, got {v!r}")
        for name, zero_ok in (("lr", False), ("weight_decay", True), ("temperature", False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not math.isfinite(v) \
                    or v < 0 or (v == 0 and not zero_ok):
                raise ValueError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "PartialRecipe":
        return cls(**{k: params[k] for k in cls.__dataclass_fields__ if k in params})

    def to_params(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PersonalReport:
    """What a device with a personal part reports beside its upload (``pp.head``, ``ditto.head``):
    on its held-out split (``n_test`` 0 when it has none) how many its personal model and the
    task's global model get right, and whether its personal part restarted from the global value."""

    n_test: int
    correct: int                # held-out, with the device's personal part after this round
    correct_global: int         # held-out, with the task's global model
    restarted: bool

    def to_body(self) -> dict:
        return {"n_test": int(self.n_test), "correct": int(self.correct),
                "correct_global": int(self.correct_global), "restarted": bool(self.restarted)}


def parse_personal_report(msg: Envelope, kind: str, max_samples: int = 10**9) -> PersonalReport:
    """The report's body fields, checked (EnvelopeError: counts outside 0..n_test, n_test out of range)."""
    n_test = body_field(msg, "n_test", int)
    if not 0 <= n_test <= max_samples:
        raise EnvelopeError(f"{kind}: n_test={n_test} out of range (0..{max_samples})")
    counts = [body_field(msg, name, int) for name in ("correct", "correct_global")]
    if not all(0 <= c <= n_test for c in counts):
        raise EnvelopeError(f"{kind}: held-out counts {counts} must lie in 0..n_test={n_test}")
    return PersonalReport(n_test, *counts, body_field(msg, "restarted", bool))


@dataclass(frozen=True)
class PartialParams(StatefulHeadParams):
    """``pp.head`` params: a stateful head task's (the device keeps v_k under the binding) plus
    FedSim/FedAlt's choice and personal epochs; :meth:`recipe` is what the device runs (the local
    recipe's step rule is not used: the personal part's epochs take plain SGD steps)."""

    KIND = KIND
    algorithm: str = choice("fedalt", ALGORITHMS)
    personal_epochs: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_choices(self)
        self.recipe()        # refuses a bad algorithm or personal_epochs

    def recipe(self) -> PartialRecipe:
        t = self.training
        return PartialRecipe(self.algorithm, t.epochs, self.personal_epochs, t.batch_size, t.lr, t.weight_decay,
                             t.temperature, t.seed)


@dataclass(frozen=True)
class PartialUpdate:
    n: int
    weight: np.ndarray          # u after local training
    report: PersonalReport      # held-out: (task's u, v_k) and (task's u, global v)

    def tensors(self) -> dict[str, np.ndarray]:
        return {"weight": self.weight}


def encode_partial_update(weight: np.ndarray, n: int, report: PersonalReport) -> tuple[dict, dict[str, np.ndarray]]:
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if not np.isfinite(weight).all():
        raise ValueError("the trained shared part contains NaN or Inf (diverged local training?)")
    C, d = weight.shape
    return {"n": int(n), "num_classes": int(C), "feature_dim": int(d), **report.to_body()}, {"weight": weight}


def parse_partial_update(msg: Envelope, num_classes: int, feature_dim: int,
                         max_samples: int = 10**9) -> PartialUpdate:
    """Validate a ``pp.head`` result against the job's (C, d); EnvelopeError if anything is off
    (a result carrying the personal part is refused: it must never leave the device)."""
    if body_field(msg, "num_classes", int) != num_classes or body_field(msg, "feature_dim", int) != feature_dim:
        raise EnvelopeError(f"{KIND}: head shape ({msg.body['num_classes']}, {msg.body['feature_dim']}) "
                            f"!= job's ({num_classes}, {feature_dim})")
    update = parse_model_update(msg, {"weight": (num_classes, feature_dim)}, max_samples)
    return PartialUpdate(update.n, update.trained["weight"], parse_personal_report(msg, KIND, max_samples))
