"""Params of the secure task kinds: a plain kind's params plus the secure round's.

A secure kind's device computes what the plain kind computes (the same handler, the same
params) and contributes it to a group sum (``protocols.payloads.secagg``), so each secure type
*is* its plain type (a subclass: the plain handler accepts it) with the round's fields beside:

* ``group``          the secure round's group (bound to its signed round configuration)
* ``max_samples``    the largest sample count a member may put in the sum
* ``max_abs_param``  the largest |value| a trained tensor may hold (the fixed-point range)
* ``dp``             under distributed DP, the round's noise (:class:`DpRound`)
* ``block_scales``   Fed3R-Sync under distributed DP: how the device scales its vector's blocks
                     first, so that one noise stddev becomes per-block noise (:class:`SyncBlockScales`)
* ``center_round``   Fed3R-Sync under distributed DP, the private feature center's round: the device
                     contributes only (Σ z, n) of its clipped rows (``sync_center_vector``)

and, per kind, ``vector_order`` (the FedAvg family: the trained tensors' order in the vector),
``update_clip_norm`` (bounded influence without DP) or ``slots`` (LADD's cluster slot layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .ditto import DittoParams
from .fed3r import Fed3RStatsParams
from .fedavg import HeadTrainingParams, TailTrainingParams
from .ladd import LaddTrainParams
from .partial import PartialParams
from .scaffold import ScaffoldParams
from .secagg import (HEAD_ORDER, SECURE_DITTO_KIND, SECURE_FEDAVG_KIND, SECURE_LADD_KIND, SECURE_PP_KIND,
                     SECURE_SCAFFOLD_KIND, SECURE_TAIL_KIND, SYNC_KIND, ClusterSlotLayout)
from .task_params import DpRound, WireParams, check_bool, check_int, check_number, check_str, nested, optional

MAX_GROUP_ID = 128
MAX_BLOCK_SCALE = 2.0 ** 20


def _check_group(group: Any) -> None:
    check_str("group", group, max_len=MAX_GROUP_ID)
    if not group:
        raise ValueError("a secure task needs its group")


@dataclass(frozen=True, kw_only=True)
class SyncBlockScales(WireParams):
    """``block_scales`` of a ``fed3r.secure`` task under distributed DP: what the device multiplies
    its vector's packed A off-diagonal entries and its b by before adding its noise share
    (``protocols.payloads.secagg.scale_sync_blocks``; the count slot then holds 1). One Skellam
    stddev σ on every entry of the scaled vector is, scaled back, σ on A's diagonal, σ/a_off_diagonal
    off it and σ/b on b: the ``ssp`` mechanism's per-block noise (aggregator/strategies/dp_fed3r.py)."""

    a_off_diagonal: float
    b: float

    def __post_init__(self):
        check_number("block_scales.a_off_diagonal", self.a_off_diagonal, high=MAX_BLOCK_SCALE, low_open=True)
        check_number("block_scales.b", self.b, high=MAX_BLOCK_SCALE, low_open=True)


@dataclass(frozen=True, kw_only=True)
class SecureFed3RParams(Fed3RStatsParams):
    """``fed3r.secure`` params: dense float64 statistics (whatever ``format``/``dtype`` say: a sum
    needs fixed shapes), ``max_samples`` required; under distributed DP, ``dp`` and optionally
    ``block_scales`` (:class:`SyncBlockScales`). ``center_round`` (distributed DP, with the
    intercept, uncentred, no block scales): the round that releases the private feature center
    (aggregator/strategies/dp_center.py) — the device's vector is A's intercept column only,
    (Σ z, n) over its clipped rows (``protocols.payloads.secagg.sync_center_vector``), noise on
    every entry, the count included (its noisy sum is the center's denominator)."""

    KIND = SYNC_KIND
    REQUIRED_KEYS = ("max_samples",)
    group: str
    dp: DpRound | None = nested(DpRound)
    block_scales: SyncBlockScales | None = nested(SyncBlockScales)
    center_round: bool | None = optional()

    def __post_init__(self):
        super().__post_init__()
        _check_group(self.group)
        if self.max_samples is None:
            raise ValueError("a secure Fed3R task needs max_samples")
        if self.block_scales is not None and self.dp is None:
            raise ValueError("block_scales shape distributed-DP noise: a task without dp has none")
        if self.center_round is not None:
            check_bool("center_round", self.center_round)
            if self.center_round and (self.dp is None or self.block_scales is not None or self.centered
                                      or not self.fit_intercept or not self.feature_clip_norm):
                raise ValueError("center_round needs dp, feature_clip_norm and fit_intercept, and neither "
                                 "block_scales nor centered (it releases the mean the later rounds centre on)")


@dataclass(frozen=True, kw_only=True)
class SecureUpdateRound(WireParams):
    """The FedAvg family's secure round fields (module doc). The device's SecAgg wrapper reads
    these; the plain handler it wraps reads the plain kind's type from the same params."""

    group: str
    max_samples: int
    max_abs_param: float
    vector_order: tuple[str, ...] = HEAD_ORDER
    update_clip_norm: float | None = optional()
    dp: DpRound | None = nested(DpRound)

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)     # the plain type's checks, in a secure kind's type
        if parent is not None:
            parent()
        _check_group(self.group)
        check_int("max_samples", self.max_samples, 1)
        check_number("max_abs_param", self.max_abs_param, low_open=True)
        if not isinstance(self.vector_order, tuple) or not self.vector_order \
                or len(set(self.vector_order)) != len(self.vector_order):
            raise ValueError(f"vector_order must name distinct tensors, got {self.vector_order!r}")
        for name in self.vector_order:
            check_str("vector_order[i]", name)
        if self.update_clip_norm is not None:
            check_number("update_clip_norm", self.update_clip_norm)
        if self.dp is not None and self.dp.clip_norm is None:
            raise ValueError("dp of a secure update round needs its clip_norm")


@dataclass(frozen=True, kw_only=True)
class SecureFedAvgParams(SecureUpdateRound, HeadTrainingParams):
    KIND = SECURE_FEDAVG_KIND


@dataclass(frozen=True, kw_only=True)
class SecureTailParams(SecureUpdateRound, TailTrainingParams):
    KIND = SECURE_TAIL_KIND


@dataclass(frozen=True, kw_only=True)
class SecurePartialParams(SecureUpdateRound, PartialParams):
    KIND = SECURE_PP_KIND


@dataclass(frozen=True, kw_only=True)
class SecureDittoParams(SecureUpdateRound, DittoParams):
    KIND = SECURE_DITTO_KIND


@dataclass(frozen=True, kw_only=True)
class SecureControlRound(SecureUpdateRound):
    """A secure Scaffold round's fields: the FedAvg family's plus ``control_clip_norm``, the L2 norm
    the device clips its Δc to (as the plain server clips each Δc) before it enters the sum, so
    every Δc entry is within it. Required: a device never guesses a bound. No distributed DP
    (Scaffold's control variates are outside its accounting, as plain Scaffold refuses DP)."""

    control_clip_norm: float

    def __post_init__(self):
        super().__post_init__()
        check_number("control_clip_norm", self.control_clip_norm, low_open=True)
        if self.dp is not None:
            raise ValueError("dp: Scaffold's control variates are outside distributed DP's accounting")


@dataclass(frozen=True, kw_only=True)
class SecureScaffoldParams(SecureControlRound, ScaffoldParams):
    KIND = SECURE_SCAFFOLD_KIND


@dataclass(frozen=True, kw_only=True)
class SecureLaddParams(LaddTrainParams):
    """``ladd.train.secure`` params: ``ladd.train``'s plus the round's slot layout (``slots``, a
    JSON object: ``ClusterSlotLayout``), whose group id ``group`` must be."""

    KIND = SECURE_LADD_KIND
    group: str
    slots: dict
    max_samples: int
    max_abs_param: float
    dp: DpRound | None = nested(DpRound)

    def __post_init__(self):
        super().__post_init__()
        _check_group(self.group)
        if self.group != self.slot_layout().group_id():
            raise ValueError("the task's group is not the group of its slot layout")
        check_int("max_samples", self.max_samples, 1)
        check_number("max_abs_param", self.max_abs_param, low_open=True)

    def slot_layout(self) -> ClusterSlotLayout:
        return ClusterSlotLayout.from_json(self.slots)
