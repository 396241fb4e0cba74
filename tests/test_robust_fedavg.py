"""Robust FedAvg rules (issue #26) against plain numpy references on fixed inputs, their
conditions checked when a job is created, and the default norm bound leaving honest rounds exact."""

import numpy as np
import pytest

from aggregator.jobs.fedavg import FedAvgConfig
from aggregator.jobs.registry import build_job
from aggregator.strategies.robust_fedavg import (CenteredClipping, CoordinateMedian, DirectionScreen, InfluenceBound, Krum,
                                                 Mean, NormBound, TrimmedMean)


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
            r = row - v
            step += weight * r * min(1.0, tau / np.linalg.norm(r))
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


def test_the_defaults_equal_a_numpy_reference_of_norm_bound_influence_bound_and_direction_screen():
    """FedAvg(ψ)'s defaults, in numpy: Δ_k clipped to the median ‖Δ‖, then to the median n·‖Δ‖
    (n_k kept), then the updates whose cosine to the coordinate-wise median Δ is ≤ 0 left out,
    then the n-weighted mean. Two attackers: one sign-flipped, one with a huge claimed n."""
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 9, "init": "zeros"})
    rng = np.random.default_rng(7)
    base = rng.normal(size=8)
    ups = [(split(base + 0.5 * rng.normal(size=8)), int(rng.integers(5, 50))) for _ in range(7)]
    ups.append((split(-4 * base), 20))                               # sign flipped, scaled
    ups.append((split(base + 0.5 * rng.normal(size=8)), 100_000))    # claims a huge sample count
    job._updates = {f"d{i}": u for i, u in enumerate(ups)}
    combined, count, samples = job.round_mean()
    x, n = as_matrix(ups), np.array([w for _, w in ups], dtype=float)
    norms = np.linalg.norm(x, axis=1)               # the head starts at zero: Δ_k = θ_k
    x = x * np.minimum(1.0, np.median(norms) / norms)[:, None]
    pulls = n * np.linalg.norm(x, axis=1)
    x = x * np.minimum(1.0, np.median(pulls) / pulls)[:, None]
    ref = np.median(x, axis=0)
    keep = x @ ref > 0
    assert not keep[7] and keep[:7].all() and keep[8]                # the sign-flipped update is left out
    assert count == 9
    assert_params(combined, (n[keep, None] * x[keep]).sum(0) / n[keep].sum())
    # the huge claim pulls no harder than the round's median pull
    assert n[8] * np.linalg.norm(x[8]) == pytest.approx(np.median(n * np.linalg.norm(
        as_matrix(ups) * np.minimum(1.0, np.median(norms) / norms)[:, None], axis=1)), rel=1e-12)


def test_influence_bound_and_direction_screen_alone():
    current = {"weight": np.zeros((2, 3)), "bias": np.zeros(2)}
    ups = fixed_updates()
    bounded, scaled = InfluenceBound(2.0).apply(current, ups)
    pulls = np.array([w for _, w in ups]) * np.linalg.norm(as_matrix(ups), axis=1)
    assert scaled == int((pulls > 2.0 * np.median(pulls)).sum())
    got = np.array([w for _, w in bounded]) * np.linalg.norm(as_matrix(bounded), axis=1)
    np.testing.assert_allclose(got, np.minimum(pulls, 2.0 * np.median(pulls)), rtol=1e-12)
    assert InfluenceBound(0.0).apply(current, ups) == (ups, 0)
    kept, dropped = DirectionScreen().apply(current, ups)
    ref = np.median(as_matrix(ups), axis=0)
    want = [u for u, row in zip(ups, as_matrix(ups)) if row @ ref > 0]
    assert dropped == len(ups) - len(want) and [id(u[0]) for u in kept] == [id(u[0]) for u in want]
    with pytest.raises(ValueError):
        InfluenceBound(0.5)


def test_an_honest_round_that_agrees_averages_exactly_as_fedavg():
    """Updates of one norm, one sample count and one general direction (a few small coordinates'
    signs flipped per device) are within every default bound: passed through untouched, their
    mean is FedAvg's bit for bit."""
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros"})
    rng = np.random.default_rng(4)
    v = np.array([3.0, -2.5, 4.0, 2.0, -3.5, 0.1, -0.2, 0.15])
    ups = [(split(v * np.r_[np.ones(5), rng.choice([-1.0, 1.0], size=3)]), 12) for _ in range(7)]
    job._updates = {f"d{i}": u for i, u in enumerate(ups)}
    combined, count, samples = job.round_mean()
    want = Mean().combine([job._updates[d] for d in sorted(job._updates)])
    assert count == 7 and all(np.array_equal(combined[k], want[k]) for k in want)


def test_with_only_the_norm_bound_a_round_whose_norms_agree_averages_exactly_as_fedavg():
    """Updates of one norm (one vector, its coordinates' signs flipped per device) are all within
    the norm bound: passed through untouched, their mean is FedAvg's bit for bit."""
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros",
                               "influence_bound_multiplier": 0.0, "direction_screen": False})
    rng = np.random.default_rng(4)
    v = rng.normal(size=8)
    ups = [(split(v * rng.choice([-1.0, 1.0], size=8)), int(rng.integers(1, 50))) for _ in range(7)]
    job._updates = {f"d{i}": u for i, u in enumerate(ups)}
    combined, count, samples = job.round_mean()
    want = Mean().combine([job._updates[d] for d in sorted(job._updates)])
    assert count == 7 and all(np.array_equal(combined[k], want[k]) for k in want)


@pytest.mark.parametrize("bad", [{"aggregator": "krum", "krum_byzantine": 3},          # 7 < 2·3 + 3
                                 {"aggregator": "multi_krum", "clients_per_round": 4},
                                 {"aggregator": "nope"}, {"norm_bound_multiplier": 0.5},
                                 {"aggregator": "median", "dp_noise_multiplier": 1.0}])
def test_a_rule_whose_condition_fails_is_refused_when_the_job_is_created(bad):
    with pytest.raises(ValueError):
        build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, **bad})
    assert FedAvgConfig(clients_per_round=5, aggregator="krum", krum_byzantine=1).aggregator == "krum"


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
