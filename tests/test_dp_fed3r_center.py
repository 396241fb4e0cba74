"""DP Fed3R's private feature center (``aggregator/strategies/dp_center.py``) against numpy: the
center round releases only the noisy mean, the centred rounds' model equals a numpy ssp solve on
rows centred and clipped by hand, shifted back to raw features; the job asks the operator's m
devices first, then sends the center; bad centers and rows beyond the centred clip are refused."""

import math

import numpy as np
import pytest
from ops_fleet import Features, kept_windows
from ssp_reference import GRID_MARGIN, grid_tolerance, release_noise, ssp_weights
from stateful_jobs import run_round

from aggregator.jobs.registry import build_job
from aggregator.strategies.dp_center import PrivateFeatureCenter
from aggregator.strategies.dp_fed3r import CalibratedSSP, Fed3RSensitivity, NoisyFed3R
from edge_client.agent import TaskDeclined
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from protocols.envelope import EnvelopeError, decode, encode
from protocols.messages import TaskRef, result_message
from protocols.payloads.fed3r import CENTER_TENSOR, KIND, Fed3RStats
from protocols.rounds import RoundClosed

D, C = 12, 3


def clip(Z, F):
    return Z * np.minimum(1.0, F / np.linalg.norm(Z, axis=1, keepdims=True))


def stats_of(Z, y):
    Za = np.hstack([Z, np.ones((len(Z), 1))])
    A, B = Za.T @ Za, Za.T @ np.eye(C)[y]
    return Fed3RStats(n=len(Z), p=D + 1, a_upper=A[np.triu_indices(D + 1)], class_ids=np.arange(C), b=B.T), A, B


def data(n, seed, offset=6.0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, C, n)
    Z = offset + rng.normal(size=(n, D)) + 2.0 * np.eye(C, D)[y]      # a large shared mean, as ReLU features have
    return Z, y


def test_center_and_centred_solve_equal_a_numpy_reference():
    z, F, Fc, N, lam = 1.5, 25.0, 4.0, 1, 0.01
    (Z0, y0), (Z1, y1) = data(40, 0), data(200, 1)
    mechanism = CalibratedSSP(z, Fed3RSensitivity.of(N, Fc, True), b_share=0.2)
    center = PrivateFeatureCenter(C, D + 1, z, N, F)
    noisy = NoisyFed3R(C, D + 1, lam, True, True, mechanism, rng=np.random.default_rng(3), center=center)
    assert noisy.centering
    for i in range(len(Z0)):                                          # the center round: one row per device
        noisy.add(stats_of(clip(Z0[i:i + 1], F), y0[i:i + 1])[0])
    noisy.release()
    assert not noisy.centering and noisy.n_contributions == 0 and noisy.releases == 0   # nothing of the model released
    rng = np.random.default_rng(3)                                    # the reference draws the same noise
    sensitivity = N * math.hypot(F, 1.0)                              # z(1 + 2^-20)Δ_c: the grid's rounding counted
    column = np.r_[clip(Z0, F).sum(axis=0), len(Z0)] + rng.normal(0.0, z * sensitivity * (1 + GRID_MARGIN), D + 1)
    mu = column[:-1] / column[-1]
    np.testing.assert_allclose(center.value, mu, rtol=0, atol=2 * sensitivity * GRID_MARGIN / column[-1])
    mu = center.value                                                 # its bits: the rows below are centred by them

    rows = clip(Z1 - mu, Fc)
    stats, A, B = stats_of(rows, y1)
    noisy.add(stats)
    noisy.release()
    model = noisy.solve()
    scale = mechanism.scale()                                         # ssp's noise, as tests/test_dp_fed3r_ssp.py
    p = D + 1
    E, noise_b = release_noise(scale, p, C, rng)
    noisy_b = B + noise_b
    grid_a, grid_b = grid_tolerance(mechanism.sensitivity)
    np.testing.assert_allclose(noisy.released.A.numpy(), A + E, rtol=0, atol=grid_a)
    np.testing.assert_allclose(noisy.released.B.numpy(), noisy_b, rtol=0, atol=grid_b)
    # the solve of the released sums (just checked against the sums plus the reference noise)
    W = ssp_weights(noisy.released.A.numpy(), noisy.released.B.numpy(), scale.a_off_diagonal, lam)
    norms = np.linalg.norm(W[:-1], axis=0)
    coef, bias = (W[:-1] / norms).T, W[-1] / norms
    np.testing.assert_allclose(model.coef_, coef, rtol=1e-7, atol=1e-10)
    np.testing.assert_allclose(model.intercept_, bias - coef @ mu, rtol=1e-7, atol=1e-9)    # shifted back
    Zt, _ = data(50, 2)
    np.testing.assert_allclose(Zt @ model.coef_.T + model.intercept_, (Zt - mu) @ coef.T + bias, atol=1e-9)
    raw = model.raw_weights_
    np.testing.assert_allclose(np.hstack([Zt, np.ones((50, 1))]) @ raw, np.hstack([Zt - mu, np.ones((50, 1))]) @ W,
                               atol=1e-8)


def handlers(devices, folder, n=3):
    """Each device's Fed3R task, its sample windows kept in folder/<device> (the job caps samples:
    a device without a state folder would decline, edge_client/sample_windows.py)."""
    out = {}
    for i, d in enumerate(devices):
        Z, y = data(n, 10 + i)
        out[d] = Fed3RStatsTask(Z.astype(np.float32), y, lambda b, s, w: Features(D), windows=kept_windows(folder / d))
    return out


def config(**over):
    return {"num_classes": C, "feature_dim": D, "dp_noise_multiplier": 2.0, "feature_clip_norm": 20.0,
            "max_samples": 1, "dp_center_devices": 3, "dp_center_clip_norm": 3.0, "clients_per_round": 10,
            "seed": 4, "max_abs_feature": 50.0, **over}


def test_job_asks_m_devices_for_the_center_then_centres_the_rest(tmp_path):
    devices = [f"cam-{i}" for i in range(8)]
    job = build_job("fed3r", config())
    h = handlers(devices, tmp_path)
    first = run_round(job, h, KIND)
    assert len(first) == 3 and all(not params.get("centered") for params, *_ in first.values())
    mu = job.strategy.center.value
    assert mu is not None and job.contributions == 0                  # the center round released only μ̂
    assert job.evaluate(None, None)["privacy"]["releases"] == 1        # ... and that is the job's one release
    second = run_round(job, h, KIND)
    assert sorted(second) == sorted(set(devices) - set(first))        # each device once
    for d, (params, tensors, body, out) in second.items():
        assert params["centered"] and params["feature_clip_norm"] == 3.0
        np.testing.assert_array_equal(tensors[CENTER_TENSOR], mu)
        row = clip(h[d].images[:1].astype(np.float64) - mu, 3.0)      # what the device sent: its centred row
        assert np.linalg.norm(row) <= 3.0 + 1e-9
    assert job.contributions == 5 and job.strategy.releases == 1
    state = job.state_dict()
    again = build_job("fed3r", config())
    again.load_state_dict(state)                                      # a restart keeps the center
    np.testing.assert_array_equal(again.strategy.center.value, mu)
    np.testing.assert_allclose(again.model().intercept_, job.model().intercept_, rtol=1e-12)


def test_the_center_round_waits_for_its_m_devices_and_drops_a_round_most_of_them_left(tmp_path):
    job = build_job("fed3r", config(dp_center_devices=4))
    devices = [f"cam-{i}" for i in range(9)]
    h = handlers(devices, tmp_path)
    assert job.next_participants(set(devices[:3])) == []              # 3 online < m = 4: no round yet
    chosen = job.next_participants(set(devices))
    assert len(chosen) == 4
    answered = chosen[0]                                              # the other three time out
    job.apply(answered, job.parse_result(result_envelope(h[answered], *job.task_for(answered))))
    job.close_round(RoundClosed(job.round, (answered,), tuple(chosen[1:]), (), ()))
    assert job.strategy.centering and job.strategy.releases == 0      # 1 of 4 < 2: dropped, not released
    assert job.evaluate(None, None)["privacy"]["releases"] == 0
    again = job.next_participants(set(devices))
    assert answered not in again and len(again) == 4                  # who answered is never asked again


def result_envelope(handler, params, tensors):
    body, out = handler(params, tensors)
    return decode(encode(result_message("cam-0", TaskRef("fed3r", 2, "x" * 32), KIND, body, out)))


def test_no_release_round_smaller_than_dp_min_round_devices_opens(tmp_path):
    """``dp_min_round_devices``: every round of the model is a release with noise of its own, so a
    round of fewer devices is not opened (the center round is its own rule), and the job is
    finished once fewer than that many devices are left to ask."""
    devices = [f"cam-{i}" for i in range(10)]
    job = build_job("fed3r", config(dp_min_round_devices=4, max_attempts=2))
    h = handlers(devices, tmp_path)
    assert len(run_round(job, h, KIND)) == 3                          # the center round: m = 3 < 4 is fine
    rest = sorted(set(devices) - set(job.contributed) - set(job.attempts))
    assert job.next_participants(set(rest[:3])) == [] and job.round == 1     # 3 online < 4: no release yet
    assert not job.finished(set(rest[:3]), set(rest))                 # 7 known: it waits for them
    sent = run_round(job, h, KIND, only=rest, silent=rest[:2])        # 5 answer, 2 drop out
    assert len(sent) == 5 and job.strategy.releases == 1
    assert job.eligible(set(rest)) == rest[:2]                        # asked once of twice: still eligible
    assert job.next_participants(set(devices)) == [] and job.finished(set(devices), set(devices))   # 2 < 4
    plain = build_job("fed3r", config(max_attempts=2))
    run_round(plain, h, KIND)
    run_round(plain, h, KIND, only=rest, silent=rest[:2])
    assert sorted(plain.next_participants(set(devices))) == rest[:2]   # without it: a second release of 2


@pytest.mark.parametrize("kind, over, message", [
    ("fed3r", {"dp_noise_multiplier": 0.0, "dp_center_devices": 0, "dp_min_round_devices": 5}, "need DP"),
    ("fed3r-sync", {"dp_min_round_devices": 5}, "each group is a release"),
])
def test_dp_min_round_devices_is_central_dps(kind, over, message):
    with pytest.raises(ValueError, match=message):
        build_job(kind, config(**over))


def test_bad_centers_are_declined_and_uncentred_rows_refused(tmp_path):
    job = build_job("fed3r", config())
    h = handlers(["cam-0", "cam-1", "cam-2"], tmp_path)
    run_round(job, h, KIND)
    params, tensors = job.task_for("cam-9")
    device = handlers(["cam-9"], tmp_path)["cam-9"]
    for bad in ({}, {CENTER_TENSOR: np.zeros(D + 1)}, {CENTER_TENSOR: np.full(D, np.nan)}):
        with pytest.raises(TaskDeclined):
            device(params, bad)
    uncentred = {**params, "centered": None, "feature_clip_norm": 20.0}   # a device that ignores the center
    with pytest.raises(EnvelopeError, match="clipped bound"):
        job.parse_result(result_envelope(device, {k: v for k, v in uncentred.items() if v is not None}, {}))
    job.parse_result(result_envelope(device, params, tensors))           # the honest one passes


@pytest.mark.parametrize("over, message", [
    ({"dp_noise_multiplier": 0.0}, "need DP"),
    ({"dp_center_clip_norm": 0.0}, "dp_center_clip_norm > 0"),
    ({"fit_intercept": False}, "fit_intercept"),
    ({"random_features": {"seed": 1, "dim": 16, "sigma": 1.0}}, "random_features"),
])
def test_job_refuses_a_centring_it_cannot_do(over, message):
    with pytest.raises(ValueError, match=message):
        build_job("fed3r", config(**over))


def test_secure_fed3r_center_round_is_a_secure_group():
    with pytest.raises(ValueError, match="at least 3"):
        build_job("fed3r-sync", config(dp_center_devices=2))


def sync_job(devices, **over):
    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from protocols.identity import DeviceIdentity, IdentityRegistry

    return Fed3RSyncJob(Fed3RSyncConfig(**config(**over)), identity=DeviceIdentity.generate("aggregator"),
                        registry=IdentityRegistry({d: DeviceIdentity.generate(d).public_key_bytes for d in devices}))


def test_secure_device_sends_its_noisy_feature_sum_then_centred_statistics(tmp_path):
    """Fed3R-Sync's device (``SecureFed3R``) against numpy, the same seeded noise: in the center
    round, (Σ z, n) of its first N rows clipped to F with noise on every entry, the count's too;
    after it, the statistics of its rows minus the center, clipped to F_c, blocks scaled, noised."""
    from edge_client.tasks.secure_fed3r import SecureFed3R
    from protocols.identity import DeviceIdentity
    from protocols.payloads.secagg import pack_sync_vector, scale_sync_blocks
    from protocols.secagg.distributed_dp import add_skellam_noise

    devices = [f"cam-{i}" for i in range(6)]
    job = sync_job(devices, max_samples=2)
    chosen = job.next_participants(set(devices))
    assert len(chosen) == 3 and job.strategy.centering
    params, tensors = job.task_for(chosen[0])
    assert params["center_round"] and "block_scales" not in params and not tensors and params["feature_clip_norm"] == 20.0
    Z, y = data(5, 7)
    device = SecureFed3R(DeviceIdentity.generate("cam-0"), job.identity.public_key_bytes,
                         Fed3RStatsTask(Z.astype(np.float32), y, lambda b, s, w: Features(D),
                                        windows=kept_windows(tmp_path)),
                         noise_rng=np.random.default_rng(11))
    # cap_by_weight: all 5 rows, each weighed 2/5 (the cap of 2 samples in all)
    assert params["cap_by_weight"] and params["max_samples"] == 2
    rows = clip(Z.astype(np.float32).astype(np.float64), 20.0)
    dp = params["dp"]
    expected = add_skellam_noise(np.r_[rows.sum(axis=0) * (2 / 5), 2.0], dp["stddev"], dp["scale_bits"],
                                 np.random.default_rng(11), noised=slice(0, D + 1))
    np.testing.assert_allclose(device.vector(params, tensors), expected, rtol=1e-12, atol=1e-9)

    mu = np.linspace(-1.0, 1.0, D) * 0.5           # the center as released (any value: the device takes it)
    job.strategy.center.release_noised(np.r_[mu * 4, 4.0], 3)
    for d in chosen:
        job.contributed[d] = 0
    rest = job.next_participants(set(devices))
    assert not job.strategy.centering and sorted(rest) == sorted(set(devices) - set(chosen))
    params, tensors = job.task_for(rest[0])
    assert params["centered"] and params["feature_clip_norm"] == 3.0 and "center_round" not in params
    np.testing.assert_array_equal(tensors[CENTER_TENSOR], mu)
    rows = np.hstack([clip(Z.astype(np.float32).astype(np.float64) - mu, 3.0), np.ones((5, 1))])
    A, B = (rows.T @ rows) * (2 / 5), (rows.T @ np.eye(C)[y]) * (2 / 5)
    scales, dp = params["block_scales"], params["dp"]
    vector = scale_sync_blocks(pack_sync_vector(A[np.triu_indices(D + 1)], B.T, 0), D + 1, C,
                               scales["a_off_diagonal"], scales["b"])
    vector[-1] = 1.0
    device.noise_rng = np.random.default_rng(12)
    expected = add_skellam_noise(vector, dp["stddev"], dp["scale_bits"], np.random.default_rng(12),
                                 noised=slice(0, len(vector) - 1))
    np.testing.assert_allclose(device.vector(params, tensors), expected, rtol=1e-12, atol=1e-9)


def test_a_devices_noise_shares_are_each_seeded_afresh_from_the_operating_system(tmp_path, monkeypatch):
    """Unseeded (as a device runs), each noise share comes from a generator seeded from 256 bits of
    os.urandom drawn for that share, never from one stream for the process's life (PCG64 is not
    cryptographic: inferring its state once gave every later share; the Java device draws from
    SecureRandom). With os.urandom pinned, two shares of the same vector are the same bits, and the
    same as a generator seeded with those bits; unpinned, they differ."""
    from edge_client.tasks.secure_fed3r import SecureFed3R
    from protocols.identity import DeviceIdentity
    from protocols.secagg.distributed_dp import add_skellam_noise

    devices = [f"cam-{i}" for i in range(6)]
    job = sync_job(devices, max_samples=2)
    chosen = job.next_participants(set(devices))
    params, tensors = job.task_for(chosen[0])
    Z, y = data(5, 7)
    device = SecureFed3R(DeviceIdentity.generate("cam-0"), job.identity.public_key_bytes,
                         Fed3RStatsTask(Z.astype(np.float32), y, lambda b, s, w: Features(D),
                                        windows=kept_windows(tmp_path)))
    first, second = device.vector(params, tensors), device.vector(params, tensors)
    assert not np.array_equal(first, second)              # fresh entropy: other noise
    pinned = bytes(range(32))
    import os

    monkeypatch.setattr(os, "urandom", lambda n: pinned[:n])
    first, second = device.vector(params, tensors), device.vector(params, tensors)
    np.testing.assert_array_equal(first, second)
    rows = clip(Z.astype(np.float32).astype(np.float64), 20.0)
    dp = params["dp"]
    seeded = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int.from_bytes(pinned, "big"))))
    expected = add_skellam_noise(np.r_[rows.sum(axis=0) * (2 / 5), 2.0], dp["stddev"], dp["scale_bits"], seeded,
                                 noised=slice(0, D + 1))
    np.testing.assert_allclose(first, expected, rtol=1e-12, atol=1e-9)
