"""LADD style clustering: KMeans + silhouette model selection, routing, purity."""

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.metrics import silhouette_score

from aggregator.strategies.ladd import StyleClustering, clustering_purity, nearest_centroid
from edge_client.style import extract_style, image_styles
from fedfleet.emulation.synthetic_scenes import make_benchmark


@pytest.fixture(scope="module")
def bench():
    return make_benchmark(seed=3, image_size=32, n_source=1, devices_per_domain=5, images_per_device=(6, 10),
                          test_per_domain=6)


def test_synthetic_domains_separate_and_are_recovered(bench):
    styles = np.stack([extract_style(d.images) for d in bench.devices])
    domains = [d.domain for d in bench.devices]
    model = StyleClustering((2, 7), n_init=10, random_state=0).fit(styles)
    truth_silhouette = silhouette_score(styles.reshape(len(styles), -1), domains)
    assert truth_silhouette > 0.5                      # the domains themselves are well separated
    assert model.silhouette_scores_[model.n_clusters_] > 0.5
    assert model.n_clusters_ == len(set(domains))
    assert clustering_purity(model.labels_, domains) >= 0.9
    # test images, one style each, go to the cluster of their domain's devices
    for domain, (images, _) in bench.test.items():
        device_cluster = model.labels_[domains.index(domain)]
        routed = model.predict(image_styles(images))
        assert (routed == device_cluster).mean() >= 0.8


def test_k_is_the_silhouette_argmax_of_independent_kmeans_runs():
    rng = np.random.default_rng(0)
    centres = rng.normal(0, 10, (3, 5))
    X = np.concatenate([c + rng.normal(0, 1.0, (12, 5)) for c in centres])
    model = StyleClustering((2, 6), n_init=5, random_state=1).fit(X)
    scores = {}
    for k in range(2, 7):
        km = KMeans(n_clusters=k, n_init=5, random_state=1).fit(X)
        scores[k] = silhouette_score(X, km.labels_)
    assert model.silhouette_scores_ == pytest.approx(scores)
    best = max(scores, key=scores.get)
    assert model.n_clusters_ == best == 3
    ref = KMeans(n_clusters=best, n_init=5, random_state=1).fit(X)
    np.testing.assert_allclose(model.cluster_centers_, ref.cluster_centers_)
    np.testing.assert_array_equal(model.labels_, ref.labels_)


def test_predict_is_the_nearest_centroid_and_survives_storage():
    rng = np.random.default_rng(2)
    X = np.concatenate([rng.normal(m, 0.3, (8, 4)) for m in (0, 5, 10)])
    model = StyleClustering((2, 5)).fit(X)
    Q = rng.normal(5, 6, (50, 4))
    brute = np.array([np.argmin([np.sum((q - c) ** 2) for c in model.cluster_centers_]) for q in Q])
    np.testing.assert_array_equal(model.predict(Q), brute)
    np.testing.assert_array_equal(StyleClustering.from_centroids(model.cluster_centers_).predict(Q), brute)
    np.testing.assert_array_equal(nearest_centroid(Q, model.cluster_centers_), brute)
    # styles may be given as (n, 3, w, w) tensors: flattened like the stored centroids
    styles = rng.normal(0, 1, (9, 3, 3, 3))
    fitted = StyleClustering((2, 3)).fit(styles)
    assert fitted.predict(styles[:2]).shape == (2,)


def test_purity_by_hand():
    assert clustering_purity([0, 0, 1, 1, 1], ["a", "a", "b", "b", "a"]) == pytest.approx(4 / 5)
    assert clustering_purity([0, 1, 2], ["a", "a", "a"]) == 1.0
    assert clustering_purity([0, 0, 0, 0], ["a", "b", "c", "c"]) == 0.5
    with pytest.raises(ValueError):
        clustering_purity([0, 1], ["a"])


def test_edge_cases_and_bad_inputs():
    X = np.random.default_rng(0).normal(size=(4, 3))
    one = StyleClustering((1, 1)).fit(X)
    assert one.n_clusters_ == 1 and set(one.labels_) == {0}
    assert StyleClustering((2, 20)).fit(X).n_clusters_ in (2, 3)     # k capped at n - 1
    with pytest.raises(ValueError, match="NaN"):
        StyleClustering().fit(np.full((5, 3), np.nan))
    with pytest.raises(ValueError, match="k_range"):
        StyleClustering((3, 2)).fit(X)
    with pytest.raises(ValueError, match="cannot cluster"):
        StyleClustering((2, 5)).fit(X[:2])
    with pytest.raises(RuntimeError, match="not fitted"):
        StyleClustering().predict(X)
    with pytest.raises(ValueError, match="features"):
        StyleClustering((2, 2)).fit(X).predict(np.zeros((1, 4)))


def test_no_centroid_is_left_without_members_when_k_exceeds_the_distinct_styles():
    """A review's finding: a forced k larger than the distinct styles kept KMeans's memberless
    centroids; a style routed to one had no cluster model (a KeyError in the job). Such a k is
    not a k-clustering: it is skipped, and with no other k the bank is one cluster."""
    from aggregator.strategies.ladd import StyleClustering, cluster_styles

    rng = np.random.default_rng(2)
    distinct = rng.normal(size=(3, 27)).astype(np.float32)
    bank = np.repeat(distinct, 3, axis=0) + rng.normal(scale=1e-7, size=(9, 27)).astype(np.float32)
    for seed in range(8):
        fitted = StyleClustering((2, 6), 10, seed).fit(bank)
        assert fitted.n_clusters_ == len(np.unique(fitted.labels_)) == len(fitted.cluster_centers_)
        assert set(fitted.predict(bank)) <= set(fitted.labels_)
    forced, why = cluster_styles(np.repeat(distinct, 3, axis=0), (4, 4), 10, 0)
    assert why is not None and forced.n_clusters_ == 1 and set(forced.predict(distinct)) == {0}


# ----------------------------------------------------------------------------- the style screen
def _reference_spread(X):
    """The lower-middle distance of the rows from their coordinate-wise median."""
    d = np.sqrt(((X - np.median(X, axis=0)) ** 2).sum(axis=1))
    return np.sort(d)[(len(d) - 1) // 2]


def _reference_screen(X, multiple, min_styles=4):
    """The screen in plain numpy, independently: rows whose nearest other row is farther than
    multiple x the lower-middle distance of the rows from their coordinate-wise median, in the fleet
    and in every fleet without one other row (each of at least ``min_styles`` rows and of a distance
    above 0)."""
    X = np.asarray(X, np.float64).reshape(len(X), -1)
    pair = np.sqrt(((X[:, None, :] - X[None, :, :]) ** 2).sum(axis=2))
    np.fill_diagonal(pair, np.inf)
    if len(X) - 1 < min_styles:
        return []
    fleets = {j: _reference_spread(np.delete(X, j, axis=0)) for j in range(len(X))} | {"all": _reference_spread(X)}
    return [i for i in range(len(X))
            if all(0 < spread and pair[i].min() > multiple * spread for j, spread in fleets.items() if j != i)]


def _reference_clustering(X, k_range=(2, 8), n_init=10, seed=0):
    """KMeans + silhouette over the given rows, straight from sklearn (no screen)."""
    X = np.asarray(X, np.float64).reshape(len(X), -1)
    best = None
    for k in range(k_range[0], min(k_range[1], len(X) - 1) + 1):
        km = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit(X)
        if len(np.unique(km.labels_)) == k:
            score = silhouette_score(X, km.labels_)
            if best is None or score > best[0]:
                best = (score, km)
    return best[1]


def test_one_fabricated_style_no_longer_decides_the_clustering(bench):
    """A review's finding: one enrolled device sending a style with every entry at the parser's
    bound 255·S² (accepted: each entry is reachable by the DC term alone) made the silhouette pick
    k = 2, the attacker alone against all 20 honest devices of 4 domains (purity 0.25 instead of
    1.0), and LADD's per-domain heads were lost for the job. The screen leaves it out of the fit
    with its reason: k, the honest partition and the centroids are the fit without it (sklearn
    directly), and the attacker goes to its nearest centroid."""
    from aggregator.strategies.ladd import cluster_styles
    from protocols.envelope import Envelope
    from protocols.payloads.ladd import encode_style, parse_style

    S = bench.image_size
    styles = np.stack([extract_style(d.images) for d in bench.devices])
    domains = [d.domain for d in bench.devices]
    evil = np.full((3, 3, 3), 255.0 * S * S, np.float32)
    parse_style(Envelope("result", "evil", *encode_style(evil, 8, 1)), 1, S)       # the parser takes it
    bank = np.concatenate([styles, evil[None]])

    # without the screen: the review's collapse (what the job did before)
    plain = _reference_clustering(bank)
    assert plain.n_clusters == 2 and clustering_purity(plain.labels_[:-1], domains) == 0.25

    model, why = cluster_styles(bank, (2, 8), 10, 0)
    honest = _reference_clustering(styles)
    assert why is None
    assert model.n_clusters_ == honest.n_clusters == len(set(domains)) == 4
    assert clustering_purity(model.labels_[:-1], domains) == 1.0
    np.testing.assert_array_equal(model.labels_[:-1], honest.labels_)
    np.testing.assert_allclose(model.cluster_centers_, honest.cluster_centers_)
    assert sorted(model.screened_) == _reference_screen(bank, 4.0) == [len(styles)]
    reason = model.screened_[len(styles)]
    assert reason.startswith("style screened: its nearest other style is") and "limit 4x" in reason
    ref_scores = {k: silhouette_score(styles.reshape(len(styles), -1),
                                      KMeans(n_clusters=k, n_init=10, random_state=0)
                                      .fit(styles.reshape(len(styles), -1)).labels_) for k in range(2, 9)}
    assert model.silhouette_scores_ == pytest.approx(ref_scores)
    far = np.argmin(((honest.cluster_centers_ - evil.reshape(-1)) ** 2).sum(axis=1))
    assert model.labels_[-1] == far                          # routed as a late device is
    # order-free: the same screen and partition whatever the order of the bank (a shard
    # coordinator and one aggregator see the same styles)
    order = np.random.default_rng(5).permutation(len(bank))
    shuffled, _ = cluster_styles(bank[order], (2, 8), 10, 0)
    assert [order[i] for i in shuffled.screened_] == [len(styles)]
    assert clustering_purity(shuffled.labels_[np.argsort(order)][:-1], domains) == 1.0
    # off: the fit is sklearn's over every style, the collapse included
    off, _ = cluster_styles(bank, (2, 8), 10, 0, screen_multiple=0.0)
    assert off.screened_ == {} and off.n_clusters_ == 2


@pytest.mark.parametrize("image_size,domains,per_domain,seed", [
    (32, ("night", "fog", "sunset", "rain"), 5, 3), (32, ("night", "fog", "sunset", "rain"), 2, 0),
    (64, ("night", "fog", "sunset", "rain"), 10, 1), (32, ("night", "fog", "sunset", "rain", "overexposed"), 3, 2),
    (32, ("night", "fog", "overexposed"), 3, 0), (32, ("fog", "sunset"), 5, 0), (32, ("night",), 5, 4)])
def test_honest_benchmark_fleets_lose_no_style_to_the_screen(image_size, domains, per_domain, seed):
    """No honest device of make_benchmark's fleets is screened (the worst measured ratio over every
    subset of its domains, 1-10 devices each, four styles or more, is 2.95 against the limit 4: the
    margin in aggregator/strategies/ladd.py), so their clustering is the one without a screen. One night
    device beside a fog-only fleet, a minority domain of one, is what the screen cannot tell
    from a fabricated style (its nearest style is 58-87x the typical distance out)."""
    from aggregator.strategies.ladd import STYLE_SCREEN_MULTIPLE, cluster_styles, screen_styles

    fleet = make_benchmark(seed=seed, image_size=image_size, n_source=1, target_domains=domains,
                           devices_per_domain=per_domain, images_per_device=(6, 10), test_per_domain=0)
    styles = np.stack([extract_style(d.images) for d in fleet.devices])
    assert screen_styles(styles) == {} and _reference_screen(styles, STYLE_SCREEN_MULTIPLE) == []
    model, _ = cluster_styles(styles, (2, 8), 10, 0)
    off, _ = cluster_styles(styles, (2, 8), 10, 0, screen_multiple=0.0)
    np.testing.assert_array_equal(model.labels_, off.labels_)
    assert model.silhouette_scores_ == off.silhouette_scores_


def test_one_style_at_the_median_gets_no_honest_style_screened():
    """A review's finding (Fed3R's energy screen, the same shape here): one style placed at the
    coordinate-wise median adds a distance of 0 and takes the typical distance down a rank. Honest
    styles at 1, 2, 4 and 5 from the median have typical distance 4, and a lone one 12 beyond its
    nearest (3x) is kept; with the added style the typical distance was 2 (6x, limit 4x) and it was
    screened. Judged by the fleet without the added style, it is kept; the added style's own
    verdict is the reference's (every fleet without one other style)."""
    from aggregator.strategies.ladd import screen_styles

    honest = np.array([[0.0, 1.0], [-2.0, 0.0], [0.0, -4.0], [5.0, 0.0], [17.0, 0.0]])
    assert screen_styles(honest) == {} and _reference_screen(honest, 4.0) == []
    with_liar = np.vstack([honest, [[0.0, 0.0]]])
    assert _reference_spread(with_liar) == 2.0 and _reference_spread(honest) == 4.0
    assert screen_styles(with_liar) == {} and _reference_screen(with_liar, 4.0) == []
    far = np.vstack([with_liar, [[100.0, 0.0]]])                # a style 83 beyond everyone still is
    assert list(screen_styles(far)) == [6] == _reference_screen(far, 4.0)
    assert "the largest without any one other style" in screen_styles(far)[6]
    rng = np.random.default_rng(3)
    for _ in range(30):                       # random fleets, far styles among them: the reference's verdicts
        styles = np.concatenate([rng.normal(0, 1, (rng.integers(3, 9), 3)), rng.normal(0, 40, (rng.integers(0, 3), 3))])
        assert sorted(screen_styles(styles)) == _reference_screen(styles, 4.0)


def _recomputed_spread_without_another(X):
    """typical_spread_without_another as it was, each j's fleet recomputed from scratch (O(n²·d·log n)):
    the reference the sorted-columns version must match bit for bit."""
    from aggregator.strategies.robust_fedavg import typical

    def spread(rows):
        return typical(np.linalg.norm(rows - np.median(rows, axis=0), axis=1))

    without = np.array([spread(np.delete(X, j, axis=0)) for j in range(len(X))])
    without[without <= 0] = np.inf
    top = np.argsort(-without, kind="stable")[:2]
    best = np.full(len(X), without[top[0]])
    best[top[0]] = without[top[1]]
    own = spread(X)
    return np.maximum(best, own if own > 0 else np.inf)


def _fleets_with_ties():
    """Even and odd sizes (2 up, and 400/401 rows: several blocks of 139), columns full of equal
    values, equal rows, -0.0 beside 0.0, magnitudes 1e-3..1e5."""
    rng = np.random.default_rng(11)
    for n in (2, 3, 4, 5, 6, 7, 8, 9, 16, 17):
        yield rng.integers(-2, 3, (n, 5)).astype(np.float64)            # ties in every column
        yield rng.normal(size=(n, 9)) * 10.0 ** rng.integers(-3, 6)
    dup = rng.normal(size=(6, 4))
    yield np.vstack([dup, dup[:3], dup[:1]])                              # equal rows
    signed_zeros = np.array([[-0.0, 0.0], [0.0, -0.0], [-0.0, -0.0], [1.0, -0.0], [-0.0, 2.0], [-0.0, -0.0]])
    yield signed_zeros                                                  # medians of one value each
    yield signed_zeros[:5]                                              # of two
    for n in (400, 401):
        X = rng.normal(size=(n, 75))
        X[:, :20] = np.round(X[:, :20])                                   # ties beside distinct values
        yield X


def test_medians_without_each_row_are_np_median_bit_for_bit():
    from aggregator.strategies.ladd import medians_without_each

    for X in _fleets_with_ties():
        got = medians_without_each(X)
        want = np.stack([np.median(np.delete(X, j, axis=0), axis=0) for j in range(len(X))])
        assert got.tobytes() == want.tobytes(), X.shape               # -0.0 and +0.0 told apart too


def test_spread_without_another_is_the_recomputed_one_bit_for_bit(monkeypatch):
    """The columns sorted once, not a median per removed style (O(n²·d·log n): 2.9 s at n = 2000,
    d = 48; each style 3·(2b+1)² long, up to 1323): the same bits as recomputing each fleet."""
    from aggregator.strategies import ladd

    for X in _fleets_with_ties():
        expected = _recomputed_spread_without_another(X)
        assert ladd.typical_spread_without_another(X).tobytes() == expected.tobytes(), X.shape
    median, calls = np.median, []

    def counted_median(*args, **kwargs):
        calls.append(args[0].shape)
        return median(*args, **kwargs)

    monkeypatch.setattr(np, "median", counted_median)
    ladd.typical_spread_without_another(np.random.default_rng(0).normal(size=(50, 3)))
    assert calls == [(50, 3)]                                           # the fleet's own only


def test_screen_edge_cases():
    from aggregator.strategies.ladd import StyleClustering, screen_styles

    rng = np.random.default_rng(7)
    three = np.array([[0.0, 0.0], [1.0, 0.0], [1000.0, 0.0]])
    assert screen_styles(three) == {}                           # three styles: k = 2 is the only choice
    four = np.vstack([three, [[0.5, 0.5]]])                     # any one of them may be why there are four
    assert screen_styles(four) == {} and _reference_screen(four, 4.0) == []
    five = np.vstack([four, [[0.0, 1.0]]])
    assert list(screen_styles(five)) == [2] == _reference_screen(five, 4.0)
    pair = np.vstack([five, [[1000.0, 1.0]]])                   # two alike far styles: a group, kept
    assert screen_styles(pair) == {}
    same = np.vstack([np.ones((5, 3)), [[50.0, 50.0, 50.0]]])   # typical distance 0: nothing to judge by
    assert screen_styles(same) == {}
    blobs = np.concatenate([rng.normal(m, 0.3, (6, 4)) for m in (0, 5, 10)])
    assert screen_styles(blobs) == {}
    for bad in (1.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="screen multiple"):
            screen_styles(five, bad)
    # blocks of rows (1,200 styles: 129 rows a block, large fleets stay O(n) in memory) give each
    # row's distances computed alone, bit for bit
    from aggregator.strategies.ladd import nearest_other_distance
    big = rng.normal(size=(1200, 27)) * 1e5
    nearest = []
    for i in range(len(big)):
        d = np.sqrt(((big - big[i]) ** 2).sum(axis=1))
        d[i] = np.inf
        nearest.append(d.min())
    np.testing.assert_array_equal(nearest_other_distance(big), nearest)
    # a screened style leaves a one-cluster fallback's centroid alone too
    lone = StyleClustering((1, 1)).fit(five)
    np.testing.assert_allclose(lone.cluster_centers_[0], five[[0, 1, 3, 4]].mean(axis=0))
    assert list(lone.screened_) == [2] and set(lone.labels_) == {0}
