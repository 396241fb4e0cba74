"""FedNCM == the normalised class means of the pooled data (numpy reference), from Fed3R's uploads."""

import numpy as np
import pytest

from aggregator.jobs.registry import build_job, job_kind_name
from aggregator.strategies.fedncm import FedNCM
from edge_client.fed3r import Fed3RAccumulator
from protocols.envelope import Envelope, decode, encode
from protocols.payloads.fed3r import encode_stats, parse_stats


def reference_head(Z, y, C):
    """numpy: per-class mean, divided by its norm; an unseen class gets a zero row."""
    W = np.zeros((C, Z.shape[1]))
    for c in range(C):
        if (y == c).any():
            mu = Z[y == c].mean(axis=0)
            W[c] = mu / np.linalg.norm(mu)
    return W


def device_results(Z, y, C, splits, dense):
    """Each device's Fed3R upload, as the device code computes and the wire carries it."""
    for k, idx in enumerate(splits):
        acc = Fed3RAccumulator(C, Z.shape[1], True, None)
        for chunk in np.array_split(idx, 2):
            acc.update(Z[chunk], y[chunk])
        A, ids, b = acc.sparse()
        body, tensors = encode_stats(A, ids, b, acc.n, C, dense=dense)
        yield decode(encode(Envelope("result", f"dev{k}", body, tensors)))


@pytest.mark.parametrize("dense", [False, True])
def test_fedncm_equals_the_numpy_class_means(dense):
    rng = np.random.default_rng(3)
    C, d, n = 6, 9, 240
    Z = rng.normal(size=(n, d)) + 2.0 * rng.normal(size=(C, d))[rng.integers(0, C, n)]
    y = rng.integers(0, C - 1, size=n)                 # class C-1 never seen
    Z += 3.0 * np.eye(C, d)[y]                         # classes separable enough for a non-trivial score
    splits = [np.flatnonzero(y == c) for c in range(C - 1)]      # every device one class (label skew)
    splits = [s for part in splits for s in np.array_split(part, 2)]
    server = FedNCM(C, d + 1, device="cpu")
    for env in device_results(Z, y, C, splits, dense):
        server.add(parse_stats(env, server.p, C))
    model = server.solve()
    ref = reference_head(Z, y, C)
    assert np.abs(model.coef_ - ref).max() < 1e-12
    assert np.array_equal(model.intercept_, np.zeros(C))
    assert np.array_equal(model.counts_, np.bincount(y, minlength=C))
    ref_pred = (Z @ ref.T).argmax(1)
    assert np.array_equal(model.predict(Z), ref_pred)
    assert model.score(Z, y) == np.mean(ref_pred == y) > 0.5


def test_the_job_serves_the_means_through_fed3rs_task_and_refuses_what_it_cannot_compute():
    rng = np.random.default_rng(0)
    C, d = 3, 5
    Z, y = rng.normal(size=(60, d)) + np.eye(3, d)[np.arange(60) % 3] * 4, np.arange(60) % 3
    job = build_job("fedncm", {"num_classes": C, "feature_dim": d, "clients_per_round": 2})
    assert job_kind_name(job) == "fedncm" and job.kind == "fed3r.stats"     # the devices' Fed3R task
    for env, device in zip(device_results(Z, y, C, [np.arange(0, 30), np.arange(30, 60)], False), ("a", "b")):
        job.apply(device, job.parse_result(env))
    arrays = job.model_arrays()
    assert np.abs(arrays["coef"] - reference_head(Z, y, C)).max() < 1e-12
    assert job.evaluate(Z, y)["accuracy"] == np.mean((Z @ reference_head(Z, y, C).T).argmax(1) == y)
    with pytest.raises(ValueError, match="fit_intercept"):
        build_job("fedncm", {"fit_intercept": False})
    with pytest.raises(ValueError, match="DP"):
        build_job("fedncm", {"dp_noise_multiplier": 1.0, "feature_clip_norm": 1.0})
