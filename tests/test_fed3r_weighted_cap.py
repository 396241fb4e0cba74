"""A DP Fed3R task's cap by weight (``cap_by_weight``): the device sums every one of its n samples,
each weighed min(1, N/n), instead of keeping its first N. Against numpy: the packed and the factor
form carry w·ZᵀZ and w·ZᵀY with n = N; the aggregator's checks accept the weighted contribution
(fractional class counts, a factor of more rows than n) at exactly the bound N clipped rows allow,
and still refuse one past it; a DP job asks for it, a streaming one does not."""

import numpy as np
import pytest
from ops_fleet import Features, kept_windows
from stateful_jobs import run_round

from aggregator.jobs.registry import build_job
from aggregator.strategies.dp_fed3r import check_bounded
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from protocols.envelope import EnvelopeError, decode, encode
from protocols.messages import TaskRef, result_message
from protocols.payloads.fed3r import KIND, parse_stats

D, C, F = 12, 3, 4.0
PARAMS = {"num_classes": C, "backbone": "b", "image_size": 8, "weights_sha256": "", "fit_intercept": True,
          "random_features": None, "format": "dense", "dtype": "float64", "feature_clip_norm": F,
          "max_samples": 3, "cap_samples": True, "cap_by_weight": True}


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, C, n)
    return (3.0 * rng.normal(size=(n, D)) + 4 * np.eye(C, D)[y]).astype(np.float32), y


def reference(Z: np.ndarray, y: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(A, B, n) by hand: rows clipped to F, the bias appended, every row weighed min(1, cap/n)."""
    Z = Z.astype(np.float64)
    Z = Z * np.minimum(1.0, F / np.linalg.norm(Z, axis=1, keepdims=True))
    Za = np.hstack([Z, np.ones((len(Z), 1))])
    w = min(1.0, cap / len(Z))
    return w * (Za.T @ Za), w * (Za.T @ np.eye(C)[y]), min(len(Z), cap)


def dense(stats) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of parsed statistics, packed or factor, as full p x p and p x C matrices."""
    p = stats.p
    if stats.r_factor is not None:
        R = stats.full_factor()
        A, rows = R.T @ R, (R.T @ stats.qty).T
    else:
        A = np.zeros((p, p))
        A[np.triu_indices(p)] = stats.a_upper
        A = A + np.triu(A, 1).T
        rows = stats.b
    B = np.zeros((p, C))
    B[:, stats.class_ids] = rows.T
    return A, B


def answer(Z, y, params, folder):
    task = Fed3RStatsTask(Z, y, lambda b, s, w: Features(D), windows=kept_windows(folder))
    body, tensors = task(params, None)
    return decode(encode(result_message("cam-1", TaskRef("j", 1, "t"), KIND, body, tensors)))


@pytest.mark.parametrize("n", [10, 3, 2], ids=["weighed", "at-the-cap", "under-the-cap"])
def test_the_packed_statistics_weigh_every_sample_to_the_cap(tmp_path, n):
    Z, y = data(n, n)
    env = answer(Z, y, PARAMS, tmp_path)
    stats = parse_stats(env, D + 1, C, max_samples=3, weighed=True)
    A, B, count = reference(Z, y, 3)
    assert stats.n == count
    got_a, got_b = dense(stats)
    np.testing.assert_allclose(got_a, A, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_b, B, rtol=1e-12, atol=1e-12)
    check_bounded(stats, 3, F, True)


def test_the_factor_form_carries_both_factors_times_the_root_of_the_weight(tmp_path):
    Z, y = data(7, 1)                                   # 7 rows < p = 13: the factor form is smaller
    env = answer(Z, y, {**PARAMS, "format": "sparse", "factor": True, "max_samples": 2}, tmp_path)
    assert env.body["a_format"] == "factor" and env.body["n"] == 2 and len(env.tensors["R"]) == 7
    with pytest.raises(EnvelopeError, match="factor R has 7 rows"):      # 7 rows, n = 2: only weighed
        parse_stats(env, D + 1, C, max_samples=2)
    stats = parse_stats(env, D + 1, C, max_samples=2, weighed=True)
    A, B, _ = reference(Z, y, 2)
    got_a, got_b = dense(stats)
    np.testing.assert_allclose(got_a, A, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(got_b, B, rtol=1e-11, atol=1e-11)
    check_bounded(stats, 2, F, True)


def test_weighted_counts_are_accepted_only_where_the_task_weighed(tmp_path):
    Z, y = data(10, 4)
    env = answer(Z, y, PARAMS, tmp_path)
    with pytest.raises(EnvelopeError, match="do not add up"):         # class counts 0.3, 0.9, 1.8
        parse_stats(env, D + 1, C, max_samples=3)
    assert parse_stats(env, D + 1, C, max_samples=3, weighed=True).n == 3


def test_the_bound_is_met_exactly_by_rows_at_the_clip_and_broken_past_it(tmp_path):
    """49 rows of norm F in one class, weighed to 1: ‖A‖ = R² (attained, the weights' rounding within
    check_bounded's slack); the same rows weighed to 1.5 by a device that lies about n are refused."""
    Z = np.full((49, D), 10.0, dtype=np.float32)
    y = np.zeros(49, dtype=np.int64)
    env = answer(Z, y, {**PARAMS, "max_samples": 1}, tmp_path / "a")
    stats = parse_stats(env, D + 1, C, max_samples=1, weighed=True)
    a_norm = np.linalg.norm(dense(stats)[0])
    assert a_norm == pytest.approx(F * F + 1, rel=1e-12)
    check_bounded(stats, 1, F, True)
    forged = env.tensors["A_upper"] * 1.5
    with pytest.raises(ValueError, match="exceed the clipped bound"):
        check_bounded(type(stats)(n=1, p=D + 1, a_upper=forged, class_ids=stats.class_ids, b=stats.b), 1, F, True)


def job_config(**over):
    return {"num_classes": C, "feature_dim": D, "dp_noise_multiplier": 2.0, "feature_clip_norm": F,
            "max_samples": 2, "clients_per_round": 10, "seed": 4, **over}


def test_a_dp_job_asks_for_the_weighted_cap_and_takes_what_it_sends(tmp_path):
    devices = [f"cam-{i}" for i in range(4)]
    handlers = {d: Fed3RStatsTask(*data(5 + i, 10 + i), lambda b, s, w: Features(D), windows=kept_windows(tmp_path / d))
                for i, d in enumerate(devices)}
    job = build_job("fed3r", job_config())
    sent = run_round(job, handlers, KIND)
    assert sorted(sent) == devices
    for d, (params, _, body, _) in sent.items():
        assert params["cap_samples"] and params["cap_by_weight"] and params["max_samples"] == 2
        assert body["n"] == 2                                          # 5..8 samples, weighed to 2
    assert job.contributions == 4
    streaming = build_job("fed3r", {**job_config(dp_noise_multiplier=0.0), "streaming": True})
    params, _ = streaming.task_for(devices[0])
    assert params["cap_samples"] and "cap_by_weight" not in params     # a stream counts the samples it holds
