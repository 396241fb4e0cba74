"""FedOpt: adaptive server optimizers on the round's pseudo-gradient (Reddi et al. 2021, Alg. 2).

The round's combined parameters x̄ give the pseudo-gradient Δ_t = x̄ − x_t (the direction the
devices moved, so the step *adds* it). With m_{−1} = 0 and v_{−1} = τ² (the paper's
initialisation, so the first step's denominator is never below 2τ):

    m_t = β₁ m_{t−1} + (1 − β₁) Δ_t
    v_t = v_{t−1} + Δ_t²                                        FedAdagrad
    v_t = β₂ v_{t−1} + (1 − β₂) Δ_t²                            FedAdam
    v_t = v_{t−1} − (1 − β₂) Δ_t² sign(v_{t−1} − Δ_t²)          FedYogi
    x_{t+1} = x_t + η m_t / (√v_t + τ)

No bias correction (the paper has none). τ bounds the adaptivity: coordinates whose updates
are tiny take steps of about η m/τ rather than η·sign. The three differ only in v, so each is a
one-method subclass of :class:`FedOpt`. Moments are float64 and checkpointed with the step
count (``server_m.<tensor>``, ``server_v.<tensor>``), so a restarted job steps bit-identically.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping

import numpy as np

from aggregator.strategies.fedavg import FedAvg, Params, ServerOptimizer, prefixed_tensors


class FedOpt(ServerOptimizer):
    """Adaptive server step; subclasses say how the second moment v accumulates Δ²."""

    def __init__(self, server_lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3):
        if not np.isfinite(server_lr) or server_lr <= 0:
            raise ValueError(f"server_lr must be a positive finite number, got {server_lr}")
        if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta1 and beta2 must lie in [0, 1), got {beta1}, {beta2}")
        if not np.isfinite(tau) or tau <= 0:
            raise ValueError(f"tau must be a positive finite number, got {tau}")
        self.server_lr, self.beta1, self.beta2, self.tau = float(server_lr), float(beta1), float(beta2), float(tau)
        self.m: Params | None = None
        self.v: Params | None = None
        self.steps = 0

    @abstractmethod
    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        """v_t from v_{t−1} and Δ_t² (float64, elementwise)."""

    def step(self, params: Mapping[str, np.ndarray], averaged: Mapping[str, np.ndarray]) -> Params:
        self.check_matching(params, averaged)
        new: Params = {}
        m_next: Params = {}
        v_next: Params = {}
        for k, x in params.items():
            x64 = np.asarray(x, dtype=np.float64)
            delta = np.asarray(averaged[k], dtype=np.float64) - x64
            m_prev = np.zeros_like(delta) if self.m is None else self.m[k]
            v_prev = np.full_like(delta, self.tau ** 2) if self.v is None else self.v[k]
            m_next[k] = self.beta1 * m_prev + (1.0 - self.beta1) * delta
            v_next[k] = self.second_moment(v_prev, delta * delta)
            new[k] = (x64 + self.server_lr * m_next[k] / (np.sqrt(v_next[k]) + self.tau)).astype(np.asarray(x).dtype)
        self.m, self.v = m_next, v_next
        self.steps += 1
        return new

    def state_dict(self) -> dict[str, np.ndarray]:
        out = {"server_steps": np.array([self.steps], dtype=np.int64)}
        for name, moment in (("server_m", self.m), ("server_v", self.v)):
            out.update({f"{name}.{k}": v for k, v in (moment or {}).items()})
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.steps = int(state["server_steps"][0])
        self.m, self.v = prefixed_tensors(state, "server_m."), prefixed_tensors(state, "server_v.")


class FedAdagrad(FedOpt):
    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        return v + delta_sq


class FedAdam(FedOpt):
    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        return self.beta2 * v + (1.0 - self.beta2) * delta_sq


class FedYogi(FedOpt):
    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        # v moves towards Δ² by an additive (1 − β₂)Δ², never multiplicatively (Zaheer et al. 2018)
        return v - (1.0 - self.beta2) * delta_sq * np.sign(v - delta_sq)


ADAPTIVE = {"adam": FedAdam, "yogi": FedYogi, "adagrad": FedAdagrad}
SERVER_OPTIMIZERS = ("sgd", *ADAPTIVE)        # "sgd": FedAvg / FedAvgM (server_momentum)


def make_server_optimizer(name: str, server_lr: float, momentum: float = 0.0, beta1: float = 0.9,
                          beta2: float = 0.99, tau: float = 1e-3) -> ServerOptimizer:
    """The job's server step by name: "sgd" is FedAvg (FedAvgM with momentum), else FedOpt's."""
    if name == "sgd":
        return FedAvg(server_lr, momentum)
    if name not in ADAPTIVE:
        raise ValueError(f"server_optimizer must be one of {SERVER_OPTIMIZERS}, got {name!r}")
    if momentum:
        raise ValueError(f"server_momentum is FedAvgM's; {name} has its own first moment (server_beta1)")
    return ADAPTIVE[name](server_lr, beta1, beta2, tau)
