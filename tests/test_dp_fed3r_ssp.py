"""DP Fed3R's mechanisms against independent references: the per-block noise of ``ssp`` (numpy
reference on fixed inputs with the noise seeded; χ² of each block's scale), its noise multiplier
against the worst device computed entry by entry, its ε against dp-accounting used directly, and
the job's choice of mechanism (central and under secure aggregation)."""

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp
from scipy import stats
from scipy.stats import norm
from ssp_reference import grid_tolerance, release_noise, spiked_wigner_shrinkage, ssp_weights

from aggregator.compute.privacy import PLD_DISCRETIZATION, PrivacyAccountant
from aggregator.jobs.registry import build_job
from aggregator.strategies.dp_fed3r import (CalibratedSSP, DistributedSSP, Fed3RSensitivity, NoisyFed3R,
                                            UniformGaussian)
from protocols.payloads.fed3r import Fed3RStats


def chi2_ok(noise: np.ndarray, stddev: float) -> bool:
    lo, hi = stats.chi2.ppf([1e-6, 1 - 1e-6], noise.size) / noise.size
    return lo < float(np.mean(noise ** 2)) / stddev ** 2 < hi


def statistics(p: int, C: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    Z = np.hstack([rng.normal(size=(n, p - 1)), np.ones((n, 1))])
    Y = np.eye(C)[rng.integers(0, C, n)]
    return Z.T @ Z, Z.T @ Y


def test_ssp_noise_per_block_has_its_stated_scale():
    p, C = 200, 10
    sens = Fed3RSensitivity.of(3, 2.0, True)
    scale = CalibratedSSP(1.5, sens, b_share=0.3).scale()
    assert scale.a_off_diagonal == pytest.approx(scale.a_diagonal / math.sqrt(2), rel=1e-15)
    packed, noise_b = scale.release(np.zeros(p * (p + 1) // 2), np.zeros((p, C)), sens, np.random.default_rng(3))
    iu = np.triu_indices(p)
    diagonal = iu[0] == iu[1]
    assert chi2_ok(packed[diagonal], scale.a_diagonal)
    assert chi2_ok(packed[~diagonal], scale.a_off_diagonal)
    assert chi2_ok(noise_b.ravel(), scale.b)
    # and no other scale passes: 10 % off is far outside the χ² interval at these sizes
    assert not chi2_ok(packed[~diagonal], 1.1 * scale.a_off_diagonal)


def test_ssp_release_and_solve_equal_a_numpy_reference():
    """Fixed sums, the noise seeded: the released sums and the model are what a plain numpy
    implementation of the mechanism gives (spiked-Wigner shrinkage, λ = max(λ_job, 2E/(3π)), column norms)."""
    p, C, n, lam = 40, 4, 300, 0.01
    A, B = statistics(p, C, n, 0)
    mechanism = CalibratedSSP(2.0, Fed3RSensitivity.of(1, 3.0, True), b_share=0.25)
    noisy = NoisyFed3R(C, p, lam, True, True, mechanism, rng=np.random.default_rng(7))
    noisy.add(Fed3RStats(n=n, p=p, a_upper=A[np.triu_indices(p)], class_ids=np.arange(C), b=B.T))
    noisy.release()
    model = noisy.solve()
    # the reference, from the stddevs of the docstring's formulas
    z, d_a, d_b, s = 2.0, 10.0, math.sqrt(10.0), 0.25
    sigma_a, sigma_b = z * d_a / math.sqrt(1 - s), z * d_b / math.sqrt(s)
    assert (mechanism.scale().a_diagonal, mechanism.scale().b) == pytest.approx((sigma_a, sigma_b), rel=1e-15)
    E, noise_b = release_noise(mechanism.scale(), p, C, np.random.default_rng(7))
    noisy_b = B + noise_b
    grid_a, grid_b = grid_tolerance(mechanism.sensitivity)
    np.testing.assert_allclose(noisy.released.A.numpy(), A + E, rtol=0, atol=grid_a)
    np.testing.assert_allclose(noisy.released.B.numpy(), noisy_b, rtol=0, atol=grid_b)
    # the solve of the released sums (just checked against the sums plus the reference noise)
    W = ssp_weights(noisy.released.A.numpy(), noisy.released.B.numpy(), sigma_a / math.sqrt(2), lam)
    norms = np.linalg.norm(W[:-1], axis=0)
    np.testing.assert_allclose(model.coef_, (W[:-1] / norms).T, rtol=1e-7, atol=1e-10)
    np.testing.assert_allclose(model.intercept_, W[-1] / norms, rtol=1e-7, atol=1e-10)


def planted(p: int, spikes: list[float], bulk: float, seed: int) -> np.ndarray:
    """A PSD matrix with the given eigenvalues in random directions and the rest ``bulk``."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(p, p)))
    values = np.full(p, bulk)
    values[:len(spikes)] = spikes
    return (q * values) @ q.T


def test_ssp_shrinkage_recovers_planted_spikes_and_beats_the_psd_projection():
    """Spiked Wigner: a direction holding θ = 3E/2 shows up near θ + E²/(4θ) in the noisy A; ssp maps
    it back to within 3 % of θ, and its denoised A is closer to the true A than the PSD projection."""
    p = 400
    mechanism = CalibratedSSP(1.0, Fed3RSensitivity.of(1, 1.0, True), 0.2)
    scale = mechanism.scale()
    edge = scale.spectral_edge(p)
    spikes = [3.0 * edge, 1.5 * edge]
    truth = planted(p, spikes, 0.05 * edge, seed=1)
    iu = np.triu_indices(p)
    noisy = np.zeros((p, p))
    noisy[iu] = scale.release(np.zeros(len(iu[0])), np.zeros((p, 2)), mechanism.sensitivity, np.random.default_rng(2))[0]
    noisy = truth + noisy + np.triu(noisy, 1).T
    raw_top = np.linalg.eigvalsh(noisy)[-2:][::-1]
    assert raw_top[1] > 1.5 * edge * 1.08                 # the noise pushed the weaker spike up (E²/(4θ) = E/6)
    denoised = mechanism.denoised(torch.from_numpy(noisy)).numpy()
    top = np.linalg.eigvalsh(denoised)[-2:][::-1]
    np.testing.assert_allclose(top, spikes, rtol=0.03)
    np.testing.assert_allclose(denoised, spiked_wigner_shrinkage(noisy, scale.a_off_diagonal), atol=1e-8)
    w, v = np.linalg.eigh(noisy)
    psd = (v * np.clip(w, 0, None)) @ v.T
    assert np.linalg.norm(denoised - truth) < 0.5 * np.linalg.norm(psd - truth)


def test_ssp_edge_and_lambda_grow_with_the_number_of_releases():
    """k releases of independent noise sum to √k times one's stddev: the job's solve after k rounds
    uses E√k (in the shrinkage and in λ), as the numpy reference does."""
    p, C, n, lam, k = 30, 3, 200, 0.01, 4
    A, B = statistics(p, C, n, 5)
    mechanism = CalibratedSSP(2.0, Fed3RSensitivity.of(1, 3.0, True), b_share=0.25)
    assert mechanism.regulariser(p, lam, k) == pytest.approx(2 * mechanism.regulariser(p, lam, 1), rel=1e-12)
    noisy = NoisyFed3R(C, p, lam, True, True, mechanism, rng=np.random.default_rng(9))
    iu = np.triu_indices(p)
    for _ in range(k):
        noisy.add(Fed3RStats(n=n, p=p, a_upper=A[iu] / k, class_ids=np.arange(C), b=B.T / k))
        noisy.release()
    assert noisy.releases == k
    model = noisy.solve()
    W = ssp_weights(noisy.released.A.numpy(), noisy.released.B.numpy(), mechanism.scale().a_off_diagonal, lam, k)
    np.testing.assert_allclose(model.coef_, (W[:-1] / np.linalg.norm(W[:-1], axis=0)).T, rtol=1e-7, atol=1e-10)
    one = ssp_weights(noisy.released.A.numpy(), noisy.released.B.numpy(), mechanism.scale().a_off_diagonal, lam, 1)
    assert not np.allclose(model.coef_, (one[:-1] / np.linalg.norm(one[:-1], axis=0)).T, atol=1e-6)


@pytest.mark.parametrize("mechanism", [CalibratedSSP(1.7, Fed3RSensitivity.of(5, 2.0, True), 0.2),
                                       UniformGaussian(1.7, Fed3RSensitivity.of(5, 2.0, True)),
                                       DistributedSSP(1.7, Fed3RSensitivity.of(5, 2.0, True), 0.3)],
                         ids=["ssp", "gaussian", "ssp-distributed"])
def test_noise_multiplier_bounds_the_worst_device_entry_by_entry(mechanism):
    """A device of N identical rows of norm R on one axis (the bound is attained there): its
    statistics divided entry by entry by their noise stddevs have norm ≤ 1/z, and the bound is tight."""
    N, F, p, C = 5, 2.0, 6, 3
    z_row = np.zeros(p)
    z_row[0], z_row[-1] = F, 1.0
    Z = np.tile(z_row, (N, 1))
    A, b = Z.T @ Z, Z.T @ np.eye(C)[np.zeros(N, int)]
    scale = mechanism.scale()
    iu = np.triu_indices(p)
    per_entry = np.where(iu[0] == iu[1], scale.a_diagonal, scale.a_off_diagonal)
    moved = math.sqrt(np.sum((A[iu] / per_entry) ** 2) + np.sum((b / scale.b) ** 2))
    assert scale.noise_multiplier(mechanism.sensitivity) == pytest.approx(mechanism.noise_multiplier, rel=1e-12)
    assert moved <= 1 / mechanism.noise_multiplier * (1 + 1e-12)
    assert moved >= 0.5 / mechanism.noise_multiplier                   # the bound is not loose by much


def test_pld_accounting_is_dp_accountings_and_sound():
    """ε of a ssp job is the PLD accountant's for GaussianDpEvent(z), built here with the library
    directly; the closed form of the Gaussian mechanism (Balle & Wang 2018) agrees it is sound, and
    it is below RDP's for the same z (the noise the same guarantee needs is smaller)."""
    z, delta = 3.0, 1e-5
    job = build_job("fed3r", {"dp_noise_multiplier": z, "dp_delta": delta, "feature_clip_norm": 4.0, "max_samples": 2})
    report = job.config.privacy_report(1)
    accountant = pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    accountant.compose(dp_accounting.GaussianDpEvent(z))
    assert report["epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)
    finer = pld.PLDAccountant()                                   # the library's default grid: never more
    finer.compose(dp_accounting.GaussianDpEvent(z))
    assert finer.get_epsilon(delta) <= report["epsilon"] <= finer.get_epsilon(delta) * (1 + 1e-3)
    assert report["accounting"] == "pld"
    eps = report["epsilon"]
    assert norm.cdf(0.5 / z - eps * z) - np.exp(eps) * norm.cdf(-0.5 / z - eps * z) <= delta * (1 + 1e-6)
    rdp_accountant = rdp.RdpAccountant()
    rdp_accountant.compose(dp_accounting.GaussianDpEvent(z))
    assert eps < rdp_accountant.get_epsilon(delta)
    assert PrivacyAccountant(z, delta, accounting="pld").affordable(1, eps * (1 + 1e-9))


def test_job_chooses_its_mechanism_and_refuses_bad_ones():
    base = {"num_classes": 3, "feature_dim": 5, "dp_noise_multiplier": 2.0, "feature_clip_norm": 1.0, "max_samples": 4}
    job = build_job("fed3r", base)
    assert isinstance(job.strategy.mechanism, CalibratedSSP)                     # the default
    legacy = build_job("fed3r", {**base, "dp_mechanism": "gaussian"})
    assert isinstance(legacy.strategy.mechanism, UniformGaussian)
    assert legacy.config.privacy_report(1)["accounting"] == "rdp"
    sigma = 2.0 * 4 * math.sqrt(2.0) * math.sqrt(3.0)                           # z N R √(R²+1), R² = 2
    scale = legacy.strategy.mechanism.scale()
    assert scale.a_diagonal == scale.a_off_diagonal == scale.b == pytest.approx(sigma, rel=1e-12)
    for bad in ({"dp_mechanism": "laplace"}, {"dp_b_share": 1.0}, {"dp_b_share": 0.0}):
        with pytest.raises(ValueError):
            build_job("fed3r", {**base, **bad})


def test_secure_fed3r_noise_is_ssp_per_block_made_from_one_stddev_the_devices_can_add():
    """Under SecAgg every device adds one Skellam stddev σ_A to its whole vector; scaling the vector's
    blocks first (off-diagonal entries × √2, B × σ_A/σ_B) and the sum back makes it ``ssp``'s
    per-block noise, at the same z: the worst device's scaled vector moves by at most σ_A/z, and
    tightly. Accounted with RDP like every Skellam job."""
    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig
    from protocols.payloads.secagg import pack_sync_vector, scale_sync_blocks

    cfg = Fed3RSyncConfig(num_classes=3, feature_dim=5, dp_noise_multiplier=2.0, feature_clip_norm=1.0, max_samples=4,
                          clients_per_round=5, dp_b_share=0.25)
    mechanism = cfg.mechanism()
    assert isinstance(mechanism, DistributedSSP) and mechanism.accounting == "rdp"
    assert cfg.privacy_report(1)["accounting"] == "rdp"
    sens = Fed3RSensitivity.of(4, 1.0, True)
    central = CalibratedSSP(2.0, sens, 0.25).scale()
    assert mechanism.scale() == central                                # the central mechanism's stddevs
    sigma = cfg.dp_noise_stddev()
    assert sigma == pytest.approx(2.0 * sens.a / math.sqrt(0.75), rel=1e-12)
    scales = cfg.block_scales()
    assert scales.a_off_diagonal == pytest.approx(math.sqrt(2.0), rel=1e-12)
    assert sigma / scales.a_off_diagonal == pytest.approx(central.a_off_diagonal, rel=1e-12)
    assert sigma / scales.b == pytest.approx(central.b, rel=1e-12)
    # the worst device (N rows of norm R in one class): its scaled vector's norm is sensitivity σ_A/z
    N, p, C = 4, 6, 3
    row = np.zeros(p)
    row[0], row[-1] = 1.0, 1.0
    Z = np.tile(row, (N, 1))
    A, b = Z.T @ Z, (Z.T @ np.eye(C)[np.zeros(N, int)]).T
    scaled = scale_sync_blocks(pack_sync_vector(A[np.triu_indices(p)], b, 0), p, C, scales.a_off_diagonal, scales.b)
    assert np.linalg.norm(scaled) == pytest.approx(sigma / 2.0, rel=1e-12)
    assert mechanism.scale().noise_multiplier(sens) == pytest.approx(2.0, rel=1e-12)
    gaussian = Fed3RSyncConfig(num_classes=3, feature_dim=5, dp_noise_multiplier=2.0, feature_clip_norm=1.0,
                               max_samples=4, clients_per_round=5, dp_mechanism="gaussian")
    assert gaussian.block_scales() is None and gaussian.dp_noise_stddev() == pytest.approx(2.0 * sens.joint, rel=1e-12)


def test_a_secure_dp_sum_is_scaled_back_only_when_every_member_scaled():
    """Fed3R-Sync under distributed DP: a group sum whose count slot says every survivor scaled its
    blocks is scaled back (the release is numpy's unscaled sum); one where a member did not (a
    device library that ignores block_scales: 0 in its slot), or whose slots claim more members than
    survived, is refused, nothing released. (A malicious member can still fake its slot, as it can
    fake its statistics: the slot guards against old libraries, not against attackers.)"""
    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from aggregator.jobs.secure_rounds import GroupSumOutOfBound
    from protocols.identity import DeviceIdentity, IdentityRegistry
    from protocols.payloads.secagg import pack_sync_vector, scale_sync_blocks, sync_vector_length

    p, C, members = 7, 3, ("d0", "d1", "d2")
    cfg = Fed3RSyncConfig(num_classes=C, feature_dim=p - 1, dp_noise_multiplier=1.5, feature_clip_norm=2.0,
                          max_samples=4, clients_per_round=3)
    ids = {d: DeviceIdentity.generate(d) for d in members}
    job = Fed3RSyncJob(cfg, identity=DeviceIdentity.generate("aggregator"),
                       registry=IdentityRegistry({d: k.public_key_bytes for d, k in ids.items()}))
    assert sorted(job.next_participants(set(members))) == list(members)    # the round (and its bound) opened
    scales = cfg.block_scales()
    rng = np.random.default_rng(4)
    A, B = statistics(p, C, 9, 5)
    vectors = [scale_sync_blocks(pack_sync_vector(A[np.triu_indices(p)] / 3, B.T / 3, 0), p, C,
                                 scales.a_off_diagonal, scales.b) + rng.normal(0, 0.01, sync_vector_length(p, C))
               for _ in members]
    for v in vectors:
        v[-1] = 1.0                                   # each member scaled (the noise leaves the slot alone)
    unscaled_by_one = [v.copy() for v in vectors]
    unscaled_by_one[0][-1] = 0.0
    with pytest.raises(GroupSumOutOfBound, match="says 2 of its 3 members scaled"):
        job.on_secure_sum(np.sum(unscaled_by_one, axis=0), members)
    over = [v.copy() for v in vectors]
    over[1][-1] = 2.0                                 # a slot claiming more than one member
    with pytest.raises(GroupSumOutOfBound, match="says 4 of its 3 members scaled"):
        job.on_secure_sum(np.sum(over, axis=0), members)
    # nothing of the discarded sums is in the model, but they were unmasked: their members count as
    # released (never asked again, the job's release reported)
    assert job.strategy.releases == 0 and sorted(job.contributed) == list(members)
    job.on_secure_sum(np.sum(vectors, axis=0), members)
    assert job.strategy.releases == 1 and sorted(job.contributed) == list(members)
    total = np.sum(vectors, axis=0)
    iu = np.triu_indices(p)
    off = iu[0] != iu[1]
    want_a = total[:len(iu[0])].copy()
    want_a[off] /= scales.a_off_diagonal
    np.testing.assert_allclose(job.strategy.released.packed_upper(), want_a, rtol=1e-12)
    np.testing.assert_allclose(job.strategy.released.B.numpy(),
                               (total[len(iu[0]):-1] / scales.b).reshape(C, p).T, rtol=1e-12)
    np.testing.assert_allclose(job.strategy.released.packed_upper(), A[iu], atol=0.1)     # the data, near


def test_shrinkage_edge_matches_the_group_noise_actually_released():
    """A review's finding (Fed3R-Sync + ssp): each member adds σ²/t, so a group of s ≥ t survivors
    holds s/t·σ² per entry (1.5× with SecAgg's t = ⌈2κ/3⌉, nobody dropping), while the shrinkage and
    λ took one release's σ per group: the pure-noise bulk reached √(s/t) ≈ 1.22× past the edge and
    noise directions were debiased to large eigenvalues. The released sums count noise units."""
    import torch

    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from protocols.identity import DeviceIdentity, IdentityRegistry

    D, C, K = 150, 3, 30
    devices = [f"cam-{i:02d}" for i in range(K)]
    cfg = Fed3RSyncConfig(num_classes=C, feature_dim=D, dp_noise_multiplier=2.0, feature_clip_norm=5.0,
                          max_samples=1, clients_per_round=K, seed=4, max_abs_feature=50.0)
    job = Fed3RSyncJob(cfg, identity=DeviceIdentity.generate("aggregator"),
                       registry=IdentityRegistry({d: DeviceIdentity.generate(d).public_key_bytes for d in devices}))
    members = job.next_participants(set(devices))
    assert len(members) == K
    dp = job._round_dp
    t = dp["threshold"]
    assert t < K                                   # SecAgg's ⌈2κ/3⌉
    # every member survives: the ring sum of zero data carries K shares of N(0, σ_dev²) per entry
    rng = np.random.default_rng(0)
    total = rng.normal(0.0, dp["stddev"] * np.sqrt(K), job.vector_length)
    total[-1] = K                                  # every member scaled its blocks
    job.on_secure_sum(total, tuple(members))
    noisy = job.strategy
    A = noisy.released.A.numpy()
    eig = np.linalg.eigvalsh(A)
    assert noisy.noise_units == K / t and noisy.releases == 1
    edge_used = noisy.mechanism.scale().spectral_edge(A.shape[0], noisy.noise_units)
    edge_true = noisy.mechanism.scale().spectral_edge(A.shape[0], 1) * np.sqrt(K / t)    # 2σ_o√(p·s/t)
    assert edge_used == edge_true
    assert eig.max() <= 1.05 * edge_used, (
        f"pure noise reaches λ_max={eig.max():.4g} > edge used {edge_used:.4g} (true edge {edge_true:.4g}); "
        f"{int((eig > edge_used).sum())} noise directions treated as spikes")
    shrunk = noisy.mechanism.shrunk(torch.from_numpy(eig), noisy.noise_units).numpy()
    assert (shrunk > edge_used / 2).sum() == 0
