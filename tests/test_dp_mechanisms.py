"""The DP mechanisms against plain numpy references: clipping bounds hold (server and device
side), DP-FedAvg is the clipped mean plus noise, adaptive clipping follows Andrew et al.'s rule,
Fed3R statistics are bounded and noised at the stated scale, and under secure aggregation the
devices' Skellam shares sum to the intended variance through the real SecAgg round."""

import dataclasses
import math

import numpy as np
import pytest
from ops_fleet import Features, in_memory_keys, kept_windows
from scipy import stats

from aggregator.jobs.registry import build_job
from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob
from aggregator.strategies.dp_fed3r import (Fed3RSensitivity, NoisyFed3R, UniformGaussian, check_bounded,
                                            fed3r_sensitivity)
from aggregator.shards.fedavg_sums import local_dp_round_step
from aggregator.strategies.dp_fedavg import AdaptiveClipNorm, DPFedAvg, FixedClipNorm
from aggregator.strategies.fedavg import FedAvg
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining
from protocols.clipping import clip_update, global_norm
from protocols.envelope import EnvelopeError, decode, encode
from protocols.messages import TaskRef, result_message
from protocols.payloads.fed3r import Fed3RStats
from protocols.payloads.secagg import to_envelope
from protocols.secagg import AggregateReady, ClientState, Phase, RoundStart
from protocols.secagg.driver import run_round
from protocols.secagg.fixedpoint import max_scale_bits


def variance_ratio_ok(samples: np.ndarray, variance: float) -> bool:
    """Mean square / variance inside the two-sided 1e-6 chi-square interval (mean-zero samples)."""
    dof = samples.size
    lo, hi = stats.chi2.ppf([1e-6, 1 - 1e-6], dof) / dof
    return lo < float(np.mean(samples.astype(np.float64) ** 2)) / variance < hi


def test_clipping_bounds_the_global_norm_and_keeps_the_direction():
    rng = np.random.default_rng(0)
    for scale in (1e-3, 1.0, 1e3):
        delta = {"w": rng.normal(size=(4, 5)) * scale, "b": rng.normal(size=4) * scale}
        clipped, norm = clip_update(delta, 0.5)
        flat = np.concatenate([delta["w"].ravel(), delta["b"]])
        assert norm == pytest.approx(np.linalg.norm(flat))
        assert global_norm(clipped) <= 0.5 * (1 + 1e-12)
        expected = flat * min(1.0, 0.5 / np.linalg.norm(flat))
        np.testing.assert_allclose(np.concatenate([clipped["w"].ravel(), clipped["b"]]), expected, rtol=1e-12)


def test_dp_fedavg_is_the_clipped_sum_over_kappa_plus_noise():
    rng = np.random.default_rng(1)
    params = {"weight": rng.normal(size=(3, 4)).astype(np.float32), "bias": rng.normal(size=3).astype(np.float32)}
    updates = [{k: v + rng.normal(size=v.shape) * s for k, v in params.items()} for s in (0.01, 1.0, 30.0)]
    dp = DPFedAvg(FedAvg(), 1e-12, FixedClipNorm(0.8), expected_clients=5, rng=np.random.default_rng(2))
    new = local_dp_round_step(dp, params, {f"d{i}": (u, 1) for i, u in enumerate(updates)})    # the job's path
    reference = {k: params[k].astype(np.float64).copy() for k in params}
    for u in updates:
        d = np.concatenate([(u[k] - params[k]).astype(np.float64).ravel() for k in ("weight", "bias")])
        d *= min(1.0, 0.8 / np.linalg.norm(d))
        reference["weight"] += d[:12].reshape(3, 4) / 5
        reference["bias"] += d[12:] / 5
    for k in params:
        np.testing.assert_allclose(new[k], reference[k], rtol=1e-5, atol=1e-6)


def test_adaptive_clipping_follows_the_quantile_rule_and_its_noise_split():
    clip = AdaptiveClipNorm(1.0, target_quantile=0.5, learning_rate=0.2, count_stddev=2.0)
    # Andrew et al. Eq. 4: the update noise keeps z overall once the count took its share
    assert clip.update_noise_multiplier(1.0) == pytest.approx((1.0 - 1 / 16) ** -0.5)
    with pytest.raises(ValueError, match="z/2"):
        AdaptiveClipNorm(1.0, count_stddev=0.4).update_noise_multiplier(1.0)
    quiet = AdaptiveClipNorm(1.0, 0.5, 0.2, count_stddev=1e-9)
    quiet.observe(1, 4, expected=4, rng=np.random.default_rng(0))       # 1 of 4 under C
    assert quiet.value == pytest.approx(math.exp(-0.2 * (0.25 - 0.5)))
    norms = np.random.default_rng(3).uniform(1, 9, size=(300, 20))
    for row in norms:
        quiet.observe(int((row <= quiet.value).sum()), len(row), expected=20, rng=np.random.default_rng(0))
    assert abs(quiet.value - np.median(norms)) < 0.6


def fed3r_stats_task(folder, n=40, d=6, scale=5.0, seed=0):
    """A fresh device's Fed3R task, its sample windows kept in ``folder`` (a DP job caps samples:
    without a state folder the device would decline, edge_client/sample_windows.py)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    return Fed3RStatsTask((rng.normal(size=(n, d)) * scale).astype(np.float32), y, lambda b, s, w: Features(d),
                          windows=kept_windows(folder))


def fed3r_envelope(task, params):
    body, tensors = task({"num_classes": 3, "backbone": "x", "image_size": 8, "weights_sha256": "", **params})
    return decode(encode(result_message("dev0", TaskRef("j", 1, "x" * 32), "fed3r.stats", body, tensors)))


def test_device_clipping_and_cap_bound_the_statistics_and_the_server_checks_them(tmp_path):
    folders = (tmp_path / str(k) for k in range(10))            # a fresh device each
    F, N = 1.5, 25
    job = build_job("fed3r", {"num_classes": 3, "feature_dim": 6, "dp_noise_multiplier": 1.0,
                              "feature_clip_norm": F, "max_samples": N})
    params = job.task_for("dev0")[0]
    assert params["cap_samples"] and params["max_samples"] == N
    factor = job.parse_result(fed3r_envelope(fed3r_stats_task(next(folders), n=2), params))      # n < p: the factor form
    assert factor.r_factor is not None
    stats_ = job.parse_result(fed3r_envelope(fed3r_stats_task(next(folders)), params))
    assert stats_.n == N
    A = np.zeros((7, 7))
    A[np.triu_indices(7)] = stats_.a_upper
    assert np.trace(A) <= N * (F ** 2 + 1) * (1 + 1e-12)            # Σ ‖z‖² over clipped rows + bias
    assert np.linalg.norm(A + np.triu(A, 1).T) <= N * (F ** 2 + 1) and np.linalg.norm(stats_.b) <= N * math.sqrt(F ** 2 + 1)
    unclipped = {k: v for k, v in params.items() if k not in ("feature_clip_norm",)}
    with pytest.raises(EnvelopeError, match="clipped bound"):       # a device that did not clip is refused
        job.parse_result(fed3r_envelope(fed3r_stats_task(next(folders)), unclipped))
    with pytest.raises(EnvelopeError, match="clipped bound"):       # in either form
        job.parse_result(fed3r_envelope(fed3r_stats_task(next(folders), n=2), unclipped))
    with pytest.raises(EnvelopeError, match="cap"):
        job.parse_result(fed3r_envelope(fed3r_stats_task(next(folders)), {**params, "max_samples": 40}))


def test_a_dense_gram_matrix_is_bounded_by_its_whole_frobenius_norm_not_its_packed_triangle():
    """A crafted dense upload: the Gram matrix of one row z spread over every feature, ‖A‖_F = ‖z‖² =
    1.3 N R², whose packed triangle (each off-diagonal entry once) has norm ≈ 0.92 N R². Measured
    on the triangle it passed, and its device's influence exceeded the sensitivity the noise is
    calibrated to; it is refused. An honest row of norm R passes."""
    from aggregator.strategies.dp_fed3r import packed_frobenius

    F, N, d = 2.0, 1, 40
    r2 = F ** 2 + 1
    iu = np.triu_indices(d + 1)
    rng = np.random.default_rng(0)
    A = rng.normal(size=(d + 1, d + 1))
    A = A @ A.T
    assert packed_frobenius(A[iu], d + 1) == pytest.approx(np.linalg.norm(A), rel=1e-12)
    z = np.full(d + 1, math.sqrt(1.3 * r2 / (d + 1)))
    crafted = np.outer(z, z)
    assert np.linalg.norm(crafted[iu]) < N * r2 < np.linalg.norm(crafted)
    b = np.zeros((3, d + 1))
    with pytest.raises(ValueError, match="clipped bound"):
        check_bounded(Fed3RStats(n=N, p=d + 1, a_upper=crafted[iu], class_ids=np.arange(3), b=b), N, F, True)
    honest = np.append(rng.normal(size=d), 1.0)
    honest[:-1] *= F / np.linalg.norm(honest[:-1])                 # ‖z‖ = F, then the bias feature
    check_bounded(Fed3RStats(n=N, p=d + 1, a_upper=np.outer(honest, honest)[iu], class_ids=np.arange(3), b=b),
                  N, F, True)


def test_noisy_fed3r_adds_noise_of_the_stated_scale_once_per_round():
    p, C, sigma = 150, 5, 3.0
    uniform = UniformGaussian(1.0, Fed3RSensitivity(0.6 * sigma, 0.8 * sigma))       # zΔ = σ on every entry
    noisy = NoisyFed3R(C, p, 0.1, True, True, uniform, rng=np.random.default_rng(5))
    rng = np.random.default_rng(6)
    Z = rng.normal(size=(100, p))
    A = Z.T @ Z
    stats_ = Fed3RStats(n=100, p=p, a_upper=A[np.triu_indices(p)], class_ids=np.arange(C), b=rng.normal(size=(C, p)))
    noisy.add(stats_)
    assert noisy.released.n_contributions == 0                     # nothing released before the round closes
    noisy.release()
    noise_a = noisy.released.packed_upper() - A[np.triu_indices(p)]
    noise_b = noisy.released.B.cpu().numpy() - stats_.b.T
    assert variance_ratio_ok(np.concatenate([noise_a, noise_b.ravel()]), sigma ** 2)
    noisy.release()                                                # an empty round releases nothing
    assert noisy.releases == 1 and noisy.n_contributions == 1
    huge = NoisyFed3R(C, p, 1e-3, True, True, UniformGaussian(1.0, Fed3RSensitivity(6e5, 8e5)),
                      rng=np.random.default_rng(0))
    huge.add(stats_)
    huge.release()
    assert np.isfinite(huge.solve().coef_).all()                   # an indefinite noisy A still solves (PSD projection)


def test_fed3r_sensitivity_is_the_largest_device_contribution():
    """Δ from docs/algorithms.md is attained: N identical rows of norm F in one class."""
    F, N, d = 2.0, 7, 5
    z = np.zeros(d)
    z[0] = F
    Zb = np.tile(np.append(z, 1.0), (N, 1))
    A, b = Zb.T @ Zb, Zb.T @ np.eye(3)[np.zeros(N, int)]
    worst = math.sqrt(np.sum(A[np.triu_indices(d + 1)] ** 2) + np.sum(b ** 2))
    assert worst <= fed3r_sensitivity(N, F, True) * (1 + 1e-12)
    assert worst >= 0.7 * fed3r_sensitivity(N, F, True)           # and the bound is not loose by much
    check_bounded(Fed3RStats(n=N, p=d + 1, a_upper=A[np.triu_indices(d + 1)], class_ids=np.arange(3), b=b.T),
                  N, F, True)


class ZeroUpdate:
    """A device that trained nothing: its update is exactly the head it was sent."""

    def __call__(self, params, tensors):
        return {"n": 10}, {k: v.copy() for k, v in tensors.items()}


@pytest.mark.parametrize("group_threshold, threshold, dropped", [(0.0, 4, 0), (0.0, 4, 1), (0.8, 5, 1), (0.8, 5, 2)],
                         ids=["all-survive", "one-drops", "t=0.8:one-drops", "t=0.8:two-drop"])
def test_distributed_noise_sums_to_the_intended_variance_under_secagg(group_threshold, threshold, dropped):
    """Each member adds σ²/t, t SecAgg's ⌈2κ/3⌉ or ``dp_group_threshold``'s share of the group:
    any sum the server can reveal (t survivors or more) carries at least σ², and a group that
    keeps fewer than t reveals nothing."""
    ids = [f"dev{i}" for i in range(6)]
    identities, agg, registry = in_memory_keys(ids)
    z, clip = 1.5, 0.3
    cfg = SecureFedAvgConfig(num_classes=10, feature_dim=2000, rounds=1, clients_per_round=6, seed=1,
                             dp_noise_multiplier=z, dp_clip_norm=clip, dp_group_threshold=group_threshold)
    job = SecureFedAvgJob(cfg, identity=agg, registry=registry)
    chosen = job.next_participants(set(ids))
    config = job.secure.config
    devices = {d: SecureFedAvgTraining(identities[d], agg.public_key_bytes, ZeroUpdate(),
                                       noise_rng=np.random.default_rng(100 + i)) for i, d in enumerate(chosen)}
    vectors = {d: devices[d].vector(*job.task_for(d)) for d in chosen}
    dp = job.task_for(chosen[0])[0]["dp"]
    assert dp["threshold"] == config.threshold == threshold and config.scale_bits == dp["scale_bits"]
    assert dp["stddev"] == pytest.approx(z * clip / math.sqrt(threshold))
    dropouts = {d: Phase.MASKED_INPUT for d in chosen[:dropped]}
    run = run_round(config, agg, {d: identities[d] for d in chosen}, vectors, dropouts=dropouts)
    if 6 - dropped < threshold:
        assert not isinstance(run.outcome, AggregateReady)            # fewer than t: nothing revealed
        return
    assert isinstance(run.outcome, AggregateReady)
    survivors = sorted(run.outcome.survivors)
    total = run.outcome.decode()
    assert len(survivors) == 6 - dropped >= threshold
    # the ring added nothing: the sum is exactly the survivors' noisy vectors
    assert np.array_equal(total, np.sum([vectors[d] for d in survivors], axis=0))
    assert total[-1] == len(survivors)                              # the count entry carries no noise
    assert variance_ratio_ok(total[:-1], len(survivors) * dp["stddev"] ** 2)
    assert len(survivors) * dp["stddev"] ** 2 >= (z * clip) ** 2 * (1 - 1e-12)   # never less than σ²
    before = {k: v.astype(np.float64) for k, v in job.params.items()}
    job.on_secure_sum(total, tuple(survivors))
    moved, _, _ = job.round_step()
    np.testing.assert_allclose(moved["bias"] - before["bias"], total[-11:-1] / 6, rtol=1e-5, atol=1e-6)


def test_a_group_threshold_without_distributed_dp_is_refused_not_ignored():
    """``dp_group_threshold`` sizes the devices' noise shares; on a secure job without DP it would
    do nothing, so each secure family refuses it (one ValueError naming the field), and takes it with DP."""
    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig
    from aggregator.jobs.secure_ladd import SecureLaddConfig

    plain = {"fedavg": dict(num_classes=10, feature_dim=20), "fed3r-sync": dict(num_classes=10, feature_dim=20),
             "ladd": dict(model={"num_classes": 5, "image_size": 64})}
    for name, config in (("fedavg", SecureFedAvgConfig), ("fed3r-sync", Fed3RSyncConfig), ("ladd", SecureLaddConfig)):
        with pytest.raises(ValueError, match="dp_group_threshold applies to distributed DP only"):
            config(**plain[name], dp_group_threshold=0.9)
        config(**plain[name])                                            # 0 (the default) is fine without DP
        dp = {"dp_noise_multiplier": 1.0} | ({"feature_clip_norm": 8.0} if name == "fed3r-sync" else {"dp_clip_norm": 1.0})
        assert config(**plain[name], **dp, dp_group_threshold=0.9).group_threshold(10) == 9


def test_a_device_adding_distributed_noise_joins_only_a_64_bit_round():
    """Its Skellam share is scaled for the 64-bit ring: the device opens its session asking for 64,
    so a RoundStart in the 32-bit ring (which the job never sends: its config refuses dp with
    ring_bits 32) is refused, the device sends nothing and leaves the round (its secrets erased;
    outside an agent no task to decline); a device without noise takes either."""
    ids = [f"dev{i}" for i in range(4)]
    identities, agg, registry = in_memory_keys(ids)
    common = dict(num_classes=3, feature_dim=4, rounds=1, clients_per_round=4, seed=1)
    for dp, wanted in (({"dp_noise_multiplier": 1.0, "dp_clip_norm": 0.5}, 64), ({}, None)):
        job = SecureFedAvgJob(SecureFedAvgConfig(**common, **dp), identity=agg, registry=registry)
        chosen = job.next_participants(set(ids))
        device = SecureFedAvgTraining(identities[chosen[0]], agg.public_key_bytes, ZeroUpdate(),
                                      noise_rng=np.random.default_rng(0))
        params, tensors = job.task_for(chosen[0])
        assert device.on_task(job.config.job_id, job.secure.config.round_id, params, tensors) == []
        (client,) = device.sessions.sessions.values()
        assert client.required_ring_bits == wanted
        wide = job.secure.config
        narrow = dataclasses.replace(wide, ring_bits=32, scale_bits=max_scale_bits(len(wide.members), wide.bound, 32))
        start = RoundStart(job_id=narrow.job_id, round_id=narrow.round_id, group_id=narrow.group_id,
                           sender="aggregator", recipient=chosen[0], config=narrow).signed(agg)
        replies = device.on_message(to_envelope(start))
        assert (replies == []) == (wanted == 64) and client.state is (
            ClientState.ABORTED if wanted else ClientState.ADVERTISED)
        assert len(device.sessions.sessions) == (0 if wanted else 1)


def test_the_metrics_claim_no_epsilon_for_a_run_with_seeded_noise(monkeypatch, tmp_path):
    """A review's finding (stop 61): /metrics exported the ε of a run whose noise was seeded (tests
    comparing bits), which anyone knowing the seed can undo. Its report says ``not_private``; the
    metrics now carry that instead of an ε."""
    import types

    from aggregator.api.metrics import render_metrics
    from aggregator.storage.store import Store
    from aggregator.strategies.dp_noise import NOISE_SEED_ENV

    config = {"job_id": "j", "num_classes": 3, "feature_dim": 4, "dp_noise_multiplier": 1.0, "dp_clip_norm": 1.0}
    stats = {"bytes_in": 0, "duplicates": 0, "late": 0, "rejections": {}}
    store = Store(tmp_path / "state.db")

    def metrics():
        privacy = build_job("fedavg", config).evaluate(None, None)["privacy"]
        job = {"job_id": "j", "round": 1, "contributions": 0, "accuracy": None, "privacy": privacy, "stats": stats}
        service = types.SimpleNamespace(live={"job": job, "stats": stats}, store=None,       # what metrics read
                                        link=types.SimpleNamespace(bytes_sent=0))
        return render_metrics(store, service)

    monkeypatch.delenv(NOISE_SEED_ENV, raising=False)
    private = metrics()
    assert 'fedfleet_job_privacy_epsilon{job="j"}' in private and "seeded_noise" not in private
    monkeypatch.setenv(NOISE_SEED_ENV, "7")
    seeded = metrics()
    assert 'fedfleet_job_privacy_seeded_noise{job="j"} 1' in seeded and "privacy_epsilon" not in seeded


def test_a_seeded_noise_source_repeats_its_draws_and_every_privacy_report_says_it_is_not_private(monkeypatch):
    """FEDFLEET_TEST_DP_NOISE_SEED (tests comparing two runs' bits): two jobs draw the same noise,
    and the report carries ``not_private``; unset, the draws differ and the report has no such key."""
    from aggregator.jobs.registry import build_job
    from aggregator.strategies.dp_noise import NOISE_SEED_ENV, noise_source

    config = {"job_id": "j", "num_classes": 3, "feature_dim": 4, "dp_noise_multiplier": 1.0, "dp_clip_norm": 1.0}
    monkeypatch.delenv(NOISE_SEED_ENV, raising=False)
    assert noise_source().normal() != noise_source().normal()
    assert "not_private" not in build_job("fedavg", config).evaluate(None, None)["privacy"]
    monkeypatch.setenv(NOISE_SEED_ENV, "7")
    assert noise_source().normal() == noise_source().normal() == np.random.default_rng(7).normal()
    assert NOISE_SEED_ENV in build_job("fedavg", config).evaluate(None, None)["privacy"]["not_private"]
    monkeypatch.setenv(NOISE_SEED_ENV, "seven")
    with pytest.raises(ValueError, match="non-negative integer"):
        noise_source()


def test_unseeded_noise_is_cryptographic_gaussian_and_never_repeats(monkeypatch):
    """Unseeded, the mechanisms draw from a cryptographic generator (a fresh OS seed per draw,
    expanded by the SecAgg mask PRG), not numpy's PCG64, whose state could be inferred and its noise
    subtracted. The draws are N(0, 1) by scipy's CDF (Kolmogorov–Smirnov on a fixed seed), scaled
    and shaped as numpy's ``Generator.normal``; a DP-FedAvg release from the default source differs
    run to run by noise of the stated scale."""
    from aggregator.strategies.dp_noise import NOISE_SEED_ENV, CryptographicNoise, noise_source, standard_normals

    monkeypatch.delenv(NOISE_SEED_ENV, raising=False)
    assert isinstance(noise_source(), CryptographicNoise)
    z = standard_normals(200_001, b"k" * 32)
    assert z.shape == (200_001,) and np.array_equal(z, standard_normals(200_001, b"k" * 32))
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01 and np.abs(z).max() < 8.58   # the 2^-53 grid's tail
    assert not np.array_equal(z[:1000], standard_normals(1000, b"j" * 32))

    source = CryptographicNoise()
    draws = source.normal(3.0, 2.0, (400, 500))
    assert draws.shape == (400, 500) and abs(draws.mean() - 3.0) < 0.02 and abs(draws.std() - 2.0) < 0.02
    assert isinstance(source.normal(), float) and source.normal(0.0, 1.0, 7).shape == (7,)
    assert not np.array_equal(source.normal(0.0, 1.0, 64), source.normal(0.0, 1.0, 64))

    params = {"w": np.zeros((20, 50), dtype=np.float64)}
    updates = {f"d{i}": ({"w": np.full((20, 50), 0.01)}, 1) for i in range(4)}
    releases = [local_dp_round_step(DPFedAvg(FedAvg(), 1.0, FixedClipNorm(0.5), expected_clients=4), params, updates)["w"]
                for _ in range(2)]
    noise = releases[0] - releases[1]                   # the clipped sums cancel: two draws of N(0, (zC/κ)²) each
    assert abs(noise.std() / (math.sqrt(2) * 1.0 * 0.5 / 4) - 1) < 0.1
