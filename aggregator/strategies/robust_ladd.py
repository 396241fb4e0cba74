"""LADD's round aggregation with bounded influence: the job's robust rule within each cluster.

:class:`~aggregator.strategies.ladd.ClusterSpecificAveraging` streams the round's φ mean over
every update and each cluster's θ_c mean over its members. :class:`RobustClusterAveraging` keeps
the round's updates instead and combines them at ``result`` with a
:class:`~aggregator.strategies.robust_fedavg.RobustAggregation` (norm bound, then rule): φ over
all updates, θ_c over cluster c's, each bounded relative to its own current parameters, so a
device can steer neither the shared encoder nor its cluster's head. A cluster with fewer than
three updates is bounded on every cluster's θ updates instead (a median of one or two bounds
nothing), as the canonical sums bound it (``aggregator/shards/ladd_sums.py``), and a round of
fewer than three updates by the job's references of earlier rounds too (``LaddSmallRounds``, φ's
through ``RobustAggregation``'s small-round path, the θ slots' as the canonical sums take it). A
cluster with fewer updates than the rule needs keeps its θ_c (reported by the rule), as a cluster
nobody trained for does.
The mean rule over the updates in arrival order makes the same float64 additions as the
streaming class: with no update bounded the result is the same, bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np

from aggregator.shards.ladd_sums import theta_slot
from aggregator.strategies.ladd import ClusterAveraging, Params, cast_like
from aggregator.strategies.ladd_slot_limits import MIN_OWN_UPDATES
from aggregator.strategies.ladd_small_rounds import LaddSmallRounds
from aggregator.strategies.robust_fedavg import NormBound, RobustAggregation, flatten
from aggregator.strategies.small_round_reference import SmallRoundReference

log = logging.getLogger("fedfleet.aggregator")


class RobustClusterAveraging(ClusterAveraging):
    def __init__(self, is_cluster_specific: Callable[[str], bool], aggregation: RobustAggregation,
                 small_rounds: LaddSmallRounds | None = None):
        super().__init__()
        self.is_cluster_specific, self.aggregation = is_cluster_specific, aggregation
        # the job's references for rounds of fewer than three updates (none given: off)
        self.small_rounds = small_rounds or LaddSmallRounds(SmallRoundReference(False, []), SmallRoundReference(False, []))
        # a small cluster's updates come bounded (_bound_theta_slots): its rule and screen only
        self._without_bounds = RobustAggregation(aggregation.rule, NormBound(0.0), screen=aggregation.screen)
        self._global: list[tuple[Params, int]] = []
        self._clusters: dict[int, list[tuple[Params, int]]] = {}
        # the devices of φ's updates and of each cluster's, in their order (the references' pools name them)
        self._global_devices: list[str] = []
        self._devices: dict[int, list[str]] = {}

    def add(self, cluster: int, tensors: Mapping[str, np.ndarray], n: int, device: str = "") -> None:
        if isinstance(n, bool) or int(n) != n or n <= 0:
            raise ValueError(f"weight (sample count) must be a positive integer, got {n!r}")
        for name, value in tensors.items():
            if not np.isfinite(np.asarray(value, dtype=np.float64)).all():
                raise ValueError(f"update tensor {name!r} contains NaN or Inf")
        phi = {k: v for k, v in tensors.items() if not self.is_cluster_specific(k)}
        theta = {k: v for k, v in tensors.items() if self.is_cluster_specific(k)}
        device = device or f"#{self.count}"          # without ids (a test's), one key per update
        if phi:
            self._global.append((phi, int(n)))
            self._global_devices.append(device)
        if theta:
            self._clusters.setdefault(int(cluster), []).append((theta, int(n)))
            self._devices.setdefault(int(cluster), []).append(device)
        self._counted(cluster)

    def result(self, global_params: Mapping[str, np.ndarray], cluster_params: Mapping[int, Mapping[str, np.ndarray]]
               ) -> tuple[Params, dict[int, Params]]:
        self._check(global_params, cluster_params)          # before the references take the round
        phi = {k: np.array(v, copy=True) for k, v in global_params.items()}
        self._combine_into(phi, self._global, "global", self.aggregation, (self.small_rounds.phi, self._global_devices))
        thetas = {c: {k: np.array(v, copy=True) for k, v in p.items()} for c, p in cluster_params.items()}
        bounded_here, held = self._bound_theta_slots(thetas)
        for c, updates in self._clusters.items():
            if not held:
                self._combine_into(thetas[c], updates, f"cluster {c}",
                                   self._without_bounds if c in bounded_here else self.aggregation)
        return phi, thetas

    def _check(self, global_params: Mapping[str, np.ndarray], cluster_params: Mapping[int, Mapping[str, np.ndarray]]
               ) -> None:
        """ValueError for an update of a cluster, or of a tensor, the model does not have."""
        slots = [("global", global_params, self._global)]
        for c, updates in self._clusters.items():
            if c not in cluster_params:
                raise ValueError(f"update for unknown cluster {c}")
            slots.append((f"cluster {c}", cluster_params[c], updates))
        for where, params, updates in slots:
            unknown = set(updates[0][0]) - set(params) if updates else set()
            if unknown:
                raise ValueError(f"update carries unknown {where} tensor(s) {sorted(unknown)}")

    def _bound_theta_slots(self, thetas: Mapping[int, Params]) -> tuple[set[int], bool]:
        """Bound the updates of each cluster with fewer than MIN_OWN_UPDATES of them on every
        cluster's θ updates, layer by layer (``ladd_sums.slot_limits``'s rule and the θ reference's
        in a small round, as the canonical sums decide them), and close the round into the θ
        reference; (the clusters so bounded, whose combination skips its own bound layers, whether
        the θ reference holds the round: a round of one before it exists moves no θ_c)."""
        layers = self.aggregation.bound_layers()
        if not layers or not self._clusters:
            return set(), False
        start = {c: flatten({k: thetas[c][k] for k in updates[0][0]}) for c, updates in self._clusters.items()}
        bounded, measured = dict(self._clusters), []
        for i, layer in enumerate(layers):
            values = {c: [layer.statistic(start[c], t, w) for t, w in updates] for c, updates in bounded.items()}
            limits = self.small_rounds.limits(i, layer, {theta_slot(c): v for c, v in values.items()})
            measured.append({device: {theta_slot(c): value} for c, column in values.items()
                             for device, value in zip(self._devices[c], column)})
            bounded = {c: [layer.bound_one(start[c], t, w, limits[theta_slot(c)]) for t, w in updates]
                       for c, updates in bounded.items()}
        held = bool(self.small_rounds.close(measured))
        small = {c for c, updates in self._clusters.items() if len(updates) < MIN_OWN_UPDATES}
        for c in small:
            self._clusters[c] = bounded[c]
        return small, held

    def _combine_into(self, params: Params, updates: list[tuple[Params, int]], where: str,
                      aggregation: RobustAggregation, reference: tuple[SmallRoundReference, list[str]] | None = None
                      ) -> None:
        """Combine ``updates`` into ``params`` (``reference``: φ's, and the updates' devices: a round of
        fewer than three is bounded by it too and closed into it, as the FedAvg family's whole round)."""
        if not updates:
            return
        current = {k: params[k] for k in updates[0][0]}
        if reference is None:
            combined, report = aggregation.aggregate(current, updates)
        else:
            small_rounds, devices = reference
            combined, report, (limits, statistics) = aggregation.aggregate_measured(current, updates, small_rounds)
            small_rounds.observe(len(updates), limits, None if statistics is None else dict(zip(devices, statistics)))
        if report.get("skipped") or report.get("norm_bounded"):
            log.warning("LADD %s: %s", where, report)
        for name, value in (combined or {}).items():
            params[name] = cast_like(value, params[name])
