"""FedBuff: asynchronous buffered aggregation with staleness weighting (Nguyen et al., AISTATS 2022).

No rounds: a device is given the global model of some version v, trains on it and sends back its
trained parameters y_k. The server knows the model x_v it gave out, so the device's update is
Δ_k = y_k − x_v. Updates are buffered; every K arrivals the server takes one step and the
version advances:

    τ_k  = t − v_k                        staleness: server steps since the device's model
    s(τ) = (1 + τ)^(−a)                   a = ½ gives the paper's 1/√(1+τ)
    x_{t+1} = x_t + η · (1/K) Σ_{k in buffer} s(τ_k) Δ_k      (paper Alg. 1, uniform device weights)

An update older than ``max_staleness`` steps is not buffered (its base model is no longer kept);
it is counted in ``stale_dropped``. The strategy keeps the models of the last ``max_staleness``
+ 1 versions, the only ones an accepted update can be based on, so memory is bounded.

Bounded influence (``aggregation``, ``history``: the layers of FedAvg(ψ),
``aggregator/strategies/robust_fedavg.py``, composed, with the job's defaults): a step treats
the buffer's K updates as FedAvg treats a round's, θ_k = x_t + s(τ_k) Δ_k with weight 1 (FedBuff
weighs devices uniformly): norm bound, contribution bound, direction screen, the rule, then the
history's momentum; x_{t+1} = x_t + η (target − x_t). A step of fewer than three updates is bounded
by the reference of earlier steps too (``small_rounds``, which names each update's device: ``add``'s
``device``). Without them (None) the step is the paper's.

Tensors are ``dict[str, ndarray]``; the buffer keeps each update in float64 in arrival order and
the paper's step sums them in that order (the step is defined by arrival order: that is what
asynchronous means). Nothing here knows devices, rounds or transport;
``aggregator/jobs/fedavg_async.py`` feeds it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import logging

import numpy as np

from aggregator.compute.privacy import UNPUBLISHED_PREFIX
from aggregator.strategies.robust_fedavg import RobustAggregation, RoundHistory
from aggregator.strategies.small_round_reference import SmallRoundReference

Params = dict[str, np.ndarray]
BUFFER_DEVICES = UNPUBLISHED_PREFIX + "fedbuff.devices"    # who sent each buffered update (a checkpoint's)
log = logging.getLogger("fedfleet.aggregator")


class AsyncStrategy(ABC):
    """An aggregation rule without rounds: versions of one global model, updates based on one of them."""

    version: int

    @abstractmethod
    def model_for(self, version: int) -> Params:
        """The global model of ``version`` (what a device given that version trains on)."""

    @abstractmethod
    def add(self, trained: Mapping[str, np.ndarray], base_version: int) -> str:
        """Take one device's trained parameters; answer "buffered", "stepped" or "stale"."""

    @abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None: ...


def staleness_weight(staleness: int, exponent: float = 0.5) -> float:
    """s(τ) = (1 + τ)^(−exponent); 1/√(1+τ) by default (FedBuff's polynomial weighting)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return float((1.0 + staleness) ** -exponent)


class FedBuff(AsyncStrategy):
    def __init__(self, initial: Mapping[str, np.ndarray], buffer_size: int = 4, server_lr: float = 1.0,
                 max_staleness: int = 8, staleness_exponent: float = 0.5,
                 aggregation: RobustAggregation | None = None, history: RoundHistory | None = None,
                 small_rounds: SmallRoundReference | None = None):
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if not np.isfinite(server_lr) or server_lr <= 0:
            raise ValueError(f"server_lr must be a positive finite number, got {server_lr}")
        self.buffer_size, self.server_lr = int(buffer_size), float(server_lr)
        self.max_staleness, self.staleness_exponent = int(max_staleness), float(staleness_exponent)
        self.version = 0
        self._models: dict[int, Params] = {0: {k: np.array(v) for k, v in initial.items()}}
        self.aggregation, self.history, self.small_rounds = aggregation, history, small_rounds
        self._buffer: list[dict[str, np.ndarray]] = []   # s(τ_k) Δ_k of the buffered updates, in arrival order
        self._devices: list[str] = []                    # who sent each ("": not named)
        self.last_report: dict = {}                      # what the bounded-influence layers did at the last step
        self.buffered = 0
        self.stale_dropped = 0
        self.applied = 0                 # updates that went into a server step or the open buffer

    @property
    def params(self) -> Params:
        return self._models[self.version]

    def model_for(self, version: int) -> Params:
        if version not in self._models:
            raise KeyError(f"model version {version} is not kept (current {self.version}, "
                           f"max staleness {self.max_staleness})")
        return self._models[version]

    def buffered_devices(self) -> set[str]:
        """Who sent the updates in the open buffer (those not named left out)."""
        return {device for device in self._devices if device}

    def staleness(self, base_version: int) -> int:
        if not 0 <= base_version <= self.version:
            raise ValueError(f"base version {base_version} outside 0..{self.version}")
        return self.version - base_version

    def add(self, trained: Mapping[str, np.ndarray], base_version: int, device: str = "") -> str:
        """``device``: who sent it, for the reference of small steps (``small_rounds``: updates not
        named count as one device there)."""
        tau = self.staleness(base_version)
        if tau > self.max_staleness:
            self.stale_dropped += 1
            return "stale"
        base = self._models[base_version]
        if set(trained) != set(base):
            raise ValueError(f"update has tensors {sorted(trained)}, model has {sorted(base)}")
        weight = staleness_weight(tau, self.staleness_exponent)
        deltas = {}
        for name, value in trained.items():
            value = np.asarray(value, dtype=np.float64)
            if value.shape != base[name].shape:
                raise ValueError(f"tensor {name!r} has shape {value.shape}, expected {base[name].shape}")
            if not np.isfinite(value).all():
                raise ValueError(f"update tensor {name!r} contains NaN or Inf")
            deltas[name] = weight * (value - np.asarray(base[name], dtype=np.float64))
        self._buffer.append(deltas)                # only after every check: a bad update changes nothing
        self._devices.append(str(device))
        self.buffered += 1
        self.applied += 1
        if self.buffered < self.buffer_size:
            return "buffered"
        self._step()
        return "stepped"

    def _step(self) -> None:
        current = self.params
        x = {name: np.asarray(value, dtype=np.float64) for name, value in current.items()}
        new = {name: (x[name] + move).astype(np.asarray(current[name]).dtype)
               for name, move in self._move(x).items()}
        self.version += 1
        self._models[self.version] = new
        for old in [v for v in self._models if v < self.version - self.max_staleness]:
            del self._models[old]
        self._buffer, self._devices, self.buffered = [], [], 0

    def _move(self, x: Params) -> Params:
        """What the step adds: η/K Σ s(τ_k) Δ_k (the paper), or η (target − x_t) bounded."""
        if self.aggregation is None:
            total = {}
            for deltas in self._buffer:            # summed in arrival order, as the paper's step
                for name, delta in deltas.items():
                    total[name] = total[name] + delta if name in total else delta
            return {name: self.server_lr / self.buffer_size * value for name, value in total.items()}
        updates = [({name: x[name] + delta for name, delta in deltas.items()}, 1) for deltas in self._buffer]
        combined, self.last_report, (limits, statistics) = self.aggregation.aggregate_measured(
            x, updates, self.small_rounds)
        if self.small_rounds is not None:          # a step of K < 3 is bounded by the reference (and closed into it)
            self.small_rounds.observe(len(updates), limits, None if statistics is None else
                                      {device: row for device, row in zip(self._devices, statistics)})
        if combined is None:                       # too few updates for the rule's guarantee (or held): no move
            return {name: np.zeros_like(value) for name, value in x.items()}
        if self.last_report.get("norm_bounded") or self.last_report.get("screened"):
            log.warning("fedbuff step %d: %s", self.version + 1, self.last_report)
        target = self.history.step(x, combined) if self.history is not None else combined
        return {name: self.server_lr * (target[name] - x[name]) for name in x}

    # persistence: the kept versions, the open buffer and the counters (exact float64 sums)
    def state_dict(self) -> dict[str, np.ndarray]:
        out = {"fedbuff.counters": np.array([self.version, self.buffered, self.stale_dropped, self.applied],
                                            dtype=np.int64)}
        for version, model in self._models.items():
            for name, value in model.items():
                out[f"model.{version}.{name}"] = value
        for i, deltas in enumerate(self._buffer):
            for name, value in deltas.items():
                out[f"buffer.{i}.{name}"] = value
        if self._buffer:
            out[BUFFER_DEVICES] = np.array(self._devices, dtype=str)
        return {**out, **(self.history.state_dict() if self.history is not None else {}),
                **(self.small_rounds.state_dict() if self.small_rounds is not None else {})}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.version, self.buffered, self.stale_dropped, self.applied = (int(x) for x in state["fedbuff.counters"])
        self._models, buffer = {}, {}
        for key, value in state.items():
            if key.startswith("model."):
                version, name = key[len("model."):].split(".", 1)
                self._models.setdefault(int(version), {})[name] = np.array(value)
            elif key.startswith("buffer."):
                # buffer.{i}.{name}; a checkpoint of the summing buffer (buffer.{name}) is one entry
                index, _, name = key[len("buffer."):].partition(".")
                index, name = (int(index), name) if index.isdigit() and name else (0, key[len("buffer."):])
                buffer.setdefault(index, {})[name] = np.array(value, dtype=np.float64)
        self._buffer = [buffer[i] for i in sorted(buffer)]
        devices = [str(d) for d in np.asarray(state.get(BUFFER_DEVICES, [])).reshape(-1)]
        self._devices = devices if len(devices) == len(self._buffer) else [""] * len(self._buffer)
        if self.history is not None:
            self.history.load_state_dict(state)
        if self.small_rounds is not None:
            self.small_rounds.load_state_dict(state)
        if self.version not in self._models:
            raise ValueError(f"state has no model for its version {self.version}")
