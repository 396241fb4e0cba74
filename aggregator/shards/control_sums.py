"""How shards sum Scaffold's rounds (``scaffold``, ``scaffold-tail``): FedAvg's round sums of the
trained tensors (``fedavg_sums.py``) and, in the same buckets and up the same tree, Σ Δc_k over
the round's accepted updates, each Δc_k clipped by the job's own rule
(``ScaffoldControls.clipped_control``, ``aggregator/jobs/scaffold.py``).

The coordinator's job takes its control step on the root's sum, c ← c + (|S| / K) · Σ Δc_k / |S|
with |S| the accepted updates, before its server step (:meth:`ControlledRoundSums.take_round`); in a
round of fewer than three the Δc bound's limit is within the job's reference of earlier rounds too,
decided and kept by ``round_mean`` as the model's is (:meth:`ControlledRoundSums.references`);
one aggregator adds its round's Δc up the same tree (:func:`local_control_sum`), so c is the same
bits either way. c lives in the job's checkpoint, as the model does, so it survives a restart of
the coordinator; a shard keeps only the stored results.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from protocols.clipping import clip_update, global_norm

from aggregator.shards.fedavg_sums import FedAvgRoundSums, RoundContext, bound_layers
from aggregator.shards.sum_tree import Contribution, PartialSum, add_weighted, local_tree_sum
from aggregator.strategies.robust_fedavg import NormBound

CONTROL_SUM = "control_sum."        # + tensor name: Σ clip(Δc_k) (float64)

Tensors = dict[str, np.ndarray]


def control_sums(deltas: Iterable[Mapping[str, np.ndarray]]) -> Tensors:
    """A bucket's Σ Δc_k (float64, keyed ``CONTROL_SUM`` + name) of its clipped deltas, in the order given."""
    sums: Tensors = {}
    for delta in deltas:
        add_weighted(sums, delta)
    return {CONTROL_SUM + k: v for k, v in sums.items()}


def control_total(state: Mapping[str, np.ndarray]) -> Tensors:
    """The Σ Δc_k a (root) state holds, by tensor name."""
    return {k[len(CONTROL_SUM):]: v for k, v in state.items() if k.startswith(CONTROL_SUM)}


def local_control_sum(deltas: Mapping[str, Mapping[str, np.ndarray]]) -> Tensors | None:
    """One aggregator's Σ Δc_k over its round's ``deltas`` (device -> clipped Δc_k), added up the
    buckets' tree as shards add it (None: no delta)."""
    total = local_tree_sum(ControlledRoundSums(), deltas.items(),
                           lambda members: PartialSum(control_sums(delta for _device, delta in members)))
    return None if total is None else control_total(total.state)


class ControlBound:
    """The round's bound on the Δc_k (a phase after the update's bound layers): each scaled to at
    most ``multiplier`` × the round's median ‖Δc‖ (0: off); the update itself it leaves alone. In a
    round of fewer than three Δc that median is the round's own (one device's in a round of one), so
    the limit is also within the job's reference of earlier rounds (``ScaffoldControls.control_rounds``,
    a ``SmallRoundReference``), as the update's bound layers are within the model's."""

    def __init__(self, multiplier: float):
        self.multiplier = multiplier
        self._norms = NormBound(multiplier)

    def limit(self, norms) -> float:
        return self._norms.limit(norms)

    @staticmethod
    def bound_one(x, tensors, weight, limit: float):
        return tensors, weight


class ControlledRoundSums(FedAvgRoundSums):
    """FedAvg's round sums plus each bucket's Σ Δc_k, each Δc_k within the round's control bound
    (its limit decided in a phase after the update's layers, on every shard's ‖Δc_k‖); the
    round's root moves the job's control c."""

    def round_layers(self, job) -> list:
        bound = job.control_bound()
        return super().round_layers(job) + ([bound] if bound is not None else [])

    def statistics(self, new_job, members: list[Contribution], context: RoundContext) -> dict[str, float]:
        job = new_job()
        if len(context.limits) < len(bound_layers(job.config)):
            return super().statistics(new_job, members, context)
        return {device: global_norm(job.clipped_control(update)) for device, update in self._loaded(job, members)}

    def sum_updates(self, job, updates: list[tuple[str, Any]], context: RoundContext) -> PartialSum:
        fedavg = super().sum_updates(job, updates, context)
        limits = context.limits[len(bound_layers(job.config)):]      # the control bound's, if on
        deltas = control_sums(clip_update(job.clipped_control(update), limits[0])[0] if limits and limits[0] > 0
                              else job.clipped_control(update) for _device, update in updates)
        return PartialSum({**fedavg.state, **deltas}, fedavg.contributed)

    def references(self, job) -> tuple:
        return (*super().references(job), job.control_rounds)

    def take_round(self, job, total: PartialSum | None, accepted: int, held: tuple = ()) -> None:
        # a round of one Δc that the Δc bound's reference holds (none usable yet) moves no c
        if total is not None and accepted and job.control_rounds not in held:
            job.step_control(control_total(total.state), accepted)
