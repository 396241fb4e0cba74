"""Robust aggregation of a FedAvg round's plaintext updates: no single device steers the average.

A round's updates are (θ_k, n_k): the tensors device k trained, and its sample count. Layers, in
this order (docs/algorithms.md, "Bounded influence"):

* :class:`NormBound`, on by default: Δ_k = θ_k − x_t is scaled to at most ``multiplier`` times
  the median ‖Δ‖ of the round (a fleet-relative bound: no constant to tune per model). The job's
  default multiplier is 1: every update is clipped to the round's median norm, so no device pushes
  harder than the typical one. An update within the bound is passed through untouched (the same
  bits); an honest round whose norms differ is therefore not FedAvg's bit for bit (about half its
  updates are scaled down), which on the non-IID demo fleet costs no accuracy (it gains some).
* :class:`WeightBound`: a weight is a claim (n_k); w_k is capped at ``multiplier`` times the
  round's median weight (the job's default: 2), so no device holds more of the weighted mean
  than a few typical ones, whatever its update (a tiny Δ_k at n_k = 10^9 passes every other layer
  and freezes the model).
* :class:`ContributionBound`: the norm bound leaves a device's weight alone, and a weight is a
  claim (n_k); a device's pull on the weighted mean, w_k·‖Δ_k‖, is capped at ``multiplier``
  times the round's median pull by lowering w_k (the job's default: 0.5).
* :class:`DirectionScreen`: an update pointing away from the round's consensus,
  ⟨Δ_k, coordinate-wise median of the Δ⟩ ≤ 0, is left out of the rule.
* a rule (:class:`RobustRule`): the sample-weighted mean (FedAvg), the coordinate-wise median,
  the coordinate-wise trimmed mean (Yin et al. 2018), Krum / Multi-Krum (Blanchard et al. 2017),
  centred clipping (Karimireddy et al. 2021).
  Each states the fewest updates its guarantee needs (``min_updates``); a job checks that against
  κ when it is created, and a round that ends with fewer updates moves nothing.
* :class:`RoundHistory`, state across rounds (the job checkpoints it): the server steps along a
  momentum of the rounds' combined steps, s_t = β s_{t−1} + (1 − β)(x̄_t − x_t), so one round's
  updates (an attacker's among them) move the model by 1 − β of their step at once, and the
  following rounds' updates answer the rest.

"The round's median" of the three bounds is :func:`typical`'s: the lower middle value when the count
is even, so that in a round of two updates the bound is the smaller device's, never their mean.
A round of fewer than three updates is bounded by a :class:`SmallRoundReference` too (state across
rounds, checkpointed): the limits of earlier rounds, since in a round of one the median is the
update's own; a round of one moves nothing before such a reference exists.

Updates are flattened to one float64 vector per device (tensor names sorted), so every layer
before the history and every rule is a function of the round's set of updates, never of their order.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np

from aggregator.strategies.fedavg import WeightedMean
from aggregator.strategies.small_round_reference import SmallRoundReference

Params = dict[str, np.ndarray]
Update = tuple[Mapping[str, np.ndarray], float]     # (θ_k, its weight: n_k, or less once bounded)


def flatten(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(tensors[k], dtype=np.float64).ravel() for k in sorted(tensors)])


def _deltas(current: Mapping[str, np.ndarray], updates: Sequence[Update]) -> tuple[np.ndarray, np.ndarray]:
    """(x_t flattened, the matrix of Δ_k = θ_k − x_t, one row per update)."""
    x = flatten(current)
    return x, np.stack([flatten(t) - x for t, _ in updates])


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
    """FedAvg: Σ w_k θ_k / Σ w_k (no robustness; what the layers before it protect). With sample
    counts for weights it is FedAvg's own :class:`WeightedMean` (the same additions); weights a
    :class:`ContributionBound` lowered are fractions, summed in float64 as well."""

    name = "mean"

    def combine(self, updates: Sequence[Update]) -> Params:
        if all(isinstance(w, (int, np.integer)) for _, w in updates):
            mean = WeightedMean()
            for tensors, n in updates:
                mean.add(tensors, n)
            return mean.result()
        weights = np.array([w for _, w in updates], dtype=np.float64)
        return _unflatten(weights @ np.stack([flatten(t) for t, _ in updates]) / weights.sum(), updates[0][0])


class CoordinateMedian(RobustRule):
    """The median of each coordinate over the round's updates (unweighted: a weight is a claim)."""

    name = "median"

    def combine(self, updates: Sequence[Update]) -> Params:
        stacked = np.stack([flatten(t) for t, _ in updates])
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
        stacked = np.sort(np.stack([flatten(t) for t, _ in updates]), axis=0)
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
        x = np.stack([flatten(t) for t, _ in updates])
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
        x = np.stack([flatten(t) for t, _ in updates])
        weights = np.array([n for _, n in updates], dtype=np.float64)
        weights /= weights.sum()
        centre = np.median(x, axis=0)
        radius = self.radius_multiplier * float(np.median(np.linalg.norm(x - centre, axis=1)))
        if radius == 0:                 # most updates are the median itself: nothing to clip against
            return _unflatten(centre, updates[0][0])
        mean = Mean().combine(updates)
        if (np.linalg.norm(x - flatten(mean), axis=1) <= radius).all():
            return mean     # nothing lies beyond τ of the mean: it is the fixed point (FedAvg's bits)
        for _ in range(self.iterations):
            residuals = x - centre
            distances = np.linalg.norm(residuals, axis=1)
            shrink = np.minimum(1.0, radius / np.maximum(distances, np.finfo(float).tiny))
            centre = centre + (weights * shrink) @ residuals
        return _unflatten(centre, updates[0][0])


def typical(values) -> float:
    """The round's typical value a fleet-relative bound multiplies: the median, the lower of the two
    middle values when their count is even. With the mean of the two, a round of two updates had no
    bound at all: one device claiming n = 10^9 beside one claiming 20 set the weight cap at 5·10^8
    times the multiplier (a review's finding), and the same held for ‖Δ‖ and the pull. Order-free,
    so shards and one aggregator reach the same limit from the same statistics."""
    array = np.asarray(values, dtype=np.float64).ravel()
    middle = (array.size - 1) // 2
    return float(np.partition(array, middle)[middle])


class BoundLayer(ABC):
    """A bounded-influence layer: one statistic per update, a limit of ``multiplier`` × the round's
    typical (lower-median) statistic, and each update past it bounded to it (0: the layer is off).

    A whole round at once (:meth:`apply`), or one update at a time for sums split across shards
    (``aggregator/shards/fedavg_sums.py``): every update's :meth:`statistic` gathered first, the
    :meth:`limit` decided on all of them, then :meth:`bound_one` applied to each."""

    REPORTED: str       # the round report's count of the updates it bounded
    multiplier: float

    def apply(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]) -> tuple[list[Update], int]:
        """(the updates bounded, how many were); an update within the bound is returned as it was."""
        return self.apply_limited(current, updates)[:2]

    @abstractmethod
    def apply_limited(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]
                      ) -> tuple[list[Update], int, float]:
        """:meth:`apply`'s answer and the round's limit (0: none)."""

    def limit(self, statistics) -> float:
        """The round's bound from every update's statistic; 0 when most devices' is 0 (nothing to
        compare the others with: nothing is bounded)."""
        return self.multiplier * typical(statistics)

    @staticmethod
    @abstractmethod
    def statistic(x: np.ndarray, tensors: Mapping[str, np.ndarray], weight: float) -> float:
        """One update's statistic (``x``: x_t flattened)."""

    @abstractmethod
    def bound_one(self, x: np.ndarray, tensors: Mapping[str, np.ndarray], weight: float, limit: float) -> Update:
        """One update bounded by the round's ``limit``."""


class NormBound(BoundLayer):
    """Scale Δ_k = θ_k − x_t to at most ``multiplier`` × the round's median ‖Δ‖ (0: off)."""

    REPORTED = "norm_bounded"

    def __init__(self, multiplier: float):
        if multiplier != 0 and not (multiplier >= 1 and math.isfinite(multiplier)):
            raise ValueError(f"the norm bound's multiplier must be 0 (off) or >= 1, got {multiplier}")
        self.multiplier = multiplier

    def apply_limited(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]
                      ) -> tuple[list[Update], int, float]:
        if not self.multiplier or not updates:
            return list(updates), 0, 0.0
        x, deltas = _deltas(current, updates)
        norms = np.linalg.norm(deltas, axis=1)
        limit = self.limit(norms)
        out = [self._bounded(x, tensors, n, delta, float(norm), limit) for (tensors, n), delta, norm in
               zip(updates, deltas, norms)]
        return out, int((norms > limit).sum()) if limit else 0, limit

    @staticmethod
    def statistic(x: np.ndarray, tensors: Mapping[str, np.ndarray], weight: float) -> float:
        """‖Δ_k‖ of one update (``x``: x_t flattened)."""
        return float(np.linalg.norm(flatten(tensors) - x))

    def bound_one(self, x: np.ndarray, tensors: Mapping[str, np.ndarray], weight: float, limit: float) -> Update:
        delta = flatten(tensors) - x
        return self._bounded(x, tensors, weight, delta, float(np.linalg.norm(delta)), limit)

    @staticmethod
    def _bounded(x, tensors, weight, delta: np.ndarray, norm: float, limit: float) -> Update:
        if limit and norm > limit:
            return _unflatten(x + delta * (limit / norm), tensors), weight
        return tensors, weight


def _multiplier(what: str, value: float) -> float:
    """A weight-lowering bound's multiplier: a finite number >= 0 (0: the bound is off)."""
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"the {what}'s multiplier must be a finite number >= 0 (0: off), got {value}")
    return value


class WeightBound(BoundLayer):
    """Lower w_k to at most ``multiplier`` × the round's median weight (0: off); tensors are untouched.

    Why: the weighted mean divides by Σ w_k, so a device claiming a huge n_k with an update that
    barely moves (under every norm, pull and direction check) drags the round's step towards zero;
    with its weight bounded it counts as at most ``multiplier`` typical devices."""

    REPORTED = "weight_capped"

    def __init__(self, multiplier: float):
        self.multiplier = _multiplier("weight bound", multiplier)

    def apply_limited(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]
                      ) -> tuple[list[Update], int, float]:
        if not self.multiplier or not updates:
            return list(updates), 0, 0.0
        limit = self.limit([w for _, w in updates])
        return [(t, min(float(w), limit)) for t, w in updates], sum(w > limit for _, w in updates), limit

    @staticmethod
    def statistic(x: np.ndarray, tensors: Mapping[str, np.ndarray], weight: float) -> float:
        return float(weight)

    def bound_one(self, x: np.ndarray, tensors: Mapping[str, np.ndarray], weight: float, limit: float) -> Update:
        return tensors, min(float(weight), limit)


class ContributionBound(BoundLayer):
    """Lower w_k so that w_k·‖Δ_k‖ is at most ``multiplier`` × the round's median of them (0: off);
    tensors are untouched.

    Δ_k is the update as the norm bound left it. Why: FedAvg weighs Δ_k by the sample count its
    device claims, which no norm bound touches; on a Dirichlet split a few devices hold several
    times the median's samples, and a label-flipping or sign-flipping one among them outweighs
    many honest ones. A bounded device keeps pulling, in its direction, exactly as hard as the limit."""

    REPORTED = "weight_bounded"

    def __init__(self, multiplier: float):
        self.multiplier = _multiplier("contribution bound", multiplier)

    def apply_limited(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]
                      ) -> tuple[list[Update], int, float]:
        if not self.multiplier or not updates:
            return list(updates), 0, 0.0
        weights = np.array([w for _, w in updates], dtype=np.float64)
        pulls = weights * np.linalg.norm(_deltas(current, updates)[1], axis=1)
        limit = self.limit(pulls)
        out = [self._bounded(t, w, float(pull), limit) for (t, w), pull in zip(updates, pulls)]
        return out, int((pulls > limit).sum()) if limit else 0, limit

    @staticmethod
    def statistic(x: np.ndarray, tensors: Mapping[str, np.ndarray], weight: float) -> float:
        """w_k·‖Δ_k‖ of one update (``x``: x_t flattened)."""
        return weight * float(np.linalg.norm(flatten(tensors) - x))

    def bound_one(self, x: np.ndarray, tensors: Mapping[str, np.ndarray], weight: float, limit: float) -> Update:
        return self._bounded(tensors, weight, self.statistic(x, tensors, weight), limit)

    @staticmethod
    def _bounded(tensors, weight, pull: float, limit: float) -> Update:
        return (tensors, float(weight * limit / pull)) if limit and pull > limit else (tensors, weight)


class DirectionScreen:
    """Leave out each update with ⟨Δ_k, m⟩ ≤ 0, m the coordinate-wise median of the round's Δ
    (a reference half the round can lie about without moving it); on with ``enabled``.

    Why: a bounded update still chooses its direction, and one sent against the fleet (a sign
    flip) cancels an honest one. Non-IID honest updates agree with the median less than IID ones
    but rarely oppose it. A round of fewer than three updates has no majority to define m, and a
    round the screen would empty (or whose median is zero) is kept whole."""

    MIN_UPDATES = 3

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)

    def apply(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]) -> tuple[list[Update], int]:
        """(the updates kept, how many were left out)."""
        keep = self.kept(current, updates)
        return [u for u, kept in zip(updates, keep) if kept], int((~keep).sum())

    def kept(self, current: Mapping[str, np.ndarray], updates: Sequence[Update]) -> np.ndarray:
        """Which of ``updates`` the screen keeps (a bool per update)."""
        everything = np.ones(len(updates), dtype=bool)
        if not self.enabled or len(updates) < self.MIN_UPDATES:
            return everything
        deltas = _deltas(current, updates)[1]
        keep = deltas @ np.median(deltas, axis=0) > 0
        return keep if keep.any() else everything


class RobustAggregation:
    """A round's updates through the norm bound, the weight bound, the contribution bound and the
    direction screen, then the rule; each layer is a function of the round's set of updates (and,
    in a round of fewer than three, of the reference a :class:`SmallRoundReference` holds)."""

    def __init__(self, rule: RobustRule, bound: NormBound, contribution: ContributionBound | None = None,
                 screen: DirectionScreen | None = None, weight: WeightBound | None = None):
        self.rule, self.bound = rule, bound
        self.weight = weight or WeightBound(0.0)
        self.contribution = contribution or ContributionBound(0.0)
        self.screen = screen or DirectionScreen(False)

    def bound_layers(self) -> list[BoundLayer]:
        """The per-update bound layers that are on, in the order they apply (what shards and LADD's
        small clusters apply one update at a time)."""
        return [layer for layer in (self.bound, self.weight, self.contribution) if layer.multiplier]

    def aggregate(self, current: Mapping[str, np.ndarray], updates: Sequence[Update],
                  reference: SmallRoundReference | None = None) -> tuple[Params | None, dict]:
        """(the combined tensors, or None when the round has too few updates for the rule or is a
        round of one that ``reference`` holds; a report)."""
        return self.aggregate_measured(current, updates, reference)[:2]

    def aggregate_measured(self, current: Mapping[str, np.ndarray], updates: Sequence[Update],
                           reference: SmallRoundReference | None = None
                           ) -> tuple[Params | None, dict, tuple[tuple[float, ...], list | None]]:
        """:meth:`aggregate`'s answer and what the round's close gives ``reference.observe``: the
        limits of the bound layers that are on and, in a small round, each update's statistics
        (a tuple per update, in the order given; None otherwise)."""
        report = {"rule": self.rule.name, "updates": len(updates)}
        weighted, counts, measured = self._bounded(current, updates, reference)
        if len(updates) < self.rule.min_updates():
            return None, {**report, "skipped": f"{self.rule.name} needs at least {self.rule.min_updates()} updates"}, \
                measured
        if reference is not None and reference.holds(len(updates)):
            return None, {**report, "skipped": reference.HELD}, measured
        keep = self._screened(current, weighted)
        kept = [u for u, k in zip(weighted, keep) if k]
        return self.rule.combine(kept), {**report, **counts, "screened": int((~keep).sum())}, measured

    def kept(self, current: Mapping[str, np.ndarray], updates: Sequence[Update],
             reference: SmallRoundReference | None = None) -> np.ndarray:
        """Which of ``updates`` reach the rule (a bool per update): what else a round sums of its
        devices (Scaffold's Δc) follows, so a screened device moves nothing of the round."""
        if len(updates) < self.rule.min_updates() or (reference is not None and reference.holds(len(updates))):
            return np.zeros(len(updates), dtype=bool)
        return self._screened(current, self._bounded(current, updates, reference)[0])

    def _bounded(self, current, updates: Sequence[Update], reference: SmallRoundReference | None = None
                 ) -> tuple[list[Update], dict, tuple[tuple[float, ...], list | None]]:
        if reference is None or not reference.small(len(updates)):
            bounded, scaled, norm_limit = self.bound.apply_limited(current, updates)
            capped, weight_capped, weight_limit = self.weight.apply_limited(current, bounded)
            weighted, lowered, pull_limit = self.contribution.apply_limited(current, capped)
            limits = tuple(limit for layer, limit in ((self.bound, norm_limit), (self.weight, weight_limit),
                                                      (self.contribution, pull_limit)) if layer.multiplier)
            return weighted, {"norm_bounded": scaled, "weight_capped": weight_capped, "weight_bounded": lowered}, \
                (limits, None)
        # a small round: each layer's limit also within the reference's, one update at a time as
        # the canonical sums bound them (aggregator/shards/fedavg_sums.py)
        x, bounded = flatten(current), list(updates)
        counts = {"norm_bounded": 0, "weight_capped": 0, "weight_bounded": 0}
        limits, statistics = [], [[] for _ in updates]
        for i, layer in enumerate(self.bound_layers()):
            values = [layer.statistic(x, t, w) for t, w in bounded]
            limit = reference.limit(i, layer.limit(values), len(updates))
            counts[layer.REPORTED] = sum(1 for v in values if limit and v > limit)
            bounded = [layer.bound_one(x, t, w, limit) for t, w in bounded]
            limits.append(limit)
            for row, value in zip(statistics, values):
                row.append(value)
        return bounded, counts, (tuple(limits), [tuple(row) for row in statistics])

    def _screened(self, current, weighted: Sequence[Update]) -> np.ndarray:
        keep = self.screen.kept(current, weighted)
        if keep.sum() < self.rule.min_updates():     # the rule's guarantee needs its updates: screen none
            return np.ones(len(weighted), dtype=bool)
        return keep


class RoundHistory:
    """Server momentum on the combined step (0: off): with a_t = x̄_t − x_t the round's combined
    step, s_1 = a_1 and s_t = β s_{t−1} + (1 − β) a_t; the model moves to x_t + s_t.

    Why (Karimireddy, He & Jaggi 2021, "Learning from history"): what one round's updates do to
    the model is bounded by 1 − β of their step now; the rest comes in over the next rounds,
    when other devices' updates, computed at the moved model, answer it. On the non-IID demo
    fleet it also damps FedAvg's round-to-round swings (an honest gain). The first round moves
    as FedAvg does, s_1 = a_1 (FedAvgM's start from zero, s_1 = (1 − β) a_1, measured worse on
    bench/robustness.py: sign flipping −3.5 points instead of −1.2 over its seeds 0–9).
    The state is s: the job checkpoints it (key ``history.step``) and restores it on resume."""

    KEY = "history.step"

    def __init__(self, momentum: float):
        if not (0 <= momentum < 1):
            raise ValueError(f"the history momentum must lie in [0, 1), got {momentum}")
        self.momentum = momentum
        self.smoothed: np.ndarray | None = None

    def step(self, current: Mapping[str, np.ndarray], combined: Params) -> Params:
        """The tensors to move to: ``combined`` itself when off, else x_t + s_t."""
        if not self.momentum:
            return combined
        x = flatten({k: current[k] for k in combined})
        a = flatten(combined) - x
        self.smoothed = a if self.smoothed is None else self.momentum * self.smoothed + (1 - self.momentum) * a
        return _unflatten(x + self.smoothed, combined)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {} if self.smoothed is None else {self.KEY: self.smoothed.copy()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Back to a checkpoint (one taken before the first step, or before the history existed, has none)."""
        self.smoothed = np.array(state[self.KEY], dtype=np.float64) if self.KEY in state else None


def check_group_mean(sums: Mapping[str, np.ndarray], n: int, members: int, max_samples: int,
                     max_abs_param: float) -> None:
    """ValueError unless a secure group's Σ n_k θ_k and Σ n_k are what its members can send with the
    bounds every device checks before it masks (1 ≤ n_k ≤ max_samples, |θ_k| ≤ max_abs_param entry
    by entry): members ≤ n ≤ members × max_samples, and the mean Σ n_k θ_k / n, a convex combination
    of the θ_k, within max_abs_param. Always on: without it one member could put a negative count in
    its count slot (within the fixed-point bound) so that Σ n_k is 1 and the mean is the weighted sum
    itself. What a member inside these bounds can still do is in docs/secure-aggregation.md."""
    if not members <= n <= members * max_samples:
        raise ValueError(f"the group's Σ n_k = {n} is outside [{members}, {members} members x {max_samples}]")
    largest = max((float(np.abs(s).max()) for s in sums.values() if s.size), default=0.0) / n
    if largest > max_abs_param * (1 + 1e-6) + 1e-9:           # the fixed-point sum's rounding, over n
        raise ValueError(f"the group's mean has an entry of {largest:.4g}, beyond max_abs_param {max_abs_param:g}")


def check_dp_group_sum(sums: Mapping[str, np.ndarray], n: int, members: int, bound: float) -> None:
    """ValueError unless a distributed-DP group's sum is what its members can send: each sends its
    clipped update plus its noise share, every entry within the round's per-entry ``bound`` (the
    encoder refuses others), and an un-noised weight of 1: so the weight is ``members`` and no entry
    of the sum passes members × bound."""
    largest = max((float(np.abs(s).max()) for s in sums.values() if s.size), default=0.0)
    if n != members or largest > members * bound * (1 + 1e-6):
        raise ValueError(f"a DP group of {members} sent a weight of {n} and an entry of {largest:.4g} "
                         f"(each member's entries within {bound:.4g})")


def check_weighted_group_sum(sums: Mapping[str, np.ndarray], n: int, current: Mapping[str, np.ndarray],
                             members: int, clip_norm: float, max_samples: int) -> None:
    """ValueError unless a secure group's Σ n_k θ_k is what members who clipped ‖θ_k − x_t‖ ≤ C can
    send: n ≤ members × max_samples and ‖Σ n_k θ_k − n·x_t‖ = ‖Σ n_k Δ_k‖ ≤ Σ n_k C = n·C. The
    server sees the sum only: what a member inside the bound can still do is in docs/secure-aggregation.md."""
    if n > members * max_samples:
        raise ValueError(f"the group claims {n} samples, more than {members} members x {max_samples}")
    norm = float(np.linalg.norm(flatten(sums) - n * flatten(current)))
    if norm > n * clip_norm * (1 + 1e-5) + 1e-4:        # the fixed-point sum's rounding
        raise ValueError(f"‖Σ n_k Δ_k‖ = {norm:.4g} exceeds n·C = {n * clip_norm:.4g} (n={n}, C={clip_norm})")
