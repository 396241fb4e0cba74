"""LADD's server-side math: style clustering, cluster-specific averaging, SWA teachers.

Pure tensor-in / tensor-out pieces (no transport, no rounds), spec §2.2-2.4:

* :class:`StyleClustering`, a scikit-learn style estimator. ``fit(styles)`` runs KMeans
  (``n_init`` restarts, best inertia) for every k in ``k_range`` and keeps the partition
  with the highest silhouette score (Euclidean, raw styles); ``predict`` sends a style to
  the nearest centroid (new devices, test images). Attributes after fit: ``n_clusters_``,
  ``labels_``, ``cluster_centers_``, ``silhouette_scores_`` {k: score}, ``inertias_``.
* :class:`ClusterSpecificAveraging`: one round's aggregation. A model is split by parameter
  name into global φ and cluster-specific θ (``is_cluster_specific``). Every update adds its
  φ tensors to one sample-weighted mean over *all* participants and its θ tensors to the
  mean of *its own cluster* only; a cluster with no participant keeps its θ_c, and a name no
  update carried (e.g. frozen BatchNorm buffers) keeps its value. Streaming, in arrival order:
  a job sums the same means in canonical order, as its shards would
  (``aggregator/shards/ladd_sums.py``), which the tests hold to this one.
* :class:`SwaTeacher`: the per-cluster pseudo-label teacher g_c. Before t_START it is a copy
  of the cluster model; from t_START on it is the running mean of the cluster models it is
  given (stochastic weight averaging, every array including BN buffers).
* :func:`clustering_purity`: Σ_c max_d |c ∩ d| / N against known domains.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from aggregator.strategies.fedavg import WeightedMean

Params = dict[str, np.ndarray]

CLUSTER_SCOPES = ("head", "all")
CLUSTERINGS = ("styles", "none")        # LADD's style clusters, or one cluster (FedAvg + self-training)


def cluster_specific_predicate(scope: str) -> Callable[[str], bool]:
    """Which parameter names are θ: LADD (cls) = the decoder/head, LADD (all) = everything."""
    if scope == "head":
        return lambda name: name.startswith("head.")
    if scope == "all":
        return lambda name: True
    raise ValueError(f"cluster scope must be one of {CLUSTER_SCOPES}, got {scope!r}")


def _as_styles(X) -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim > 2:
        X = X.reshape(len(X), -1)
    if X.ndim != 2 or len(X) == 0:
        raise ValueError(f"styles must be (n_devices, n_features) with n_devices >= 1, got {X.shape}")
    if not np.isfinite(X).all():
        raise ValueError("styles contain NaN or Inf")
    return X


class StyleClustering:
    """KMeans over styles with k chosen by silhouette (LADD Algorithm 2, [C]'s sklearn version).

    ``k_range``: inclusive (k_min, k_max); k values that a silhouette cannot score
    (k >= n_samples) are skipped. With ``k_range=(1, 1)`` everything is one cluster.
    """

    def __init__(self, k_range: tuple[int, int] = (2, 8), n_init: int = 10, random_state: int | None = 0):
        self.k_range = k_range
        self.n_init = n_init
        self.random_state = random_state

    def get_params(self, deep: bool = True) -> dict:
        return {"k_range": self.k_range, "n_init": self.n_init, "random_state": self.random_state}

    def set_params(self, **params) -> "StyleClustering":
        for k, v in params.items():
            setattr(self, k, v)
        return self

    def fit(self, X, y=None) -> "StyleClustering":
        from sklearn.cluster import KMeans
        from sklearn.metrics import silhouette_score

        X = _as_styles(X)
        k_min, k_max = (int(k) for k in self.k_range)
        if not 1 <= k_min <= k_max:
            raise ValueError(f"k_range must be 1 <= k_min <= k_max, got {self.k_range}")
        if self.n_init < 1:
            raise ValueError(f"n_init must be >= 1, got {self.n_init}")
        self.silhouette_scores_: dict[int, float] = {}
        self.inertias_: dict[int, float] = {}
        best = None
        if k_min == 1 and (k_max == 1 or len(X) < 3):
            self._set(np.zeros(len(X), np.int64), X.mean(axis=0, keepdims=True), 1)
            return self
        for k in range(max(k_min, 2), min(k_max, len(X) - 1) + 1):
            km = KMeans(n_clusters=k, n_init=self.n_init, random_state=self.random_state).fit(X)
            # fewer distinct styles than k leave centroids without members: not a k-clustering,
            # and a style routed to such a centroid has no cluster model (a review's finding)
            if len(np.unique(km.labels_)) < k:
                continue
            score = float(silhouette_score(X, km.labels_, metric="euclidean"))
            self.silhouette_scores_[k], self.inertias_[k] = score, float(km.inertia_)
            if best is None or score > best[0]:
                best = (score, km)
        if best is None:
            raise ValueError(f"cannot cluster {len(X)} styles with k in {self.k_range} "
                             "(a silhouette needs 2 <= k <= n_samples - 1)")
        km = best[1]
        self._set(km.labels_.astype(np.int64), km.cluster_centers_, km.n_clusters)
        return self

    def _set(self, labels: np.ndarray, centers: np.ndarray, k: int) -> None:
        self.labels_ = labels
        self.cluster_centers_ = np.asarray(centers, dtype=np.float64)
        self.n_clusters_ = int(k)

    def predict(self, X) -> np.ndarray:
        if not hasattr(self, "cluster_centers_"):
            raise RuntimeError("StyleClustering is not fitted")
        X = _as_styles(X)
        if X.shape[1] != self.cluster_centers_.shape[1]:
            raise ValueError(f"styles have {X.shape[1]} features, the centroids {self.cluster_centers_.shape[1]}")
        return nearest_centroid(X, self.cluster_centers_)

    def fit_predict(self, X, y=None) -> np.ndarray:
        return self.fit(X).labels_

    @classmethod
    def from_centroids(cls, centers: np.ndarray) -> "StyleClustering":
        """A predictor from stored centroids (what the server keeps after clustering)."""
        model = cls()
        centers = _as_styles(centers)
        model._set(np.zeros(0, np.int64), centers, len(centers))
        return model


def cluster_styles(bank, k_range: tuple[int, int], n_init: int, seed: int | None) -> tuple[StyleClustering, str | None]:
    """LADD's clustering of the style bank, and why it fell back (None when it did not): styles too
    few for k >= k_min (a silhouette needs 2 <= k <= n - 1) or that never split are one cluster,
    rather than a job that cannot leave its style phase."""
    try:
        return StyleClustering(k_range, n_init, seed).fit(bank), None
    except ValueError as exc:
        return StyleClustering((1, 1), n_init, seed).fit(bank), f"{exc}: one cluster"

def nearest_centroid(X: np.ndarray, centers: np.ndarray) -> np.ndarray:
    d2 = ((X[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2)
    return d2.argmin(axis=1).astype(np.int64)


def clustering_purity(labels: Iterable[int], truth: Iterable) -> float:
    """Σ over clusters of the size of its largest true group, divided by N."""
    labels, truth = np.asarray(list(labels)), np.asarray(list(truth))
    if labels.shape != truth.shape or labels.size == 0:
        raise ValueError("labels and truth must be equally long and non-empty")
    total = 0
    for c in np.unique(labels):
        _, counts = np.unique(truth[labels == c], return_counts=True)
        total += counts.max()
    return float(total / labels.size)


class ClusterAveraging(ABC):
    """One LADD round's aggregation: ``add`` each device's update (its cluster, its trained
    tensors, its sample count), then ``result`` once for the new (φ, {c: θ_c})."""

    def __init__(self):
        self.participants: dict[int, int] = {}           # cluster -> updates this round

    @property
    def count(self) -> int:
        return sum(self.participants.values())

    def _counted(self, cluster: int) -> None:
        self.participants[int(cluster)] = self.participants.get(int(cluster), 0) + 1

    @abstractmethod
    def add(self, cluster: int, tensors: Mapping[str, np.ndarray], n: int, device: str = "") -> None:
        """Take one device's update (``device``: its id, which an order-free sum is ordered by); a
        bad one raises ValueError and changes nothing."""

    @abstractmethod
    def result(self, global_params: Mapping[str, np.ndarray], cluster_params: Mapping[int, Mapping[str, np.ndarray]]
               ) -> tuple[Params, dict[int, Params]]:
        """New (φ, {c: θ_c}); dtypes and untouched entries of the inputs are kept."""


class ClusterSpecificAveraging(ClusterAveraging):
    """One round's φ / θ_c means; ``result`` applies them to the current parameters."""

    def __init__(self, is_cluster_specific: Callable[[str], bool]):
        super().__init__()
        self.is_cluster_specific = is_cluster_specific
        self._global = WeightedMean()
        self._clusters: dict[int, WeightedMean] = {}

    def add(self, cluster: int, tensors: Mapping[str, np.ndarray], n: int, device: str = "") -> None:
        phi = {k: v for k, v in tensors.items() if not self.is_cluster_specific(k)}
        theta = {k: v for k, v in tensors.items() if self.is_cluster_specific(k)}
        # validate both parts before touching either accumulator, so a bad update changes nothing
        for part in (phi, theta):
            for name, value in part.items():
                if not np.isfinite(np.asarray(value, dtype=np.float64)).all():
                    raise ValueError(f"update tensor {name!r} contains NaN or Inf")
        if phi:
            self._global.add(phi, n)
        if theta:
            self._clusters.setdefault(int(cluster), WeightedMean()).add(theta, n)
        self._counted(cluster)

    def result(self, global_params: Mapping[str, np.ndarray], cluster_params: Mapping[int, Mapping[str, np.ndarray]]
               ) -> tuple[Params, dict[int, Params]]:
        phi = {k: np.array(v, copy=True) for k, v in global_params.items()}
        if self._global.count:
            for name, mean in self._global.result().items():
                if name not in phi:
                    raise ValueError(f"update carries unknown global tensor {name!r}")
                phi[name] = cast_like(mean, phi[name])
        thetas = {c: {k: np.array(v, copy=True) for k, v in p.items()} for c, p in cluster_params.items()}
        for c, acc in self._clusters.items():
            if c not in thetas:
                raise ValueError(f"update for unknown cluster {c}")
            for name, mean in acc.result().items():
                if name not in thetas[c]:
                    raise ValueError(f"update carries unknown cluster tensor {name!r}")
                thetas[c][name] = cast_like(mean, thetas[c][name])
        return phi, thetas


def cast_like(value: np.ndarray, like: np.ndarray) -> np.ndarray:
    if value.shape != like.shape:
        raise ValueError(f"averaged tensor has shape {value.shape}, parameter {like.shape}")
    return value.astype(like.dtype)


class SwaTeacher:
    """The pseudo-label teacher of one cluster: copy before t_START, running mean from t_START."""

    def __init__(self, params: Mapping[str, np.ndarray]):
        self.params: Params = {k: np.array(v, copy=True) for k, v in params.items()}
        self.averaged = 0          # models in the running mean (0: plain copy)
        self.version = 0           # bumped at every change (so a sender knows when it changed)

    def copy_from(self, params: Mapping[str, np.ndarray]) -> None:
        self.params = {k: np.array(v, copy=True) for k, v in params.items()}
        self.averaged = 0
        self.version += 1

    def average_in(self, params: Mapping[str, np.ndarray]) -> None:
        """w_g ← (w_g · n + w_c) / (n + 1); the first call after copies starts the mean at w_c."""
        if set(params) != set(self.params):
            raise ValueError("teacher and cluster model have different tensors")
        n = self.averaged
        self.params = {k: ((self.params[k].astype(np.float64) * n + np.asarray(params[k], np.float64)) / (n + 1))
                       .astype(self.params[k].dtype) for k in self.params}
        self.averaged = n + 1
        self.version += 1
