"""Payload of ``ditto.head`` tasks and results: Ditto (Li et al. 2021) on the linear head.

Each round a device does two things from the task's global head ψ = (weight, bias):

* the global part, exactly ``fedavg.head``'s local pass (the recipe, the local rule), whose result
  ψ_k goes back and is averaged by the server as FedAvg(ψ)'s;
* the personal part: its own head v_k, kept in its state store between rounds (first time, or
  when stale: v_k = ψ), trained for ``personal_epochs`` epochs at ``personal_lr`` on
  f_k(v_k) + λ/2‖v_k − ψ‖² (the same local rule with FedProx's pull, μ = λ, towards the task's
  ψ). v_k never leaves the device.

Task (aggregator -> device): ``fedavg.head``'s tensors and params, plus ``job_id``, the state
binding (``protocols.payloads.stateful``) and :class:`DittoRecipe` (flat).

Result (device -> aggregator): ``fedavg.head``'s (tensors ``weight``, ``bias``; body ``n``,
``num_classes``, ``feature_dim``) plus the held-out counts of ``pp.head``
(:class:`~protocols.payloads.partial.PersonalReport`): ``n_test``, ``correct`` with v_k after
this round, ``correct_global`` with the task's ψ, and ``restarted``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..envelope import Envelope
from .fedavg import encode_head_update, parse_head_update
from .partial import PersonalReport, parse_personal_report
from .stateful import StatefulHeadParams

KIND = "ditto.head"
MAX_LAMBDA = 1e4            # FedProx's μ bound (LocalRuleRecipe.prox_mu): λ is that μ on the personal pass


@dataclass(frozen=True)
class DittoRecipe:
    """The personal pass: λ (the pull towards the global head; the Fed3R paper's code uses 0.1),
    its epochs and its learning rate. Every field is required on the wire (a device never guesses
    the job's λ)."""

    ditto_lambda: float = 0.1
    personal_epochs: int = 1
    personal_lr: float = 0.01

    def __post_init__(self):
        v = self.personal_epochs
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= 10_000:
            raise ValueError(f"personal_epochs must be an integer in 1..10000, got {v!r}")
        for name, hi in (("ditto_lambda", MAX_LAMBDA), ("personal_lr", 100.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not math.isfinite(v) \
                    or not 0 < v <= hi:
                raise ValueError(f"{name} must be a finite number in (0, {hi:g}], got {v!r}")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "DittoRecipe":
        """The task's recipe; KeyError when a field is missing."""
        return cls(**{k: params[k] for k in cls.__dataclass_fields__})

    def to_params(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DittoParams(StatefulHeadParams):
    """``ditto.head`` params: a stateful head task's (the device keeps v_k under the binding) plus
    the personal pass (:class:`DittoRecipe`'s fields, all required: a device never guesses λ)."""

    KIND = KIND
    REQUIRED_KEYS = ("ditto_lambda", "personal_epochs", "personal_lr")
    ditto_lambda: float = 0.1
    personal_epochs: int = 1
    personal_lr: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        self.ditto()            # refuses a bad λ, personal_epochs or personal_lr

    def ditto(self) -> DittoRecipe:
        return DittoRecipe(self.ditto_lambda, self.personal_epochs, self.personal_lr)


@dataclass(frozen=True)
class DittoUpdate:
    n: int
    weight: np.ndarray          # ψ_k: the global head after the device's local pass
    bias: np.ndarray
    report: PersonalReport      # held-out: v_k after this round, and the task's ψ

    def tensors(self) -> dict[str, np.ndarray]:
        return {"weight": self.weight, "bias": self.bias}


def encode_ditto_update(weight: np.ndarray, bias: np.ndarray, n: int,
                        report: PersonalReport) -> tuple[dict, dict[str, np.ndarray]]:
    body, tensors = encode_head_update(weight, bias, n)
    return {**body, **report.to_body()}, tensors


def parse_ditto_update(msg: Envelope, num_classes: int, feature_dim: int, max_samples: int = 10**9) -> DittoUpdate:
    """Validate a ``ditto.head`` result: ``fedavg.head``'s checks (exactly the head's tensors, so a
    result carrying anything else, such as the personal head, is refused) and the held-out counts."""
    head = parse_head_update(msg, num_classes, feature_dim, max_samples)
    return DittoUpdate(head.n, head.weight, head.bias, parse_personal_report(msg, KIND, max_samples))
