"""Robust FedAvg rules and layers (issue #26) against plain numpy references on fixed inputs,
their conditions checked when a job is created, the default pipeline (norm bound, contribution
bound, direction screen, mean, round history) as one numpy reference over rounds, and the
history surviving a checkpoint."""

import numpy as np
import pytest

from aggregator.jobs.fedavg import FedAvgConfig
from aggregator.jobs.registry import build_job
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.strategies.robust_fedavg import (CenteredClipping, ContributionBound, CoordinateMedian, DirectionScreen,
                                                 Krum, Mean, NormBound, RobustAggregation, RoundHistory, TrimmedMean,
                                                 WeightBound, typical)
from protocols.rounds import RoundClosed

NORM_BOUND_ONLY = {**PLAIN_MEAN, "norm_bound_multiplier": 1.0}


def fixed_updates(m=7, seed=3):
    rng = np.random.default_rng(seed)
    return [({"weight": rng.normal(size=(2, 3)), "bias": rng.normal(size=2)}, int(rng.integers(1, 50)))
            for _ in range(m)]


def as_matrix(updates):
    """Rows: each update as [bias, weight.ravel()] (tensor names sorted, as the rules flatten)."""
    return np.stack([np.concatenate([t["bias"].ravel(), t["weight"].ravel()]) for t, _ in updates])


def split(vector):
    return {"bias": vector[:2], "weight": vector[2:].reshape(2, 3)}


def assert_params(got, want_vector):
    want = split(want_vector)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-15)


def test_mean_median_and_trimmed_mean_equal_numpy():
    ups = fixed_updates()
    x, n = as_matrix(ups), np.array([w for _, w in ups], dtype=float)
    assert_params(Mean().combine(ups), (n[:, None] * x).sum(0) / n.sum())
    assert_params(CoordinateMedian().combine(ups), np.median(x, axis=0))
    k = 1                                    # ⌊0.2 · 7⌋ per end
    srt = np.sort(x, axis=0)
    assert_params(TrimmedMean(0.2).combine(ups), srt[k:len(x) - k].mean(0))


def krum_reference(x, f, select):
    m = len(x)
    scores = []
    for i in range(m):
        d = sorted(float(((x[i] - x[j]) ** 2).sum()) for j in range(m) if j != i)
        scores.append(sum(d[:m - f - 2]))
    return sorted(np.argsort(scores, kind="stable")[:select])


@pytest.mark.parametrize("select", [1, 3])
def test_krum_and_multi_krum_equal_the_reference_and_drop_an_outlier(select):
    ups = fixed_updates()
    ups[4] = ({"weight": ups[4][0]["weight"] + 100.0, "bias": ups[4][0]["bias"]}, ups[4][1])
    x, n = as_matrix(ups), np.array([w for _, w in ups], dtype=float)
    chosen = krum_reference(x, 2, select)
    assert Krum(2, select).chosen(ups) == chosen and 4 not in chosen
    assert_params(Krum(2, select).combine(ups), (n[chosen, None] * x[chosen]).sum(0) / n[chosen].sum())


def centered_clipping_reference(x, n, radius_multiplier, iterations):
    """Karimireddy et al.'s iteration written out per update, from the coordinate-wise median."""
    v = np.median(x, axis=0)
    tau = radius_multiplier * np.median([np.linalg.norm(row - v) for row in x])
    for _ in range(iterations):
        step = np.zeros_like(v)
        for row, weight in zip(x, n / n.sum()):
            r, distance = row - v, np.linalg.norm(row - v)
            step += weight * r * (min(1.0, tau / distance) if distance > 0 else 1.0)
        v = v + step
    return v


@pytest.mark.parametrize("radius_multiplier, iterations", [(1.0, 1), (1.0, 3), (2.0, 5)])
def test_centered_clipping_equals_the_reference_and_bounds_an_outlier(radius_multiplier, iterations):
    ups = fixed_updates()
    ups[4] = ({"weight": ups[4][0]["weight"] - 100.0, "bias": ups[4][0]["bias"]}, ups[4][1])
    x, n = as_matrix(ups), np.array([w for _, w in ups], dtype=float)
    got = CenteredClipping(radius_multiplier, iterations).combine(ups)
    assert_params(got, centered_clipping_reference(x, n, radius_multiplier, iterations))
    honest = np.delete(x, 4, axis=0)
    honest_mean = (np.delete(n, 4)[:, None] * honest).sum(0) / np.delete(n, 4).sum()
    plain_mean = (n[:, None] * x).sum(0) / n.sum()
    moved = np.linalg.norm(as_matrix([(got, 1)])[0] - honest_mean)
    assert moved < np.linalg.norm(plain_mean - honest_mean) / 5        # the outlier no longer drags the result


def test_centered_clipping_with_everything_within_the_radius_is_fedavg_bit_for_bit():
    ups = fixed_updates()
    got = CenteredClipping(1e3, 3).combine(ups)
    want = Mean().combine(ups)
    assert all(np.array_equal(got[k], want[k]) for k in want)


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


# ---------------------------------------------------------------- FedAvg(ψ)'s default layers
def contribution_bound_reference(x, n, multiplier):
    """w_k = n_k · min(1, c·median_j(n_j‖x_j‖) / (n_k‖x_k‖)), written out per update (x: the Δ rows)."""
    pulls = [n_k * np.linalg.norm(row) for row, n_k in zip(x, n)]
    limit = multiplier * np.median(pulls)
    return np.array([n_k * min(1.0, limit / pull) for n_k, pull in zip(n, pulls)])


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


def default_pipeline_reference(x0, rounds, beta=0.7, contribution=0.5):
    """FedAvg(ψ)'s defaults written out in numpy: per round, clip Δ_k to the median norm, bound
    w_k·‖Δ_k‖ by contribution × its median, keep ⟨Δ_k, median Δ⟩ > 0, a = Σ w Δ / Σ w over those
    kept, s = a (first round) or β s + (1 − β) a, x ← x + s."""
    x, s = x0.astype(np.float64), None
    for ups in rounds:
        d = as_matrix(ups) - x
        norms = np.linalg.norm(d, axis=1)
        d = d * np.minimum(1.0, np.median(norms) / norms)[:, None]
        w = contribution_bound_reference(d, np.array([n for _, n in ups], dtype=float), contribution)
        keep = d @ np.median(d, axis=0) > 0
        a = (w[keep, None] * d[keep]).sum(0) / w[keep].sum()
        s = a if s is None else beta * s + (1 - beta) * a
        x = (x + s).astype(np.float32)         # the job keeps the head in float32
    return x


def job_rounds(job, rounds):
    for ups in rounds:
        job.next_participants({f"d{i}" for i in range(len(ups))})
        job._updates = {f"d{i}": u for i, u in enumerate(ups)}
        job.close_round(RoundClosed(job.round, tuple(job._updates), (), (), ()))


def outlier_rounds():
    """Three rounds of 7 updates; one device sends a large, sign-flipped update with a large count."""
    rounds = []
    for r in range(3):
        ups = fixed_updates(seed=10 + r)
        ups[2] = ({k: -8 * v for k, v in ups[2][0].items()}, 400)
        rounds.append(ups)
    return rounds


def test_the_default_pipeline_equals_the_numpy_reference_over_rounds():
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros", "rounds": 3})
    rounds = outlier_rounds()
    _, report = job.config.robust_aggregation().aggregate(job.params, rounds[0])
    assert report["norm_bounded"] and report["weight_bounded"] and report["screened"]    # every layer acts
    job_rounds(job, rounds)
    got = as_matrix([({"weight": job.params["weight"], "bias": job.params["bias"]}, 1)])[0]
    np.testing.assert_allclose(got, default_pipeline_reference(np.zeros(8), rounds), rtol=1e-5, atol=1e-6)


def test_the_round_history_survives_a_checkpoint():
    """A job resumed from round 2's checkpoint ends where the uninterrupted one does, bit for bit;
    without the history's state it would not."""
    cfg = {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros", "rounds": 3}
    rounds = outlier_rounds()
    whole, first = build_job("fedavg", cfg), build_job("fedavg", cfg)
    job_rounds(whole, rounds)
    job_rounds(first, rounds[:2])
    state = first.state_dict()
    assert "history.step" in state
    resumed, forgetful = build_job("fedavg", cfg), build_job("fedavg", cfg)
    resumed.load_state_dict(state)
    forgetful.load_state_dict({k: v for k, v in state.items() if not k.startswith("history.")})
    job_rounds(resumed, rounds[2:])
    job_rounds(forgetful, rounds[2:])
    assert all(np.array_equal(resumed.params[k], whole.params[k]) for k in whole.params)
    assert not np.array_equal(forgetful.params["weight"], whole.params["weight"])


def test_round_history_is_the_exponential_average_of_the_steps():
    history, x = RoundHistory(0.7), {"w": np.zeros(3)}
    steps = [np.array([1.0, 0.0, 2.0]), np.array([-1.0, 4.0, 0.0]), np.array([0.5, 0.5, 0.5])]
    want = steps[0]
    assert np.array_equal(history.step(x, {"w": steps[0]})["w"], want)
    for a in steps[1:]:
        want = 0.7 * want + 0.3 * a
        np.testing.assert_allclose(history.step(x, {"w": a})["w"], want, rtol=1e-15)
    combined = {"w": steps[0]}
    assert RoundHistory(0.0).step(x, combined) is combined and RoundHistory(0.0).state_dict() == {}     # off


@pytest.mark.parametrize("bad", [{"aggregator": "krum", "krum_byzantine": 3},          # 7 < 2·3 + 3
                                 {"aggregator": "multi_krum", "clients_per_round": 4},
                                 {"aggregator": "nope"}, {"norm_bound_multiplier": 0.5},
                                 {"contribution_bound_multiplier": -1.0}, {"history_momentum": 1.0},
                                 {"history_momentum": -0.1}, {"direction_screen": "yes"},
                                 {"small_round_reference": "yes"},
                                 {"aggregator": "median", "dp_noise_multiplier": 1.0}])
def test_a_rule_whose_condition_fails_is_refused_when_the_job_is_created(bad):
    with pytest.raises(ValueError):
        build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, **bad})
    assert FedAvgConfig(clients_per_round=5, aggregator="krum", krum_byzantine=1).aggregator == "krum"


@pytest.mark.parametrize("layer", [{"contribution_bound_multiplier": 0.5}, {"direction_screen": True}])
def test_the_plaintext_layers_are_off_and_refused_under_secure_aggregation(layer):
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig

    config = SecureFedAvgConfig()
    assert not (config.contribution_bound_multiplier or config.direction_screen or config.history_momentum)
    with pytest.raises(ValueError, match="plaintext"):
        SecureFedAvgConfig(**layer)


def test_a_secure_job_may_step_along_the_round_history_which_needs_only_the_rounds_sum():
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig

    assert SecureFedAvgConfig(history_momentum=0.7).round_history().momentum == 0.7
    with pytest.raises(ValueError, match="momentum"):
        SecureFedAvgConfig(history_momentum=1.0)


# ---------------------------------------------------------------- LADD: the rule within each cluster
def ladd_updates(seed=5):
    rng = np.random.default_rng(seed)
    return [(int(c), {"enc": rng.normal(size=4), "cls": rng.normal(size=(2, 2))}, int(rng.integers(1, 30)))
            for c in (0, 0, 1, 0, 1, 1, 0)]


def test_ladd_robust_mean_is_the_streaming_average_bit_for_bit():
    from aggregator.strategies.ladd import ClusterSpecificAveraging
    from aggregator.strategies.robust_fedavg import RobustAggregation
    from aggregator.strategies.robust_ladd import RobustClusterAveraging

    phi, thetas = {"enc": np.zeros(4)}, {0: {"cls": np.zeros((2, 2))}, 1: {"cls": np.zeros((2, 2))}}
    streaming, robust = (ClusterSpecificAveraging(lambda k: k == "cls"),
                         RobustClusterAveraging(lambda k: k == "cls", RobustAggregation(Mean(), NormBound(3.0))))
    for c, t, n in ladd_updates():
        streaming.add(c, t, n)
        robust.add(c, t, n)
    (p1, t1), (p2, t2) = streaming.result(phi, thetas), robust.result(phi, thetas)
    assert np.array_equal(p1["enc"], p2["enc"]) and all(np.array_equal(t1[c]["cls"], t2[c]["cls"]) for c in t1)
    assert robust.participants == streaming.participants == {0: 4, 1: 3}


def test_ladd_median_applies_within_each_cluster():
    from aggregator.strategies.robust_fedavg import RobustAggregation
    from aggregator.strategies.robust_ladd import RobustClusterAveraging

    ups = ladd_updates()
    robust = RobustClusterAveraging(lambda k: k == "cls", RobustAggregation(CoordinateMedian(), NormBound(0.0)))
    for c, t, n in ups:
        robust.add(c, t, n)
    phi, thetas = robust.result({"enc": np.zeros(4)}, {0: {"cls": np.zeros((2, 2))}, 1: {"cls": np.zeros((2, 2))}})
    np.testing.assert_array_equal(phi["enc"], np.median([t["enc"] for _, t, _ in ups], axis=0))
    for cluster in (0, 1):
        want = np.median([t["cls"] for c, t, _ in ups if c == cluster], axis=0)
        np.testing.assert_array_equal(thetas[cluster]["cls"], want)


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


def test_centered_clipping_keeps_iterating_after_an_unclipped_step():
    """A review's finding: the rule returned the weighted mean as soon as every update lay within τ
    of the current iterate, which is no fixed point when, from the mean, some lie beyond τ."""
    from aggregator.strategies.robust_fedavg import CenteredClipping

    x = np.array([[-1.0], [-1.0], [0.0], [1.0], [1.0]])
    n = np.array([1, 1, 1, 1, 10])
    ups = [({"w": row.copy()}, int(k)) for row, k in zip(x, n)]
    got = CenteredClipping(1.0, 3).combine(ups)["w"]
    want = centered_clipping_reference(x, n.astype(float), 1.0, 3)
    # the code returns the weighted mean 9/14 = 0.642857 after the first (unclipped) iteration;
    # the iteration itself continues to ~0.748 because from the mean two updates lie beyond τ = 1
    assert np.allclose(got, want, atol=1e-12), (got, want)


# ---------------------------------------------------------------- rounds of fewer than three updates
EVIL_SHIFT, EVIL_CLAIM = 1e5, 10 ** 9          # within the wire's 2^20, and a claimed count of 10^9


def lower_median(values):
    values = np.sort(np.asarray(values, dtype=np.float64))
    return values[(len(values) - 1) // 2]


def small_round_pipeline_reference(x0, rounds, beta=0.7, norm=1.0, weight=2.0, contribution=0.5, screen=True):
    """FedAvg(ψ)'s defaults in numpy with the small-round rule as docs/algorithms.md states it, the
    heads after each round. ``rounds``: per round, device -> (vector as ``as_matrix`` orders it, n).

    Per round of m updates: the norm limit (norm × lower median ‖Δ‖), the weight cap (weight ×
    lower median n), the pull limit (contribution × lower median w·‖Δ‖ after both), each, in a round
    of m < 3 with a reference all of whose limits are > 0, the smaller positive one of its own and
    the reference's; with m = 1 and no such reference nothing moves. A round of m >= 3 makes its
    limits the reference; a smaller one adds each device's (‖Δ‖, n, pull) to a pool (a device's
    latest), whose limits become the reference once it holds 3 devices. Then the screen (m >= 3),
    the weighted mean of what is kept and the history's momentum."""
    x, s, reference, pool, heads = x0.astype(np.float64), None, None, {}, []
    for updates in rounds:
        devices = sorted(updates)
        m = len(devices)
        usable = reference is not None and min(reference) > 0
        small = m < 3

        def limit(i, own):
            return (min(own, reference[i]) if own > 0 else reference[i]) if small and usable else own

        d = np.stack([updates[k][0] for k in devices]) - x
        n = np.array([updates[k][1] for k in devices], dtype=np.float64)
        norms = np.linalg.norm(d, axis=1)
        norm_limit = limit(0, norm * lower_median(norms))
        if norm_limit:
            d = d * np.minimum(1.0, norm_limit / norms)[:, None]
        weight_limit = limit(1, weight * lower_median(n))
        w = np.minimum(n, weight_limit)
        pulls = w * np.linalg.norm(d, axis=1)
        pull_limit = limit(2, contribution * lower_median(pulls))
        if pull_limit:
            w = np.where(pulls > pull_limit, w * pull_limit / pulls, w)
        held = small and m == 1 and not usable
        if not small:
            reference, pool = (norm_limit, weight_limit, pull_limit), {}
        else:
            pool.update({k: (norms[i], n[i], pulls[i]) for i, k in enumerate(devices)})
            if len(pool) >= 3:
                rows = np.array([pool[k] for k in sorted(pool)])
                pooled = (norm * lower_median(rows[:, 0]), weight * lower_median(rows[:, 1]),
                          contribution * lower_median(rows[:, 2]))
                reference = tuple(np.minimum(reference, pooled)) if usable else pooled
                pool = {}
        if not held:
            keep = d @ np.median(d, axis=0) > 0 if screen and m >= 3 else np.ones(m, dtype=bool)
            keep = keep if keep.any() else np.ones(m, dtype=bool)
            a = (w[keep, None] * d[keep]).sum(0) / w[keep].sum()
            s = a if s is None else beta * s + (1 - beta) * a
            x = (x + s).astype(np.float32)
        heads.append(np.array(x, dtype=np.float64))
    return heads


def head_vector(job):
    return as_matrix([({"weight": job.params["weight"], "bias": job.params["bias"]}, 1)])[0]


def play(job, rounds):
    """Close ``rounds`` (device -> (vector, n)) on ``job``; its head after each. An entry None is the
    attacker, whose vector is computed at the head it is given: every entry moved by EVIL_SHIFT."""
    heads = []
    for updates in rounds:
        job.next_participants(set(updates))
        x = head_vector(job)
        job._updates = {k: (split(x + EVIL_SHIFT if v is None else v[0]), EVIL_CLAIM if v is None else v[1])
                        for k, v in updates.items()}
        job.close_round(RoundClosed(job.round, tuple(sorted(updates)), (), (), ()))
        heads.append(head_vector(job))
    return heads


def honest_round(devices, seed):
    rng = np.random.default_rng(seed)
    return {d: (rng.normal(0.0, 0.1, size=8), int(rng.integers(10, 60))) for d in devices}


def resolved(rounds, heads_before):
    """``rounds`` with the attacker's vector as it sends it (at the head it was given)."""
    return [{k: ((x + EVIL_SHIFT, EVIL_CLAIM) if v is None else v) for k, v in updates.items()}
            for updates, x in zip(rounds, heads_before)]


FLEET = [f"h{i}" for i in range(5)]
SMALL_ROUND_SCENARIOS = {
    # the review's: the attacker is the only device online for the job's first round
    "alone first": [{"evil": None}] + [honest_round(FLEET, 20 + r) for r in range(3)],
    # alone in a later round, then with one honest device, honest rounds between
    "alone later": [honest_round(FLEET, 30), {"evil": None}, honest_round(FLEET, 31),
                    {"evil": None, **honest_round(["h0"], 32)}, honest_round(FLEET, 33)],
    # a review's finding: two attackers alone in a round each, then one honest device, made a pool of
    # three whose lower median was theirs, and the next lone round took it (pooled limits only tighten)
    "two alone, then one": [honest_round(FLEET, 50), {"evil": None}, {"evil2": None}, honest_round(["h1"], 51),
                            {"evil": None}, honest_round(FLEET, 52)],
}


def played_as_the_reference_says(job, rounds, screen: bool) -> list[np.ndarray]:
    """The job's heads over ``rounds``, each checked against the numpy pipeline's."""
    heads = play(job, rounds)
    want = small_round_pipeline_reference(np.zeros(8), resolved(rounds, [np.zeros(8)] + heads[:-1]), screen=screen)
    for got, expected in zip(heads, want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    return heads


@pytest.mark.parametrize("screen", [True, False], ids=["whole round", "canonical sums"])
@pytest.mark.parametrize("scenario", sorted(SMALL_ROUND_SCENARIOS))
def test_a_device_alone_in_a_round_is_bounded_by_the_reference_of_earlier_rounds(scenario, screen):
    """A review's finding: every bound is relative to the round's own median, which in a round of
    one update is that update's: a device alone in a round, its head moved by 10^5 with n = 10^9,
    moved the model by 10^5 and the history carried it on. Now such a round is bounded by the last
    full round's limits, and moves nothing before there are any (against numpy; the job's
    canonical-sums path with the screen off, the whole-round path with it on)."""
    rounds = SMALL_ROUND_SCENARIOS[scenario]
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 5, "init": "zeros",
                               "rounds": len(rounds), "direction_screen": screen})
    heads = played_as_the_reference_says(job, rounds, screen)
    honest_norms = [np.linalg.norm(v - x) for updates, x in zip(rounds, [np.zeros(8)] + heads[:-1])
                    for v, _ in (u for u in updates.values() if u is not None)]
    steps = np.linalg.norm(np.diff(np.stack([np.zeros(8)] + heads), axis=0), axis=1)
    assert steps.max() <= max(honest_norms)          # no round moved further than an honest update (10^5 before)
    if scenario == "alone first":
        assert steps[0] == 0                         # no reference yet: a round of one moves nothing


def test_a_job_of_one_device_a_round_moves_once_three_devices_have_answered():
    """κ = 1: a round of one update moves nothing until three distinct devices have answered (h0
    twice counts once); their statistics' lower medians are the reference then, and bound the
    attacker's round as any other (against numpy)."""
    rounds = [honest_round(["h0"], 40), honest_round(["h0"], 41), honest_round(["h1"], 42),
              honest_round(["h2"], 43), {"evil": None}, honest_round(["h1"], 44), honest_round(["h3"], 45)]
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 1, "init": "zeros",
                               "rounds": len(rounds), "direction_screen": False})
    heads = played_as_the_reference_says(job, rounds, screen=False)
    assert all(not h.any() for h in heads[:4]) and heads[4].any()
    assert np.abs(heads[4]).max() < 1.0              # the attacker's round: an honest-sized step


def test_rounds_of_three_or_more_updates_are_bit_for_bit_what_they_were():
    """The reference only bounds rounds of fewer than three updates: over rounds of 3, 5 and 7
    updates (an outlier among them) the heads are the same bits with it on and off, on both of the
    job's paths; with PLAIN_MEAN's layers off it has nothing to bound."""
    from aggregator.strategies.small_round_reference import SmallRoundReference

    rounds = [honest_round(FLEET[:3], 50), {**honest_round(FLEET, 51), "h4": (np.full(8, 30.0), 900)},
              honest_round([f"d{i}" for i in range(7)], 52), honest_round(FLEET[1:4], 53)]
    for base in ({}, {"direction_screen": False}, {"aggregator": "median"}, PLAIN_MEAN, NORM_BOUND_ONLY):
        config = {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros", "rounds": 4, **base}
        on = build_job("fedavg", {**config, "small_round_reference": True})
        off = build_job("fedavg", {**config, "small_round_reference": False})
        for got, want in zip(play(on, rounds), play(off, rounds)):
            assert got.tobytes() == want.tobytes(), base
        assert on.state_dict().keys() - off.state_dict().keys() <= {SmallRoundReference.LIMITS}


def test_the_reference_and_its_pool_survive_a_checkpoint():
    """Resumed from a checkpoint that holds the reference (or a pool of small rounds' statistics),
    a job bounds a later lone device's round as the uninterrupted one does, bit for bit; without
    them it holds that round instead."""
    from aggregator.strategies.small_round_reference import SmallRoundReference

    cases = {"reference": (1, [honest_round(FLEET, 60), {"evil": None}]),
             "pool": (2, [honest_round(["h0"], 62), honest_round(["h1"], 63),
                          {"evil": None, **honest_round(["h2"], 64)}, {"evil": None}])}
    for name, (at, rounds) in cases.items():
        config = {"num_classes": 2, "feature_dim": 3, "clients_per_round": 5, "init": "zeros",
                  "rounds": len(rounds), "direction_screen": False}
        whole, first = build_job("fedavg", config), build_job("fedavg", config)
        play(whole, rounds)
        play(first, rounds[:at])
        state = first.state_dict()
        assert (SmallRoundReference.LIMITS in state) == (name == "reference")
        assert (SmallRoundReference.POOL in state) == (name == "pool")
        resumed, forgetful = build_job("fedavg", config), build_job("fedavg", config)
        resumed.load_state_dict(state)
        forgetful.load_state_dict({k: v for k, v in state.items() if "bounds." not in k})
        resumed_heads, forgetful_heads = play(resumed, rounds[at:]), play(forgetful, rounds[at:])
        assert resumed.params["weight"].tobytes() == whole.params["weight"].tobytes(), name
        # the last round, the attacker's alone: bounded, or held without what the checkpoint held
        resumed_heads.insert(0, head_vector(first))
        forgetful_heads.insert(0, head_vector(first))
        assert (resumed_heads[-1] != resumed_heads[-2]).any(), name
        assert (forgetful_heads[-1] == forgetful_heads[-2]).all(), name


def test_the_small_round_reference_is_the_lower_median_of_three_devices_and_ignores_order():
    from aggregator.strategies.small_round_reference import SmallRoundReference

    layers = [NormBound(1.0), WeightBound(2.0)]
    reference = SmallRoundReference(True, layers)
    assert reference.holds(1) and not reference.holds(2) and not reference.small(3)
    reference.observe(1, (0.0, 0.0), {"a": (5.0, 10.0)})
    reference.observe(1, (0.0, 0.0), {"a": (1.0, 90.0)})            # a's latest counts, once
    reference.observe(1, (0.0, 0.0), {"b": (3.0, 20.0)})
    assert reference.limits is None and sorted(reference.pool) == ["a", "b"]
    other = SmallRoundReference(True, layers)
    other.load_state_dict(reference.state_dict())
    for r in (reference, other):
        r.observe(2, (0.0, 0.0), {"d": (8.0, 30.0), "c": (2.0, 40.0)})
    # sorted norms 1, 2, 3, 8 and counts 20, 30, 40, 90: the lower middle values 2 and 30
    assert reference.limits.tolist() == other.limits.tolist() == [2.0, 60.0] and not reference.pool
    assert reference.limit(0, 7.0, 1) == 2.0 and reference.limit(0, 1.5, 2) == 1.5 and reference.limit(0, 0.0, 2) == 2.0
    assert reference.limit(0, 7.0, 3) == 7.0                        # a round of three: its own
    reference.observe(4, (0.0, 5.0, 9.0), None)                     # a full round whose devices did not move
    assert reference.holds(1) and reference.limit(0, 7.0, 1) == 7.0
    assert not SmallRoundReference(False, layers).holds(1) and not SmallRoundReference(True, []).holds(1)


def test_the_small_round_reference_is_off_where_no_layer_acts():
    """Off under DP (its clipped, noised mean uses no bound layer) and with every layer off (LADD's:
    tests/test_ladd_small_rounds.py)."""
    assert FedAvgConfig().small_rounds().enabled
    assert not FedAvgConfig(dp_noise_multiplier=1.0).small_rounds().enabled
    assert not FedAvgConfig(**{**PLAIN_MEAN, "small_round_reference": True}).small_rounds().enabled
