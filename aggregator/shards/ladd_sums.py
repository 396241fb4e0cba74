"""A LADD training round's sums, split in buckets: what shards add, and what one aggregator adds
the same way so that both give the same bits.

A LADD round moves the shared part φ to the mean of every update's φ and each cluster's part
θ_c to the mean of its own cluster's θ_c (``aggregator/strategies/ladd.py``): one weighted mean
per *slot* (φ, θ_0, θ_1, ...), each with the bounded-influence layers that need one number per
update (the norm bound, the contribution bound: ``fedavg_sums.py``), decided per slot (a θ_c's
limit is a multiple of its own cluster's median, or of the median of every cluster's θ updates
when its own cluster sent fewer than three: ``slot_limits``, ``aggregator/strategies/ladd_slot_limits.py``;
one aggregator's ``RobustClusterAveraging``
decides it the same way; in a round of fewer than three updates, within the job's reference of
earlier rounds, ``LaddSmallRounds``, which the coordinator's job and one aggregator's keep alike).
The round closes in phases, as FedAvg's does: for each layer every update's statistic in each of
its slots, the limits decided slot by slot on all of them; then each bucket
sums w_k θ'_k and w_k per slot in canonical (device id) order, and the bucket sums are added up
the fixed tree (``sum_tree.py``). A bucket holds only the clusters its devices are in, so two
partial sums add slot by slot where both hold it and pass a slot only one holds through unchanged
(:func:`add_slots`): which slots meet at each node is fixed by the tree, not by the shards.

With shards the statistics and the subtree sums come from the shards that hold the updates (a
shard parses a ``ladd.train`` result against the cluster it names; the coordinator, which holds
the assignment, refuses a receipt whose cluster is not the device's). With one aggregator they
come from its own memory (:class:`CanonicalClusterAveraging`): the same arithmetic.

DP-LADD (``aggregator/strategies/dp_ladd.py``) sums in the same buckets up the same tree, in one
phase: each bucket sums its devices' joint deltas [φ_k − φ_t | θ_k − θ_c,t] clipped at the round's
C as one vector, per slot, unweighted, with their count and how many were within C
(:func:`clipped_slot_sums`); the job's mechanism adds its noise once, to the root, on every slot
the round selected (:func:`dp_round_model`): at the coordinator with shards, the same release and
the same bits as one aggregator.

Not here: robust rules and the direction screen (they need every update of a slot at once: such a
config is refused on shards, and one aggregator combines it as before), and the style phase (its
KMeans is not a sum: shards forward the tiny style results whole and the coordinator clusters, as
one aggregator does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from protocols.clipping import clip_update
from protocols.envelope import EnvelopeError
from protocols.payloads.ladd import KIND_TRAIN

from aggregator.shards.fedavg_sums import SUM, WEIGHT, bound_layers, bounded_update
from aggregator.shards.sum_tree import AdditiveState, Contribution, PartialSum, add_weighted, local_tree_sum
from aggregator.strategies.dp_ladd import GLOBAL, apply_mean_deltas
from aggregator.strategies.ladd import ClusterAveraging, cast_like
from aggregator.strategies.ladd_slot_limits import PHI, slot_limits
from aggregator.strategies.ladd_small_rounds import LaddSmallRounds
from aggregator.strategies.robust_fedavg import flatten

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
SLOT = "/"                      # a bucket state's keys: "<slot>/sum.<tensor>", "<slot>/weight_total"
DP_COUNT, DP_UNCLIPPED = "dp/count", "dp/unclipped"     # DP: the deltas summed, those within C

Params = dict[str, np.ndarray]
LaddUpdate = tuple[str, int, Params, int]       # (device, cluster, trained tensors, n_k)


def theta_slot(cluster: int) -> str:
    return f"theta{int(cluster)}"


def slots_of(is_theta: Callable[[str], bool], cluster: int, tensors: Mapping[str, np.ndarray]) -> dict[str, Params]:
    """An update's tensors by slot: φ's, then its cluster's θ (an empty part is no slot)."""
    phi = {k: v for k, v in tensors.items() if not is_theta(k)}
    theta = {k: v for k, v in tensors.items() if is_theta(k)}
    return {slot: part for slot, part in ((PHI, phi), (theta_slot(cluster), theta)) if part}


@dataclass(frozen=True)
class LaddRoundContext:
    """What a round's close has decided when it asks for statistics or sums: each slot's tensors
    as the round's devices trained from them (φ_t, θ_c,t) and, per layer decided so far, each
    slot's limit. Statistics are asked for the first layer without limits."""

    current: dict[str, Params]
    limits: tuple[dict[str, float], ...] = ()
    clip: float | None = None                   # DP: the round's C
    _flat: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def slot(self, slot: str) -> Params:
        if slot not in self.current:
            raise EnvelopeError(f"{KIND_TRAIN}: an update for slot {slot!r}, which the round does not train")
        return self.current[slot]

    def flat(self, slot: str) -> np.ndarray:
        if slot not in self._flat:
            self._flat[slot] = flatten(self.slot(slot))
        return self._flat[slot]

    def slot_limits(self, slot: str) -> tuple[float, ...]:
        return tuple(limits[slot] for limits in self.limits)


def _bounded_slots(layers: list, is_theta, context: LaddRoundContext, update: LaddUpdate):
    """(slot, x_t of the slot, its bounded tensors, its weight) of each slot of one update."""
    _device, cluster, tensors, n = update
    for slot, part in slots_of(is_theta, cluster, tensors).items():
        x = context.flat(slot)
        yield slot, x, *bounded_update(layers, x, part, n, context.slot_limits(slot))


def slot_statistics(layers: list, is_theta, context: LaddRoundContext, updates: list[LaddUpdate]
                    ) -> dict[str, dict[str, float]]:
    """device -> {slot: the statistic of the next undecided layer} of each update."""
    layer = layers[len(context.limits)]
    return {update[0]: {slot: layer.statistic(x, t, w) for slot, x, t, w in _bounded_slots(layers, is_theta, context, update)}
            for update in updates}


def slot_sums(layers: list, is_theta, context: LaddRoundContext, updates: list[LaddUpdate]) -> PartialSum:
    """Σ w_k θ'_k and Σ w_k per slot of the updates, in the order given (a bucket's: canonical)."""
    sums: dict[str, Params] = {}
    weights: dict[str, float] = {}
    contributed = {}
    for update in updates:
        for slot, _x, t, w in _bounded_slots(layers, is_theta, context, update):
            add_weighted(sums.setdefault(slot, {}), t, w)
            weights[slot] = weights.get(slot, 0.0) + float(w)
        contributed[update[0]] = int(update[3])
    state = {f"{slot}{SLOT}{SUM}{name}": v for slot, part in sums.items() for name, v in part.items()}
    state.update({f"{slot}{SLOT}{WEIGHT}": np.array([w]) for slot, w in weights.items()})
    return PartialSum(state, contributed)


def clipped_slot_sums(is_theta, context: LaddRoundContext, updates: list[LaddUpdate]) -> PartialSum:
    """DP-LADD's sums of the updates, in the order given: each device's joint delta over its slots
    clipped at C (the context's ``clip``) as one vector, summed per slot, unweighted (n_k would
    make the sensitivity data-dependent); their count and how many were within C."""
    sums: Params = {}
    contributed, unclipped = {}, 0
    for device, cluster, tensors, n in updates:
        delta = {}
        for slot, part in slots_of(is_theta, cluster, tensors).items():
            start = context.slot(slot)
            delta.update({f"{slot}{SLOT}{SUM}{name}": np.asarray(v, np.float64) - np.asarray(start[name], np.float64)
                          for name, v in part.items()})
        clipped, norm = clip_update(delta, context.clip)
        add_weighted(sums, clipped)
        unclipped += norm <= context.clip
        contributed[device] = int(n)
    return PartialSum({**sums, DP_COUNT: np.array([float(len(contributed))]),
                       DP_UNCLIPPED: np.array([float(unclipped)])}, contributed)


def bucket_sums(job, context: LaddRoundContext, updates: list[LaddUpdate]) -> PartialSum:
    """A bucket's sums of its updates: the bounded weighted slot sums, DP-LADD's clipped ones under DP."""
    if job.dp is not None:
        return clipped_slot_sums(job.is_theta, context, updates)
    return slot_sums(bound_layers(job.config), job.is_theta, context, updates)


def add_slots(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Two partial states' union: a key both hold added, a key one holds passed through (no 0 + x)."""
    return {**left, **right, **{k: left[k] + right[k] for k in left.keys() & right.keys()}}


def slot_means(layers: list, current: dict[str, Params],
               statistics: Callable[[LaddRoundContext], dict[str, dict[str, float]]],
               root: Callable[[LaddRoundContext], PartialSum | None],
               small_rounds: LaddSmallRounds | None = None) -> dict[str, Params]:
    """slot -> its combined tensors (float64) for each slot some update moved; each layer's limits
    decided per slot on every update's statistic (``statistics``), then the root of the tree of
    bounded sums (``root``). With ``small_rounds`` (the job's ``LaddSmallRounds``, state across
    rounds) a round of fewer than three updates is bounded by earlier rounds too, a slot it holds
    moves nothing (when it holds every slot no root is asked for), and the round is closed into it."""
    limits: tuple[dict[str, float], ...] = ()
    measured = []
    for i, layer in enumerate(layers):
        values = statistics(LaddRoundContext(current, limits))
        by_slot: dict[str, list[float]] = {}
        for row in values.values():
            for slot, value in row.items():
                by_slot.setdefault(slot, []).append(value)
        limits += (small_rounds.limits(i, layer, by_slot) if small_rounds is not None else slot_limits(layer, by_slot),)
        measured.append(values)
    held = small_rounds.close(measured) if small_rounds is not None else set()
    if measured and not {slot for row in measured[0].values() for slot in row} - held:
        return {}
    total = root(LaddRoundContext(current, limits))
    state = total.state if total is not None else {}
    means = {}
    for slot in (slot for slot in current if slot not in held):
        weight = state.get(f"{slot}{SLOT}{WEIGHT}")
        if weight is not None and weight[0] > 0:
            prefix = f"{slot}{SLOT}{SUM}"
            means[slot] = {k[len(prefix):]: s / weight[0] for k, s in state.items() if k.startswith(prefix)}
    return means


def round_slots(trainable: list[str], is_theta, phi: Params, theta: Mapping[int, Params],
                clusters) -> dict[str, Params]:
    """The round's slots as its devices trained from them: φ's trained tensors and θ_c's of each
    cluster in ``clusters``."""
    slots = {PHI: {k: phi[k] for k in trainable if not is_theta(k)}}
    slots.update({theta_slot(c): {k: theta[c][k] for k in trainable if is_theta(k)} for c in sorted(set(clusters))})
    return {slot: part for slot, part in slots.items() if part}


def apply_slot_means(phi: Params, theta: Mapping[int, Params], means: dict[str, Params]
                     ) -> tuple[Params, dict[int, Params]]:
    """New (φ, {c: θ_c}): each moved slot's means cast to its tensors' dtypes, the rest copied."""
    new_phi = {k: np.array(v, copy=True) for k, v in phi.items()}
    new_theta = {c: {k: np.array(v, copy=True) for k, v in part.items()} for c, part in theta.items()}
    for name, mean in means.get(PHI, {}).items():
        new_phi[name] = cast_like(mean, new_phi[name])
    for c, part in new_theta.items():
        for name, mean in means.get(theta_slot(c), {}).items():
            part[name] = cast_like(mean, part[name])
    return new_phi, new_theta


def round_model(job, clusters, statistics, root) -> tuple[Params, dict[int, Params]] | None:
    """The LADD ``job``'s closing training round's new (φ, {c: θ_c}) from its updates' statistics and
    tree root (one aggregator's or the shards'; ``clusters``: the updates' clusters); None when
    nothing moves. Under DP every round releases (the accountant counts it), updates or not."""
    if job.dp is not None:
        return dp_round_model(job, root)
    current = round_slots(job.trainable, job.is_theta, job.phi, job.theta, clusters)
    means = slot_means(bound_layers(job.config), current, statistics, root, job.small_rounds)
    return apply_slot_means(job.phi, job.theta, means) if means else None


def dp_round_model(job, root) -> tuple[Params, dict[int, Params]]:
    """DP-LADD's round: the root of the clipped sums, zeros on a selected slot nobody filled, noised
    once by the job's mechanism in a fixed slot order (φ, then each selected cluster's θ_c), then
    φ_t + R_φ / m and θ_c,t + R_c / m_c over the devices selected (``dp_ladd.py``)."""
    selected = job.selected_clusters()
    current = round_slots(job.trainable, job.is_theta, job.phi, job.theta, selected)
    clip = job.dp.clip.value
    total = root(LaddRoundContext(current, clip=clip))
    state = total.state if total is not None else {}
    released = {}
    for slot, owner in ((PHI, GLOBAL), *((theta_slot(c), c) for c in sorted(selected))):
        for name, x in current.get(slot, {}).items():
            released[(owner, name)] = state.get(f"{slot}{SLOT}{SUM}{name}", np.zeros(np.shape(x)))
    count, unclipped = (int(state[DP_COUNT][0]), int(state[DP_UNCLIPPED][0])) if state else (0, 0)
    noisy = job.dp.release_total(released, clip, unclipped, count, sum(selected.values()))
    return apply_mean_deltas(job.phi, job.theta, noisy, selected)


class CanonicalClusterAveraging(ClusterAveraging):
    """One aggregator's LADD round summed as shards sum it (module docstring): the updates are kept
    by device and combined at ``result`` in canonical order up the bucket tree."""

    def __init__(self, job):
        super().__init__()
        self.job = job
        self.updates: dict[str, LaddUpdate] = {}

    def add(self, cluster: int, tensors: Mapping[str, np.ndarray], n: int, device: str = "") -> None:
        job, cluster = self.job, int(cluster)
        if not device or device in self.updates:
            raise ValueError(f"a canonical LADD round takes each device's update once, by its id (got {device!r})")
        if isinstance(n, bool) or int(n) != n or n <= 0:
            raise ValueError(f"weight (sample count) must be a positive integer, got {n!r}")
        if cluster not in job.theta or (job.dp is not None and cluster not in job.selected_clusters()):
            raise ValueError(f"update for cluster {cluster}, which had no device selected this round")
        model = job.cluster_model(cluster)
        for name, value in tensors.items():
            if name not in job.trainable or np.shape(value) != np.shape(model[name]):
                raise ValueError(f"update tensor {name!r} is not one of the round's slots (or has the wrong shape)")
            if not np.isfinite(np.asarray(value, dtype=np.float64)).all():
                raise ValueError(f"update tensor {name!r} contains NaN or Inf")
        self.updates[device] = (device, cluster, dict(tensors), int(n))
        self._counted(cluster)

    def result(self, global_params, cluster_params) -> tuple[Params, dict[int, Params]]:
        model = self.model()
        return model if model is not None else apply_slot_means(global_params, cluster_params, {})

    def model(self) -> tuple[Params, dict[int, Params]] | None:
        job, updates = self.job, list(self.updates.values())

        def root(context: LaddRoundContext) -> PartialSum | None:     # in canonical order, bucket by bucket
            return local_tree_sum(LaddRoundSums(), updates, lambda members: bucket_sums(job, context, members))

        def statistics(context: LaddRoundContext) -> dict[str, dict[str, float]]:
            return slot_statistics(bound_layers(job.config), job.is_theta, context, updates)

        return round_model(job, [u[1] for u in updates], statistics, root)


class LaddRoundSums(AdditiveState):
    """Plain LADD's training-round sums on shards: a shard checks a ``ladd.train`` result against
    the cluster it names (its own job holds no assignment), its receipt carries the sample count,
    the cluster and the KD digest the device confirmed, and at the round's close it reports each
    accepted update's statistics and its buckets' slot sums (``context``: a :class:`LaddRoundContext`;
    DP-LADD: the clipped sums, in one phase). Style results are not summed: shards forward them."""

    per_round = True
    reads_job_only = True

    def refusal(self, job) -> str:
        # (a job built from its config holds its initial model: shards check updates against its layout)
        return "" if job.dp is not None else job.config.needs_every_update()     # DP-LADD clips and sums

    def summed_kinds(self, job) -> tuple[str, ...]:
        return (job.train_kind,)

    def check(self, job, env) -> Any:
        return job.parse_accepted(env)

    def check_receipt(self, job, device: str, receipt: dict) -> None:
        if receipt.get("cluster") != job.assignment.get(device):
            raise EnvelopeError(f"{KIND_TRAIN}: update for cluster {receipt.get('cluster')}, the device belongs to "
                                f"{job.assignment.get(device)}")

    @staticmethod
    def _updates(job, members: list[Contribution]) -> list[LaddUpdate]:
        out = []
        for device, _round, load in members:
            update = load(job).payload
            out.append((device, update.cluster, update.tensors, update.n))
        return out

    def statistics(self, new_job, members: list[Contribution], context: LaddRoundContext) -> dict[str, dict[str, float]]:
        job = new_job()
        return slot_statistics(bound_layers(job.config), job.is_theta, context, self._updates(job, members))

    def sum_bucket(self, new_job, members: list[Contribution], context: LaddRoundContext) -> PartialSum:
        job = new_job()
        return bucket_sums(job, context, self._updates(job, members))

    def add(self, left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return add_slots(left, right)

    def receipt(self, job, payload) -> dict:
        update = payload.payload
        kd = update.kd_sha256 if SHA256_HEX.fullmatch(update.kd_sha256) else ""     # a digest, or nothing kept
        return {"n": int(update.n), "cluster": int(update.cluster), "kd_sha256": kd}

    def record(self, job, device: str, receipt: dict) -> None:
        job.record_train_update(device, str(receipt.get("kd_sha256", "")))
