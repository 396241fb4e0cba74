"""Central differential privacy around LADD's cluster-specific averaging (DP-LADD).

A LADD round moves the global tensors φ with every participant's update and each cluster's
θ_c with its own participants' only. Under DP a device k of cluster c, selected in a round that
opened from φ_t, θ_c,t, contributes its *joint* delta over everything it trained,

    Δ_k = [φ_k − φ_t | θ_k − θ_c,t],   Δ̃_k = Δ_k · min(1, C / ‖Δ_k‖₂),

and the round releases one vector, the concatenation over the global slot and the slot of
every cluster with a selected device:

    R = [Σ_k Δ̃φ_k | Σ_{k∈c} Δ̃θ_k for each such c] + N(0, (z_Δ C)² I).

Adding or removing device k changes R by [Δ̃φ_k | its own cluster's Δ̃θ_k] only, of L2 norm
≤ C: the whole round is one Gaussian mechanism of sensitivity C and multiplier z_Δ, exactly a
DP-FedAvg round for the accountant (the clusters' slots are disjoint: parallel composition is
this same argument, no extra cost). The mechanism is DP-FedAvg's own
(:class:`~aggregator.strategies.dp_fedavg.ClippedGaussianSum`, fixed or adaptive C). Then,
as post-processing, φ ← φ_t + R_φ / m and θ_c ← θ_c,t + R_c / m_c, with m and m_c the
devices *selected* for the round (fixed at its opening, never the number that answered).
Devices are unweighted: sample counts would make the sensitivity data-dependent.

Outside the guarantee: the styles (the style round is plaintext, the server clusters them) and
therefore the cluster assignment, which the mechanism takes as public.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from aggregator.strategies.dp_fedavg import ClippedGaussianSum
from aggregator.strategies.ladd import ClusterAveraging, Params, cast_like

GLOBAL = "phi"


def apply_mean_deltas(global_params: Mapping[str, np.ndarray], cluster_params: Mapping[int, Mapping[str, np.ndarray]],
                      sums: Mapping[tuple, np.ndarray], selected: Mapping[int, int]) -> tuple[Params, dict[int, Params]]:
    """φ + R_φ / m and θ_c + R_c / m_c from the released sums keyed ("phi", name) / (c, name);
    a cluster with no slot in ``sums`` keeps θ_c (shared by central and distributed DP-LADD)."""
    total = sum(selected.values())
    phi = {k: np.array(v, copy=True) for k, v in global_params.items()}
    theta = {c: {k: np.array(v, copy=True) for k, v in p.items()} for c, p in cluster_params.items()}
    for (slot, name), value in sums.items():
        target, count = (phi, total) if slot == GLOBAL else (theta[slot], selected[slot])
        target[name] = cast_like(np.asarray(target[name], np.float64) + value / count, target[name])
    return phi, theta


class DPClusterAveraging(ClusterAveraging):
    """One DP-LADD round: joint clipping of each device's φ and θ_c delta, one Gaussian release,
    summed as the updates arrive (a job sums the same arithmetic in canonical order, as its shards
    would: ``aggregator/shards/ladd_sums.py``; the tests hold the two to each other).

    ``trainable``: the tensors devices train (the released slots); ``selected``: cluster ->
    devices selected this round (clusters with none release nothing and keep θ_c)."""

    def __init__(self, mechanism: ClippedGaussianSum, is_cluster_specific: Callable[[str], bool],
                 trainable: list[str], global_params: Mapping[str, np.ndarray],
                 cluster_params: Mapping[int, Mapping[str, np.ndarray]], selected: Mapping[int, int]):
        super().__init__()
        self.mechanism, self.is_cluster_specific = mechanism, is_cluster_specific
        self.selected = {int(c): int(n) for c, n in selected.items() if n > 0}
        unknown = set(self.selected) - set(cluster_params)
        if unknown:
            raise ValueError(f"selected devices of unknown clusters {sorted(unknown)}")
        self.start_global, self.start_clusters = global_params, cluster_params
        shapes = {(GLOBAL, k): np.shape(global_params[k]) for k in trainable if not is_cluster_specific(k)}
        for c in self.selected:
            shapes.update({(c, k): np.shape(cluster_params[c][k]) for k in trainable if is_cluster_specific(k)})
        self.round_sum = mechanism.open_sum(shapes)

    def add(self, cluster: int, tensors: Mapping[str, np.ndarray], n: int, device: str = "") -> None:
        cluster = int(cluster)
        if cluster not in self.selected:
            raise ValueError(f"update for cluster {cluster}, which had no device selected this round")
        delta = {}
        for name, value in tensors.items():
            slot, start = ((cluster, self.start_clusters[cluster]) if self.is_cluster_specific(name)
                           else (GLOBAL, self.start_global))
            if name not in start or np.shape(value) != np.shape(start[name]):
                raise ValueError(f"update tensor {name!r} is not one of the round's slots (or has the wrong shape)")
            delta[(slot, name)] = np.asarray(value, np.float64) - np.asarray(start[name], np.float64)
        self.round_sum.add(delta)
        self._counted(cluster)

    def result(self, global_params: Mapping[str, np.ndarray], cluster_params: Mapping[int, Mapping[str, np.ndarray]]
               ) -> tuple[Params, dict[int, Params]]:
        """Releases the round (noise even if nobody answered: the accountant counts every round)."""
        sums = self.mechanism.release(self.round_sum, sum(self.selected.values()))
        return apply_mean_deltas(global_params, cluster_params, sums, self.selected)
