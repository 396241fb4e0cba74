"""FedGloSS's server (Caldarola et al., thesis §4.4, Alg. 5): sharpness-aware minimisation on the
server, at FedAvg's traffic.

SAM needs the gradient at w + ε with ε along the gradient at w: two exchanges per round. FedGloSS
takes ε from the round before instead, ε̃ᵗ = ρ Δ̃ᵗ⁻¹/‖Δ̃ᵗ⁻¹‖ (0 while there is none), and sends the
perturbed w̃ᵗ = wᵗ + ε̃ᵗ (:meth:`FedGlossServer.perturbed`). Devices train from w̃ᵗ with ADMM duals
(``edge_client/tasks/fedgloss_training.py``); with x̄ the round's combined update (the job's
sample-weighted mean of the w_k) and p = |Cᵗ|/K the round's share of the fleet:

    σᵗ⁺¹ = σᵗ − p (x̄ − w̃ᵗ)/β            (the global dual)
    Δ̃ᵗ   = w̃ᵗ − x̄                        (the sharpness-aware pseudo-gradient, kept for ε̃ᵗ⁺¹)
    wᵗ⁺¹ = wᵗ − η Δ̃ᵗ − β σᵗ⁺¹            (the descent applies to the *unperturbed* wᵗ)

σ's step is measured from w̃ᵗ, the point the devices started from, as in the CVPR 2025 paper's
Alg. 1 (line 22) and the authors' code (the pseudo-gradient taken while the server model is still
perturbed). The thesis's Alg. 5 prints it from wᵗ; at ρ > 0 that rule has no fixed point: where
x̄ = wᵗ, Δ̃ = ε̃ keeps norm ρ and w moves by η ε̃ every round (a review's finding: on a convex
quadratic it drifted linearly, 1.0 from the optimum after 1,000 rounds at ρ = 0.01, where the
paper's rule settles 0.015 from it; tests/test_fedgloss.py). The scale p = |Cᵗ|/K is FedDyn's
(Acar et al. 2021) 1/(β|C|) Σ_k over the whole fleet C; the authors' code divides by
β·K·|Cᵗ| instead, |Cᵗ| times less. The mean is the same combined x̄ the descent uses (Alg. 5:
the plain mean), so the job's bounded-influence layers bound a device's pull on σ too (equal n_k:
the same). η is Alg. 5's 1 by default (eq. 4.9's η_g otherwise). ρ = 0 leaves the ADMM base,
FedDyn's server step.

Every computation is float64; w̃ is cast to the model's dtype before it is sent, and the step
uses that cast w̃ (the point the devices really started from). Δ̃ and σ are server state, in the
job's checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from aggregator.strategies.fedavg import Params, ServerOptimizer, prefixed_tensors

PSEUDO_GRADIENT = "fedgloss_pseudo_gradient."
DUAL = "fedgloss_dual."


def _norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(t, dtype=np.float64))) for t in tensors.values())))


class FedGlossServer(ServerOptimizer):
    """The server's ascent (w̃) and descent (wᵗ⁺¹) steps, with Δ̃ᵗ⁻¹ and σ as its state."""

    def __init__(self, rho: float, beta: float, server_lr: float = 1.0):
        if not np.isfinite(rho) or rho < 0:
            raise ValueError(f"fedgloss rho must be a finite number >= 0, got {rho}")
        if not np.isfinite(beta) or beta <= 0:
            raise ValueError(f"admm beta must be a finite number > 0, got {beta}")
        if not np.isfinite(server_lr) or server_lr <= 0:
            raise ValueError(f"server_lr must be a positive finite number, got {server_lr}")
        self.rho, self.beta, self.server_lr = float(rho), float(beta), float(server_lr)
        self.pseudo_gradient: Params | None = None     # Δ̃ᵗ⁻¹, float64
        self.dual: Params | None = None                # σᵗ, float64
        self.steps = 0

    def perturbed(self, params: Mapping[str, np.ndarray]) -> Params:
        """w̃ = w + ρ Δ̃ᵗ⁻¹/‖Δ̃ᵗ⁻¹‖ in the params' dtype (w itself before the first step, or for Δ̃ = 0)."""
        norm = _norm(self.pseudo_gradient) if self.pseudo_gradient is not None else 0.0
        if norm == 0.0 or self.rho == 0.0:
            return {k: np.array(v, copy=True) for k, v in params.items()}
        scale = self.rho / norm
        return {k: (np.asarray(v, np.float64) + scale * self.pseudo_gradient[k]).astype(np.asarray(v).dtype)
                for k, v in params.items()}

    def step(self, params: Mapping[str, np.ndarray], averaged: Mapping[str, np.ndarray],
             participation: float = 1.0) -> Params:
        """wᵗ⁺¹ from wᵗ (``params``), the round's x̄ (``averaged``) and p (``participation``, in (0, 1])."""
        self.check_matching(params, averaged)
        if not 0.0 < participation <= 1.0:
            raise ValueError(f"participation must lie in (0, 1], got {participation}")
        start = {k: np.asarray(v, np.float64) for k, v in self.perturbed(params).items()}    # w̃ᵗ as sent
        w = {k: np.asarray(v, np.float64) for k, v in params.items()}
        mean = {k: np.asarray(averaged[k], np.float64) for k in params}
        dual = self.dual or {k: np.zeros_like(v) for k, v in w.items()}
        self.dual = {k: dual[k] - participation * (mean[k] - start[k]) / self.beta for k in w}
        self.pseudo_gradient = {k: start[k] - mean[k] for k in w}
        self.steps += 1
        return {k: (w[k] - self.server_lr * self.pseudo_gradient[k] - self.beta * self.dual[k])
                .astype(np.asarray(params[k]).dtype) for k in w}

    def state_dict(self) -> dict[str, np.ndarray]:
        out = {"server_steps": np.array([self.steps], dtype=np.int64)}
        for prefix, tensors in ((PSEUDO_GRADIENT, self.pseudo_gradient), (DUAL, self.dual)):
            out.update({prefix + k: v.copy() for k, v in (tensors or {}).items()})
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.steps = int(state["server_steps"][0])
        self.pseudo_gradient, self.dual = prefixed_tensors(state, PSEUDO_GRADIENT), prefixed_tensors(state, DUAL)
