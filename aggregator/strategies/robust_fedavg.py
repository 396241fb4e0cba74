"""Robust aggregation of a FedAvg round's plaintext updates: no single device steers the average.

A round's updates are (θ_k, n_k): the tensors device k trained, and its sample count. Two layers
(docs/algorithms.md, "Bounded influence"):

* :class:`NormBound`, on by default: Δ_k = θ_k − x_t is scaled to at most ``multiplier`` times
  the median ‖Δ‖ of the round (a fleet-relative bound: no constant to tune per model). The job's
  default multiplier is 1: every update is clipped to the round's median norm, so no device pushes
  harder than the typical one. An update within the bound is passed through untouched (the same
  bits); an honest round whose norms differ is therefore not FedAvg's bit for bit (about half its
  updates are scaled down), which on the non-IID demo fleet costs no accuracy (it gains some).
* a rule (:class:`RobustRule`): the sample-weighted mean (FedAvg), the coordinate-wise median,
  the coordinate-wise trimmed mean (Yin et al. 2018), Krum / Multi-Krum (Blanchard et al. 2017),
  centred clipping (Karimireddy et al. 2021).
  Each states the fewest updates its guarantee needs (``min_updates``); a job checks that against
  κ when it is created, and a round that ends with fewer updates moves nothing.

Updates are flattened to one float64 vector per device (tensor names sorted), so every rule is a
function of the set of updates, never of their order.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np

from aggregator.strategies.fedavg import WeightedMean

Params = dict[str, np.ndarray]
Update = tuple[Mapping[str, np.ndarray], int]


def _flatten(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(tensors[k], dtype=np.float64).ravel() for k in sorted(tensors)])


def _unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray]) -> Params:
    out, at = {}, 0
    for k in sorted(like):
        shape = np.shape(like[k])
        size = int(np.prod(shape))
        out[k] = vector[at:at + size].reshape(shape)
        at += size
    return out


class RobustRule(ABC):
    """One way of combining a round's updates into the tensors the server step moves towards."""

    name: str

    def min_updates(self) -> int:
        """The fewest updates the rule's guarantee holds for."""
        return 1

    @abstractmethod
    def combine(self, updates: Sequence[Update]) -> Params:
        """The combined tensors of ``updates`` (at least ``min_updates`` of them)."""


class Mean(RobustRule):
    """FedAvg: Σ n_k θ_k / Σ n_k (no robustness; what the norm bound protects)."""

    name = "mean"

    def combine(self, updates: Sequence[Update]) -> Params:
        mean = WeightedMean()
        for tensors, n in updates:
            mean.add(tensors, n)
        return mean.result()


class CoordinateMedian(RobustRule):
    """The median of each coordinate over the round's updates (unweighted: a weight is a claim)."""

    name = "median"

    def combine(self, updates: Sequence[Update]) -> Params:
        stacked = np.stack([_flatten(t) for t, _ in updates])
        return _unflatten(np.median(stacked, axis=0), updates[0][0])


class TrimmedMean(RobustRule):
    """Each coordinate's mean after dropping its ⌊β·m⌋ largest and ⌊β·m⌋ smallest values."""

    name = "trimmed_mean"

    def __init__(self, trim_fraction: float):
        if not 0 <= trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must lie in [0, 0.5), got {trim_fraction}")
        self.trim_fraction = trim_fraction

    def trimmed(self, m: int) -> int:
        return int(math.floor(self.trim_fraction * m))

    def combine(self, updates: Sequence[Update]) -> Params:
        stacked = np.sort(np.stack([_flatten(t) for t, _ in updates]), axis=0)
        k = self.trimmed(len(updates))
        return _unflatten(stacked[k:len(updates) - k].mean(axis=0), updates[0][0])


class Krum(RobustRule):
    """Multi-Krum with f Byzantine devices: score each update by the summed squared distances to
    its m − f − 2 nearest others, keep the ``select`` lowest scores (1: Krum) and average them
    weighted by n_k. Needs m ≥ 2f + 3 updates."""

    name = "krum"

    def __init__(self, byzantine: int, select: int = 1):
        if byzantine < 0 or select < 1:
            raise ValueError(f"Krum needs f >= 0 and select >= 1, got f={byzantine}, select={select}")
        self.byzantine, self.select = byzantine, select

    def min_updates(self) -> int:
        return max(2 * self.byzantine + 3, self.select)

    def chosen(self, updates: Sequence[Update]) -> list[int]:
        """Indices of the selected updates (ties broken by position: callers pass a sorted round)."""
        x = np.stack([_flatten(t) for t, _ in updates])
        distances = ((x[:, None, :] - x[None, :, :]) ** 2).sum(axis=2)
        nearest = len(updates) - self.byzantine - 2
        scores = [np.sort(np.delete(row, i))[:nearest].sum() for i, row in enumerate(distances)]
        return sorted(np.argsort(scores, kind="stable")[:self.select].tolist())

    def combine(self, updates: Sequence[Update]) -> Params:
        return Mean().combine([updates[i] for i in self.chosen(updates)])


class CenteredClipping(RobustRule):
    """Centred clipping (Karimireddy, He & Jaggi 2021): from a robust start v (the coordinate-wise
    median), ``iterations`` times v ← v + Σ w_k (θ_k − v)·min(1, τ/‖θ_k − v‖), w_k = n_k/Σ n_k.
    τ is fleet-relative: ``radius_multiplier`` × the median ‖θ_k − v‖ at the start. A device far
    from the others moves v by at most w_k·τ per iteration whatever it sends; when no update lies
    beyond τ the fixed point is the mean itself, returned as FedAvg computes it (the same bits)."""

    name = "centered_clipping"

    def __init__(self, radius_multiplier: float = 1.0, iterations: int = 3):
        if not (radius_multiplier > 0 and math.isfinite(radius_multiplier)) or iterations < 1:
            raise ValueError(f"centred clipping needs a radius multiplier > 0 and iterations >= 1, "
                             f"got {radius_multiplier}, {iterations}")
        self.radius_multiplier, self.iterations = radius_multiplier, iterations

    def combine(self, updates: Sequence[Update]) -> Params:
        x = np.stack([_flatten(t) for t, _ in updates])
        weights = np.array([n for _, n in updates], dtype=np.float64)
        weights /= weights.sum()
        centre = np.median(x, axis=0)
        radius = self.radius_multiplier * float(np.median(np.linalg.norm(x - centre, axis=1)))
        if radius == 0:                 # most updates are the median itself: nothing to clip against
            return _unflatten(centre, updates[0][0])
        for _ in range(self.iterations):
            residuals = x - centre
            distances = np.linalg.norm(residuals, axis=1)
            if (distances <= radius).all():     # unclipped, the next iterate is the mean
                return Mean().combine(updates)
            shrink = np.minimum(1.0, radius / np.maximum(distances, np.finfo(float).tiny))
            centre = centre + (weights * shrink) @ residuals
        return _unflatten(centre, updates[0][0])


class _MedianBound(ABC):
    """Scale Δ_k = θ_k − x_t so that its size (what a subclass measures) is at most ``multiplier``
    × the round's median size (0: off); an update within the bound is returned as it was (the
    same bits). Scaling Δ_k by c scales either size by c."""

    what = "bound"

    def __init__(self, multiplier: float):
        if multiplier != 0 and not (multiplier >= 1 and math.isfinite(multiplier)):
            raise ValueError(f"the {self.what}'s multiplier must be 0 (off) or >= 1, got {multiplier}")
        self.multiplier = multiplier

    @abstractmethod
    def size(self, delta: np.ndarray, n: int) -> float:
        """What the bound caps, for an update Δ of n samples."""

    def apply(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]) -> tuple[list[Update], int]:
        """(the bounded updates, how many were scaled)."""
        if not self.multiplier or not updates:
            return list(updates), 0
        x = _flatten(current)
        deltas = [_flatten(t) - x for t, _ in updates]
        sizes = np.array([self.size(d, n) for (_, n), d in zip(updates, deltas)])
        limit = self.multiplier * float(np.median(sizes))
        if limit == 0:              # most devices did not move: nothing to compare the others with
            return list(updates), 0
        out, scaled = [], 0
        for (tensors, n), delta, size in zip(updates, deltas, sizes):
            if size > limit:
                out.append((_unflatten(x + delta * (limit / size), tensors), n))
                scaled += 1
            else:
                out.append((tensors, n))
        return out, scaled


class NormBound(_MedianBound):
    """Scale Δ_k = θ_k − x_t to at most ``multiplier`` × the round's median ‖Δ‖ (0: off)."""

    what = "norm bound"

    def size(self, delta: np.ndarray, n: int) -> float:
        return float(np.linalg.norm(delta))


class InfluenceBound(_MedianBound):
    """Scale Δ_k so that a device's pull on the weighted mean, n_k·‖Δ_k‖, is at most ``multiplier``
    × the round's median pull (0: off). The norm bound caps ‖Δ_k‖ alone, so a device with many
    samples (or one that claims them: n_k is a claim) still outweighs several honest ones; this
    caps the product the mean actually weighs. n_k itself is kept (it is what the mean divides
    by), so a bounded device's update is shortened, never re-weighted."""

    what = "influence bound"

    def size(self, delta: np.ndarray, n: int) -> float:
        return n * float(np.linalg.norm(delta))


class DirectionScreen:
    """Leave out an update whose Δ_k points away from the round's coordinate-wise median Δ (cosine
    ≤ 0), unless that would leave none. A norm bound makes a sign-flipped update honest-sized but
    keeps its direction; against the median of the round (which a minority cannot move far) its
    cosine is negative, while honest non-IID updates, which disagree on *which* classes they move,
    still share the median's direction. A function of the round's set of updates."""

    def apply(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]) -> tuple[list[Update], int]:
        """(the kept updates, how many were left out)."""
        if len(updates) < 3:        # no majority to define a direction
            return list(updates), 0
        x = _flatten(current)
        deltas = np.stack([_flatten(t) - x for t, _ in updates])
        reference = np.median(deltas, axis=0)
        scale = np.linalg.norm(deltas, axis=1) * np.linalg.norm(reference)
        kept = [u for u, d, s in zip(updates, deltas, scale) if s > 0 and float(d @ reference) > 0]
        if not kept:
            return list(updates), 0
        return kept, len(updates) - len(kept)


class RobustAggregation:
    """A round's updates through the norm bound, the influence bound and the direction screen
    (each optional), then the rule."""

    def __init__(self, rule: RobustRule, bound: NormBound, influence: InfluenceBound | None = None,
                 direction: DirectionScreen | None = None):
        self.rule, self.bound, self.influence, self.direction = rule, bound, influence, direction

    def aggregate(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]) -> tuple[Params | None, dict]:
        """(the combined tensors, or None when the round has too few updates for the rule; a report)."""
        report = {"rule": self.rule.name, "updates": len(updates)}
        if len(updates) < self.rule.min_updates():
            return None, {**report, "skipped": f"{self.rule.name} needs at least {self.rule.min_updates()} updates"}
        bounded, scaled = self.bound.apply(current, updates)
        report["norm_bounded"] = scaled
        if self.influence is not None:
            bounded, report["influence_bounded"] = self.influence.apply(current, bounded)
        if self.direction is not None:
            bounded, report["direction_screened"] = self.direction.apply(current, bounded)
        return self.rule.combine(bounded), report


def check_weighted_group_sum(sums: Mapping[str, np.ndarray], n: int, current: Mapping[str, np.ndarray],
                             members: int, clip_norm: float, max_samples: int) -> None:
    """ValueError unless a secure group's Σ n_k θ_k is what members who clipped ‖θ_k − x_t‖ ≤ C can
    send: n ≤ members × max_samples and ‖Σ n_k θ_k − n·x_t‖ = ‖Σ n_k Δ_k‖ ≤ Σ n_k C = n·C. The
    server sees the sum only: what a member inside the bound can still do is in docs/secure-aggregation.md."""
    if n > members * max_samples:
        raise ValueError(f"the group claims {n} samples, more than {members} members x {max_samples}")
    norm = float(np.linalg.norm(_flatten(sums) - n * _flatten(current)))
    if norm > n * clip_norm * (1 + 1e-5) + 1e-4:        # the fixed-point sum's rounding
        raise ValueError(f"‖Σ n_k Δ_k‖ = {norm:.4g} exceeds n·C = {n * clip_norm:.4g} (n={n}, C={clip_norm})")
