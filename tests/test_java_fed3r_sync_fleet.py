"""Fed3R-Sync under distributed DP with Java and Python devices in one SecAgg group over
mosquitto, with and without a private feature center: what the aggregator releases is checked
against numpy (the clipped, capped, scaled sums plus the protocol's noise)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import java_build
from ops_fleet import kept_windows
from java_tasks import C, JAVA_IDS, PY_IDS, java_cp, start_java_devices, stop_mixed_fleet  # noqa: F401 (java_cp: a fixture)

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def run_mixed_sync_fleet(java_cp, broker, tmp_path, job, agg, keys, seeds, py_ids, data, dim) -> None:
    """Serve the Fed3R-Sync ``job`` to JAVA_IDS (one JVM) and Python agents ``py_ids`` (device i
    on ``data(i)``, Java first) until it is done with every device contributing."""
    from ops_fleet import Features, RecordingService

    from edge_client.agent import DeviceAgent
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.secure_fed3r import SecureFed3R
    from protocols.mqtt_link import BrokerConfig
    from protocols.payloads.secagg import SECAGG_TYPE, SYNC_KIND

    ids = JAVA_IDS + list(py_ids)
    service = RecordingService(job, broker.url, tmp_path / "out", set(ids), identity=agg)
    # every device with a state folder: the DP job caps their samples (edge_client/sample_windows.py)
    jvm = start_java_devices(java_cp, broker.url, tmp_path, ["--aggregator-key", agg.public_key_bytes.hex(),
                                                             "--state-dir", str(tmp_path / "java_state")],
                             seeds=seeds, data=data)
    agents = []
    for i, d in enumerate(py_ids, start=len(JAVA_IDS)):
        secure = SecureFed3R(keys[d], agg.public_key_bytes, Fed3RStatsTask(
            *data(i), lambda b, s, w: Features(dim), windows=kept_windows(tmp_path / "py_state" / d)))
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url), {}, aggregator_key=agg.public_key_bytes,
                                  protocol_handlers={SYNC_KIND: secure, SECAGG_TYPE: secure}).start())
    try:
        result = service.join(150)
    finally:
        out, err = stop_mixed_fleet(agents, jvm)
    assert result.get("state") == "done" and sorted(result["contributed"]) == sorted(ids), (result, err[-3000:])


def test_mixed_fleet_fed3r_sync_under_distributed_dp_releases_clipped_sums_plus_noise(java_cp, broker, tmp_path):
    """Fed3R-Sync under distributed DP with Java and Python devices in one SecAgg group: every
    device clips its features, caps its samples, scales its vector's blocks (``block_scales``) and
    adds its noise share; what the aggregator releases is the clipped sums plus ``ssp``'s per-block
    noise (survivors × the per-device variance on A's diagonal, divided by the square of each
    block's scale off it and on B; χ² bounds at 1e-6 per block, 465 off-diagonal and 124 B
    entries: without the Java devices' shares the ratio would be 0.4, many standard deviations
    off, and a device that did not scale would fail the round by its count slot), so the Java
    devices' clipping (features ~10× the clip norm), cap (20 of 37 samples), scaling and noise are
    the protocol's."""
    from ops_fleet import assert_noise_of_variance, clipped_sums

    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from protocols.identity import DeviceIdentity, IdentityRegistry

    ids, F, N, dim = JAVA_IDS + PY_IDS, 4.0, 20, 30

    def data(i):
        rng = np.random.default_rng(700 + i)
        y = rng.integers(0, C, 37)
        return (10 * (rng.normal(size=(37, dim)) + 2 * np.eye(C, dim)[y])).astype(np.float32), y

    seeds = {d: os.urandom(32) for d in JAVA_IDS}
    keys = {**{d: DeviceIdentity.from_private_bytes(d, s) for d, s in seeds.items()},
            **{d: DeviceIdentity.generate(d) for d in PY_IDS}}
    agg = DeviceIdentity.generate("aggregator")
    cfg = Fed3RSyncConfig(job_id="dp-sync", num_classes=C, feature_dim=dim, clients_per_round=len(ids),
                          expected_devices=len(ids), start_timeout_s=30, round_timeout_s=60, max_samples=N,
                          feature_clip_norm=F, dp_noise_multiplier=0.8, dp_target_epsilon=8.0, phase_timeout_s=4,
                          max_attempts=1)
    job = Fed3RSyncJob(cfg, identity=agg, registry=IdentityRegistry({d: k.public_key_bytes for d, k in keys.items()}))
    run_mixed_sync_fleet(java_cp, broker, tmp_path, job, agg, keys, seeds, PY_IDS, data, dim)
    A, B = clipped_sums(map(data, range(len(ids))), C, N, F)
    assert job.strategy.releases == 1
    # one stddev on every entry of the block-scaled vectors: ssp's per-block noise once scaled back
    total, scales = len(ids) * job._round_dp["stddev"] ** 2, cfg.block_scales()
    assert scales.a_off_diagonal == pytest.approx(2 ** 0.5) and scales.b > 1.5
    assert_noise_of_variance(job.strategy.released, A, B,
                             (total, total / scales.a_off_diagonal ** 2, total / scales.b ** 2))


def test_mixed_fleet_fed3r_sync_with_a_private_center_releases_the_center_then_centred_sums(java_cp, broker, tmp_path):
    """Fed3R-Sync under distributed DP with a private feature center (``dp_center_devices``), Java
    and Python devices in each group: the center round's members send (Σ z, n) of their clipped
    rows with their noise share (``center_round``), whose noisy group sum is the center; the
    rest centre their rows on it (the ``feature_center`` tensor), clip them to F_c, scale their
    blocks and add their share. Checked against numpy: the center round's sum is the members'
    clipped (Σ z, n) plus noise of the survivors' variance on every entry, the released sums are
    the others' centred, clipped statistics plus ``ssp``'s per-block noise (χ² bounds at 1e-6: a
    device that did not centre, or sent its whole statistics in the center round, fails them),
    and the model is the centred one shifted back to raw features."""
    from ops_fleet import assert_noise_of_variance
    from scipy import stats as scipy_stats

    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from protocols.identity import DeviceIdentity, IdentityRegistry

    py_ids = ["py0", "py1", "py2"]
    ids, F, Fc, N, dim = JAVA_IDS + py_ids, 400.0, 12.0, 20, 30

    def data(i):
        rng = np.random.default_rng(900 + i)
        y = rng.integers(0, C, 37)
        return (10 * (rng.normal(size=(37, dim)) + 2 * np.eye(C, dim)[y] + 5)).astype(np.float32), y   # a large mean

    seeds = {d: os.urandom(32) for d in JAVA_IDS}
    keys = {**{d: DeviceIdentity.from_private_bytes(d, s) for d, s in seeds.items()},
            **{d: DeviceIdentity.generate(d) for d in py_ids}}
    agg = DeviceIdentity.generate("aggregator")
    cfg = Fed3RSyncConfig(job_id="dp-sync-center", num_classes=C, feature_dim=dim, clients_per_round=3,
                          expected_devices=len(ids), start_timeout_s=30, round_timeout_s=60, max_samples=N,
                          feature_clip_norm=F, dp_center_devices=3, dp_center_clip_norm=Fc, dp_noise_multiplier=0.002,
                          phase_timeout_s=4, max_attempts=1, seed=5)   # noise far below the data: it is checked too
    job = Fed3RSyncJob(cfg, identity=agg, registry=IdentityRegistry({d: k.public_key_bytes for d, k in keys.items()}))
    sums, on_sum = [], job.on_secure_sum
    job.on_secure_sum = lambda total, survivors: (
        sums.append((job.strategy.centering, survivors, np.array(total), job._round_dp["stddev"])), on_sum(total, survivors))
    run_mixed_sync_fleet(java_cp, broker, tmp_path, job, agg, keys, seeds, py_ids, data, dim)
    assert [centering for centering, *_ in sums] == [True, False]
    (_, members, center_sum, center_stddev), (_, others, _, _) = sums
    assert sorted(members + others) == sorted(ids)
    assert {d[:2] for d in members} == {"ja", "py"} or {d[:2] for d in others} == {"ja", "py"}   # a mixed group
    rows = {d: data(ids.index(d)) for d in ids}

    def clipped(Z, clip):
        Z = Z.astype(np.float64)
        return Z * np.minimum(1.0, clip / np.linalg.norm(Z, axis=1, keepdims=True))

    w = N / 37                                  # cap_by_weight: every one of a device's 37 rows weighed to N in all
    exact = np.concatenate([sum(w * clipped(rows[d][0], F).sum(axis=0) for d in members), [N * len(members)]])
    noise = center_sum - exact
    lo, hi = scipy_stats.chi2.ppf([1e-6, 1 - 1e-6], noise.size) / noise.size
    assert lo < np.mean(noise ** 2) / (len(members) * center_stddev ** 2) < hi
    mu = job.strategy.center.value
    np.testing.assert_allclose(mu, center_sum[:-1] / max(center_sum[-1], 1.0), rtol=1e-12)   # dp_center.py
    A = B = 0.0
    for d in others:
        Zc = np.hstack([clipped(rows[d][0].astype(np.float64) - mu, Fc), np.ones((37, 1))])
        A, B = A + w * (Zc.T @ Zc), B + w * (Zc.T @ np.eye(C)[rows[d][1]])
    total, scales = len(others) * job._round_dp["stddev"] ** 2, cfg.block_scales()
    assert job.strategy.releases == 1           # the center round released μ̂ only
    assert_noise_of_variance(job.strategy.released, A, B,
                             (total, total / scales.a_off_diagonal ** 2, total / scales.b ** 2))
    model, Zt = job.model(), rows[ids[0]][0][:5].astype(np.float64)
    # the group's sum carries s/t of a release's variance (each member adds σ²/t): what the denoising reads
    assert job.strategy.noise_units == len(others) / job._round_dp["threshold"]
    centred = job.strategy.mechanism.solve(job.strategy.released, job.strategy.noise_units)
    np.testing.assert_allclose(Zt @ model.coef_.T + model.intercept_,
                               (Zt - mu) @ centred.coef_.T + centred.intercept_, rtol=1e-9, atol=1e-9)

