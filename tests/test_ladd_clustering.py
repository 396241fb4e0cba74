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
