"""Central DP noise on an integer grid (``aggregator/strategies/dp_noise.py``: the floating-point
attack on Gaussian samplers, Mironov 2012, Jin et al. 2022, and the grid that closes it).

Every release of DP-FedAvg (its sum and adaptive clipping's count), DP Fed3R and its feature
center is g·(round(x/g) + round(σ(1 + 2^-20)/g · Z)), g the largest power of two with
g√d ≤ Δ·2^-20. The references here compute g by their own loop over powers of two.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from scipy import stats

from aggregator.strategies.dp_center import PrivateFeatureCenter
from aggregator.strategies.dp_fed3r import CalibratedSSP, Fed3RSensitivity, NoisyFed3R, UniformGaussian
from aggregator.strategies.dp_fedavg import AdaptiveClipNorm, ClippedGaussianSum, FixedClipNorm
from aggregator.strategies.dp_noise import CryptographicNoise, SeededNoise
from protocols.payloads.fed3r import Fed3RStats

MARGIN = 2.0 ** -20


def grid_of(sensitivity: float, entries: int) -> float:
    """The largest power of two g with g·√entries ≤ sensitivity·2^-20 (a loop, not frexp)."""
    bound, g = sensitivity * MARGIN / math.sqrt(entries), 1.0
    while g > bound:
        g /= 2.0
    while 2.0 * g <= bound:
        g *= 2.0
    return g


def on_grid(values: np.ndarray, grid) -> bool:
    return bool(np.all(np.fmod(values, grid) == 0.0))


class FixedNormals:
    """A noise source whose standard normals are given: the test knows every Z the mechanism drew."""

    def __init__(self, normals: np.ndarray):
        self.normals, self.used = np.asarray(normals, dtype=np.float64), 0

    def normal(self, loc=0.0, scale=1.0, size=None):
        count = 1 if size is None else int(np.prod(size))
        z = self.normals[self.used:self.used + count]
        self.used += count
        draws = loc + scale * z
        return float(draws[0]) if size is None else draws.reshape(size)


def fedavg_sum(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(6, 7)), "b": rng.normal(size=6)}


def fed3r_stats(p: int, C: int, n: int, seed: int) -> Fed3RStats:
    rng = np.random.default_rng(seed)
    Z = rng.normal(size=(n, p))
    Y = np.eye(C)[rng.integers(0, C, n)]
    return Fed3RStats(n=n, p=p, a_upper=(Z.T @ Z)[np.triu_indices(p)], class_ids=np.arange(C), b=(Z.T @ Y).T)


def fed3r_release(mechanism, p: int, C: int, rng, stats_: Fed3RStats) -> NoisyFed3R:
    noisy = NoisyFed3R(C, p, 0.01, True, False, mechanism, rng=rng)
    noisy.add(stats_)
    noisy.release()
    return noisy


def fed3r_grids(mechanism, p: int, C: int):
    """(A's packed grid per entry, B's grid): each block's own sensitivity (Δ_A, Δ_A/√2 off the
    diagonal, Δ_B), d every entry of the release."""
    d = p * (p + 1) // 2 + p * C
    iu = np.triu_indices(p)
    sens = mechanism.sensitivity
    grid_a = np.where(iu[0] == iu[1], grid_of(sens.a, d), grid_of(sens.a / math.sqrt(2.0), d))
    return grid_a, grid_of(sens.b, d)


def test_every_released_entry_is_an_exact_multiple_of_its_grid():
    """DP-FedAvg's sum (all slots one release, d = 48), DP Fed3R's (per-block grids) and the
    feature center's: each entry an exact multiple of its grid (the old float sum was not)."""
    z, C = 1.1, 0.8
    mechanism = ClippedGaussianSum(z, FixedClipNorm(C), rng=SeededNoise(3))
    released = mechanism.release_total(fedavg_sum(0), C, 2, 3, 3)
    g = grid_of(C, 48)
    assert all(on_grid(v, g) for v in released.values())
    assert not all(on_grid(v, 2 * g) for v in released.values())      # the grid itself, not a coarser one

    p, classes = 12, 3
    for fed3r in (CalibratedSSP(1.5, Fed3RSensitivity.of(2, 3.0, True), 0.3),
                  UniformGaussian(1.5, Fed3RSensitivity.of(2, 3.0, True))):
        noisy = fed3r_release(fed3r, p, classes, SeededNoise(4), fed3r_stats(p, classes, 2, 1))
        grid_a, grid_b = fed3r_grids(fed3r, p, classes)
        assert on_grid(noisy.released.packed_upper(), grid_a) and on_grid(noisy.released.B.numpy(), grid_b)

    center = PrivateFeatureCenter(classes, p, 1.5, 2, 3.0)       # the released pair (Σ z, n), before the division
    center.add(fed3r_stats(p, classes, 2, 2))
    seen = []
    center.release_noised = lambda column, contributions: seen.append(column) or True
    center.release(SeededNoise(5))
    assert on_grid(seen[0], grid_of(2 * math.hypot(3.0, 1.0), p))


def test_values_in_the_same_grid_cell_give_bit_identical_releases_from_the_same_noise():
    """The attack: the old x + noise in float64 kept x's low-order bits (two x's a few ulps apart
    gave different releases from the same noise), which an observer could read. On the grid, x
    enters only through round(x/g): x and x + g/4 give the same bits."""
    z, C = 1.1, 0.8
    g = grid_of(C, 48)
    base = {k: np.round(v / g) * g for k, v in fedavg_sum(1).items()}           # cell centres
    nudged = {k: v + g / 4 for k, v in base.items()}
    one = ClippedGaussianSum(z, FixedClipNorm(C), rng=SeededNoise(9)).release_total(base, C, 1, 2, 2)
    two = ClippedGaussianSum(z, FixedClipNorm(C), rng=SeededNoise(9)).release_total(nudged, C, 1, 2, 2)
    for k in base:
        assert one[k].tobytes() == two[k].tobytes(), k

    p, classes = 10, 2
    fed3r = CalibratedSSP(2.0, Fed3RSensitivity.of(1, 2.0, True), 0.2)
    grid_a, grid_b = fed3r_grids(fed3r, p, classes)
    stats_ = fed3r_stats(p, classes, 1, 3)
    a_cells = np.round(stats_.a_upper / grid_a) * grid_a
    b_cells = np.round(stats_.b.T / grid_b) * grid_b                                # B is p × C in the sum
    releases = []
    for shift in (0.0, 0.25):
        moved = Fed3RStats(n=1, p=p, a_upper=a_cells + shift * grid_a, class_ids=np.arange(classes),
                           b=(b_cells + shift * grid_b).T)
        releases.append(fed3r_release(fed3r, p, classes, SeededNoise(2), moved).released)
    assert releases[0].packed_upper().tobytes() == releases[1].packed_upper().tobytes()
    assert releases[0].B.numpy().tobytes() == releases[1].B.numpy().tobytes()


def test_the_integer_noise_is_gaussian_of_the_stated_scale():
    """10^5 entries of zero released by DP-FedAvg: K = release/g are integers, and K·g is
    N(0, (zC(1 + 2^-20))²) — mean and variance within 4 standard errors, Kolmogorov–Smirnov against
    the normal's CDF (a fixed seed; 10 % off in scale fails it) — seeded and cryptographic alike."""
    z, C, d = 1.3, 0.7, 100_000
    g = grid_of(C, d)
    sigma = z * C * (1 + MARGIN)
    for source, seeded in ((SeededNoise(11), True), (CryptographicNoise(), False)):
        noise = ClippedGaussianSum(z, FixedClipNorm(C), rng=source).release_total(
            {"w": np.zeros(d)}, C, 0, 0, 1)["w"]
        steps = noise / g
        assert np.array_equal(steps, np.rint(steps))
        assert sigma / g > 1e8                                       # the integers are covered densely
        assert abs(noise.mean()) < 4 * sigma / math.sqrt(d)
        assert abs(noise.var() / sigma ** 2 - 1) < 4 * math.sqrt(2 / d)
        if seeded:
            assert stats.kstest(noise / sigma, "norm").pvalue > 1e-3
            assert stats.kstest(noise / (1.1 * sigma), "norm").pvalue < 1e-6


def test_the_noise_is_calibrated_for_the_rounding_inflated_sensitivity():
    """With Z known, each mechanism's noise is g·round(σ(1 + 2^-20)/g·Z) exactly: σ calibrated for
    Δ(1 + 2^-20), the rounded sum's sensitivity Δ + g√d, so z = σ/Δ stays the accountant's."""
    z, C = 1.1, 0.8
    Z = np.random.default_rng(0).normal(size=200)
    released = ClippedGaussianSum(z, FixedClipNorm(C), rng=FixedNormals(Z)).release_total(
        {"w": np.zeros((6, 7)), "b": np.zeros(6)}, C, 0, 0, 1)
    g = grid_of(C, 48)
    want = g * np.rint(z * C * (1 + MARGIN) / g * Z[:48])
    np.testing.assert_array_equal(np.r_[released["w"].ravel(), released["b"]], want)

    # adaptive clipping's count: sensitivity ½, one entry, σ_b (1 + 2^-20)
    clip = AdaptiveClipNorm(1.0, target_quantile=0.5, learning_rate=0.2, count_stddev=2.0)
    clip.observe(3, 4, expected=4, rng=FixedNormals(Z[:1]))
    g = grid_of(0.5, 1)
    count = g * (np.rint(1.0 / g) + np.rint(2.0 * (1 + MARGIN) / g * Z[0]))
    assert clip.value == math.exp(-0.2 * (count / 4 + 0.5 - 0.5))

    # DP Fed3R (ssp): per block, σ_i (1 + 2^-20) on each entry's own grid
    p, classes = 8, 2
    fed3r = CalibratedSSP(1.5, Fed3RSensitivity.of(2, 3.0, True), 0.3)
    d = p * (p + 1) // 2 + p * classes
    Z = np.random.default_rng(1).normal(size=d)
    zero = Fed3RStats(n=1, p=p, a_upper=np.zeros(d - p * classes), class_ids=np.arange(classes),
                      b=np.zeros((classes, p)))
    released = fed3r_release(fed3r, p, classes, FixedNormals(Z), zero).released
    grid_a, grid_b = fed3r_grids(fed3r, p, classes)
    iu = np.triu_indices(p)
    scale = fed3r.scale()
    sigma_a = np.where(iu[0] == iu[1], scale.a_diagonal, scale.a_off_diagonal)
    na = d - p * classes
    np.testing.assert_array_equal(released.packed_upper(), grid_a * np.rint(sigma_a * (1 + MARGIN) / grid_a * Z[:na]))
    np.testing.assert_array_equal(released.B.numpy().ravel(), grid_b * np.rint(scale.b * (1 + MARGIN) / grid_b * Z[na:]))
    # the rounding's extra sensitivity in noise units, √Σ(g_i/σ_i)², is within 2^-20 of the release's 1/z
    extra = math.sqrt(np.sum((grid_a / sigma_a) ** 2) + p * classes * (grid_b / scale.b) ** 2)
    assert extra <= MARGIN / scale.noise_multiplier(fed3r.sensitivity)


def test_a_sum_of_any_size_is_released_as_the_rounded_integer_n_plus_k():
    """A hostile review's finding: |x|/g ≥ 2^52 was refused (a ValueError), an outcome of x with no
    noise at all, and at a job's end (``dp_release`` "end") one every restart met again. x/g is exact
    at any size (g a power of two) and float64's n + K is the integer n + K correctly rounded, a
    function of that integer alone: the release is g·RN(n + K), here against Python's exact integers
    and its own correctly rounded int -> float, beyond 2^53 too."""
    z, C = 1.3, 1.0
    x = np.array([1e12, -3e15, 0.3, 2.0 ** 40 + 0.75])
    Z = np.random.default_rng(7).normal(size=x.size)
    mechanism = ClippedGaussianSum(z, FixedClipNorm(C), rng=FixedNormals(Z))
    released = mechanism.release_total({"w": x}, C, 0, 1, 1)["w"]
    assert mechanism.releases == 1
    g = grid_of(C, x.size)
    cells = [round(Fraction(float(v)) / Fraction(g)) for v in x]          # half to even, as np.rint
    steps = [int(k) for k in np.rint(z * C * (1 + MARGIN) / g * Z)]
    assert abs(cells[1]) > 2 ** 53                                         # rounded by float64 itself
    want = np.array([float(n + k) * g for n, k in zip(cells, steps)])
    assert released.tobytes() == want.tobytes()
