"""Robust FedAvg's bounding layers (issue #26) against plain numpy references on fixed inputs: the
norm bound (and the 1x bound at the round's median norm), the contribution bound, the direction
screen and the weight bound, each acting only on what exceeds it, and their statistics in a round
of two updates."""

import numpy as np
import pytest

from aggregator.jobs.registry import build_job
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.strategies.robust_fedavg import (ContributionBound, DirectionScreen, Mean, NormBound,
                                                 RobustAggregation, WeightBound, typical)

from robust_fedavg_reference import (NORM_BOUND_ONLY, as_matrix, assert_params, contribution_bound_reference,
                                     fixed_updates, split)


def test_norm_bound_scales_only_what_exceeds_the_multiple_of_the_median():
    current = {"weight": np.zeros((2, 3)), "bias": np.zeros(2)}
    ups = fixed_updates()
    ups[0] = ({k: 50 * v for k, v in ups[0][0].items()}, ups[0][1])
    bounded, scaled = NormBound(3.0).apply(current, ups)
    norms = np.linalg.norm(as_matrix(ups), axis=1)
    limit = 3.0 * np.median(norms)
    assert scaled == int((norms > limit).sum()) == 1
    assert np.linalg.norm(as_matrix(bounded)[0]) == pytest.approx(limit, rel=1e-12)
    for (got, _), (want, _) in zip(bounded[1:], ups[1:]):
        assert all(got[k] is want[k] for k in want)       # untouched: the same arrays, the same bits


def test_the_1x_bound_clips_each_update_to_the_rounds_median_norm():
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros",
                               **NORM_BOUND_ONLY})
    ups = fixed_updates()
    job._updates = {f"d{i}": u for i, u in enumerate(ups)}
    combined, count, samples = job.round_mean()
    x, n = as_matrix(ups), np.array([w for _, w in ups], dtype=float)
    norms = np.linalg.norm(x, axis=1)               # the head starts at zero: Δ_k = θ_k
    clipped = x * np.minimum(1.0, np.median(norms) / norms)[:, None]
    assert count == 7
    assert_params(combined, (n[:, None] * clipped).sum(0) / n.sum())


def test_an_honest_round_whose_norms_agree_averages_exactly_as_fedavg_under_the_1x_bound():
    """Updates of one norm (one vector, its coordinates' signs flipped per device) are all within
    the 1x bound: passed through untouched, their mean is FedAvg's bit for bit (the plain mean's
    job, summing in the same canonical order) and the weighted mean (numpy's, to rounding)."""
    config = {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros"}
    job, plain = build_job("fedavg", {**config, **NORM_BOUND_ONLY}), build_job("fedavg", {**config, **PLAIN_MEAN})
    rng = np.random.default_rng(4)
    v = rng.normal(size=8)
    ups = [(split(v * rng.choice([-1.0, 1.0], size=8)), int(rng.integers(1, 50))) for _ in range(7)]
    job._updates = plain._updates = {f"d{i}": u for i, u in enumerate(ups)}
    combined, count, samples = job.round_mean()
    want = plain.round_mean()[0]
    assert count == 7 and all(np.array_equal(combined[k], want[k]) for k in want)
    n = np.array([w for _, w in ups], dtype=float)
    assert_params(combined, (n[:, None] * as_matrix(ups)).sum(0) / n.sum())


def test_contribution_bound_lowers_only_the_weights_above_the_multiple_of_the_median_pull():
    current = {"weight": np.zeros((2, 3)), "bias": np.zeros(2)}
    ups = fixed_updates()
    got, lowered = ContributionBound(0.5).apply(current, ups)
    want = contribution_bound_reference(as_matrix(ups), [n for _, n in ups], 0.5)
    np.testing.assert_allclose([w for _, w in got], want, rtol=1e-12)
    assert lowered == int((want < [n for _, n in ups]).sum()) > 0
    assert all(g is u for (g, _), (u, _) in zip(got, ups))          # the tensors are untouched
    for (_, w), (_, n) in zip(got, ups):            # a weight within the bound stays the count (FedAvg's int)
        assert (type(w) is int and w == n) or w < n


def test_direction_screen_leaves_out_what_opposes_the_coordinate_wise_median():
    current = {"weight": np.full((2, 3), 0.5), "bias": np.full(2, -0.5)}
    ups = fixed_updates()
    x = as_matrix(ups) - as_matrix([(current, 1)])[0]
    opposed = x @ np.median(x, axis=0) <= 0
    assert 0 < opposed.sum() < len(ups)
    kept, screened = DirectionScreen(True).apply(current, ups)
    assert screened == opposed.sum() and [u for u, o in zip(ups, opposed) if not o] == kept
    assert DirectionScreen(False).apply(current, ups) == (ups, 0)
    assert DirectionScreen(True).apply(current, ups[:2]) == (ups[:2], 0)        # no majority to define it


def test_weight_bound_caps_claims_at_a_multiple_of_the_median_weight():
    """A device claiming n = 10^9 with an update a hair from the model passes the norm bound, the
    contribution bound and the direction screen, and held the weighted mean still; capped at twice
    the median weight, the honest devices' step survives (against numpy)."""
    rng = np.random.default_rng(4)
    current = {"w": np.zeros(6)}
    honest = [({"w": rng.normal(1.0, 0.3, 6)}, float(n)) for n in (40, 60, 50, 45)]
    attacker = ({"w": 1e-9 * honest[0][0]["w"]}, 1e9)
    updates = honest + [attacker]
    bounded, capped = WeightBound(2.0).apply(current, updates)
    assert capped == 1 and [w for _, w in bounded] == [40.0, 60.0, 50.0, 45.0, 2.0 * 50.0]
    plain = RobustAggregation(Mean(), NormBound(0.0))
    guarded = RobustAggregation(Mean(), NormBound(1.0), ContributionBound(0.5), DirectionScreen(True), WeightBound(2.0))
    honest_step = np.linalg.norm(plain.aggregate(current, honest)[0]["w"])
    frozen = np.linalg.norm(RobustAggregation(Mean(), NormBound(1.0), ContributionBound(0.5),
                                              DirectionScreen(True)).aggregate(current, updates)[0]["w"])
    kept, report = guarded.aggregate(current, updates)
    assert frozen < 1e-3 * honest_step                       # what the attack did without the bound
    assert np.linalg.norm(kept["w"]) > 0.4 * honest_step and report["weight_capped"] == 1
    assert WeightBound(0.0).apply(current, updates) == (updates, 0)


def test_a_round_of_two_updates_is_bounded_by_the_smaller_ones_statistics():
    """A review's finding: the bounds multiplied np.median, which for two values is their mean, so a
    round of two updates (clients_per_round 2, or two survivors) bounded nothing: a claim of
    n = 10^9 beside an honest 20 set the weight cap at 10^9 and froze the model, and a huge Δ set
    its own norm bound. Each bound now multiplies the lower middle value (numpy: the sorted
    statistics' element (k - 1) // 2). In a round of two the bounds cannot tell which device is
    honest, so the smaller value bounds both: a near-zero update stalls such a round (the norm
    bound scales the other's step down to its own), but no device steers it."""
    rng = np.random.default_rng(7)
    current = {"w": np.zeros(6)}
    honest = ({"w": rng.normal(1.0, 0.3, 6)}, 20.0)
    frozen = ({"w": 1e-9 * honest[0]["w"]}, 1e9)
    bounded, capped = WeightBound(2.0).apply(current, [honest, frozen])
    assert capped == 1 and [w for _, w in bounded] == [20.0, 2.0 * 20.0]
    kept, _ = RobustAggregation(Mean(), NormBound(0.0), weight=WeightBound(2.0)).aggregate(current, [honest, frozen])
    want = (20.0 * honest[0]["w"] + 40.0 * frozen[0]["w"]) / 60.0       # the two at their bounded weights
    np.testing.assert_allclose(kept["w"], want, rtol=1e-12)
    pushed = ({"w": 1e6 * honest[0]["w"]}, 20.0)
    bounded, scaled = NormBound(1.0).apply(current, [honest, pushed])
    assert scaled == 1
    assert np.linalg.norm(bounded[1][0]["w"]) == pytest.approx(np.linalg.norm(honest[0]["w"]), rel=1e-12)
    pulls = np.array([20.0, 20.0 * 1e6]) * np.linalg.norm(honest[0]["w"])
    got, lowered = ContributionBound(0.5).apply(current, [honest, pushed])
    assert lowered == 2 and [w for _, w in got] == pytest.approx(list(20.0 * np.minimum(1.0, 0.5 * pulls[0] / pulls)))
    for values in ([3.0], [5.0, 1.0], [4.0, 1.0, 3.0], [4.0, 1.0, 3.0, 2.0]):
        assert typical(values) == np.sort(values)[(len(values) - 1) // 2]
