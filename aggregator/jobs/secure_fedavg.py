"""Secure FedAvg/FedAvgM: each round's updates reach the aggregator only as one sum.

Each round is one SecAgg (or SecAgg+) group of the κ sampled devices (``SecureGroupRounds``).
A device trains as in plain FedAvg and contributes ``[n_k·t_1 | … | n_k·t_m | n_k]`` for the
tensors it trains (``trained_shapes``, in that order: the head's ``weight``, ``bias`` for
FedAvg(ψ); the tail's tensors (and the head's for FT(M)) for :class:`SecureTailFedAvgJob`); the
unmasked group sum gives Σ n_k θ_k and Σ n_k, hence exactly the FedAvg mean over the survivors
(up to the fixed-point resolution 2^-f), and the server step is the plain job's. Devices that
drop out mid-round are recovered when at least t survive; a failed round (too few survivors,
or the deadline) leaves the head and the server momentum untouched, as an empty plain round does.

Bound: every entry of a device's vector is at most ``max_samples × max(max_abs_param, 1)`` in
magnitude; devices whose trained head exceeds ``max_abs_param`` decline (the fixed-point range
is part of the signed round configuration, so nothing can overflow silently).

Distributed DP (``dp_noise_multiplier`` > 0): devices send ``[clip(θ_k − θ_t) | 1]`` with their
share of Skellam noise (``protocols/secagg/distributed_dp.py``); the sum over the fixed κ is the
noisy mean update, and the server never holds an un-noised sum. Adaptive clipping
(``dp_adaptive_clip``): the round's C is the rule's (``AdaptiveClipNorm``), the update noise σ =
z_Δ·C (Andrew et al.'s split, as the plain job's), and each device sends
``[clip(θ_k − θ_t) | (b_k − ½)·s | 1]`` with s = σ/σ_b (``dp.clip_bit_scale``): the sum's bit entry
over s is Σ (b_k − ½) with noise of stddev σ_b (at t survivors), what the plain rule releases, and C
moves by the plain rule from it (``AdaptiveClipNorm.follow``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.envelope import Envelope, EnvelopeError
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import (SECURE_DITTO_KIND, SECURE_FEDAVG_KIND, SECURE_PP_KIND, SECURE_TAIL_KIND,
                                       unpack_weighted_sum, weighted_length)
from protocols.payloads.task_kinds import params_type
from protocols.payloads.task_params import DpRound
from protocols.rounds import RoundClosed
from protocols.secagg.distributed_dp import clip_bit_scale, clip_bit_sum_bound, noisy_bound

from aggregator.jobs.ditto import DittoConfig, DittoJob
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob
from aggregator.jobs.partial import PartialConfig, PartialPersonalizationJob
from aggregator.jobs.robustness_fields import SecureUpdateBoundFields
from aggregator.jobs.secure_fields import SecureUpdateFields
from aggregator.jobs.secure_rounds import (MIN_GROUP, GroupSumOutOfBound, SecureGroupRounds, checked_vector_length,
                                          config_vector_length)
from aggregator.strategies.robust_fedavg import check_dp_group_sum, check_group_mean, check_weighted_group_sum


@dataclass
class SecureFedAvgConfig(FedAvgConfig, SecureUpdateFields, SecureUpdateBoundFields):
    """FedAvg's fields, the secure ones (``aggregator/jobs/secure_fields.py``) and the group-sum bound
    (``aggregator/jobs/robustness_fields.py``)."""

    # plaintext defences (they need each update), which FedAvgConfig's defaults would otherwise set
    contribution_bound_multiplier: float = 0.0
    direction_screen: bool = False
    history_momentum: float = 0.0

    # the vector's length for the tensors a device trains: [n·t_1 | … | n·t_m | n] (Scaffold's adds Δc)
    pack_length = staticmethod(weighted_length)

    def secure_vector_length(self) -> int | None:
        shapes = self.trained_shapes()        # None for a tail kind: the tail program's tensors
        return None if shapes is None else self.pack_length(shapes) + self.clip_bit_entries()


class SecureFedAvgJob(SecureGroupRounds, FedAvgJob):
    secure_kind = SECURE_FEDAVG_KIND

    def __init__(self, config: SecureFedAvgConfig, initial_head: dict[str, np.ndarray] | None = None,
                 identity: DeviceIdentity | None = None, registry: IdentityRegistry | None = None, **model):
        # the plain job next in the MRO (FedAvgJob, or TailFedAvgJob for the tail variant)
        super(SecureGroupRounds, self).__init__(config, initial_head=initial_head, **model)
        self.kind = self.secure_kind
        self._init_secure(identity, registry)
        # a tail kind's length is known once its tail program is read (here); a head's, from the config
        self.vector_length = config_vector_length(config) or checked_vector_length(
            config.pack_length(self.trained_shapes()) + config.clip_bit_entries(), config, config.secure_vector_remedy())
        self.bound = float(config.max_samples) * max(float(config.max_abs_param), 1.0)
        self._sum: tuple[dict[str, np.ndarray], int, int] | None = None     # (mean, updates, Σ n) of the round
        self._round_dp: dict | None = None
        self._noisy_count: float | None = None      # adaptive clipping: the round's noisy Σ (b_k − ½)

    def next_participants(self, online: set[str]) -> list[str]:
        pool = {d for d in online if d in self.registry}     # no key, no secure round
        if len(pool) < MIN_GROUP:        # too few to hide anyone's update in a sum
            self.waiting = (f"waiting for devices: a secure round needs {MIN_GROUP} with keys online, {len(pool)} "
                            f"are") if pool and not self._open and not self.finished(pool, pool) else None
            return []
        chosen = super().next_participants(pool)
        if chosen:
            self._sum, self._noisy_count = None, None
            if self.dp is not None:
                self._round_dp = self._open_dp_round(chosen)
            else:
                self.open_secure_round(self.round, chosen, self.vector_length, self.bound)
        return chosen

    def _open_dp_round(self, chosen: list[str]) -> dict:
        """The round's ``dp`` task params: C (the rule's, adaptive or fixed), the noise of stddev
        z_Δ·C on the sum (z_Δ = z with a fixed C) and, adaptive, the bit's scale s = σ/σ_b."""
        clip_norm = self.dp.clip.value
        total_stddev = self.dp.update_multiplier * clip_norm
        bit = {"clip_bit_scale": clip_bit_scale(total_stddev, self.dp.clip.count_stddev)} \
            if self.config.clip_bit_entries() else {}
        return {"clip_norm": clip_norm, **bit, **self.open_dp_round(
            self.round, chosen, self.vector_length, self._dp_data_bound(clip_norm, bit), total_stddev)}

    @staticmethod
    def _dp_data_bound(clip_norm: float, round_dp: dict) -> float:
        """Each member's per-entry bound before its noise: C (its clipped update), 1 (its count) and,
        adaptive, s/2 (its centred bit)."""
        return max(clip_norm, 1.0, round_dp.get("clip_bit_scale", 0.0) / 2)

    def task_params(self, device: str):
        """The plain kind's params (the job next in the MRO) as the secure kind's type (the table's)."""
        c = self.config
        clip = c.update_clip_norm if c.update_clip_norm > 0 and self.dp is None else None   # clipped before masking
        return params_type(self.secure_kind).extending(
            super().task_params(device), group=f"g{self.round}", max_samples=c.max_samples,
            max_abs_param=c.max_abs_param, vector_order=tuple(self.trained_shapes()), update_clip_norm=clip,
            dp=DpRound(**self._round_dp) if self.dp is not None else None, **self.secure_task_fields())

    def secure_task_fields(self) -> dict:
        """The secure kind's own task fields beyond the FedAvg family's (Scaffold: its Δc bound)."""
        return {}

    def parse_result(self, env: Envelope):
        raise EnvelopeError(f"{self.secure_kind} devices send secagg messages, never plain results")

    def apply(self, device: str, payload) -> None:
        """Never called: a secure round has no per-device result; it closes with the group's
        survivors (``GroupSettled``) after ``on_secure_sum`` recorded the sum and its members."""
        raise TypeError("a secure round has no per-device results to apply")

    def on_secure_sum(self, total: np.ndarray, survivors: tuple[str, ...]) -> None:
        noisy_count = None
        if self.dp is not None and self.config.clip_bit_entries():
            # [Σ clip(Δ_k) | Σ (b_k − ½)·s + noise | |S|]: the bit entry read, then the update's sum
            noisy_count = self._read_clip_bits(float(total[-2]), survivors)
            total = np.delete(total, -2)
        self.record_sum(*unpack_weighted_sum(total, self.trained_shapes()), survivors)
        self._noisy_count = noisy_count         # only once the whole sum is within its bounds

    def _read_clip_bits(self, bit_sum: float, survivors: tuple[str, ...]) -> float:
        """The noisy Σ (b_k − ½) from the sum's bit entry (divided by s); GroupSumOutOfBound (nothing
        applied, C kept) beyond what the survivors' honest entries can sum to (``clip_bit_sum_bound``)."""
        scale, stddev = self._round_dp["clip_bit_scale"], self._round_dp["stddev"]
        most = clip_bit_sum_bound(scale, stddev, len(survivors))
        if not abs(bit_sum) <= most + len(survivors) * 2.0 ** -self._round_dp["scale_bits"]:   # + the grid's rounding
            raise GroupSumOutOfBound(f"the clipped-indicator entry {bit_sum:.4g} of a DP group of {len(survivors)} "
                                     f"is beyond {most:.4g} (|S|·s/2 and the noise's room, s = {scale:.4g})")
        return bit_sum / scale

    def record_sum(self, sums: dict[str, np.ndarray], n: int, survivors: tuple[str, ...]) -> None:
        """The round's mean from its Σ n_k θ_k and Σ n_k (GroupSumOutOfBound: nothing recorded; a
        count of 0 or less too, which no honest group sends: it once settled the round silently)."""
        if self.dp is not None:
            self._check_dp_group_sum(sums, n, survivors)
            # the noisy sum of clipped updates over the fixed κ (n counts the survivors: weights are 1)
            self._sum = ({name: s / self.config.clients_per_round for name, s in sums.items()}, len(survivors), n)
        else:
            self._check_group_sum(sums, n, survivors)
            self._sum = ({name: weighted / n for name, weighted in sums.items()}, len(survivors), n)
        self.samples += n
        for d in survivors:
            self.contributed[d] = self.contributed.get(d, 0) + 1

    def _check_group_sum(self, sums: dict[str, np.ndarray], n: int, survivors: tuple[str, ...]) -> None:
        """Bounded influence: GroupSumOutOfBound when the sum breaks what its members' bounds allow:
        the count and the mean always, the clipped bound n·C when the round clips."""
        c = self.config
        try:
            check_group_mean(sums, n, len(survivors), c.max_samples, c.max_abs_param)
            if c.update_clip_norm > 0:
                check_weighted_group_sum(sums, n, {k: self.params[k] for k in sums}, len(survivors),
                                         c.update_clip_norm, c.max_samples)
        except ValueError as exc:
            raise GroupSumOutOfBound(str(exc)) from None

    def _check_dp_group_sum(self, sums: dict[str, np.ndarray], n: int, survivors: tuple[str, ...]) -> None:
        """Under distributed DP (skipped before: one member could mask any ring element and move
        the model by it): ``check_dp_group_sum`` at the update's per-entry bound, C or 1 (the bit
        entry, taken out and checked on its own, does not widen it: s/2 may pass both)."""
        round_dp = self._round_dp
        try:
            check_dp_group_sum(sums, n, len(survivors),
                               noisy_bound(self._dp_data_bound(round_dp["clip_norm"], {}), round_dp["stddev"]))
        except ValueError as exc:
            raise GroupSumOutOfBound(str(exc)) from None

    def round_mean(self) -> tuple[dict[str, np.ndarray] | None, int, int]:
        return self._sum if self._sum is not None else (None, 0, 0)

    def round_step(self) -> tuple[dict[str, np.ndarray] | None, int, int]:
        if self.dp is None:
            return super().round_step()
        mean_delta, updates, samples = self.round_mean()
        if mean_delta is None:           # a failed round revealed nothing
            return None, 0, 0
        trained = {name: self.params[name] for name in mean_delta}
        moved = self.dp.apply_mean_delta(trained, mean_delta)
        if self._noisy_count is not None:       # adaptive: C for the next round, by the plain rule
            self.dp.clip.follow(self._noisy_count, self.config.clients_per_round)
            self._noisy_count = None
        return moved, updates, samples

    def close_round(self, closed: RoundClosed) -> None:
        self.abort_secure_round(closed.round, "deadline")
        super().close_round(closed)
        self._sum, self._noisy_count = None, None


@dataclass
class SecureTailFedAvgConfig(SecureFedAvgConfig, TailFedAvgConfig):
    job_id: str = "fedavg-tail-secure"
    norm_bound_multiplier: float = 3.0      # FT(φ)'s, which SecureFedAvgConfig's (FedAvg(ψ)'s 1x) would hide


class SecureTailFedAvgJob(SecureFedAvgJob, TailFedAvgJob):
    """FT(φ)/FT(M) (``aggregator.jobs.fedavg_tail``) with each round's tail updates summed
    under secure aggregation (wire kind ``fedavg.tail.secure``)."""

    secure_kind = SECURE_TAIL_KIND


@dataclass
class SecurePartialConfig(SecureFedAvgConfig, PartialConfig):
    job_id: str = "pp-secure"


class SecurePartialJob(SecureFedAvgJob, PartialPersonalizationJob):
    """FedSim/FedAlt (``aggregator.jobs.partial``) with each round's shared-weight updates summed
    under secure aggregation (wire kind ``pp.head.secure``); the personal biases stay on the
    devices as in the plain job. A secure round has no per-device result, so the job reports no
    held-out counts of its own: the ``personalize`` job that follows (``personal_job``) does."""

    secure_kind = SECURE_PP_KIND


@dataclass
class SecureDittoConfig(SecureFedAvgConfig, DittoConfig):
    job_id: str = "ditto-secure"


class SecureDittoJob(SecureFedAvgJob, DittoJob):
    """Ditto(ψ) (``aggregator.jobs.ditto``) with each round's global-head updates summed under
    secure aggregation (wire kind ``ditto.head.secure``): [n·weight | n·bias | n], as FedAvg(ψ)'s.
    Each device's personal head v_k stays in its state store as in the plain job; as in
    pp-secure, the job has no per-device held-out counts (the ``personalize`` job that follows,
    ``personal_job``, evaluates every device with its own v_k)."""

    secure_kind = SECURE_DITTO_KIND
