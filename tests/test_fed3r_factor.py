"""Exact factor uploads: a device with fewer samples than features sends the canonical factor R
(RᵀR = A_k over its non-zero columns, row echelon form, positive pivots) and QᵀY instead of the
packed triangle; the aggregator's sums and the ridge solution equal the dense ones and the
centralized ridge (sklearn), on synthetic and on real MobileNetV2 features, whose dead channels
and dependent columns are what the canonical form is for; R is determined by A alone;
factors that are not the canonical one, malformed factors and statistics that are not a Gram
matrix are refused before anything is stored."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg import solve_triangular

from aggregator.strategies.fed3r import Fed3R
from edge_client.fed3r import Fed3RAccumulator
from edge_client.tasks.fed3r_stats import encode_smallest
from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.payloads.fed3r import Fed3RStats, dense_values, encode_stats, factor_values, parse_stats, triu_unpack

from test_fed3r_exactness import reference_ridge


def wire(body, tensors, sender="dev0"):
    return decode(encode(Envelope("result", sender, body, tensors)))


def device_stats(Z, y, C, keep_rows=True):
    acc = Fed3RAccumulator(C, Z.shape[1], True, keep_rows=keep_rows)
    for part in np.array_split(np.arange(len(y)), 2):
        acc.update(Z[part], y[part])
    return acc


def relu_features(rng, n, d, dead=0.0):
    """Sparse non-negative rows like a ReLU backbone's: many exact zeros, ``dead`` of the columns
    zero in every row, one column a multiple of another, one non-zero in a single row."""
    Z = np.maximum(rng.normal(size=(n, d)) - rng.uniform(0.0, 1.0), 0.0) * rng.uniform(0.1, 5)
    Z[:, rng.random(d) < dead] = 0.0
    Z[:, 3] = 2.5 * Z[:, 1]
    Z[:, 5] = 0.0
    Z[n // 2, 5] = 1.5
    return Z


def reference_factor(A, tol=1e-8):
    """The canonical factor from A alone, written from its definition: the zero columns, then the
    pivots where the rank of A's leading blocks (over the other columns) grows — the Schur
    complement of the previous pivots is positive — then R's pivot columns are the Cholesky factor
    of A[P, P] and the others R = R_P⁻ᵀ A[P, K]."""
    kept = np.flatnonzero(np.diagonal(A) > 0)
    pivots = []
    for j in kept:
        P = pivots
        schur = A[j, j] - (A[j, P] @ np.linalg.solve(A[np.ix_(P, P)], A[P, j]) if P else 0.0)
        if schur > tol * A[j, j]:
            pivots.append(j)
    R_P = np.linalg.cholesky(A[np.ix_(pivots, pivots)]).T
    R = solve_triangular(R_P, A[np.ix_(pivots, kept)], trans="T")
    return R, np.setdiff1d(np.arange(len(A)), kept)


@settings(max_examples=20, deadline=None)
@given(d=st.integers(8, 40), C=st.integers(2, 6), K=st.integers(2, 8), seed=st.integers(0, 2**31 - 1),
       sparse=st.booleans())
def test_a_fleet_mixing_factor_and_dense_uploads_gives_the_centralized_ridge(d, C, K, seed, sparse):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2 * d, size=K)                # some below p (factor), some above (dense)
    Z = relu_features(rng, int(sizes.sum()), d, dead=0.2) if sparse else \
        rng.normal(size=(int(sizes.sum()), d)) * rng.uniform(0.1, 5)
    y = rng.integers(0, C, size=len(Z))
    server = Fed3R(C, d + 1, lam=1.0, device="cpu")
    for idx in np.split(np.arange(len(y)), np.cumsum(sizes)[:-1]):
        body, tensors = encode_smallest(device_stats(Z[idx], y[idx], C), C, dense=False, dtype="float64")
        assert body.get("a_format") == "factor" or factor_values(len(idx), d + 1, C) >= dense_values(d + 1, 1)
        server.add(parse_stats(wire(body, tensors), d + 1, C))
    ref = reference_ridge(Z, y, C, 1.0)
    W = server.solve().raw_weights_
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-9
    assert server.n_samples == len(y)


def test_the_factor_is_exact_and_determined_by_A_alone():
    rng = np.random.default_rng(1)
    Z, y = relu_features(rng, 20, 50, dead=0.1), rng.integers(0, 4, 20)
    Z[7] = Z[2]                                            # a repeated image: rank 19
    form = device_stats(Z, y, 4).factor()
    A, ids, b = device_stats(Z, y, 4, keep_rows=False).sparse()
    kept = np.setdiff1d(np.arange(51), form.zero_columns)
    assert len(form.zero_columns) > 0 and len(form.r_factor) == 19 == np.linalg.matrix_rank(Z)
    np.testing.assert_allclose(form.r_factor.T @ form.r_factor, A[np.ix_(kept, kept)], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose((form.r_factor.T @ form.qty).T, b[:, kept], rtol=1e-12, atol=1e-12)
    assert np.array_equal(form.class_ids, ids) and not A[form.zero_columns].any() and not b[:, form.zero_columns].any()
    R_ref, zero_ref = reference_factor(A)                  # from A alone, by its definition
    assert np.array_equal(form.zero_columns, zero_ref)
    np.testing.assert_allclose(form.r_factor, R_ref, rtol=1e-8, atol=1e-8 * np.abs(R_ref).max())
    Q, _ = np.linalg.qr(rng.normal(size=(20, 20)))         # another Z with the same A: the same factor
    other = Fed3RAccumulator(4, 51, fit_intercept=False, keep_rows=True)    # Q·[Z 1]: A alike, rows unlike
    other.update(Q @ np.hstack([Z, np.ones((20, 1))]), y)
    assert np.array_equal(other.factor().zero_columns, form.zero_columns)
    np.testing.assert_allclose(other.factor().r_factor, form.r_factor, rtol=1e-9, atol=1e-9 * np.abs(R_ref).max())


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


def test_a_device_with_a_repeated_image_sends_the_factor_of_its_gram_matrix():
    rng = np.random.default_rng(2)
    Z = rng.normal(size=(4, 30))
    scaled = Z.copy()
    scaled[0] *= np.sqrt(2.0)                              # the same A: z zᵀ twice = (√2 z)(√2 z)ᵀ
    forms = []
    for rows, labels in ((np.vstack([Z, Z[:1]]), [0, 1, 0, 1, 0]), (scaled, [0, 1, 0, 1])):
        acc = Fed3RAccumulator(2, 30, fit_intercept=False, keep_rows=True)
        acc.update(rows, np.array(labels))
        forms.append(acc.factor())
    assert len(forms[0].r_factor) == 4
    np.testing.assert_allclose(forms[0].r_factor, forms[1].r_factor, rtol=1e-10, atol=1e-12)


def good_factor(n=6, d=20, C=3, seed=3):
    """A device's factor upload with zero columns and pivots that skip dependent columns."""
    rng = np.random.default_rng(seed)
    acc = device_stats(relu_features(rng, n, d, dead=0.3), rng.integers(0, C, n), C)
    body, tensors = encode_smallest(acc, C, False, "float64")
    R = tensors["R"]
    pivots = (R != 0).argmax(axis=1)
    assert "zero_columns" in tensors and not np.array_equal(pivots, np.arange(len(R)))
    return (body, tensors), d + 1, C


def mutated(change):
    body, tensors = good_factor()[0]
    body, tensors = dict(body), {k: np.array(v) for k, v in tensors.items()}
    change(body, tensors)
    return body, tensors


def rotate(t, seed=0):
    """R replaced by G·R, G a random orthogonal matrix: another factor of the very same A."""
    G, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(len(t["R"]),) * 2))
    t["R"], t["QtY"] = G @ t["R"], G @ t["QtY"]


def flip_row(t, i=2):
    t["R"][i] *= -1.0                                      # also a factor of the same A
    t["QtY"][i] *= -1.0


def swap_rows(t):
    t["R"][[0, 1]] = t["R"][[1, 0]]
    t["QtY"][[0, 1]] = t["QtY"][[1, 0]]


def unlist_zero_column(t):
    """Drop the first index from zero_columns and put its (zero) column back into R."""
    first, rest = t["zero_columns"][0], t.pop("zero_columns")[1:]
    if len(rest):
        t["zero_columns"] = rest
    t["R"] = np.insert(t["R"], first, 0.0, axis=1)         # no zero column before it: its place among R's


def list_bias_column(t):
    """Claim the bias column is zero (R without it): the counts no longer add up."""
    t["zero_columns"] = np.append(t["zero_columns"], 20)
    t["R"] = t["R"][:, :-1]


BAD = {    # name: (change, what the refusal says)
    "not in echelon form": (lambda b, t: t["R"].__setitem__((3, 1), 0.5), "echelon"),
    "negative pivot (sign-flipped row)": (lambda b, t: flip_row(t), "negative pivot"),
    "rotated by an orthogonal matrix": (lambda b, t: rotate(t), "echelon"),
    "rows swapped": (lambda b, t: swap_rows(t), "echelon"),
    "zero row": (lambda b, t: t["R"].__setitem__(-1, 0.0), "zero row"),
    "zero column not listed": (lambda b, t: unlist_zero_column(t), "zero column"),
    "zero_columns unsorted": (lambda b, t: t.__setitem__("zero_columns", t["zero_columns"][::-1].copy()),
                              "zero_columns must"),
    "zero_columns repeated": (lambda b, t: t["zero_columns"].__setitem__(1, t["zero_columns"][0]), "zero_columns must"),
    "zero_columns out of range": (lambda b, t: t["zero_columns"].__setitem__(-1, 21), "zero_columns must"),
    "zero_columns negative": (lambda b, t: t["zero_columns"].__setitem__(0, -1), "zero_columns must"),
    "zero_columns empty": (lambda b, t: t.__setitem__("zero_columns", np.zeros(0, dtype=np.int64)), "zero_columns must"),
    "zero_columns float": (lambda b, t: t.__setitem__("zero_columns", t["zero_columns"].astype(np.float64)), "dtype"),
    "zero_columns disagree with R's width": (lambda b, t: t.__setitem__("zero_columns", t["zero_columns"][1:]), "shape"),
    "bias column listed as zero": (lambda b, t: list_bias_column(t), "add up"),
    "NaN": (lambda b, t: t["R"].__setitem__((0, 5), np.nan), "NaN"),
    "wrong width": (lambda b, t: t.__setitem__("R", t["R"][:, :-1]), "shape"),
    "more rows than samples": (lambda b, t: b.__setitem__("n", 3), "rows"),
    "QtY shape": (lambda b, t: t.__setitem__("QtY", t["QtY"][:-1]), "shape"),
    "extra tensor": (lambda b, t: t.__setitem__("payload", np.zeros(10_000)), "exactly the tensors"),
    "missing QtY": (lambda b, t: t.pop("QtY"), "exactly the tensors"),
    "dtype mix": (lambda b, t: t.__setitem__("QtY", t["QtY"].astype(np.float32)), "dtype"),
    "dense b format": (lambda b, t: b.__setitem__("format", "dense"), "sparse"),
    "unknown a_format": (lambda b, t: b.__setitem__("a_format", "cholesky"), "a_format"),
    "n does not add up": (lambda b, t: b.__setitem__("n", b["n"] + 1), "add up"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_or_non_canonical_factors_are_refused(name):
    (body, tensors), p, C = good_factor()
    stats = parse_stats(wire(body, tensors), p, C)         # the unmodified one is accepted
    assert stats.r_factor is not None and len(stats.factor_columns) < p
    change, says = BAD[name]
    with pytest.raises(EnvelopeError, match=says):
        parse_stats(wire(*mutated(change)), p, C)


def test_the_rotated_factor_is_a_factor_of_the_same_statistics():
    """The refusals above are of the form, not of the statistics: the rotated and sign-flipped
    factors encode exactly the accepted A and b (so accepting them would let a device pick among
    many encodings of one A, which the canonical form rules out)."""
    (body, tensors), p, C = good_factor()
    for change in (rotate, flip_row):
        other = {k: np.array(v) for k, v in tensors.items()}
        change(other)
        np.testing.assert_allclose(other["R"].T @ other["R"], tensors["R"].T @ tensors["R"], atol=1e-12)
        np.testing.assert_allclose(other["R"].T @ other["QtY"], tensors["R"].T @ tensors["QtY"], atol=1e-12)


def test_the_golden_factor_vectors_are_what_a_device_computes_and_are_accepted():
    """protocols/golden/result_fed3r_factor*.bin pin the wire form for other languages: the device's
    own computation on the documented feature rows gives them, and the aggregator accepts them."""
    from protocols import golden

    vectors = golden.golden_messages()
    features = {"result_fed3r_factor": np.array([[2.0, 1.0, 0.5], [0.0, 1.5, 0.25]]),      # Z = R, Q = I
                "result_fed3r_factor_zero_columns": np.array([[2.0, 0.0, 1.0, 0.5], [0.0, 0.0, 0.0, 1.5]])}
    for name, Z in features.items():
        msg = decode(vectors[name])
        p = Z.shape[1] + 1
        stats = parse_stats(msg, p, 3)
        body, tensors = encode_smallest(device_stats(Z, np.array([0, 2]), 3), 3, False, "float64")
        assert body == {k: msg.body[k] for k in body} and set(tensors) == set(msg.tensors)
        for key, value in tensors.items():
            np.testing.assert_allclose(value, msg.tensors[key], rtol=0, atol=1e-15)
        np.testing.assert_allclose(stats.full_factor().T @ stats.full_factor(),
                                   np.hstack([Z, np.ones((2, 1))]).T @ np.hstack([Z, np.ones((2, 1))]), atol=1e-15)


@pytest.fixture(scope="module")
def mobilenet_features():
    """Fashion-MNIST training images through the pretrained MobileNetV2 (the product's backbone),
    at 32 and 64 px: ReLU6 then average pooling, so many channels are exact zeros."""
    from edge_client.data import load_fashion_mnist
    from edge_client.features import FeatureExtractor

    images, labels = load_fashion_mnist("train")
    chosen = np.random.default_rng(11).permutation(len(images))[:700]
    return {size: (FeatureExtractor.eager("mobilenet_v2", image_size=size).extract(images[chosen]).astype(np.float64),
                   labels[chosen]) for size in (32, 64)}


def leading_block_singular(Z):
    """Whether the pre-canonical factor (QR of Z as it stands) would not have been unique."""
    n = len(Z)
    return np.linalg.matrix_rank(np.hstack([Z, np.ones((n, 1))])[:, :n]) < n


@pytest.mark.parametrize("image_size", [32, 64])
def test_on_mobilenet_features_devices_send_the_factor_and_the_model_equals_the_dense_one(mobilenet_features,
                                                                                         image_size):
    Z, y = mobilenet_features[image_size]
    C, p, lam = 10, Z.shape[1] + 1, 0.1
    rng = np.random.default_rng(image_size)
    sizes = np.minimum(rng.geometric(1 / 12, size=60), 64)     # long-tailed, 1 to 64 images
    sizes = sizes[np.cumsum(sizes) <= len(Z)]
    order = np.argsort(y + rng.uniform(0, 3, len(y)), kind="stable")   # label-skewed devices
    factor_fleet, dense_fleet = Fed3R(C, p, lam=lam, device="cpu"), Fed3R(C, p, lam=lam, device="cpu")
    factors = singular = zero_cols = 0
    used = np.concatenate(np.split(order, np.cumsum(sizes))[:-1])
    for idx in np.split(order, np.cumsum(sizes))[:-1]:
        n = len(idx)
        body, tensors = encode_smallest(device_stats(Z[idx], y[idx], C), C, dense=False, dtype="float64")
        if body.get("a_format") == "factor":
            factors += 1
            zero_cols += "zero_columns" in tensors
            payload = sum(t.nbytes for t in tensors.values())
            assert payload <= 1.1 * 8 * n * (p + C), (n, payload)
        singular += leading_block_singular(Z[idx])
        factor_fleet.add(parse_stats(wire(body, tensors), p, C))
        A, ids, b = device_stats(Z[idx], y[idx], C, keep_rows=False).sparse()    # (the dense form's own
        dense_fleet.add(Fed3RStats(n, p, A[np.triu_indices(p)], ids, b))           #  wire path: tests above)
    assert factors >= 0.95 * len(sizes), (factors, len(sizes))
    assert zero_cols >= len(sizes) // 2 and singular >= len(sizes) // 4   # dead channels: QR of Z not unique
    W, W_dense = factor_fleet.solve().raw_weights_, dense_fleet.solve().raw_weights_
    ref = reference_ridge(Z[used], y[used], C, lam)
    assert np.linalg.norm(W - W_dense) / np.linalg.norm(W_dense) <= 1e-9
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-9


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
        self.sent: list[dict] = []               # the tensors of each upload

    def __call__(self, params, tensors=None):
        acc = device_stats(self.Z, self.y, self.C, keep_rows=bool(params.get("factor")))
        body, out = encode_smallest(acc, self.C, dense=False, dtype="float64")
        self.sent.append(out)
        return body, out


def test_over_mosquitto_a_mixed_fleet_equals_the_centralized_ridge(broker, tmp_path):
    import threading

    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.service.loop import AggregatorService
    from aggregator.service.settings import ServiceSettings
    from edge_client.agent import DeviceAgent
    from protocols.mqtt_link import BrokerConfig

    d, C = 24, 3
    rng = np.random.default_rng(7)
    sizes = [5, 40, 12, 60, 3, 25, 8]                       # below and above p = 25
    Z = relu_features(rng, sum(sizes), d)                   # dead and dependent columns, like a backbone's
    Z[:5, 1:4] = 0.0                                        # dead channels for the first device
    Z[5:45, 20:] = 0.0                                      # a dense upload with zero columns
    Z[50:52] = Z[46:48]                                     # repeated images (the 12-image device: rank 10)
    y = rng.integers(0, C, len(Z))
    parts = np.split(np.arange(len(y)), np.cumsum(sizes)[:-1])
    devices = [f"dev{i:02d}" for i in range(len(sizes))]
    config = Fed3RConfig(num_classes=C, feature_dim=d, lam=1.0, normalize_columns=False, clients_per_round=3,
                         round_timeout_s=30, expected_devices=len(devices))
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path,
                            ServiceSettings(tick_s=0.05), enrolled=set(devices))
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    handlers = [MixedStats(Z[i], y[i], C) for i in parts]
    agents = [DeviceAgent(dev, BrokerConfig.from_url(broker.url), {"fed3r.stats": handler},
                          retry_after_s=2).start() for dev, handler in zip(devices, handlers)]
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
    forms = [h.sent[-1] for h, n in zip(handlers, sizes) if n < d + 1]
    assert all("R" in f for f in forms) and any("zero_columns" in f for f in forms)
    assert [len(h.sent[-1]["R"]) for h, n in zip(handlers, sizes) if n == 12] == [10]
    assert all("A_upper" in h.sent[-1] for h, n in zip(handlers, sizes) if n >= d + 1)


def test_the_lazy_gram_matrix_equals_the_eager_sum_however_it_is_read():
    """A device that keeps its rows builds A only when it is read; reading it early, between
    updates, or only once the rows outgrow p gives the same bits as adding each chunk's ZᵀZ
    as it arrives (numpy, independent of the accumulator)."""
    rng = np.random.default_rng(11)
    chunks = [(np.maximum(rng.normal(size=(k, 6)), 0), rng.integers(0, 3, k)) for k in (2, 1, 3, 4)]
    want = np.zeros((7, 7))
    for Z, _ in chunks:
        Za = np.hstack([Z, np.ones((len(Z), 1))])
        want += Za.T @ Za
    for read_after in (None, 0, 1, 2):
        acc = Fed3RAccumulator(3, 6, keep_rows=True)
        for i, (Z, y) in enumerate(chunks):
            acc.update(Z, y)
            if i == read_after:
                acc.A                       # noqa: B018 - a read mid-way must not freeze A
        assert np.array_equal(acc.A, want)
