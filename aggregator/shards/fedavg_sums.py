"""A FedAvg(ψ) round's sum, split in buckets: what shards add, and what one aggregator adds the
same way so that both give the same bits.

A round's combined update is Σ w_k θ'_k / Σ w_k over its accepted updates, where θ'_k, w_k are the
update and its sample count n_k after the bounded-influence layers that need only one number per
update from the fleet (``aggregator/strategies/robust_fedavg.py``): the norm bound (‖Δ_k‖, limit
a multiple of their median) and the contribution bound (w_k·‖Δ_k‖, likewise). The round closes in
phases (:func:`round_mean`): for each layer, every update's statistic is gathered and the limit
decided on all of them; then each bucket sums w_k θ'_k and w_k in canonical (device id) order, and
the bucket sums are added up the fixed tree (``sum_tree.py``). With shards the statistics and the
subtree sums come from the shards that hold the updates; with one aggregator from its own memory
(:func:`local_round_mean`): the same per-update arithmetic, the same additions. A round of fewer
than three updates also takes the job's reference of earlier rounds (``SmallRoundReference``,
handed to :func:`round_mean` with the statistics, which also keep it: the coordinator's job and one
aggregator's keep the same one; Scaffold adds its Δc bound's, ``control_sums.py``), and a round of
one before there is one asks for no sums.

Layers that need every update at once (the direction screen's coordinate-wise median, the robust
rules) cannot be split this way: such a config is refused on shards (``FedAvgRoundSums.refusal``)
and one aggregator combines it as before.

DP-FedAvg (``aggregator/strategies/dp_fedavg.py``) sums in the same buckets up the same tree, in
one phase: each bucket sums its updates' deltas clipped at the round's C (unweighted) with their
count and how many were within C (:func:`clipped_delta_sum`: the bits adaptive clipping moves C
by), and the job's mechanism adds its noise once, to the root (:func:`dp_round_step`), at the
coordinator with shards, so a sharded job is the same release and the same bits as one aggregator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from protocols.clipping import clip_update

from aggregator.shards.buckets import canonical_key
from aggregator.shards.sum_tree import (AdditiveState, Contribution, PartialSum, add_elementwise, add_weighted,
                                        local_tree_sum)
from aggregator.strategies.robust_fedavg import flatten
from aggregator.strategies.small_round_reference import SmallRoundReference

WEIGHT = "weight_total"         # a bucket state's Σ w_k (float64: a contribution bound makes w_k fractional)
SUM = "sum."                    # + tensor name: Σ w_k θ'_k (float64); DP: Σ clip(Δ_k, C)
UNCLIPPED = "unclipped"         # DP: how many of the bucket's deltas were within C (float64)

Params = dict[str, np.ndarray]


@dataclass(frozen=True)
class RoundContext:
    """What a round's close has decided when it asks for statistics or sums: the tensors the
    devices trained from (x_t) and the limit of each bound layer decided so far (0: no bounding).
    Statistics are asked for the first layer without a limit."""

    current: Params
    limits: tuple[float, ...] = ()


def bound_layers(config) -> list:
    """The config's per-update bound layers that are on, in the order they apply."""
    return config.robust_aggregation().bound_layers()


def bounded_update(layers: list, x: np.ndarray, tensors: Mapping[str, np.ndarray], weight, limits: tuple[float, ...]):
    """(tensors, weight) of one update after each layer whose limit is decided (``limits``, in order)."""
    for layer, limit in zip(layers, limits):
        tensors, weight = layer.bound_one(x, tensors, weight, limit)
    return tensors, weight


def update_statistics(layers: list, context: RoundContext, updates) -> dict[str, float]:
    """device -> the statistic of the next undecided layer, of each (device, tensors, n) update."""
    x, out = flatten(context.current), {}
    layer = layers[len(context.limits)]
    for device, tensors, n in updates:
        t, w = bounded_update(layers, x, tensors, n, context.limits)
        out[device] = layer.statistic(x, t, w)
    return out


def weighted_sum(layers: list, context: RoundContext, updates) -> PartialSum:
    """Σ w_k θ'_k and Σ w_k of (device, tensors, n) updates, in the order given (a bucket's, canonical)."""
    x, sums, total, contributed = flatten(context.current), {}, 0.0, {}
    for device, tensors, n in updates:
        t, w = bounded_update(layers, x, tensors, n, context.limits)
        add_weighted(sums, t, w)
        total += float(w)
        contributed[device] = int(n)
    return PartialSum({**{SUM + k: v for k, v in sums.items()}, WEIGHT: np.array([total])}, contributed)


def round_mean(layers: list, current: Params, statistics: Callable[[RoundContext], dict[str, float]],
               root: Callable[[RoundContext], PartialSum | None], references: Sequence[SmallRoundReference] = ()
               ) -> tuple[Params | None, PartialSum | None, tuple[SmallRoundReference, ...]]:
    """(the round's combined tensors, the root they were divided from, the ``references`` that held
    the round); the tensors are None when no update counts. Each layer's limit comes from every
    update's statistic (``statistics``), then the root of the tree of bounded sums (``root``).
    ``references`` (the job's state across rounds) cover the layers in order, each the next
    ``len(reference.layers)`` of them (the model's first; Scaffold's Δc bound's after it): a round of
    fewer than three updates is bounded by them too, and its limits and statistics are handed to
    each: the round is closed. A round of one that the first holds (no reference yet) moves nothing
    (no root is asked for: (None, None, held)); one a later reference holds moves what that
    reference's layers bound not at all, which is the caller's to leave (Scaffold's c)."""
    covering = [(reference, j) for reference in references for j in range(len(reference.layers))]
    limits: tuple[float, ...] = ()
    measured: list[dict[str, float]] = []
    for i, layer in enumerate(layers):
        values = statistics(RoundContext(current, limits))
        own = layer.limit(list(values.values()))
        limits += (covering[i][0].limit(covering[i][1], own, len(values)) if i < len(covering) else own,)
        measured.append(values)
    held, start = [], 0
    for reference in references:        # each decides its hold on the reference the round was bounded by
        end = start + len(reference.layers)
        if measured and reference.close(limits[start:end], measured[start:end]):
            held.append(reference)
        start = end
    if held and held[0] is references[0]:
        return None, None, tuple(held)
    total = root(RoundContext(current, limits))
    if total is None or not total.state[WEIGHT][0] > 0:
        return None, total, tuple(held)
    weight = total.state[WEIGHT][0]
    return ({name[len(SUM):]: s / weight for name, s in total.state.items() if name.startswith(SUM)}, total,
            tuple(held))


def local_round_mean(config, current: Params, updates: Mapping[str, tuple[Params, int]],
                     reference: SmallRoundReference | None = None) -> Params | None:
    """One aggregator's round mean over its ``updates`` (device -> (θ_k, n_k)): the shards' arithmetic."""
    layers, adder = bound_layers(config), FedAvgRoundSums()
    triples = [(d, *updates[d]) for d in sorted(updates, key=lambda d: canonical_key(d, 0))]

    def root(context: RoundContext) -> PartialSum | None:
        return local_tree_sum(adder, triples, lambda members: weighted_sum(layers, context, members))

    return round_mean(layers, current, lambda context: update_statistics(layers, context, triples), root,
                      () if reference is None else (reference,))[0]


def clipped_delta_sum(context: RoundContext, updates) -> PartialSum:
    """DP-FedAvg's sums of (device, tensors, n) updates, in the order given: Σ clip(θ_k − x_t, C)
    with C the context's one limit, unweighted (n_k would make the sensitivity data-dependent),
    their count (``WEIGHT``) and how many were within C (``UNCLIPPED``)."""
    (clip_norm,) = context.limits
    sums: Params = {}
    unclipped, contributed = 0, {}
    for device, tensors, n in updates:
        delta = {k: np.asarray(tensors[k], np.float64) - np.asarray(x, np.float64) for k, x in context.current.items()}
        clipped, norm = clip_update(delta, clip_norm)
        add_weighted(sums, clipped)
        unclipped += norm <= clip_norm
        contributed[device] = int(n)
    return PartialSum({**{SUM + k: v for k, v in sums.items()}, WEIGHT: np.array([float(len(contributed))]),
                       UNCLIPPED: np.array([float(unclipped)])}, contributed)


def dp_round_step(dp, current: Params, root: Callable[[RoundContext], PartialSum | None]) -> Params:
    """The tensors a DP-FedAvg round moves to: its mechanism (``dp``, a ``DPFedAvg``) noises the root
    of the clipped deltas' tree (``root``: one aggregator's or the shards') once and steps. A round
    without updates still releases noise (the accountant counts it)."""
    total = root(RoundContext(current, (dp.clip.value,)))
    state = total.state if total is not None else {}
    sums = {k: state[SUM + k] if state else np.zeros(np.shape(x)) for k, x in current.items()}
    count, unclipped = (int(state[WEIGHT][0]), int(state[UNCLIPPED][0])) if state else (0, 0)
    return dp.step_from_sum(current, sums, unclipped, count)


def local_dp_round_step(dp, current: Params, updates: Mapping[str, tuple[Params, int]]) -> Params:
    """One aggregator's :func:`dp_round_step` over its ``updates`` (device -> (θ_k, n_k)): the shards' arithmetic."""
    triples = [(d, *update) for d, update in updates.items()]
    return dp_round_step(dp, current, lambda context: local_tree_sum(
        FedAvgRoundSums(), triples, lambda members: clipped_delta_sum(context, members)))


class FedAvgRoundSums(AdditiveState):
    """FedAvg(ψ)'s round sums on shards: a shard checks a head update with the job's own parser, its
    receipt carries the sample count, and at the round's close it reports statistics and bucket sums
    over the round's accepted updates it holds (``context``: a :class:`RoundContext`)."""

    per_round = True
    reads_job_only = True           # the job parses the updates; the sums are this class's own

    def refusal(self, job) -> str:
        if job.dp is not None:
            return ""               # DP-FedAvg clips and sums: no layer needs every update
        return job.config.needs_every_update()

    def check(self, job, env) -> Any:
        return job.parse_result(env)

    def round_layers(self, job) -> list:
        """The phases of a round's close, in order: the config's per-update bound layers (a kind that
        bounds more per round adds its own after them)."""
        return bound_layers(job.config)

    @staticmethod
    def _loaded(job, members: list[Contribution]) -> list[tuple[str, Any]]:
        """(device, its parsed update) of each member, in the order given: each payload decoded once."""
        return [(device, load(job).update) for device, _round, load in members]

    @staticmethod
    def _triples(updates: list[tuple[str, Any]]) -> list[tuple[str, Params, int]]:
        return [(device, update.tensors(), update.n) for device, update in updates]

    def statistics(self, new_job, members: list[Contribution], context: RoundContext) -> dict[str, float]:
        job = new_job()
        return update_statistics(bound_layers(job.config), context, self._triples(self._loaded(job, members)))

    def sum_bucket(self, new_job, members: list[Contribution], context: RoundContext) -> PartialSum:
        job = new_job()
        return self.sum_updates(job, self._loaded(job, members), context)

    def sum_updates(self, job, updates: list[tuple[str, Any]], context: RoundContext) -> PartialSum:
        """A bucket's sums of its (device, update)s: Σ w_k θ'_k and Σ w_k, DP-FedAvg's clipped deltas
        under DP (a kind that sums more adds its own)."""
        if job.dp is not None:
            return clipped_delta_sum(context, self._triples(updates))
        return weighted_sum(bound_layers(job.config), context, self._triples(updates))

    def references(self, job) -> tuple[SmallRoundReference, ...]:
        """The job's references of earlier rounds that bound :meth:`round_layers` in rounds of fewer
        than three updates, in their order (each covers the next of its layers): the model's."""
        return (job.small_rounds,)

    def take_round(self, job, total: PartialSum | None, accepted: int,
                   held: tuple[SmallRoundReference, ...] = ()) -> None:
        """What the coordinator's job takes from the round's root sum besides the mean (``accepted``:
        the updates in it; ``held``: the references that held the round), before its server step:
        nothing for FedAvg."""

    def add(self, left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return add_elementwise(left, right)

    def receipt(self, job, payload) -> dict:
        return {"n": int(payload.update.n)}

    def record(self, job, device: str, receipt: dict) -> None:
        job.record_update(device, int(receipt["n"]))
