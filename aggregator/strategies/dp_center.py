"""DP Fed3R's private feature center: the mean of a few devices' features, released once.

Why. A pretrained backbone's pooled features share a large mean (post-ReLU: every channel is
≥ 0), so most of a row's norm is the mean every row has. The clip F that bounds a device's
statistics (Δ_A = N R², R² = F² + 1) is then spent on what all rows share, not on what tells the
classes apart. Shifting every row by a center μ leaves the ridge solution with an intercept
almost unchanged (its bias absorbs the shift), while ‖z − μ‖ is far smaller than ‖z‖: the same
discriminative signal fits under a smaller clip F_c, and the noise, which scales with F_c², is
smaller. On the 100,000-device fleet of ``bench/dp_fleet_scale.py`` this is what brings ε = 1
within 2 points of no DP.

How. The job's first round (``dp_center_devices`` devices) is an ordinary DP Fed3R round at the
clip F, but of its sum only the intercept row is released: s = Σ z_i and n (one device moves
(s, n) by at most N·F and N, so Δ_c = N √(F² + 1)), with Gaussian noise N(0, (zΔ_c)²) on each of
the d + 1 entries, on the release grid (``dp_noise.grid_gaussian_release``); μ̂ = s̃ / max(ñ, 1).
The rest of those devices' statistics is dropped, never released. Under secure aggregation
(Fed3R-Sync's distributed DP) the center round's devices send only (Σ z, n), each with its share
of that noise, and the group's sum is the noisy pair (``release_noised``). Every later round's devices subtract μ̂ before clipping at F_c, and the model solved
from the centred sums is shifted back to raw features: W(z − μ̂) + b = Wz + (b − Wμ̂), so a
deployed head (and OLL after it) sees the backbone's features as they are.

Privacy. Each device is in exactly one release, the center's or one round's, each a Gaussian
mechanism of the same multiplier z: by parallel composition the job is still one release of z,
accounted as before. The center's error is about zΔ_c√d / m for m devices (the clip's bias, the
mean of clipped rather than raw rows, does not matter: any fixed shift is absorbed by the bias).
"""

from __future__ import annotations

import numpy as np

from protocols.payloads.fed3r import Fed3RStats

from aggregator.compute.ridge import ClosedFormRidge
from aggregator.strategies.fed3r import Fed3R
from aggregator.strategies.dp_noise import NoiseSource, grid_gaussian_release


class PrivateFeatureCenter:
    """The center round's sum, and the center it releases (module docstring)."""

    def __init__(self, num_classes: int, p: int, noise_multiplier: float, max_samples: int, clip_norm: float,
                 min_devices: int = 1):
        # only the intercept row of this sum is ever read (and released); p counts the bias feature
        self.pending = Fed3R(num_classes, p, fit_intercept=True, normalize_columns=False, device="cpu")
        self.min_devices = min_devices
        self.sensitivity = max_samples * float(np.hypot(clip_norm, 1.0))
        self.noise_multiplier = float(noise_multiplier)
        self.value: np.ndarray | None = None

    @property
    def released(self) -> bool:
        return self.value is not None

    def add(self, stats: Fed3RStats) -> None:
        if self.released:
            raise ValueError("the feature center is released: contributions go to the centred rounds")
        self.pending.add(stats)

    def take_sum(self, state: dict[str, np.ndarray] | None) -> None:
        """The round's sum as a Fed3R state (added up the canonical bucket tree), in place of what was added."""
        if self.released:
            raise ValueError("the feature center is released: contributions go to the centred rounds")
        self.pending = self._empty()
        if state is not None:
            self.pending.load_state_dict(state)

    def _empty(self) -> Fed3R:
        p = self.pending
        return Fed3R(p.num_classes, p.p, fit_intercept=True, normalize_columns=False, device="cpu")

    def release(self, rng: NoiseSource) -> bool:
        """Noise (Σ z_i, n) of the round and set the center; False (nothing released) when fewer than
        ``min_devices`` contributed (most of the round dropped out): their sums are dropped unreleased
        (they are in no release, so privacy holds) and the next round is the center round again."""
        if self.pending.n_contributions < max(self.min_devices, 1):
            self.pending = self._empty()
            return False
        column = self.pending.A[:, -1].cpu().numpy()                 # (Σ z_i, n): A's intercept column
        noisy = grid_gaussian_release(column, self.noise_multiplier * self.sensitivity, self.sensitivity, rng)
        return self.release_noised(noisy, self.pending.n_contributions)

    def release_noised(self, noisy_column: np.ndarray, contributions: int) -> bool:
        """Set the center from (Σ z_i, n) already noised — :meth:`release`'s, or a secure group's sum
        of its members' noisy (Σ z, n) (Fed3R-Sync's distributed DP) — of ``contributions`` devices;
        False, nothing set, below ``min_devices`` (as :meth:`release`)."""
        if self.released:
            raise ValueError("the feature center is released once")
        noisy_column = np.asarray(noisy_column, dtype=np.float64)
        if noisy_column.shape != (self.pending.p,):
            raise ValueError(f"the center's sum has shape {noisy_column.shape}, expected ({self.pending.p},)")
        if contributions < max(self.min_devices, 1):
            self.pending = self._empty()
            return False
        self.value = noisy_column[:-1] / max(float(noisy_column[-1]), 1.0)
        self.pending = None                                           # the rest is never released
        return True

    def state_dict(self) -> dict[str, np.ndarray]:
        return {} if self.value is None else {"dp_feature_center": self.value}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        if "dp_feature_center" in state:
            self.value = np.asarray(state["dp_feature_center"], dtype=np.float64)
            self.pending = None


def uncentred(model: ClosedFormRidge, center: np.ndarray) -> ClosedFormRidge:
    """``model`` (fitted on z − center, with an intercept) as the same classifier of raw z: the
    bias absorbs the shift, in the normalised head (``coef_``/``intercept_``) and in the raw solve."""
    center = np.asarray(center, dtype=np.float64)
    model.intercept_ = model.intercept_ - model.coef_ @ center
    raw = model.raw_weights_.copy()
    raw[-1] -= center @ raw[:-1]
    model.raw_weights_ = raw
    return model
