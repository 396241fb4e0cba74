"""Secure LADD: each training round's updates reach the aggregator only as one SecAgg(+) sum.

Everything but the training rounds' transport is :class:`~aggregator.jobs.ladd.LaddJob`'s
(style round, clustering, pre-training, teachers, scheduling). Style rounds stay plaintext:
a style is one averaged low-frequency amplitude spectrum, which the server must see to cluster
(spec §5). A ``ladd.train.secure`` round is one SecAgg (or SecAgg+) group over that round's
participants (``SecureGroupRounds``), and every device contributes one fixed-length vector
with a slot per cluster (``protocols.payloads.secagg.ClusterSlotLayout``)::

    [ n·φ | slot_0 … slot_{C-1} (n·θ in the device's own slot, zeros elsewhere) | n | n·e_c | e_c ]

The unmasked sum holds Σ n φ over all survivors and, per enabled cluster, Σ n θ, Σ n and the
number of contributors: φ ← Σ n φ / Σ n and θ_c ← Σ_c n θ / Σ_c n are exactly LADD's
cluster-specific averages (``ClusterSpecificAveraging``) over the survivors, up to the
fixed-point resolution 2^-f. The tensors summed are the trainable ones (what a plaintext
update carries); frozen tensors (BatchNorm) never change, as in the plaintext job.

A sum over one device is that device's update, so per-cluster slots need company:

* **At round open**, a cluster with fewer than ``min_cluster_contributors`` selected devices
  gets its slot *disabled* for the round (``enabled`` in the layout): its devices put zeros
  there and into their cluster's weight and count, still add to φ, and θ_c is kept.
* **Dropouts** can still thin an enabled slot. When the masked inputs are in (U3 is fixed,
  nothing is unmasked yet), the job checks every enabled slot: if one holds between 1 and
  ``min_cluster_contributors − 1`` survivors, the round is *aborted* before any device
  reveals a share (devices get ``RoundAborted`` and erase their secrets); nothing is
  applied, as for any failed secure round. A slot with no survivor at all is fine (θ_c kept).
  This relies on the aggregator following the protocol (the honest-but-curious model of
  docs/secure-aggregation.md); devices cannot check it, since they do not know their peers'
  clusters. On shards (``aggregator/shards/secure_groups.py``) the gate runs on the shard hosting
  the group, from the layout and clusters the coordinator hands it (``hosting_context``).
* The sum's per-cluster counts must equal what the job expects from its cluster assignment
  and the survivors; otherwise nothing is applied (a device filled the wrong slot).

Bound: every entry of a device's vector is at most ``max_samples × max(max_abs_param, 1)``; a
device with more images or a trained entry beyond ``max_abs_param`` declines and the round
goes on without it. The slot layout is bound to the signed round configuration through the
group id (``ClusterSlotLayout.group_id``).

Distributed DP (``dp_noise_multiplier`` > 0, fixed ``dp_clip_norm`` C): a device fills φ and
its slot with its update w_k − w_c clipped to C as one vector (weight 1, count 1) and adds its
share of Skellam noise (σ_dev = zC/√t, ``protocols/secagg/distributed_dp.py``) to φ and to
*every* slot. Any revealed sum has at least t survivors, so φ and each enabled θ_c carry noise of
variance ≥ (zC)² whoever dropped out; the server applies the means over the devices selected
(``aggregator/strategies/dp_ladd.py``, one release per training round for the accountant) and
never holds an un-noised sum. n and the per-cluster weights and counts carry no noise: the
server knows the survivors and their clusters anyway.

Cost: a device uploads (|φ| + C·|θ| + 1 + 2C) × 8 bytes instead of (|φ| + |θ|) × 4, i.e. the
θ part grows C-fold (docs/ladd.md has the figures). A job built from its initial model holds the
vector of the most clusters its config allows (``k_max``) to SecAgg's limits when it is built
(``checked_vector_length``); one that pre-trains its own is refused when that round opens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from protocols.envelope import Envelope, EnvelopeError
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.ladd import KIND_STYLE, Layout, layout_size
from protocols.payloads.secagg import (SECURE_LADD_KIND, ClusterSlotLayout, SlotSums, ladd_slot_bound,
                                       slot_vector_length)
from protocols.payloads.secure_tasks import SecureLaddParams
from protocols.payloads.task_params import DpRound
from protocols.rounds import RoundClosed
from protocols.secagg import ConsistencyCheckRequest, Phase, RoundConfig, UnmaskRequest
from protocols.secagg.distributed_dp import noisy_bound

from aggregator.strategies.dp_ladd import GLOBAL, apply_mean_deltas
from aggregator.strategies.robust_fedavg import check_dp_group_sum, check_group_mean
from aggregator.jobs.config_limits import Range, check_declared, limited
from aggregator.jobs.ladd import Arrays, LaddConfig, LaddJob, Pretrainer
from aggregator.jobs.secure_fields import SecureUpdateFields
from aggregator.jobs.secure_rounds import MIN_GROUP, GroupSumOutOfBound, SecureGroupRounds, checked_vector_length


@dataclass
class SecureLaddConfig(LaddConfig, SecureUpdateFields):
    """LADD's fields, the secure ones (``aggregator/jobs/secure_fields.py``; ``max_samples``: local
    images per device) and the smallest cluster a slot may sum."""

    # fewer selected/surviving devices in a cluster: no θ_c update. At least 2, a one-device slot
    # being that device's update: declared as the limit, so every entry point that checks a config
    # (the admin API's schema, aggregator serve --config, --ladd-config) refuses 1 before any job exists
    min_cluster_contributors: int = limited(2, Range(2, 1_000_000))

    def __post_init__(self):
        super().__post_init__()
        if self.aggregator != "mean":
            raise ValueError(f"aggregator {self.aggregator!r} needs each device's update; a secure job sees only sums")
        if self.clip_bit_entries():     # a LADD device's slot vector has no clipped-indicator bit
            raise ValueError("dp_adaptive_clip is not available under secure LADD (fixed dp_clip_norm only; "
                             "the secure FedAvg family takes it)")
        check_declared(self, "min_cluster_contributors")      # a config built in Python
        if self.max_samples < 1 or not self.max_abs_param > 0:
            raise ValueError("max_samples >= 1 and max_abs_param > 0 required")

    @property
    def most_clusters(self) -> int:
        """The most clusters, so slots, a round's vector may hold: the clustering picks k <= k_max
        (``aggregator/strategies/ladd.py``), and "none" is one cluster."""
        return self.k_max if self.clustering == "styles" else 1


class SecureLaddJob(SecureGroupRounds, LaddJob):
    train_kind = SECURE_LADD_KIND
    min_train_participants = MIN_GROUP      # fewer cannot hide anyone's update in a sum
    central_dp = False                      # under DP the devices add the noise in the ring

    def __init__(self, config: SecureLaddConfig, pretrainer: Pretrainer | None = None,
                 initial: tuple[Arrays, list[str]] | None = None, evaluator=None,
                 identity: DeviceIdentity | None = None, registry: IdentityRegistry | None = None):
        LaddJob.__init__(self, config, pretrainer=pretrainer, initial=initial, evaluator=evaluator)
        if initial is not None:
            # refused now, not when the first training round opens after the style rounds; a job
            # pre-training its own model learns its size then, and that round's opening refuses it
            checked_vector_length(self._largest_vector_length(), config, smaller="train a smaller model" + (
                f" or allow fewer clusters (k_max={config.k_max}: each adds a slot of the cluster-specific tensors)"
                if config.most_clusters > 1 else ""))
        self._init_secure(identity, registry)
        self.bound = ladd_slot_bound(config.max_samples, config.max_abs_param)
        self.slots: ClusterSlotLayout | None = None
        self._round_sum: tuple[tuple[Arrays, dict[int, Arrays]], dict[int, int]] | None = None
        self._round_dp: dict | None = None
        self._gate_passed = False

    # ------------------------------------------------------------------ rounds
    def next_participants(self, online: set[str]) -> list[str]:
        chosen = super().next_participants({d for d in online if d in self.registry})   # no key, no secure round
        if chosen and self.kind == SECURE_LADD_KIND:
            self._open_slot_round(chosen)
        return chosen

    def _global_and_slot(self, trainable_layout: Layout) -> tuple[Layout, Layout]:
        """The trained tensors every device sums (φ) and those of its cluster's slot (θ)."""
        return ([e for e in trainable_layout if not self.is_theta(e[0])],
                [e for e in trainable_layout if self.is_theta(e[0])])

    def _largest_vector_length(self) -> int:
        """The vector of a round with a slot for each of the most clusters the config allows (the
        initial model's trained tensors: known before the styles are clustered)."""
        global_layout, slot_layout = self._global_and_slot(self.update_layout())
        return slot_vector_length(layout_size(global_layout), layout_size(slot_layout), self.config.most_clusters)

    def _slot_layout(self, chosen) -> ClusterSlotLayout:
        """The round's vector layout: a slot per cluster, enabled if enough of its devices were chosen."""
        selected = Counter(self.assignment[d] for d in chosen)
        enabled = tuple(selected.get(k, 0) >= self.config.min_cluster_contributors for k in range(self.n_clusters))
        return ClusterSlotLayout(*self._global_and_slot(self.trainable_layout), enabled)

    def _open_slot_round(self, chosen: list[str]) -> None:
        self.slots = self._slot_layout(chosen)
        self._round_sum, self._gate_passed = None, False
        c = self.config
        if c.dp:        # the data bound: clipped entries <= C, n and the counts <= 1
            self._round_dp = {"clip_norm": c.dp_clip_norm, **self.open_dp_round(
                self.round, chosen, self.slots.vector_length, max(c.dp_clip_norm, 1.0),
                c.dp_noise_multiplier * c.dp_clip_norm, group_id=self.slots.group_id())}
        else:
            self.open_secure_round(self.round, chosen, self.slots.vector_length, self.bound,
                                   group_id=self.slots.group_id())

    def train_task(self, device: str) -> tuple[SecureLaddParams, dict[str, np.ndarray]]:
        params, tensors = super().train_task(device)
        c = self.config
        return SecureLaddParams.extending(params, group=self.slots.group_id(), slots=self.slots.to_json(),
                                          max_samples=c.max_samples, max_abs_param=c.max_abs_param,
                                          dp=DpRound(**self._round_dp) if c.dp else None), tensors

    def parse_result(self, env: Envelope):
        if self.kind == SECURE_LADD_KIND:
            raise EnvelopeError(f"{SECURE_LADD_KIND} devices send secagg messages, never plain results")
        return super().parse_result(env)

    def restore_bookkeeping(self, state: dict) -> None:
        entered = int(state["round"]) > self.round
        super().restore_bookkeeping(state)
        if entered and self.kind == SECURE_LADD_KIND:     # its secrets are gone: it closes with nothing applied
            self.slots, self._round_sum = self._slot_layout(self._participants), None

    def runs_plaintext(self, round_: int) -> bool:
        return self.kind == KIND_STYLE

    # ------------------------------------------------------------------ on a shard hosting the group
    def hosting_context(self, config: RoundConfig) -> dict:
        """The round's slot layout and its members' clusters: what the gate before the unmasking
        reads (``_thin_slots``), which a host built from the job's config alone never saw."""
        return {"slots": self.slots.to_json(), "clusters": {d: int(self.assignment[d]) for d in config.members}}

    def host_group(self, config: RoundConfig, context: dict | None = None) -> None:
        if context is not None:         # a shard's: the coordinator's layout, bound to the signed group id
            slots = ClusterSlotLayout.from_json(context["slots"])
            clusters = context["clusters"]
            if slots.group_id() != config.group_id:
                raise ValueError(f"secure round {config.round_id}: the slot layout is not group {config.group_id}'s")
            if set(clusters) != set(config.members) or not all(
                    type(k) is int and 0 <= k < len(slots.enabled) for k in clusters.values()):
                raise ValueError(f"secure round {config.round_id}: the members' clusters do not match the group")
            self.slots, self._gate_passed = slots, False
            self.assignment.update(clusters)
        super().host_group(config, context)

    # ------------------------------------------------------------------ the sum
    def _thin_slots(self, survivors) -> list[int]:
        """Enabled clusters whose slot would sum between 1 and min − 1 survivors."""
        count = Counter(self.assignment[d] for d in survivors)
        return [k for k, on in enumerate(self.slots.enabled)
                if on and 0 < count.get(k, 0) < self.config.min_cluster_contributors]

    def _route(self, outputs, paced: bool = False) -> list:
        # U3 is fixed once the masked-input phase closes and before anyone is asked for shares:
        # the last moment a too-thin slot can be refused without revealing it.
        if (self.secure is not None and not self._gate_passed
                and any(isinstance(o, (ConsistencyCheckRequest, UnmaskRequest)) for o in outputs)):
            thin = self._thin_slots(self.secure.participants(Phase.MASKED_INPUT))
            if thin:
                outputs = self.secure.abort(f"cluster slots {thin} would sum fewer than "
                                            f"{self.config.min_cluster_contributors} updates")
            else:
                self._gate_passed = True
        return super()._route(outputs, paced=paced)

    def on_secure_sum(self, total: np.ndarray, survivors: tuple[str, ...]) -> None:
        sums = self.slots.unpack_sum(total)
        count = Counter(self.assignment[d] for d in survivors)
        expected = [count.get(k, 0) if on else 0 for k, on in enumerate(self.slots.enabled)]
        if sums.count_per_cluster.tolist() != expected or sums.n < 1:     # a device filled the wrong slot
            raise GroupSumOutOfBound(f"slot counts {sums.count_per_cluster.tolist()} != expected {expected}")
        self._check_weights(sums, expected, len(survivors))
        new_model = self._noisy_means(sums) if self.config.dp else self._weighted_means(sums)
        self._round_sum = (new_model, {k: count[k] for k in sorted(count)})
        self._applied = set(survivors)
        for d in survivors:
            self.contributed[d] = self.contributed.get(d, 0) + 1
        if self.config.kd_lambda > 0:
            self.kd_confirmed |= set(survivors)       # they trained, so they hold the KD teacher

    def _check_weights(self, sums: SlotSums, members_per_cluster: list[int], members: int) -> None:
        """GroupSumOutOfBound unless the weight slots and the sums are what honest members send (a
        review found them unchecked: one member writing n = 1 − Σ others' n made φ's "mean" the
        weighted sum itself, as the count-slot attack secure FedAvg's check closes). Plain: each
        mean over its weight is a convex combination (check_group_mean); DP: every weight is 1 (the
        slots hold |S| and the cluster counts) and no entry passes |S| times the round's bound."""
        c = self.config
        parts = [(sums.phi, sums.n, members)] + [(sums.theta.get(k, {}), int(sums.n_per_cluster[k]), m)
                                                 for k, m in enumerate(members_per_cluster)]
        try:
            for tensors, n, m in parts:
                if c.dp:
                    check_dp_group_sum(tensors, n, m, noisy_bound(max(c.dp_clip_norm, 1.0), self._round_dp["stddev"]))
                elif m:
                    check_group_mean(tensors, n, m, c.max_samples, c.max_abs_param)
                elif n:
                    raise ValueError(f"a weight of {n} in a slot nobody filled")
        except ValueError as exc:
            raise GroupSumOutOfBound(str(exc)) from None

    def _weighted_means(self, sums: SlotSums) -> tuple[Arrays, dict[int, Arrays]]:
        """φ ← Σ n φ / Σ n and θ_k ← Σ_k n θ / Σ_k n (an enabled slot nobody filled keeps θ_k)."""
        phi = {k: v.copy() for k, v in self.phi.items()}
        for name, weighted in sums.phi.items():
            phi[name] = (weighted / sums.n).astype(phi[name].dtype)
        theta = {k: {name: v.copy() for name, v in part.items()} for k, part in self.theta.items()}
        for k, weighted_part in sums.theta.items():
            if sums.n_per_cluster[k] > 0:
                for name, weighted in weighted_part.items():
                    theta[k][name] = (weighted / sums.n_per_cluster[k]).astype(theta[k][name].dtype)
        return phi, theta

    def _noisy_means(self, sums: SlotSums) -> tuple[Arrays, dict[int, Arrays]]:
        """Distributed DP: the sums are Σ clipped deltas plus the survivors' noise, on φ and every
        enabled slot; means over the devices *selected* (aggregator/strategies/dp_ladd.py)."""
        released = {(GLOBAL, name): v for name, v in sums.phi.items()}
        released.update({(k, name): v for k, part in sums.theta.items() for name, v in part.items()})
        selected = Counter(self.assignment[d] for d in self._participants)
        return apply_mean_deltas(self.phi, self.theta, released, selected)

    def _round_aggregate(self):
        if self.kind != SECURE_LADD_KIND:
            return super()._round_aggregate()
        return self._round_sum if self._round_sum is not None else (None, {})

    def close_round(self, closed: RoundClosed) -> None:
        secure = self.kind == SECURE_LADD_KIND and closed.round == self.round
        if secure:
            self.abort_secure_round(closed.round, "deadline")
        super().close_round(closed)
        if secure and self.round_log and self.round_log[-1]["round"] == closed.round:
            self.round_log[-1]["slots_disabled"] = [k for k, on in enumerate(self.slots.enabled) if not on]
            self.round_log[-1]["secure_failed"] = any(r == closed.round for r, _ in self.failed_rounds)
        self._round_sum = None
