"""FedAvg and FedAvgM: sample-weighted parameter averaging with an optional server optimizer.

A round's updates are accumulated by :class:`WeightedMean` (running Σ n_k·x_k and Σ n_k in
float64, so arrival order and float32 rounding of partial sums do not matter):

    x̄ = Σ_k n_k x_k / Σ_k n_k                                   (FedAvg, McMahan et al. 2017)

The server then treats Δ = x_t − x̄ as a pseudo-gradient and takes one SGD step with
learning rate η (``server_lr``) and heavy-ball momentum β (``momentum``), as in FedAvgM
(Hsu et al. 2019) and torch.optim.SGD:

    v_{t+1} = β v_t + Δ        (v_0 = 0, so v_1 = Δ)
    x_{t+1} = x_t − η v_{t+1}

η = 1, β = 0 is plain FedAvg; that case returns x̄ itself (not x_t − (x_t − x̄), which can
differ in the last bit), so averaging identical updates is exactly the identity. The
classes hold tensors as ``dict[str, ndarray]`` and know nothing about rounds or transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

Params = dict[str, np.ndarray]


class ServerOptimizer(ABC):
    """One server step per round: the round's combined parameters x̄ in, the next global x out.

    Implementations: :class:`FedAvg`/:class:`FedAvgM` here, FedAdam/FedYogi/FedAdagrad in
    ``aggregator/strategies/fedopt.py``. They see only x_t and x̄ (never the devices' updates), so
    every one of them also runs under secure aggregation and after DP's noisy mean. Their state
    (momentum, moments) is server state a job checkpoints through ``state_dict``."""

    steps: int

    @abstractmethod
    def step(self, params: Mapping[str, np.ndarray], averaged: Mapping[str, np.ndarray]) -> Params:
        """New global parameters (dtype of ``params``) from the current ones and the round's mean."""

    @abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]:
        """Flat arrays (names distinct from a model's tensors) that restore the optimizer exactly."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None: ...

    @staticmethod
    def check_matching(params: Mapping[str, np.ndarray], averaged: Mapping[str, np.ndarray]) -> None:
        if set(params) != set(averaged):
            raise ValueError(f"averaged tensors {sorted(averaged)} do not match parameters {sorted(params)}")


def prefixed_tensors(state: Mapping[str, np.ndarray], prefix: str) -> Params | None:
    """The tensors a ``state_dict`` stored under ``prefix`` (the prefix taken off the names), as
    float64 copies; None where it stored none (nothing kept yet: no step taken, no model observed)."""
    found = {k[len(prefix):]: np.array(v, dtype=np.float64) for k, v in state.items() if k.startswith(prefix)}
    return found or None


class WeightedMean:
    """Running sample-weighted mean of dicts of equally shaped tensors."""

    def __init__(self):
        self._sums: dict[str, np.ndarray] = {}
        self.total_weight = 0
        self.count = 0

    def add(self, tensors: Mapping[str, np.ndarray], weight: int) -> None:
        if isinstance(weight, bool) or int(weight) != weight or weight <= 0:
            raise ValueError(f"weight (sample count) must be a positive integer, got {weight!r}")
        if self._sums and set(tensors) != set(self._sums):
            raise ValueError(f"update has tensors {sorted(tensors)}, expected {sorted(self._sums)}")
        for name, value in tensors.items():
            value = np.asarray(value, dtype=np.float64)
            if not np.isfinite(value).all():
                raise ValueError(f"update tensor {name!r} contains NaN or Inf")
            if name in self._sums:
                if value.shape != self._sums[name].shape:
                    raise ValueError(f"tensor {name!r} has shape {value.shape}, expected {self._sums[name].shape}")
                self._sums[name] += weight * value
            else:
                self._sums[name] = weight * value
        self.total_weight += int(weight)
        self.count += 1

    def result(self) -> Params:
        if not self.count:
            raise ValueError("no updates to average")
        return {name: s / self.total_weight for name, s in self._sums.items()}


class FedAvg(ServerOptimizer):
    """Server step x_{t+1} = x_t − η·(β v_t + (x_t − x̄)); defaults η = 1, β = 0 (plain FedAvg)."""

    def __init__(self, server_lr: float = 1.0, momentum: float = 0.0):
        if not np.isfinite(server_lr) or server_lr <= 0:
            raise ValueError(f"server_lr must be a positive finite number, got {server_lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
        self.server_lr = float(server_lr)
        self.momentum = float(momentum)
        self.velocity: Params | None = None
        self.steps = 0

    @staticmethod
    def mean(updates: list[tuple[Mapping[str, np.ndarray], int]]) -> Params:
        """Σ n_k x_k / Σ n_k over (tensors, n_k) pairs (convenience for callers holding a list)."""
        acc = WeightedMean()
        for tensors, n in updates:
            acc.add(tensors, n)
        return acc.result()

    def step(self, params: Mapping[str, np.ndarray], averaged: Mapping[str, np.ndarray]) -> Params:
        self.check_matching(params, averaged)
        self.steps += 1
        if self.server_lr == 1.0 and self.momentum == 0.0:
            return {k: np.asarray(averaged[k]).astype(np.asarray(params[k]).dtype) for k in params}
        new: Params = {}
        velocity: Params = {}
        for k, x in params.items():
            x64 = np.asarray(x, dtype=np.float64)
            delta = x64 - np.asarray(averaged[k], dtype=np.float64)
            v = delta if self.velocity is None or self.momentum == 0.0 else self.momentum * self.velocity[k] + delta
            velocity[k] = v
            new[k] = (x64 - self.server_lr * v).astype(np.asarray(x).dtype)
        self.velocity = velocity
        return new

    # persistence (the velocity is server state that must survive a restart)
    def state_dict(self) -> dict[str, np.ndarray]:
        out = {"server_steps": np.array([self.steps], dtype=np.int64)}
        for k, v in (self.velocity or {}).items():
            out[f"velocity.{k}"] = v
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.steps = int(state["server_steps"][0])
        self.velocity = prefixed_tensors(state, "velocity.")


class FedAvgM(FedAvg):
    """FedAvg with server momentum; defaults from the Fed3R paper's grid (η = 1, β = 0.9)."""

    def __init__(self, server_lr: float = 1.0, momentum: float = 0.9):
        super().__init__(server_lr, momentum)
