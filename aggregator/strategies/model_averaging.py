"""The model a FedAvg-family job serves: the last global model, its SWA, or its window average (WiMA).

Training goes on from the last global model w^t either way; what changes is the model the job
evaluates, reports and saves as ``model.npz`` (the one a deployment rolls out):

* :class:`LastModel`: w^t (FedAvg as it always was).
* :class:`StochasticWeightAveraging` (server SWA, Caldarola et al. 2022 / thesis Alg. 4): from
  round t₀ the clients' learning rate follows a cycle of c rounds, linearly from γ₁ (the job's
  client LR) down to γ₂, and at the end of every cycle (the low-LR model) the server folds the
  global model into a running mean, w_SWA ← (w_SWA·n + w^t)/(n + 1). The first cycle's end
  starts the mean (n = 0); before it the served model is w^t. SWA's gain is the averaging
  (thesis Table 4.11); c = 1 and γ₂ = γ₁ average every round at a constant LR.
* :class:`WindowAverage` (WiMA, thesis §4.5): the mean of the last W global models, from round 1
  (fewer than W at the start: the mean of those there are). A ring of W models, so the mean
  is recomputed from the ring (no running sum whose rounding drifts over thousands of rounds).

Each observes the global model after every round's server step (``observe(t, w^t)``, t = 0 for
the initial model) and checkpoints what it holds (``served_*`` arrays), so a restarted job
serves the same bytes. Means are taken in float64 and served in the model's dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

from aggregator.strategies.fedavg import prefixed_tensors

Params = dict[str, np.ndarray]


class ServedModel(ABC):
    """What the job serves, given the rounds' global models."""

    def client_lr(self, round_: int, base_lr: float) -> float:
        """The learning rate the round's devices get (SWA's cycle; else the job's)."""
        return base_lr

    @abstractmethod
    def observe(self, round_: int, params: Mapping[str, np.ndarray]) -> None:
        """The global model after round ``round_``'s server step (0: the initial model)."""

    @abstractmethod
    def served(self, params: Mapping[str, np.ndarray]) -> Params:
        """The model to evaluate, report and deploy, given the current global model."""

    def state_dict(self) -> dict[str, np.ndarray]:
        return {}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        pass


def _cast_like(mean: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> Params:
    return {k: np.asarray(mean[k]).astype(np.asarray(like[k]).dtype) for k in like}


class LastModel(ServedModel):
    def observe(self, round_, params):
        pass

    def served(self, params):
        return {k: np.array(v) for k, v in params.items()}


class StochasticWeightAveraging(ServedModel):
    def __init__(self, start_round: int, cycle_rounds: int = 1, lr_min: float | None = None):
        if start_round < 1 or cycle_rounds < 1:
            raise ValueError(f"SWA needs start_round >= 1 and cycle_rounds >= 1, got {start_round}, {cycle_rounds}")
        if lr_min is not None and (not np.isfinite(lr_min) or lr_min <= 0):
            raise ValueError(f"SWA's lowest client LR must be > 0, got {lr_min}")
        self.start_round, self.cycle_rounds, self.lr_min = int(start_round), int(cycle_rounds), lr_min
        self.mean: Params | None = None        # float64
        self.count = 0

    def _position(self, round_: int) -> int | None:
        """Round's place in its cycle, 0 .. c−1 (None before t₀)."""
        return None if round_ < self.start_round else (round_ - self.start_round) % self.cycle_rounds

    def client_lr(self, round_, base_lr):
        """γ(i) = (1 − t)γ₁ + tγ₂, t = (mod(i−1, c) + 1)/c (thesis 001 Eq. 2.36–2.37, Izmailov et al.):
        a cycle's first round already moves 1/c of the way, its last (where the model is averaged)
        runs at γ₂; c = 1 is the constant γ₂. (It ramped with i/(c−1) before: γ₁ at each cycle's start.)"""
        i = self._position(round_)
        if i is None or self.lr_min is None:
            return base_lr
        t = (i + 1) / self.cycle_rounds
        return (1 - t) * base_lr + t * self.lr_min

    def observe(self, round_, params):
        if self._position(round_) != self.cycle_rounds - 1:
            return
        x = {k: np.asarray(v, np.float64) for k, v in params.items()}
        self.mean = x if self.mean is None else {k: (self.mean[k] * self.count + x[k]) / (self.count + 1) for k in x}
        self.count += 1

    def served(self, params):
        return {k: np.array(v) for k, v in params.items()} if self.mean is None else _cast_like(self.mean, params)

    def state_dict(self):
        out = {"served_swa_count": np.array([self.count], dtype=np.int64)}
        out.update({f"served_swa.{k}": v for k, v in (self.mean or {}).items()})
        return out

    def load_state_dict(self, state):
        self.count = int(state["served_swa_count"][0])
        self.mean = prefixed_tensors(state, "served_swa.")


class WindowAverage(ServedModel):
    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"WiMA's window must be >= 1, got {window}")
        self.window = int(window)
        self.ring: list[Params] = []            # oldest first, at most W

    def observe(self, round_, params):
        if round_ < 1:
            return                               # the window holds the rounds' models, not the initial one
        self.ring = [*self.ring, {k: np.array(v) for k, v in params.items()}][-self.window:]

    def served(self, params):
        if not self.ring:
            return {k: np.array(v) for k, v in params.items()}
        mean = {k: np.mean([np.asarray(m[k], np.float64) for m in self.ring], axis=0) for k in params}
        return _cast_like(mean, params)

    def state_dict(self):
        out = {"served_wima_count": np.array([len(self.ring)], dtype=np.int64)}
        if self.ring:
            out.update({f"served_wima.{k}": np.stack([m[k] for m in self.ring]) for k in self.ring[0]})
        return out

    def load_state_dict(self, state):
        count = int(state["served_wima_count"][0])
        stacks = {k[len("served_wima."):]: np.asarray(v) for k, v in state.items() if k.startswith("served_wima.")}
        self.ring = [{k: np.array(s[i]) for k, s in stacks.items()} for i in range(count)]


SERVED_MODELS = ("last", "swa", "wima")
