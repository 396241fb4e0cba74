"""Payload of ``fedgloss.head`` tasks: FedGloSS (Caldarola et al., thesis §4.4, Alg. 5) on the
linear head.

Task (aggregator -> device): tensors ``weight`` (C, d), ``bias`` (C,): the *perturbed* global
head w̃ = w + ρ Δ̃ᵗ⁻¹/‖Δ̃ᵗ⁻¹‖ (the server's ascent step with the previous round's pseudo-gradient);
``params``: the model fields, ``fedavg.head``'s local recipe (epochs, batch_size, lr,
weight_decay, temperature, seed, the local rule), ``job_id``, the state binding
(``protocols.payloads.stateful``) and :class:`AdmmRecipe`'s ``admm_beta``.

The device keeps its ADMM dual σ_k in its state store (0 the first time, and after it went
stale), takes its local steps w ← w − lr (d − σ_k + (w − w̃)/β + wd·w) (d: the local rule's
direction, SGD or SAM...) and then sets σ_k ← σ_k − (w_E − w̃)/β.

Result (device -> aggregator): exactly ``fedavg.head``'s (``weight``, ``bias``, ``n``): the
upload, like the download, is FedAvg's (1× traffic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .stateful import StatefulHeadParams
from .task_params import WireParams, part

KIND = "fedgloss.head"
MAX_ADMM_BETA = 1e6


@dataclass(frozen=True)
class AdmmRecipe(WireParams):
    """FedGloSS's ADMM weight β, the same on the server (its dual step) and every device (the
    penalty (w − w̃)/β and the dual step): validated on both sides."""

    REQUIRED_KEYS = ("admm_beta",)    # a device never guesses the server's β
    admm_beta: float = 10.0          # the thesis's β (Table A.5)

    def __post_init__(self):
        v = self.admm_beta
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not 0 < v <= MAX_ADMM_BETA:
            raise ValueError(f"admm_beta must be a finite number in (0, {MAX_ADMM_BETA:g}], got {v!r}")



@dataclass(frozen=True)
class FedGlossParams(StatefulHeadParams):
    """``fedgloss.head`` params: a stateful head task's (the device keeps its dual) plus β."""

    KIND = KIND
    admm: AdmmRecipe = part(AdmmRecipe)
