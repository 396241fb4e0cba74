"""The local step rules of every device trainer: plain SGD, FedProx, FedSAM, FedASAM.

A trainer (numpy, eager torch, a training program through ``TrainingSession``; the head's and
the backbone tail's) owns the parameters and knows how to compute the mini-batch's loss and
gradient at any parameters: ``gradient_at(current) -> (loss, ∇loss)``. A rule decides which
direction d the step takes; the trainer then applies its own update, the same for every rule:

    w ← w − lr · (d + wd · w)                  (torch.optim.SGD's weight decay, as before)

* :class:`PlainGradient`: d = ∇L(w) (one gradient evaluation).
* :class:`SharpnessAware` (SAM, Foret et al. 2021; FedSAM, Caldarola et al. 2022):
  ε̂ = ρ g/‖g‖ with g = ∇L(w), then d = ∇L(w + ε̂): two evaluations per step, so twice the
  local compute (it shows in the report's device compute).
* :class:`AdaptiveSharpnessAware` (ASAM, Kwon et al. 2021; FedASAM): ε̂ = ρ T² g/‖T g‖,
  T = diag(|w| + η), the ascent scaled to each weight's magnitude. Every tensor is scaled
  (ASAM's reference code leaves biases at T = 1; a review measured the difference on a linear
  head at 13 % of the bias's step and 3.4 % of the weight's, one step).
* :class:`Proximal` (FedProx, Li et al. 2020) around any of them: d + μ(w − w_global), the
  gradient of μ/2‖w − w_global‖² added to the wrapped rule's direction.
* :class:`AdmmDual` (FedGloSS's local step, thesis Alg. 5 line 15) around any of them:
  d − σ_k + (w − w_global)/β, a proximal term with μ = 1/β plus the device's ADMM dual σ_k.

Norms are over all trained tensors together (SAM's "global" ε), in float64; the perturbed
parameters and the directions keep the trainer's dtype (float32). The trainer hands the rule
only the tensors it trains, so FT(φ)'s frozen head is neither perturbed nor pulled. A rule is
stateless between steps; a rule with device state (Scaffold's control variate) is one more
wrapper that adds its correction to the direction, like :class:`Proximal`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import numpy as np

from protocols.payloads.fedavg import LocalRuleRecipe

Params = dict[str, np.ndarray]
GradientAt = Callable[[Mapping[str, np.ndarray]], tuple[float, Params]]


def global_norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(t, dtype=np.float64))) for t in tensors.values())))


class LocalRule(ABC):
    """One local step's direction from the mini-batch's gradient function."""

    evaluations_per_step = 1          # gradient evaluations (forward + backward passes) per step

    @abstractmethod
    def direction(self, current: Mapping[str, np.ndarray], gradient_at: GradientAt,
                  global_params: Mapping[str, np.ndarray]) -> tuple[float, Params]:
        """(the mini-batch loss at ``current``, the step's direction d, dtype of ``current``).
        ``current`` are the trained tensors now; ``global_params`` the round's start (the task's)."""


class PlainGradient(LocalRule):
    def direction(self, current, gradient_at, global_params):
        return gradient_at(current)


class SharpnessAware(LocalRule):
    """SAM: descend with the gradient at the worst point of the ρ-ball along g."""

    evaluations_per_step = 2

    def __init__(self, rho: float):
        if not np.isfinite(rho) or rho <= 0:
            raise ValueError(f"SAM needs rho > 0, got {rho}")
        self.rho = float(rho)

    def perturbation(self, current: Mapping[str, np.ndarray], gradient: Mapping[str, np.ndarray]) -> Params:
        """ε̂ = ρ g/‖g‖ (zero for a zero gradient: there is no ascent direction)."""
        scale = self.rho / (global_norm(gradient) + 1e-12)
        return {k: np.asarray(scale * np.asarray(g, np.float64), dtype=np.asarray(current[k]).dtype)
                for k, g in gradient.items()}

    def direction(self, current, gradient_at, global_params):
        loss, gradient = gradient_at(current)
        eps = self.perturbation(current, gradient)
        _, sharp = gradient_at({k: current[k] + eps[k] for k in current})
        return loss, sharp


class AdaptiveSharpnessAware(SharpnessAware):
    """ASAM: the ascent in the coordinates T = diag(|w| + η), invariant to rescaling the weights."""

    def __init__(self, rho: float, eta: float):
        super().__init__(rho)
        if not np.isfinite(eta) or eta < 0:
            raise ValueError(f"ASAM needs eta >= 0, got {eta}")
        self.eta = float(eta)

    def perturbation(self, current, gradient):
        t = {k: np.abs(np.asarray(current[k], np.float64)) + self.eta for k in current}
        scaled = {k: t[k] * np.asarray(g, np.float64) for k, g in gradient.items()}       # T g
        scale = self.rho / (global_norm(scaled) + 1e-12)
        return {k: np.asarray(scale * t[k] * scaled[k], dtype=np.asarray(current[k]).dtype) for k in scaled}


class Proximal(LocalRule):
    """FedProx around another rule: the objective gains μ/2‖w − w_global‖²."""

    def __init__(self, mu: float, inner: LocalRule):
        if not np.isfinite(mu) or mu <= 0:
            raise ValueError(f"FedProx needs mu > 0, got {mu}")
        self.mu, self.inner = float(mu), inner
        self.evaluations_per_step = inner.evaluations_per_step

    def direction(self, current, gradient_at, global_params):
        loss, d = self.inner.direction(current, gradient_at, global_params)
        pull = {k: np.asarray(current[k], np.float64) - np.asarray(global_params[k], np.float64) for k in current}
        loss += 0.5 * self.mu * global_norm(pull) ** 2
        return loss, {k: (d[k] + self.mu * pull[k]).astype(np.asarray(d[k]).dtype) for k in d}


class AdmmDual(Proximal):
    """ADMM's local subproblem around another rule: f_k − σ_kᵀ(w − w_global) + 1/(2β)‖w − w_global‖²,
    σ_k the device's dual (kept in its state store between rounds, fixed during a round)."""

    def __init__(self, beta: float, dual: Mapping[str, np.ndarray], inner: LocalRule):
        if not np.isfinite(beta) or beta <= 0:
            raise ValueError(f"ADMM needs beta > 0, got {beta}")
        super().__init__(1.0 / beta, inner)
        self.dual = {k: np.asarray(v, np.float64) for k, v in dual.items()}

    def direction(self, current, gradient_at, global_params):
        loss, d = super().direction(current, gradient_at, global_params)
        loss -= sum(float(np.sum(self.dual[k] * (np.asarray(current[k], np.float64)
                                                  - np.asarray(global_params[k], np.float64)))) for k in current)
        return loss, {k: (d[k] - self.dual[k]).astype(np.asarray(d[k]).dtype) for k in d}


def rule_for(recipe: LocalRuleRecipe) -> LocalRule:
    """The rule a task's recipe names (validated by ``LocalRuleRecipe``)."""
    if recipe.local_rule == "sam":
        rule: LocalRule = SharpnessAware(recipe.sam_rho)
    elif recipe.local_rule == "asam":
        rule = AdaptiveSharpnessAware(recipe.sam_rho, recipe.asam_eta)
    else:
        rule = PlainGradient()
    return Proximal(recipe.prox_mu, rule) if recipe.prox_mu > 0 else rule


def apply_step(param: np.ndarray, direction: np.ndarray, lr, weight_decay) -> None:
    """w ← w − lr·(d + wd·w), in place, in the parameter's dtype (torch.optim.SGD's order of operations)."""
    grad = direction + weight_decay * param if weight_decay else direction
    param -= np.asarray(grad, dtype=param.dtype) * lr
