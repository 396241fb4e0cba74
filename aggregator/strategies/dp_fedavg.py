"""Central differential privacy around FedAvg: clip each device's update, add Gaussian noise.

DP-FedAvg (McMahan et al. 2018), at the aggregator. For the round's updates θ_k of the
parameters θ_t every device started from:

    Δ_k  = θ_k − θ_t,   Δ̃_k = Δ_k · min(1, C / ‖Δ_k‖₂)           (‖Δ̃_k‖₂ ≤ C)
    Δ̄    = (Σ_k Δ̃_k + N(0, (z_Δ C)² I)) / m                        (m = κ, fixed)
    θ_{t+1} = the wrapped FedAvg/FedAvgM step towards θ_t + Δ̄

The sum of clipped updates has L2 sensitivity C when one device is added or removed, so the
noise multiplier is z_Δ (the denominator is the *expected* number of devices κ, never the
number that answered, which would itself depend on who took part). Devices are unweighted:
sample counts n_k would make the sensitivity data-dependent.

Adaptive clipping (Andrew et al. 2021, "quantile-based"): besides its update each device
contributes the bit b_k = 1[‖Δ_k‖ ≤ C]; the noisy fraction

    b̄ = (Σ_k (b_k − ½) + N(0, σ_b²)) / m + ½,   C ← C · exp(−η (b̄ − γ))

moves C geometrically towards the γ-quantile of the update norms. The bit sum has sensitivity ½,
so the two Gaussian releases together equal one with multiplier z when
z_Δ = (z⁻² − (2σ_b)⁻²)^(−½) (their Eq. 4): the accountant sees z either way.

Both releases are drawn on an integer grid, never as a float added to a float
(``dp_noise.grid_gaussian_release``: the floating-point attack on Gaussian samplers, and why
the grid's rounding costs nothing the accountant does not see).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

from protocols.clipping import clip_update

from aggregator.strategies.dp_noise import (MODEL_RELEASE, NoiseSource, grid_gaussian_release,
                                            grid_gaussian_release_all, noise_for, noise_source)
from aggregator.strategies.fedavg import Params, ServerOptimizer


COUNT_SENSITIVITY = 0.5      # adaptive clipping's Σ (b_k − ½) moves by ½ when one device comes or goes


class ClipNorm(ABC):
    """The clipping norm C of the next round and the noise multiplier left for the updates."""

    def __init__(self, clip_norm: float):
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"clip norm must be a positive finite number, got {clip_norm}")
        self.value = float(clip_norm)

    @abstractmethod
    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        """z_Δ: the multiplier of the update sum's noise when the job's total is ``noise_multiplier``."""

    @abstractmethod
    def observe(self, unclipped: int, count: int, expected: int, rng: NoiseSource) -> None:
        """Move C after a round of ``count`` updates, ``unclipped`` of them within C before clipping."""


class FixedClipNorm(ClipNorm):
    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        return noise_multiplier

    def observe(self, unclipped: int, count: int, expected: int, rng: NoiseSource) -> None:
        pass


class AdaptiveClipNorm(ClipNorm):
    """Quantile-based clipping: γ (``target_quantile``), η (``learning_rate``), σ_b (``count_stddev``)."""

    def __init__(self, clip_norm: float, target_quantile: float = 0.5, learning_rate: float = 0.2,
                 count_stddev: float = 1.0):
        super().__init__(clip_norm)
        if not 0 < target_quantile < 1:
            raise ValueError(f"target quantile must lie in (0, 1), got {target_quantile}")
        if not (learning_rate > 0 and count_stddev > 0):
            raise ValueError("learning rate and count stddev must be > 0")
        self.target_quantile, self.learning_rate, self.count_stddev = target_quantile, learning_rate, count_stddev

    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        rest = noise_multiplier ** -2 - (2 * self.count_stddev) ** -2
        if rest <= 0:
            raise ValueError(f"the clipped-count noise σ_b = {self.count_stddev} must exceed z/2 = "
                             f"{noise_multiplier / 2} (it would spend the whole budget)")
        return rest ** -0.5

    def observe(self, unclipped: int, count: int, expected: int, rng: NoiseSource) -> None:
        centred = unclipped - 0.5 * count          # Σ (b_k − ½), exact: halves of small integers
        self.follow(float(grid_gaussian_release(centred, self.count_stddev, COUNT_SENSITIVITY, rng)), expected)

    def follow(self, noisy_centred: float, expected: int) -> None:
        """Move C from a released noisy Σ (b_k − ½) (noised here, or by the devices under
        distributed DP: ``aggregator/jobs/secure_fedavg.py``) over ``expected`` devices (m)."""
        fraction = noisy_centred / expected + 0.5
        self.value *= math.exp(-self.learning_rate * (fraction - self.target_quantile))


class ClippedSum:
    """One round's sum of per-device deltas, each clipped to C as one vector, over fixed slots.

    The slots (name -> shape) are what the round releases; a device's delta may fill any subset
    of them (LADD: the global slots and its own cluster's), and its clip covers all it fills, so
    adding or removing one device moves the whole sum by at most C in L2."""

    def __init__(self, shapes: Mapping, clip_norm: float):
        self.clip_norm = float(clip_norm)
        self.total = {k: np.zeros(shape, dtype=np.float64) for k, shape in shapes.items()}
        self.count = self.unclipped = 0         # the deltas added, those within C (adaptive clipping's bits)

    def add(self, delta: Mapping[object, np.ndarray]) -> None:
        """Clip ``delta`` and add it; a delta naming an unknown slot or of the wrong shape changes nothing."""
        for k, v in delta.items():
            if k not in self.total or np.shape(v) != self.total[k].shape:
                raise ValueError(f"delta slot {k!r} is not one of the round's (or has the wrong shape)")
            if not np.isfinite(v).all():
                raise ValueError(f"delta slot {k!r} contains NaN or Inf")
        clipped, norm = clip_update(delta, self.clip_norm)
        for k, v in clipped.items():
            self.total[k] += v
        self.count += 1
        self.unclipped += norm <= self.clip_norm


class ClippedGaussianSum:
    """The DP-FedAvg mechanism: per-device clipping to C and one Gaussian release of the sum per
    round, N(0, (z_Δ C)² I) on every slot on the release grid (shared by DP-FedAvg and DP-LADD).

    ``rng`` is the noise source (OS entropy by default; a seeded generator only in tests, since
    anyone knowing the seed can subtract the noise)."""

    def __init__(self, noise_multiplier: float, clip: ClipNorm, rng: NoiseSource | None = None):
        if not noise_multiplier > 0:
            raise ValueError("need noise_multiplier > 0")
        self.noise_multiplier, self.clip = float(noise_multiplier), clip
        self.update_multiplier = clip.update_noise_multiplier(self.noise_multiplier)
        self.rng = rng if rng is not None else noise_source()
        self.releases = 0

    def open_sum(self, shapes: Mapping) -> ClippedSum:
        """A round's sum at the current C."""
        return ClippedSum(shapes, self.clip.value)

    def release(self, round_sum: ClippedSum, expected: int) -> dict:
        """Σ clipped deltas + noise on every slot (released even when nobody contributed, as the
        accountant counts it); moves C afterwards (adaptive, ``expected`` is m of the count)."""
        return self.release_total(round_sum.total, round_sum.clip_norm, round_sum.unclipped, round_sum.count, expected)

    def release_total(self, total: Mapping[str, np.ndarray], clip_norm: float, unclipped: int, count: int,
                      expected: int) -> dict:
        """:meth:`release` of a sum of ``count`` deltas clipped at ``clip_norm``, ``unclipped`` of them
        within it, however it was added up (one aggregator's bucket tree or its shards':
        ``aggregator/shards/fedavg_sums.py``)."""
        stddev = self.update_multiplier * clip_norm
        rng = noise_for(self.rng, MODEL_RELEASE, self.releases)     # seeded (tests): the same after a restart
        # all slots are one release of sensitivity C (d: every entry of every slot), on the grid
        noisy = grid_gaussian_release_all(total, stddev, clip_norm, rng)
        self.clip.observe(unclipped, count, expected, rng)
        self.releases += 1
        return noisy

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"dp_clip_norm": np.array([self.clip.value]), "dp_releases": np.array([self.releases], dtype=np.int64)}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.clip.value = float(state["dp_clip_norm"][0])
        self.releases = int(state["dp_releases"][0])


class DPFedAvg(ClippedGaussianSum):
    """Clip, sum, noise, then the wrapped strategy's step (FedAvg/FedAvgM/FedOpt: post-processing).

    ``expected_clients`` is m (κ)."""

    def __init__(self, strategy: ServerOptimizer, noise_multiplier: float, clip: ClipNorm, expected_clients: int,
                 rng: NoiseSource | None = None):
        if expected_clients < 1:
            raise ValueError("need expected_clients >= 1")
        super().__init__(noise_multiplier, clip, rng)
        self.strategy, self.expected_clients = strategy, int(expected_clients)

    @property
    def steps(self) -> int:
        return self.strategy.steps

    def step_from_sum(self, params: Mapping[str, np.ndarray], clipped_sum: Mapping[str, np.ndarray], unclipped: int,
                      count: int) -> Params:
        """New parameters from the round's sum of ``count`` deltas already clipped at the current C
        (``unclipped`` of them within it), added up the bucket tree by one aggregator or its shards
        (``aggregator/shards/fedavg_sums.py``: ``dp_round_step``); moves C afterwards (adaptive)."""
        noisy = self.release_total(clipped_sum, self.clip.value, unclipped, count, self.expected_clients)
        return self.apply_mean_delta(params, {k: s / self.expected_clients for k, s in noisy.items()})

    def apply_mean_delta(self, params: Mapping[str, np.ndarray], mean_delta: Mapping[str, np.ndarray]) -> Params:
        averaged = {k: np.asarray(params[k], np.float64) + mean_delta[k] for k in params}
        return self.strategy.step(params, averaged)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**self.strategy.state_dict(), **super().state_dict()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.strategy.load_state_dict(state)
        super().load_state_dict(state)
