"""Robust FedAvg's aggregation rules (issue #26) against plain numpy references on fixed inputs: the
mean, the coordinate-wise median, the trimmed mean, Krum and Multi-Krum, centered clipping (which
bounds an outlier, is FedAvg bit for bit when every update is within its radius, and keeps
iterating after an unclipped step)."""

import numpy as np
import pytest

from aggregator.strategies.robust_fedavg import CenteredClipping, CoordinateMedian, Krum, Mean, TrimmedMean

from robust_fedavg_reference import as_matrix, assert_params, fixed_updates


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
