"""LADD with a robust rule within each cluster: the robust mean is the streaming cluster average bit
for bit, and the median applies within each cluster (against numpy)."""

import numpy as np

from aggregator.strategies.robust_fedavg import CoordinateMedian, Mean, NormBound, RobustAggregation


def ladd_updates(seed=5):
    rng = np.random.default_rng(seed)
    return [(int(c), {"enc": rng.normal(size=4), "cls": rng.normal(size=(2, 2))}, int(rng.integers(1, 30)))
            for c in (0, 0, 1, 0, 1, 1, 0)]


def test_ladd_robust_mean_is_the_streaming_average_bit_for_bit():
    from aggregator.strategies.ladd import ClusterSpecificAveraging
    from aggregator.strategies.robust_fedavg import RobustAggregation
    from aggregator.strategies.robust_ladd import RobustClusterAveraging

    phi, thetas = {"enc": np.zeros(4)}, {0: {"cls": np.zeros((2, 2))}, 1: {"cls": np.zeros((2, 2))}}
    streaming, robust = (ClusterSpecificAveraging(lambda k: k == "cls"),
                         RobustClusterAveraging(lambda k: k == "cls", RobustAggregation(Mean(), NormBound(3.0))))
    for c, t, n in ladd_updates():
        streaming.add(c, t, n)
        robust.add(c, t, n)
    (p1, t1), (p2, t2) = streaming.result(phi, thetas), robust.result(phi, thetas)
    assert np.array_equal(p1["enc"], p2["enc"]) and all(np.array_equal(t1[c]["cls"], t2[c]["cls"]) for c in t1)
    assert robust.participants == streaming.participants == {0: 4, 1: 3}


def test_ladd_median_applies_within_each_cluster():
    from aggregator.strategies.robust_fedavg import RobustAggregation
    from aggregator.strategies.robust_ladd import RobustClusterAveraging

    ups = ladd_updates()
    robust = RobustClusterAveraging(lambda k: k == "cls", RobustAggregation(CoordinateMedian(), NormBound(0.0)))
    for c, t, n in ups:
        robust.add(c, t, n)
    phi, thetas = robust.result({"enc": np.zeros(4)}, {0: {"cls": np.zeros((2, 2))}, 1: {"cls": np.zeros((2, 2))}})
    np.testing.assert_array_equal(phi["enc"], np.median([t["enc"] for _, t, _ in ups], axis=0))
    for cluster in (0, 1):
        want = np.median([t["cls"] for c, t, _ in ups if c == cluster], axis=0)
        np.testing.assert_array_equal(thetas[cluster]["cls"], want)
