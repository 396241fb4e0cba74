"""LADD's round aggregation with bounded influence: the job's robust rule within each cluster.

:class:`~aggregator.strategies.ladd.ClusterSpecificAveraging` streams the round's φ mean over
every update and each cluster's θ_c mean over its members. :class:`RobustClusterAveraging` keeps
the round's updates instead and combines them at ``result`` with a
:class:`~aggregator.strategies.robust_fedavg.RobustAggregation` (norm bound, then rule): φ over
all updates, θ_c over cluster c's, each bounded relative to its own current parameters, so a
device can steer neither the shared encoder nor its cluster's head. A cluster with fewer than
three updates is bounded on every cluster's θ updates instead (a median of one or two bounds
nothing), as the canonical sums bound it (``aggregator/shards/ladd_sums.py``). A cluster with
fewer updates than the rule needs keeps its θ_c (reported by the rule), as a cluster nobody
trained for does.
The mean rule over the updates in arrival order makes the same float64 additions as the
streaming class: with no update bounded the result is the same, bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np

from aggregator.shards.ladd_sums import MIN_OWN_UPDATES, slot_limits
from aggregator.strategies.ladd import ClusterAveraging, Params, cast_like
from aggregator.strategies.robust_fedavg import NormBound, RobustAggregation, flatten

log = logging.getLogger("fedfleet.aggregator")


class RobustClusterAveraging(ClusterAveraging):
    def __init__(self, is_cluster_specific: Callable[[str], bool], aggregation: RobustAggregation):
        super().__init__()
        self.is_cluster_specific, self.aggregation = is_cluster_specific, aggregation
        # a small cluster's updates come bounded (_bound_small_clusters): its rule and screen only
        self._without_bounds = RobustAggregation(aggregation.rule, NormBound(0.0), screen=aggregation.screen)
        self._global: list[tuple[Params, int]] = []
        self._clusters: dict[int, list[tuple[Params, int]]] = {}

    def add(self, cluster: int, tensors: Mapping[str, np.ndarray], n: int, device: str = "") -> None:
        if isinstance(n, bool) or int(n) != n or n <= 0:
            raise ValueError(f"weight (sample count) must be a positive integer, got {n!r}")
        for name, value in tensors.items():
            if not np.isfinite(np.asarray(value, dtype=np.float64)).all():
                raise ValueError(f"update tensor {name!r} contains NaN or Inf")
        phi = {k: v for k, v in tensors.items() if not self.is_cluster_specific(k)}
        theta = {k: v for k, v in tensors.items() if self.is_cluster_specific(k)}
        if phi:
            self._global.append((phi, int(n)))
        if theta:
            self._clusters.setdefault(int(cluster), []).append((theta, int(n)))
        self._counted(cluster)

    def result(self, global_params: Mapping[str, np.ndarray], cluster_params: Mapping[int, Mapping[str, np.ndarray]]
               ) -> tuple[Params, dict[int, Params]]:
        phi = {k: np.array(v, copy=True) for k, v in global_params.items()}
        self._combine_into(phi, self._global, "global", self.aggregation)
        thetas = {c: {k: np.array(v, copy=True) for k, v in p.items()} for c, p in cluster_params.items()}
        for c in self._clusters:
            if c not in thetas:
                raise ValueError(f"update for unknown cluster {c}")
        bounded_here = self._bound_small_clusters(thetas)
        for c, updates in self._clusters.items():
            self._combine_into(thetas[c], updates, f"cluster {c}",
                               self._without_bounds if c in bounded_here else self.aggregation)
        return phi, thetas

    def _bound_small_clusters(self, thetas: Mapping[int, Params]) -> set[int]:
        """Bound the updates of each cluster with fewer than MIN_OWN_UPDATES of them on every
        cluster's θ updates, layer by layer (``ladd_sums.slot_limits``'s rule, as the canonical
        sums decide it); the clusters so bounded, whose combination skips its own bound layers."""
        layers = self.aggregation.bound_layers()
        small = {c for c, updates in self._clusters.items() if len(updates) < MIN_OWN_UPDATES}
        if not layers or not small or sum(map(len, self._clusters.values())) < MIN_OWN_UPDATES:
            return set()
        start = {c: flatten({k: thetas[c][k] for k in updates[0][0]}) for c, updates in self._clusters.items()}
        bounded = dict(self._clusters)
        for layer in layers:
            limits = slot_limits(layer, {c: [layer.statistic(start[c], t, w) for t, w in updates]
                                         for c, updates in bounded.items()})
            bounded = {c: [layer.bound_one(start[c], t, w, limits[c]) for t, w in updates]
                       for c, updates in bounded.items()}
        for c in small:
            self._clusters[c] = bounded[c]
        return small

    def _combine_into(self, params: Params, updates: list[tuple[Params, int]], where: str,
                      aggregation: RobustAggregation) -> None:
        if not updates:
            return
        unknown = set(updates[0][0]) - set(params)
        if unknown:
            raise ValueError(f"update carries unknown {where} tensor(s) {sorted(unknown)}")
        combined, report = aggregation.aggregate({k: params[k] for k in updates[0][0]}, updates)
        if report.get("skipped") or report.get("norm_bounded"):
            log.warning("LADD %s: %s", where, report)
        for name, value in (combined or {}).items():
            params[name] = cast_like(value, params[name])
