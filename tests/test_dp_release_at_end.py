"""DP Fed3R releasing once, when the job ends (``dp_release`` "end", ``NoisyFed3R.release_at_end``):
closed rounds' sums are held exactly and noised once, so the model holds one release's noise
however many rounds ran. Against numpy and against a one-round release drawing the same noise;
over mosquitto: no model (no accuracy) before the end, one noisy sum after it, and the job's files
never hold the unreleased sums."""

import json

import numpy as np
import pytest
from ops_fleet import Features, assert_noise_of_variance, clipped_sums
from test_dp_over_mqtt import C, D, device_data, run_service

from aggregator.compute.privacy import UNPUBLISHED_PREFIX
from aggregator.jobs.registry import build_job
from aggregator.strategies.dp_fed3r import CalibratedSSP, Fed3RSensitivity, NoisyFed3R
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from protocols.payloads.fed3r import Fed3RStats

P = D + 1


def stats(seed: int, n: int = 7) -> Fed3RStats:
    rng = np.random.default_rng(seed)
    Z = np.hstack([rng.normal(size=(n, D)), np.ones((n, 1))])
    y = rng.integers(0, C, n)
    A, B = Z.T @ Z, Z.T @ np.eye(C)[y]
    return Fed3RStats(n=n, p=P, a_upper=A[np.triu_indices(P)], class_ids=np.arange(C), b=B.T)


def strategy(release_at_end: bool, seed: int = 3) -> NoisyFed3R:
    mechanism = CalibratedSSP(1.5, Fed3RSensitivity.of(1, 4.0, True), 0.2)
    return NoisyFed3R(C, P, 0.01, True, True, mechanism, rng=np.random.default_rng(seed), release_at_end=release_at_end)


def test_held_rounds_are_exact_and_released_once_as_one_round_of_them_all():
    rounds = [[stats(1), stats(2)], [stats(3)], [stats(4), stats(5), stats(6)]]
    held = strategy(True)
    for members in rounds:
        for s in members:
            held.add(s)
        held.release()                                  # a round closes: nothing released
        assert held.releases == 0 and held.unreleased
    exact = sum(np.asarray(s.a_upper) for members in rounds for s in members)
    np.testing.assert_allclose(held.held.packed_upper(), exact, rtol=1e-13)
    assert held.n_contributions == 6 and held.n_samples == 42
    assert held.release_held() and not held.release_held()       # once; a second call has nothing to release
    assert held.releases == 1 and not held.unreleased and held.n_contributions == 6
    # the same noise draw on the same total, released as one round: the same model
    one_round = strategy(False)
    one_round.take_round_sum(held_sum_state(rounds))
    one_round.release()
    np.testing.assert_allclose(held.released.packed_upper(), one_round.released.packed_upper(), rtol=1e-12)
    np.testing.assert_allclose(held.solve().coef_, one_round.solve().coef_, rtol=1e-9, atol=1e-12)
    # where releasing every round left three rounds' noise
    per_round = strategy(False)
    for members in rounds:
        for s in members:
            per_round.add(s)
        per_round.release()
    assert per_round.releases == 3


def held_sum_state(rounds) -> dict:
    total = strategy(True).held
    for members in rounds:
        for s in members:
            total.add(s)
    return total.sums_state()


def test_a_restart_resumes_the_held_sums_and_the_files_never_hold_them():
    s = strategy(True)
    s.add(stats(1))
    s.release()
    state = s.state_dict()
    unpublished = [k for k in state if k.startswith(UNPUBLISHED_PREFIX)]
    assert unpublished and all(np.array_equal(state[k], v) for k, v in s.state_dict().items())
    resumed = strategy(True)
    resumed.load_state_dict(state)
    assert resumed.unreleased and np.array_equal(resumed.held.packed_upper(), s.held.packed_upper())
    # a job releasing each round checkpoints no held sums
    assert not [k for k in strategy(False).state_dict() if k.startswith(UNPUBLISHED_PREFIX)]


@pytest.mark.parametrize("kind,fields,message", [
    ("fed3r", {"dp_release": "later"}, "dp_release"),
    ("fed3r", {"dp_noise_multiplier": 0.0, "dp_release": "end"}, "need DP"),
    ("fed3r-sync", {"dp_release": "end"}, "central DP's rule"),
])
def test_a_release_the_job_cannot_make_is_refused(kind, fields, message):
    config = {"num_classes": C, "feature_dim": D, "dp_noise_multiplier": 1.0, "feature_clip_norm": 4.0,
              "max_samples": 5, **fields}
    with pytest.raises(ValueError, match=message):
        build_job(kind, config)


def test_dp_fed3r_over_mosquitto_releases_its_rounds_once_at_the_end(broker, tmp_path):
    ids = [f"dev{i}" for i in range(5)]
    F, N, z = 4.0, 20, 0.8
    cfg = {"job_id": "dp-end", "num_classes": C, "feature_dim": D, "clients_per_round": 2, "round_timeout_s": 30,
           "expected_devices": 5, "dp_noise_multiplier": z, "dp_target_epsilon": 8.0, "feature_clip_norm": F,
           "max_samples": N, "dp_mechanism": "gaussian", "dp_release": "end"}
    job = build_job("fed3r", cfg)
    result = run_service(job, broker, tmp_path, ids,
                         lambda i: {"fed3r.stats": Fed3RStatsTask(*device_data(i), lambda b, s, w: Features(D))})
    assert result["state"] == "done" and len(job.contributed) == 5
    A, B = clipped_sums(map(device_data, range(5)), C, N, F)
    # three rounds, one noisy sum: one draw's variance in every entry (three rounds' when each is released)
    assert job.strategy.releases == 1 and not job.strategy.unreleased
    assert_noise_of_variance(job.strategy.released, A, B, job.config.mechanism().scale().b ** 2)
    saved = json.loads((tmp_path / "results.json").read_text())
    before_end = saved["history"][:-1]
    assert len(before_end) >= 2 and all(e["held_until_job_end"] and "accuracy" not in e for e in before_end)
    assert saved["final"]["privacy"]["noisy_sums"] == 1 and "held_until_job_end" not in saved["final"]
    with np.load(tmp_path / "statistics.npz") as files:
        assert not [k for k in files.files if k.startswith(UNPUBLISHED_PREFIX)]
        np.testing.assert_array_equal(files["B"], job.strategy.released.B.cpu().numpy())


def test_simulate_refuses_a_release_it_does_not_know():
    import dataclasses

    from fedfleet.dp_fleet import dp_job_fields
    from fedfleet.simulate import PRESETS

    cfg = dataclasses.replace(PRESETS["smoke"], dp_epsilon=1.0, dp_release="never")
    with pytest.raises(ValueError, match="dp_release must be one of"):
        dp_job_fields(cfg, "fed3r", {"num_classes": C, "feature_dim": D})
