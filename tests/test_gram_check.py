"""The Gram check a dense Fed3R upload gets before it is stored (``check_gram``): positive
semi-definite within the float32 wire precision, per coordinate (D^-½AD^-½ + τI, τ = 4·p·ε32),
judged against numpy's eigenvalues of that unit-diagonal matrix; the same verdicts through the
aggregator's CPU factorisation (LAPACK in place, through scipy), its GPU one (torch, run here on
the CPU) and numpy's."""

import numpy as np
import pytest

import torch

from aggregator.strategies.fed3r import Fed3R, torch_positive_definite
from protocols.envelope import EnvelopeError
from protocols.payloads.fed3r import check_gram, numpy_positive_definite, triu_pack

P = 129
EPS64, EPS32 = float(np.finfo(np.float64).eps), float(np.finfo(np.float32).eps)
CHECKS = {"numpy": numpy_positive_definite, "lapack": Fed3R(3, P, 0.01, device="cpu").positive_definite,
          "torch": lambda upper, tau: torch_positive_definite(upper, tau, torch.device("cpu"))}


def honest(rng, n) -> np.ndarray:
    """ReLU-like features on very different scales, dead (all-zero) dimensions, a bias column."""
    X = np.abs(rng.normal(size=(n, P - 1))) * 10.0 ** rng.uniform(-4, 4, P - 1)
    X[:, rng.choice(P - 1, 20, replace=False)] = 0.0
    Z = np.hstack([X, np.ones((n, 1))])
    return Z.T @ Z


def unit_min_eig(A: np.ndarray) -> float:
    d = np.diag(A)
    s = 1 / np.sqrt(np.where(d > 0, d, 1.0))
    return float(np.linalg.eigvalsh(A * s[:, None] * s[None, :])[0])


@pytest.mark.parametrize("check", CHECKS)
def test_honest_gram_matrices_pass_rank_deficient_or_not(check):
    rng = np.random.default_rng(0)
    for n in (3, 40, 500):
        check_gram(triu_pack(honest(rng, n)), P, EPS64, CHECKS[check])
        check_gram(triu_pack(honest(rng, n).astype(np.float32).astype(np.float64)), P, EPS32, CHECKS[check])


@pytest.mark.parametrize("check", CHECKS)
def test_a_negative_direction_beyond_the_float32_bound_is_refused(check):
    rng = np.random.default_rng(1)
    A = honest(rng, 500)
    d = np.sqrt(np.diag(A))
    live = d > 0
    S = A[np.ix_(live, live)] / np.outer(d[live], d[live])
    lam, U = np.linalg.eigh(S)
    for depth in (1e-2, 1e-1, 1.0):        # the unit-diagonal form's smallest eigenvalue moved to -depth
        bad = A.copy()
        bent = S - (lam[0] + depth) * np.outer(U[:, 0], U[:, 0])
        bad[np.ix_(live, live)] = bent * np.outer(d[live], d[live])
        assert unit_min_eig(bad) < -4 * P * EPS32
        with pytest.raises(EnvelopeError, match="not positive semi-definite"):
            check_gram(triu_pack(bad), P, EPS64, CHECKS[check])


def test_a_zero_diagonal_entry_with_a_non_zero_row_and_a_negative_diagonal_are_refused():
    A = honest(np.random.default_rng(2), 50)
    dead = int(np.flatnonzero(np.diag(A) == 0)[-1])
    assert 0 < dead < P - 1
    # |A_ij|² > A_ii·A_jj = 0: right of the dead diagonal entry (its packed row) and above it (its
    # column, in the packed rows before it); one too small for float32 too
    for other, value in ((P - 1, 1e-3), (0, 1e-3), (dead - 1, 1e-3), (0, 1e-300)):
        bad = A.copy()
        bad[dead, other] = bad[other, dead] = value
        with pytest.raises(EnvelopeError, match="zero diagonal entry"):
            check_gram(triu_pack(bad), P, EPS64)
    neg = A.copy()
    neg[0, 0] = -1.0
    with pytest.raises(EnvelopeError, match="negative diagonal"):
        check_gram(triu_pack(neg), P, EPS64)


def test_a_checked_parse_keeps_float64_views_and_sums_the_same():
    """``parse_stats(checked=True)`` (bytes an ingest worker validated) skips the passes over every
    value and hands back read-only views on the message's bytes; the sums from them are the sums
    from the validated copies, bit for bit."""
    from protocols.envelope import Envelope, decode, encode
    from protocols.payloads.fed3r import Fed3RStats, encode_stats, parse_stats

    rng = np.random.default_rng(3)
    body, tensors = encode_stats(honest(rng, 40), np.arange(3), rng.normal(size=(3, P)), 40, 3)
    env = decode(encode(Envelope(type="result", sender="dev01", body=body, tensors=tensors, id="ab" * 16)))
    full = parse_stats(env, P, 3, fit_intercept=False)
    checked = parse_stats(env, P, 3, fit_intercept=False, checked=True)
    for stats in (full, checked):           # no copy of a float64 upload, checked or not
        assert np.shares_memory(stats.a_upper, env.tensors["A_upper"]) and not stats.a_upper.flags.writeable
    copies = Fed3RStats(n=full.n, p=P, a_upper=full.a_upper.copy(), class_ids=full.class_ids.copy(), b=full.b.copy())
    sums = [Fed3R(3, P, 0.01), Fed3R(3, P, 0.01), Fed3R(3, P, 0.01)]
    for strategy, stats in zip(sums, (full, checked, copies)):
        strategy.add(stats)
        strategy.add(stats)
    for other in sums[1:]:
        assert torch.equal(sums[0].A, other.A) and torch.equal(sums[0].B, other.B)
    assert np.array_equal(env.tensors["A_upper"], triu_pack(honest(np.random.default_rng(3), 40)))  # never written


@pytest.mark.parametrize("p", [0, 1, 2, 7, 130])
def test_triu_pack_is_numpys_upper_triangle_in_row_order(p):
    a = np.random.default_rng(p).standard_normal((p, p)).astype(np.float32 if p % 2 else np.float64)
    packed = triu_pack(a)
    assert packed.dtype == a.dtype
    np.testing.assert_array_equal(packed, a[np.triu_indices(p)])


@pytest.mark.parametrize("check", CHECKS)
def test_the_reused_scratch_matrix_carries_nothing_from_one_check_to_the_next(check):
    """One thread's checks share one float32 matrix (``_gram_scratch``): a verdict must not depend
    on what the check before left in it (a factor, a failed factorisation's partial one, another p)."""
    rng = np.random.default_rng(5)
    good = honest(rng, 200)
    bad = good.copy()
    bad[0, 0] = good[0, 0] * 1e-3                   # |A_01|² > A_00·A_11 for some pair: indefinite
    assert unit_min_eig(bad) < -4 * P * EPS32
    small = honest(rng, 30)[:50, :50]
    calls = []

    def recorded(upper, tau):
        calls.append(upper.dtype)
        return CHECKS[check](upper, tau)

    for _ in range(2):
        for matrix, p in ((good, P), (bad, P), (good, P), (small, 50), (bad, P), (small, 50), (good, P)):
            calls.clear()
            if matrix is bad:
                with pytest.raises(EnvelopeError, match="not positive semi-definite"):
                    check_gram(triu_pack(matrix), p, EPS64, recorded)
                assert calls == [np.float32, np.float64]
            else:       # decided by the float32 check on the scratch matrix, not by the float64 fallback
                check_gram(triu_pack(matrix), p, EPS64, recorded)
                assert calls == [np.float32]
