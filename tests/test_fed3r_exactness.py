"""Federated Fed3R == centralized ridge, through the real client code, wire encoding and server."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from sklearn.linear_model import Ridge

from aggregator.compute.ridge import ClosedFormRidge
from aggregator.strategies.fed3r import Fed3R
from edge_client.fed3r import Fed3RAccumulator
from protocols.envelope import Envelope, decode, encode
from protocols.payloads.fed3r import encode_stats, parse_stats, triu_pack, triu_unpack


def reference_ridge(Z, y, C, lam):
    """sklearn on the bias-augmented features, intercept handled as an ordinary column."""
    Za = np.hstack([Z, np.ones((len(Z), 1))])
    Y = np.eye(C)[y]
    return Ridge(alpha=lam, fit_intercept=False, solver="cholesky").fit(Za, Y).coef_.T   # (p, C)


def federate(Z, y, C, lam, splits, order, dense=False, rf=None):
    server = Fed3R(C, Z.shape[1] + 1 if rf is None else rf.n_components + 1, lam=lam, device="cpu")
    for k in order:
        idx = splits[k]
        if len(idx) == 0:
            continue
        acc = Fed3RAccumulator(C, Z.shape[1], True, rf)
        for chunk in np.array_split(idx, 3):          # devices stream batches
            acc.update(Z[chunk], y[chunk])
        A, ids, b = acc.sparse()
        body, tensors = encode_stats(A, ids, b, acc.n, C, dense=dense)
        wire = encode(Envelope("result", f"dev{k}", body, tensors))
        server.add(parse_stats(decode(wire), server.p, C))
    return server


@settings(max_examples=25, deadline=None)
@given(n=st.integers(20, 200), d=st.integers(2, 24), C=st.integers(2, 7), K=st.integers(1, 12),
       lam=st.sampled_from([1e-2, 1.0, 10.0]), seed=st.integers(0, 2**31 - 1),
       one_class=st.booleans(), dense=st.booleans())
def test_federated_equals_centralized(n, d, C, K, lam, seed, one_class, dense):
    rng = np.random.default_rng(seed)
    Z = rng.normal(size=(n, d)) * rng.uniform(0.1, 5)
    y = rng.integers(0, C, size=n)
    if one_class:   # every device holds exactly one class
        splits = [np.flatnonzero(y == c) for c in range(C)]
    else:
        cuts = np.sort(rng.integers(0, n, size=K - 1))
        splits = np.split(rng.permutation(n), cuts)
    order = rng.permutation(len(splits))
    server = federate(Z, y, C, lam, splits, order, dense=dense)
    ref = reference_ridge(Z, y, C, lam)
    W = server.solve().raw_weights_
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-9
    assert server.n_samples == n


def test_normalisation_and_bias_follow_the_reference_code():
    rng = np.random.default_rng(0)
    Z, y = rng.normal(size=(300, 8)), rng.integers(0, 4, 300)
    y[y == 3] = 0          # class 3 never seen -> zero column, norm replaced by 1e-6
    model = ClosedFormRidge(lam=0.01, device="cpu").fit(Z, y, num_classes=4)
    raw = reference_ridge(Z, y, 4, 0.01)
    norms = np.linalg.norm(raw[:-1], axis=0)
    norms[norms == 0] = 1e-6
    np.testing.assert_allclose(model.coef_, (raw[:-1] / norms).T, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(model.intercept_, raw[-1] / norms, rtol=1e-9, atol=1e-12)
    assert np.allclose(np.linalg.norm(model.coef_[:3], axis=1), 1.0)


def test_provisional_solution_after_each_contribution_is_ridge_over_those_devices():
    rng = np.random.default_rng(1)
    Z, y = rng.normal(size=(120, 5)), rng.integers(0, 3, 120)
    splits = np.array_split(np.arange(120), 4)
    server = Fed3R(3, 6, lam=0.5, device="cpu")
    for k, idx in enumerate(splits):
        acc = Fed3RAccumulator(3, 5)
        acc.update(Z[idx], y[idx])
        A, ids, b = acc.sparse()
        body, t = encode_stats(A, ids, b, acc.n, 3)
        server.add(parse_stats(Envelope("result", "d", body, {k2: v.copy() for k2, v in t.items()}), 6, 3))
        seen = np.concatenate(splits[:k + 1])
        ref = reference_ridge(Z[seen], y[seen], 3, 0.5)
        assert np.linalg.norm(server.solve().raw_weights_ - ref) / np.linalg.norm(ref) < 1e-10


def test_triangle_packing_round_trip():
    rng = np.random.default_rng(2)
    M = rng.normal(size=(7, 7))
    S = M + M.T
    assert np.array_equal(triu_unpack(triu_pack(S), 7), S)
    with pytest.raises(ValueError):
        triu_unpack(np.zeros(5), 7)


def test_random_features_path_matches_centralized_ridge_on_mapped_features():
    from protocols.random_features import RandomFourierFeatures

    rng = np.random.default_rng(3)
    Z, y = rng.normal(size=(150, 6)), rng.integers(0, 3, 150)
    rf = RandomFourierFeatures(n_components=40, sigma=2.0, seed=7).fit(n_features=6)
    splits = np.array_split(rng.permutation(150), 5)
    server = federate(Z, y, 3, 0.01, splits, range(5), rf=rf)
    ref = reference_ridge(rf.transform(Z), y, 3, 0.01)
    W = server.solve().raw_weights_
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-9


def test_random_features_are_reproducible_and_approximate_the_gaussian_kernel():
    from protocols.random_features import RandomFourierFeatures, uniform_stream

    a = RandomFourierFeatures(n_components=4000, sigma=1.5, seed=11).fit(n_features=3)
    b = RandomFourierFeatures(n_components=4000, sigma=1.5, seed=11).fit(n_features=3)
    c = RandomFourierFeatures(n_components=4000, sigma=1.5, seed=12).fit(n_features=3)
    assert np.array_equal(a.omega_, b.omega_) and not np.array_equal(a.omega_, c.omega_)
    # stream continuity: a later slice equals the tail of a longer draw
    assert np.array_equal(uniform_stream(5, 10)[4:], uniform_stream(5, 6, start=4))
    x = np.random.default_rng(0).normal(size=(6, 3))
    K_approx = a.transform(x) @ a.transform(x).T
    sq = ((x[:, None] - x[None]) ** 2).sum(-1)
    K = np.exp(-sq / (2 * 1.5 ** 2))
    assert np.abs(K_approx - K).max() < 0.08
    # omega entries are standard normal
    assert abs(a.omega_.mean()) < 0.05 and abs(a.omega_.std() - 1) < 0.05


def test_the_cpu_and_gpu_solvers_agree_with_numpy():
    """The CPU solve (LAPACK in place, through scipy) and the GPU one (torch's Cholesky, run here on
    the CPU) give numpy's (A + λI)⁻¹B, from the upper triangle alone or the lower one; both refuse
    a matrix that is not positive definite."""
    import torch

    from aggregator.compute.ridge import torch_ridge_solve

    rng = np.random.default_rng(7)
    Z = np.hstack([rng.normal(size=(300, 30)) * 10.0 ** rng.uniform(-2, 2, 30), np.ones((300, 1))])
    A, B, lam = Z.T @ Z, rng.normal(size=(31, 4)), 0.5
    want = np.linalg.solve(A + lam * np.eye(31), B)
    for upper, half in ((True, np.triu(A)), (False, np.tril(A))):
        lapack = ClosedFormRidge(lam, device="cpu", normalize_columns=False).fit_statistics(half, B, upper=upper)
        gpu_path = torch_ridge_solve(torch.from_numpy(half), torch.from_numpy(B), lam, upper).numpy()
        np.testing.assert_allclose(lapack.raw_weights_, want, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(gpu_path, want, rtol=1e-9, atol=1e-12)
    indefinite = A - 2 * np.linalg.eigvalsh(A)[-1] * np.eye(31)
    with pytest.raises(np.linalg.LinAlgError):
        ClosedFormRidge(lam, device="cpu").fit_statistics(indefinite, B)
    with pytest.raises(np.linalg.LinAlgError):
        torch_ridge_solve(torch.from_numpy(indefinite), torch.from_numpy(B), lam, True)
