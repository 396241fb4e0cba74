"""Fed3R-Sync: Fed3R whose statistics reach the aggregator only as secure group sums.

Each round is one group of κ devices (``clients_per_round``). The devices compute their dense
statistics, pack them into the fixed-shape vector of ``protocols.payloads.secagg`` and run
SecAgg (or SecAgg+) with the aggregator, which learns only the group sum: it adds that sum to
the Fed3R strategy exactly as it would add one device's statistics, so after ⌈K/κ⌉ groups the
classifier is the centralized ridge solution over the surviving devices (up to the fixed-point
resolution 2^-f). A group that would leave fewer than MIN_GROUP devices for a last group takes
them in (over-selection; past SecAgg's largest group it leaves MIN_GROUP for the last instead), so
no straggler is left without a group; a member known to be offline
is not waited for (``SecureGroupRounds.member_offline``). Devices that drop out mid-round are
recovered from Shamir shares when at least t survive; otherwise the round fails and *nothing* is applied (the group can be retried).

Distributed DP (``dp_noise_multiplier`` > 0): devices clip their features, cap their samples and
add their share of Skellam noise in the ring (``protocols/secagg/distributed_dp.py``), leaving the
sample count out; each group sum is released once, already noisy (``NoisyFed3R.add_noised``).
With ``ssp`` (``DistributedSSP``) the devices scale their vector's blocks first (the task's
``block_scales``), so that the one stddev they add becomes ``ssp``'s per-block noise once the
aggregator scales the sum back; the sum's count slot says how many scaled (one each).

The SecAgg sub-protocol and its service hooks are ``SecureGroupRounds`` (``secure_rounds.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from protocols.envelope import Envelope, EnvelopeError
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.fed3r import Fed3RStatsParams
from protocols.payloads.secagg import SYNC_KIND, scale_sync_blocks, sync_vector_length, unpack_sync_vector
from protocols.payloads.secure_tasks import SecureFed3RParams, SyncBlockScales
from protocols.payloads.task_params import DpRound
from protocols.rounds import RoundClosed
from protocols.secagg.config import MAX_GROUP_SIZE
from protocols.secagg.distributed_dp import noisy_bound
from protocols.secagg.fixedpoint import RING_BITS, fed3r_bound, max_scale_bits

from aggregator.strategies.dp_fed3r import (CalibratedSSP, DistributedSSP, Fed3RMechanism, Fed3RSensitivity,
                                            UniformGaussian, row_norm_bound)
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.jobs.secure_fields import SecureAggregationFields
from aggregator.jobs.secure_rounds import MIN_GROUP, GroupSumOutOfBound, SecureGroupRounds, config_vector_length
from aggregator.strategies.robust_fed3r import FeatureBound, check_group_sum


@dataclass
class Fed3RSyncConfig(Fed3RConfig, SecureAggregationFields):
    def __post_init__(self):
        super().__post_init__()
        self.refuse_inert_group_threshold(self.dp)
        if self.streaming:
            # an increment would be a group sum whose members' counts the job cannot check
            raise ValueError("fed3r-sync does not stream: run a new Fed3R-Sync job over the new data")
        if self.dp_release != "round":
            raise ValueError("fed3r-sync: each group's sum carries its devices' noise when it is unmasked (dp_release "
                             "\"end\" is central DP's rule)")
        if self.dp_min_round_devices:
            raise ValueError("fed3r-sync: each group is a release of its clients_per_round members (dp_min_round_devices "
                             "is central DP's rule for its rounds)")
        if self.dp_center_devices and self.dp_center_devices < MIN_GROUP:
            raise ValueError(f"dp_center_devices must be 0 or at least {MIN_GROUP}: the center round is a secure group")
        if self.ring_bits != RING_BITS:
            # the statistics' bound N max(F², F) leaves a 32-bit ring almost no fractional bits
            raise ValueError(f"fed3r-sync sums in the {RING_BITS}-bit ring: its statistics need the precision")

    def secure_vector_length(self) -> int:
        """[packed A (p x p, upper triangle) | B (C x p) | n]: all the config's (p: the features and the bias)."""
        return sync_vector_length(self.p, self.num_classes)

    def secure_vector_remedy(self) -> str:
        return f"fewer classes (num_classes) or a smaller {self.head_inputs_field} (p x p and C x p statistics)"

    def task_params(self) -> Fed3RStatsParams:
        return dataclasses.replace(super().task_params(), format="dense", dtype="float64", max_samples=self.max_samples)

    def accounting(self) -> str:
        return self.mechanism().accounting

    def mechanism(self) -> Fed3RMechanism:
        """The job's mechanism as the devices can add it: each adds one Skellam stddev to its whole
        vector, ``ssp``'s per-block split made by scaling the vector's blocks first (``DistributedSSP``)."""
        sensitivity = Fed3RSensitivity.of(self.max_samples, self.row_clip_norm, self.fit_intercept)
        if self.dp_mechanism == CalibratedSSP.name:
            return DistributedSSP(self.dp_noise_multiplier, sensitivity, self.dp_b_share)
        return UniformGaussian(self.dp_noise_multiplier, sensitivity)

    def dp_noise_stddev(self) -> float:
        """σ on every entry of a group's (block-scaled) sum, which the devices' shares add up to."""
        return self.mechanism().scale().a_diagonal

    def block_scales(self) -> SyncBlockScales | None:
        """What the devices scale their vector's blocks by before their noise (None: nothing)."""
        mechanism = self.mechanism()
        if not isinstance(mechanism, DistributedSSP):
            return None
        a_off_diagonal, b = mechanism.block_scales()
        return SyncBlockScales(a_off_diagonal=a_off_diagonal, b=b)


class Fed3RSyncJob(SecureGroupRounds, Fed3RJob):
    kind = SYNC_KIND
    order_free = False    # group sums, not per-device statistics, are what the aggregator holds

    def __init__(self, config: Fed3RSyncConfig, identity: DeviceIdentity | None = None,
                 registry: IdentityRegistry | None = None):
        Fed3RJob.__init__(self, config)
        self.kind = SYNC_KIND       # Fed3RJob's dataclass field would otherwise say fed3r.stats
        self._init_secure(identity, registry)
        rf = config.random_features
        feature_bound = (np.sqrt(2.0 / rf["dim"]) if rf else config.max_abs_feature)
        self.bound = fed3r_bound(config.max_samples, max(feature_bound, 1.0))   # ≥ 1: the bias feature
        self._group_bound = FeatureBound(feature_bound, config.max_samples, config.fit_intercept)
        # half the coarsest fixed-point step a plain round can have (its largest group: stragglers
        # join the last one): how far each member's entry may be from its exact statistic
        self._resolution = 2.0 ** -(max_scale_bits(config.clients_per_round + MIN_GROUP - 1, self.bound, RING_BITS) + 1)
        self.vector_length = config_vector_length(config)
        self.group_samples: list[int] = []
        self._round_dp: dict | None = None

    @property
    def contributions(self) -> int:
        return len(self.contributed)

    def next_participants(self, online: set[str]) -> list[str]:
        pool = [d for d in self.eligible(online) if d in self.registry]   # no key, no secure round
        if len(pool) < MIN_GROUP:
            return []        # too few left to hide anyone's statistics in a sum
        size = self.config.clients_per_round
        centering = self.centering
        if len(pool) - size < MIN_GROUP and not centering:
            if len(pool) > MAX_GROUP_SIZE:
                # the stragglers joining would pass SecAgg's largest group (clients_per_round near it:
                # a group of 10,002 was refused as it opened, every try): MIN_GROUP left for a last group
                size = len(pool) - MIN_GROUP
            else:
                size = len(pool)     # the stragglers join this group: left over alone they could never be summed
                away = set(self.eligible(self.reachable)) - set(pool)   # offline for now, within the grace period
                if 0 < len(away) < MIN_GROUP:
                    return []        # this would be the last group: wait for them (or for their grace to run out)
        chosen = super().next_participants(set(pool), size)    # the center round: dp_center_devices of them
        if centering and chosen:
            c = self.config
            self._round_dp = self.open_dp_round(self.round, chosen, c.p, self._dp_data_bound(),
                                                c.dp_noise_multiplier * self.strategy.center.sensitivity)
        elif self.config.dp:
            self._round_dp = self.open_dp_round(self.round, chosen, self.vector_length, self._dp_data_bound(),
                                                self.config.dp_noise_stddev())
        else:
            self.open_secure_round(self.round, chosen, self.vector_length, self.bound)
        return chosen

    def finished(self, online: set[str], known: set[str]) -> bool:
        return len(self.eligible(known | online)) < MIN_GROUP

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        stats, tensors = self.stats_task(device)
        if not self.config.dp:
            return SecureFed3RParams.extending(stats, group=f"g{self.round}").to_params(), tensors
        dp, centering = DpRound(**self._round_dp), self.centering
        return SecureFed3RParams.extending(stats, group=f"g{self.round}", dp=dp, center_round=centering or None,
                                           block_scales=None if centering else self.config.block_scales()
                                           ).to_params(), tensors

    def parse_result(self, env: Envelope):
        raise EnvelopeError("fed3r.secure devices send secagg messages, never plain results")

    def _dp_data_bound(self) -> float:
        """Each member's per-entry bound before its noise, in a DP round: the center round's
        (Σ z, n) or the statistics' (scaled by ``block_scales`` where those grow them)."""
        c = self.config
        if self.centering:
            return c.max_samples * max(c.feature_clip_norm, 1.0)
        scales = c.block_scales()
        widest = 1.0 if scales is None else max(1.0, scales.a_off_diagonal, scales.b)    # what scaling may grow
        return fed3r_bound(c.max_samples, max(row_norm_bound(c.row_clip_norm, c.fit_intercept), 1.0)) * widest

    def _check_dp_entries(self, total: np.ndarray, members: int) -> None:
        """GroupSumOutOfBound unless no entry of a DP group's sum passes ``members`` × the round's
        per-entry bound (its data bound with room for the noise: what every member's encoder holds
        to). A review's finding: one member could mask any ring element and have it released —
        an entry of 9.4e8 where three members can send 939, or a feature center of 1.2e8."""
        bound = noisy_bound(self._dp_data_bound(), self._round_dp["stddev"])
        largest = float(np.abs(total).max(initial=0.0))
        if largest > members * bound * (1 + 1e-6):
            raise GroupSumOutOfBound(f"an entry of {largest:.4g} where {members} members can send at most "
                                     f"{members * bound:.4g} (each within {bound:.4g}): nothing applied")

    def on_secure_sum(self, total: np.ndarray, survivors: tuple[str, ...]) -> None:
        c = self.config
        if c.dp:                        # the bound first; the members count as released before it (below)
            try:
                self._check_dp_entries(total, len(survivors))
            except GroupSumOutOfBound:
                for d in survivors:     # unmasked, the sum was released whether or not it is used
                    self.contributed[d] = 0
                raise
        if self.centering:    # (Σ z, n) + the devices' noise: the center, nothing else
            self.strategy.center.release_noised(total, len(survivors))
            n = 0
        elif c.dp:                   # already noisy (the devices' shares); the sample count is not released
            # unmasked, the sum is released whether or not it is used: its members count as released
            # (never asked again, the job's one release reported) before its checks may discard it
            for d in survivors:
                self.contributed[d] = 0
            a_upper, b = self._unscaled(total, len(survivors))
            threshold = (self._round_dp or {}).get("threshold", len(survivors))    # each member added σ²/t
            self.strategy.add_noised(a_upper, b, 0, len(survivors), len(survivors) / threshold)
            n = 0
        else:
            a_upper, b, n = unpack_sync_vector(total, c.p, c.num_classes)
            try:
                check_group_sum(a_upper, b, n, len(survivors), self._group_bound, self._resolution)
            except ValueError as exc:
                raise GroupSumOutOfBound(str(exc)) from None
            self.strategy.add_dense(a_upper, b, n)
        self.group_samples.append(n)
        for d in survivors:
            self.contributed[d] = 0

    def _unscaled(self, total: np.ndarray, members: int) -> tuple[np.ndarray, np.ndarray]:
        """A distributed-DP group sum's (A_upper, B), its blocks scaled back where the devices scaled
        them (``block_scales``): only when each of the ``members`` did, which its count slot says
        (1 each; a device library that ignores block_scales leaves 0), else GroupSumOutOfBound."""
        c, scales = self.config, self.config.block_scales()
        if scales is not None:
            scaled = unpack_sync_vector(total, c.p, c.num_classes)[2]
            if scaled != members:
                raise GroupSumOutOfBound(f"its count slot says {scaled} of its {members} members scaled their "
                                         "blocks (block_scales; a device library without them leaves 0): "
                                         "nothing applied")
            total = scale_sync_blocks(total, c.p, c.num_classes, 1.0 / scales.a_off_diagonal, 1.0 / scales.b)
        a_upper, b, _ = unpack_sync_vector(total, c.p, c.num_classes)
        return a_upper, b

    def apply(self, device: str, payload) -> None:
        """Never called: a secure round has no per-device result; it closes with the group's
        survivors (``GroupSettled``) after ``on_secure_sum`` recorded the sum and its members."""
        raise TypeError("a secure round has no per-device results to apply")

    def close_round(self, closed: RoundClosed) -> None:
        if self.config.dp and self.lost_to_restart(closed.round):
            # Its group may have unmasked its noisy sum just before the process died, with the marks
            # of that release (``on_secure_sum``) lost with it: its members count as released, never
            # asked again, rather than risk a second noisy sum of theirs the one release never counts.
            for d in closed.dropped:
                self.contributed.setdefault(d, 0)
        self.abort_secure_round(closed.round, "deadline")
