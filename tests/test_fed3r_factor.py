"""Exact factor uploads: a device with fewer samples than features sends R (RᵀR = A_k) and QᵀY
instead of the packed triangle; the aggregator's sums and the ridge solution equal the dense
ones and the centralized ridge (sklearn); R is determined by A alone; malformed factors and
statistics that are not a Gram matrix are refused before anything is stored."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.strategies.fed3r import Fed3R
from edge_client.fed3r import Fed3RAccumulator
from edge_client.tasks.fed3r_stats import encode_smallest
from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.payloads.fed3r import dense_values, encode_factor, encode_stats, factor_values, parse_stats, triu_unpack

from test_fed3r_exactness import reference_ridge


def wire(body, tensors, sender="dev0"):
    return decode(encode(Envelope("result", sender, body, tensors)))


def device_stats(Z, y, C, keep_rows=True):
    acc = Fed3RAccumulator(C, Z.shape[1], True, keep_rows=keep_rows)
    for part in np.array_split(np.arange(len(y)), 2):
        acc.update(Z[part], y[part])
    return acc


@settings(max_examples=20, deadline=None)
@given(d=st.integers(8, 40), C=st.integers(2, 6), K=st.integers(2, 8), seed=st.integers(0, 2**31 - 1))
def test_a_fleet_mixing_factor_and_dense_uploads_gives_the_centralized_ridge(d, C, K, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2 * d, size=K)                # some below p (factor), some above (dense)
    Z = rng.normal(size=(int(sizes.sum()), d)) * rng.uniform(0.1, 5)
    y = rng.integers(0, C, size=len(Z))
    server, kinds = Fed3R(C, d + 1, lam=1.0, device="cpu"), set()
    for idx in np.split(np.arange(len(y)), np.cumsum(sizes)[:-1]):
        body, tensors = encode_smallest(device_stats(Z[idx], y[idx], C), C, dense=False, dtype="float64")
        kinds.add(body.get("a_format", "packed"))
        server.add(parse_stats(wire(body, tensors), d + 1, C))
    ref = reference_ridge(Z, y, C, 1.0)
    W = server.solve().raw_weights_
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-9
    assert server.n_samples == len(y)


def test_the_factor_is_exact_and_determined_by_A_alone():
    rng = np.random.default_rng(1)
    Z, y = rng.normal(size=(20, 50)), rng.integers(0, 4, 20)
    acc = device_stats(Z, y, 4)
    R, qty, ids = acc.factor()
    A, ids_dense, b = acc.sparse()
    np.testing.assert_allclose(R.T @ R, A, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose((R.T @ qty).T, b, rtol=1e-12, atol=1e-12)
    assert np.array_equal(ids, ids_dense)
    n = len(R)                                             # the leading block is chol(A[:n, :n])ᵀ
    np.testing.assert_allclose(R[:, :n], np.linalg.cholesky(A[:n, :n]).T, rtol=1e-10, atol=1e-10)


def test_few_samples_at_d1280_upload_a_tenth_of_the_papers_fp32_statistics():
    d, C = 1280, 10
    rng = np.random.default_rng(0)
    for n in (8, 32, 64):
        y = rng.integers(0, C, n)
        body, tensors = encode_smallest(device_stats(rng.normal(size=(n, d)), y, C), C, False, "float64")
        assert body["a_format"] == "factor"
        m = len(np.unique(y))
        paper = d * (d + 1) // 2 + d * m                   # [P] Table 22: ½d(d+1) + dC̄ values
        sent = tensors["R"].size + tensors["QtY"].size
        assert sent == factor_values(n, d + 1, m) and sent <= paper / 10, (n, sent, paper)
    body, _ = encode_smallest(device_stats(rng.normal(size=(2000, 16)), rng.integers(0, C, 2000), C), C, False,
                              "float64")
    assert "a_format" not in body                          # n ≥ p: the triangle is smaller


def test_a_device_with_duplicate_rows_sends_the_triangle():
    rng = np.random.default_rng(2)
    z = rng.normal(size=(1, 30))
    acc = device_stats(np.vstack([z, z, rng.normal(size=(3, 30))]), np.array([0, 1, 0, 1, 0]), 2)
    assert acc.factor() is None                            # R not unique: it could reveal more than A


def good_factor(n=6, d=20, C=3, seed=3):
    rng = np.random.default_rng(seed)
    acc = device_stats(rng.normal(size=(n, d)), rng.integers(0, C, n), C)
    R, qty, ids = acc.factor()
    return encode_factor(R, qty, ids, acc.n, C), d + 1, C


def mutated(change):
    body, tensors = good_factor()[0]
    body, tensors = dict(body), {k: np.array(v) for k, v in tensors.items()}
    change(body, tensors)
    return body, tensors


BAD = {
    "not upper-trapezoidal": lambda b, t: t["R"].__setitem__((3, 1), 0.5),
    "negative diagonal": lambda b, t: t["R"].__setitem__((2, 2), -abs(t["R"][2, 2])),
    "NaN": lambda b, t: t["R"].__setitem__((0, 5), np.nan),
    "wrong width": lambda b, t: t.__setitem__("R", t["R"][:, :-1]),
    "more rows than samples": lambda b, t: b.__setitem__("n", 3),
    "QtY shape": lambda b, t: t.__setitem__("QtY", t["QtY"][:-1]),
    "extra tensor": lambda b, t: t.__setitem__("payload", np.zeros(10_000)),
    "missing QtY": lambda b, t: t.pop("QtY"),
    "dtype mix": lambda b, t: t.__setitem__("QtY", t["QtY"].astype(np.float32)),
    "dense b format": lambda b, t: b.__setitem__("format", "dense"),
    "unknown a_format": lambda b, t: b.__setitem__("a_format", "cholesky"),
    "n does not add up": lambda b, t: b.__setitem__("n", b["n"] + 1),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_factors_are_refused(name):
    (body, tensors), p, C = good_factor()
    parse_stats(wire(body, tensors), p, C)                 # the unmodified one is accepted
    with pytest.raises(EnvelopeError):
        parse_stats(wire(*mutated(BAD[name])), p, C)


def dense_result(A, b, n, C, ids):
    return wire(*encode_stats(A, ids, b, n, C))


def test_statistics_that_are_not_a_gram_matrix_or_do_not_add_up_are_refused():
    rng = np.random.default_rng(4)
    acc = device_stats(rng.normal(size=(40, 10)), rng.integers(0, 3, 40), 3, keep_rows=False)
    A, ids, b = acc.sparse()
    parse_stats(dense_result(A, b, acc.n, 3, ids), 11, 3)
    indefinite = A.copy()
    indefinite[0, 1] = indefinite[1, 0] = 0.99 * np.sqrt(A[0, 0] * A[1, 1])
    indefinite[0, 2] = indefinite[2, 0] = -0.99 * np.sqrt(A[0, 0] * A[2, 2])
    indefinite[1, 2] = indefinite[2, 1] = 0.99 * np.sqrt(A[1, 1] * A[2, 2])   # within Cauchy-Schwarz, yet indefinite
    assert np.linalg.eigvalsh(indefinite).min() < 0
    with pytest.raises(EnvelopeError, match="positive semi-definite"):
        parse_stats(dense_result(indefinite, b, acc.n, 3, ids), 11, 3)
    huge = A.copy()
    huge[0, 5] = huge[5, 0] = 1e6 * abs(A).max()
    with pytest.raises(EnvelopeError, match="Gram"):
        parse_stats(dense_result(huge, b, acc.n, 3, ids), 11, 3)
    with pytest.raises(EnvelopeError, match="add up"):
        parse_stats(dense_result(A, b, acc.n + 5, 3, ids), 11, 3)
    body, tensors = encode_stats(A, ids, b, acc.n, 3)
    with pytest.raises(EnvelopeError, match="exactly the tensors"):
        parse_stats(wire(body, {**tensors, "extra": np.zeros(10_000_00 // 8)}), 11, 3)


def test_float32_rounding_of_a_real_gram_matrix_is_not_refused():
    rng = np.random.default_rng(5)
    Z = rng.normal(size=(30, 200)).astype(np.float32) * 6       # rank-deficient (30 < 200), rounded to fp32
    acc = device_stats(Z, rng.integers(0, 3, 30), 3, keep_rows=False)
    A, ids, b = acc.sparse()
    parse_stats(wire(*encode_stats(A, ids, b, acc.n, 3, dtype="float32")), 201, 3)
    assert np.linalg.eigvalsh(triu_unpack(encode_stats(A, ids, b, acc.n, 3, dtype="float32")[1]["A_upper"]
                                          .astype(np.float64), 201)).min() < 0   # rounding made it slightly indefinite
    assert dense_values(201, 3) > factor_values(30, 201, 3)


class MixedStats:
    """A device's task handler: real statistics of its synthetic features, in whichever form is smaller."""

    def __init__(self, Z, y, C):
        self.Z, self.y, self.C = Z, y, C

    def __call__(self, params, tensors=None):
        acc = device_stats(self.Z, self.y, self.C, keep_rows=bool(params.get("factor")))
        return encode_smallest(acc, self.C, dense=False, dtype="float64")


def test_over_mosquitto_a_mixed_fleet_equals_the_centralized_ridge(broker, tmp_path):
    import threading

    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.service.loop import AggregatorService
    from edge_client.agent import DeviceAgent
    from protocols.mqtt_link import BrokerConfig

    d, C = 24, 3
    rng = np.random.default_rng(7)
    sizes = [5, 40, 12, 60, 3, 25]                          # below and above p = 25
    Z = rng.normal(size=(sum(sizes), d))
    y = rng.integers(0, C, len(Z))
    parts = np.split(np.arange(len(y)), np.cumsum(sizes)[:-1])
    devices = [f"dev{i:02d}" for i in range(len(sizes))]
    config = Fed3RConfig(num_classes=C, feature_dim=d, lam=1.0, normalize_columns=False, clients_per_round=3,
                         round_timeout_s=30, expected_devices=len(devices))
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path, enrolled=set(devices),
                            tick_s=0.05)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    agents = [DeviceAgent(dev, BrokerConfig.from_url(broker.url), {"fed3r.stats": MixedStats(Z[i], y[i], C)},
                          retry_after_s=2).start() for dev, i in zip(devices, parts)]
    thread.join(65)
    for a in agents:
        a.stop()
    assert result["state"] == "done" and sorted(result["contributed"]) == devices
    ref = reference_ridge(Z, y, C, 1.0)
    W = svc.job.strategy.solve().raw_weights_
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-9
    small = [a.stats.bytes_up for a, n in zip(agents, sizes) if n < d + 1]
    large = [a.stats.bytes_up for a, n in zip(agents, sizes) if n >= d + 1]
    assert max(small) < min(large)                          # the factor devices uploaded less
