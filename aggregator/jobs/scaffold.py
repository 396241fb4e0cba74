"""Scaffold(ψ) (Karimireddy et al. 2020, option II): FedAvg of the head with control variates.

Everything is :class:`~aggregator.jobs.fedavg.FedAvgJob`'s (sampling, deadlines, bounded
influence on y, the server step w ← w + η_g · mean(y − w) with FedAvg's sample-weighted mean where
Alg. 1 takes the plain one, FedAvgM, Fed3R initialisation); on
top, the job holds the server control c (checkpointed with the model) and sends it with each
task; each device keeps its own c_k in its state store (``edge_client/tasks/scaffold_training.py``)
and returns Δc with its trained head. At round close, over the S devices whose update was
accepted and reached the rule (one the direction screen leaves out moves no c either):
c ← c + (|S| / K) · mean(Δc), K the fleet's size (``total_devices``; 0: the devices
that contributed so far, a lower bound that grows as the job meets its fleet).

A device's Δc is bounded twice before the mean: clipped to ``control_clip_norm``, then (with the
update's norm bound on, ``norm_bound_multiplier`` > 0) scaled to at most that multiple of the
round's median ‖Δc‖, as its model update is. The fixed clip alone let one device push c along its
own direction by clip·|S|/K / |S| every round, and c enters every honest device's local step, so
the model followed while each honest update still looked typical (a review measured ‖c‖ 2 → 500
and ‖w‖ 0.75 → 134 in five rounds of ten devices). In a round of fewer than three Δc the median is
the round's own (one device's in a round of one: alone, it moved c by control_clip_norm / K each
such round, a review's finding), so the limit is within a reference of earlier rounds' too
(``control_rounds``, a ``SmallRoundReference``), and a round of one Δc before there is one moves
no c. With shards the median is taken over every shard's Δc norms in a phase of its own
(``aggregator/shards/control_sums.py``), the reference kept from them: the same bits. A device not sampled keeps its c_k (at the device), and one sampled again after more than
``state_max_staleness`` rounds restarts from c_k = 0 (``aggregator/jobs/device_state_fields.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.clipping import clip_update, global_norm
from protocols.device_inbox import TensorShape
from protocols.envelope import Envelope, body_field
from protocols.payloads.scaffold import CONTROL, HEAD, KIND, ScaffoldParams, ScaffoldUpdate, parse_control_update
from protocols.rounds import RoundClosed

from aggregator.jobs.config_limits import TOTAL_DEVICES, Range, check_whole_number, limited
from aggregator.jobs.device_state_fields import DeviceStateFields, DeviceStateRun, StatefulDevicesJob
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob, RoundUpdate
from aggregator.shards.control_sums import ControlBound, local_control_sum


@dataclass
class ScaffoldConfig(FedAvgConfig, DeviceStateFields):
    job_id: str = "scaffold"
    total_devices: int = limited(0, TOTAL_DEVICES)   # K in c's update; 0: the devices that contributed so far
    control_clip_norm: float = limited(1000.0, Range(1e-9, 1e9))   # each device's Δc is clipped to this L2 norm

    def __post_init__(self):
        super().__post_init__()
        self.check_device_state()
        if self.dp:
            raise ValueError("Scaffold's control variates are outside DP-FedAvg's accounting: no dp with scaffold")
        check_whole_number(self, "total_devices", 0)
        if not 0 < self.control_clip_norm < float("inf"):
            raise ValueError(f"control_clip_norm must be a finite number > 0, got {self.control_clip_norm!r}")

    def task_tensors(self) -> dict[str, TensorShape]:
        """The head and, beside it, the server control c over what the devices train (the head)."""
        return with_controls(super().task_tensors(), HEAD)


def with_controls(tensors: dict[str, TensorShape], controlled) -> dict[str, TensorShape]:
    """A task's tensors plus the server control c of each ``controlled`` one (ScaffoldControls.task_for)."""
    return {**tensors, **{CONTROL + name: tensors[name] for name in controlled if name in tensors}}


def clip_to_norm(tensors: dict[str, np.ndarray], bound: float) -> dict[str, np.ndarray]:
    """The tensors scaled (together) to L2 norm ``bound`` when their norm exceeds it (float64):
    ``protocols.clipping.clip_update``, which a secure round's devices apply to their own Δc."""
    return clip_update(tensors, bound)[0]


class ScaffoldControls(StatefulDevicesJob):
    """Mixin, before the FedAvg job it extends: the server control c over the tensors devices
    train (``controlled``), sent with each task, updated from the accepted Δc at round close and
    checkpointed with the model. Scaffold(ψ) controls the head, Scaffold on the tail
    (``aggregator/jobs/scaffold_tail.py``) the tensors FT(φ)/FT(M) train."""

    params_type: type = ScaffoldParams          # the wire params: the base job's plus job_id and state
    controlled: tuple[str, ...]

    CONTROL_REFERENCE_KEY = "scaffold.control_bounds"      # the Δc bound's reference, in the checkpoint

    def init_controls(self, controlled: tuple[str, ...]) -> None:
        self.device_state = DeviceStateRun()
        self.controlled = tuple(controlled)
        self.control = {k: np.zeros_like(self.params[k]) for k in self.controlled}
        self._controls: dict[str, dict[str, np.ndarray]] = {}     # this round's Δc, by device
        # what a round of fewer than three Δc is bounded by too (the model's small_rounds' kind, on
        # the Δc bound): off with the Δc bound, with small_round_reference false and under DP
        bound = self.control_bound()
        self.control_rounds = self.config.small_rounds(self.CONTROL_REFERENCE_KEY, [bound] if bound else [])

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        params, tensors = super().task_for(device)
        return params, {**tensors, **{CONTROL + k: v.copy() for k, v in self.control.items()}}

    def task_params(self, device: str):
        c = self.config
        return self.params_type.extending(super().task_params(device), job_id=c.job_id,
                                          state=c.binding(self.device_state.run, self.round))

    def parse_result(self, env: Envelope) -> RoundUpdate:
        update = parse_control_update(env, {k: self.params[k].shape for k in self.controlled})
        return RoundUpdate(body_field(env, "round", int), update)

    def apply(self, device: str, payload: RoundUpdate) -> None:
        fresh = device not in self._updates
        super().apply(device, payload)
        update: ScaffoldUpdate = payload.update
        if fresh and device in self._updates:           # accepted into the open round
            self._controls[device] = self.clipped_control(update)

    def clipped_control(self, update: ScaffoldUpdate) -> dict[str, np.ndarray]:
        """An update's Δc clipped to ``control_clip_norm`` (float64): what the round's bound measures."""
        return clip_to_norm(update.delta_control, self.config.control_clip_norm)

    def control_bound(self) -> ControlBound | None:
        """The round's fleet-relative bound on the Δc_k, when the update's norm bound is on."""
        multiplier = self.config.norm_bound_multiplier
        return ControlBound(multiplier) if multiplier else None

    def control_step(self) -> None:
        """c ← c + (|S| / K) · mean(Δc) over the round's accepted updates that reach its rule, each
        within the round's bound (in a round of fewer than three Δc, within its reference of earlier
        rounds too: ``control_rounds``), their Σ Δc added up the canonical bucket tree as K shards
        add it (``aggregator/shards/control_sums.py``)."""
        # a round of one update the model's reference holds moves no c; its Δc still go to the Δc
        # bound's reference, as its update's statistics go to the model's (shards measure them alike)
        held = self.small_rounds.holds(len(self._updates))
        # a device whose update the screen left out moves no more of c than of the model (a review
        # found a screened sign-flipper's Δc still pulled c, round after round)
        left_out = set() if held else self.left_out()
        accepted = {d: delta for d, delta in self._controls.items() if d in self._updates and d not in left_out}
        bound = self.control_bound()
        if accepted and bound:
            norms = {d: global_norm(delta) for d, delta in accepted.items()}
            limit = self.control_rounds.limit(0, bound.limit(list(norms.values())), len(norms))
            held = self.control_rounds.close((limit,), [norms]) or held
            if limit > 0:       # 0: most Δc are 0, nothing to bound (as the update's bound reads a 0 limit)
                accepted = {d: clip_to_norm(delta, limit) for d, delta in accepted.items()}
        if accepted and not held:
            self.step_control(local_control_sum(accepted), len(accepted))

    def step_control(self, total: dict[str, np.ndarray], accepted: int) -> None:
        """c ← c + (|S| / K) · Σ Δc_k / |S| from the round's sum of ``accepted`` clipped deltas
        (a sharded job's coordinator takes it on the shards' sums)."""
        self.move_control({k: total[k] / accepted for k in self.controlled}, accepted)

    def move_control(self, mean: dict[str, np.ndarray], accepted: int) -> None:
        """c ← c + (|S| / K) · mean, |S| = ``accepted`` devices' Δc averaged into ``mean``."""
        share = self.participation(accepted)
        for k in self.controlled:
            self.control[k] = (self.control[k] + share * mean[k]).astype(np.float32)

    def close_round(self, closed: RoundClosed) -> None:
        if self._open and closed.round == self.round:
            self.control_step()
        self._controls = {}
        super().close_round(closed)

    def next_participants(self, online: set[str]) -> list[str]:
        chosen = super().next_participants(online)
        if chosen:
            self._controls = {}
        return chosen

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**super().state_dict(), **{CONTROL + k: v.copy() for k, v in self.control.items()},
                **self.control_rounds.state_dict()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """The model's state, c and the Δc bound's reference (a checkpoint of the version before it
        holds none: the job goes on as one whose reference is still to be made)."""
        super().load_state_dict(state)
        self.control = {k: np.asarray(state[CONTROL + k], dtype=np.float32).copy() for k in self.controlled}
        self.control_rounds.load_state_dict(state)


class ScaffoldJob(ScaffoldControls, FedAvgJob):
    """Scaffold on the head: FedAvgJob plus the server control c (see the module docstring)."""

    def __init__(self, config: ScaffoldConfig, initial_head: dict[str, np.ndarray] | None = None, strategy=None):
        super().__init__(config, initial_head=initial_head, strategy=strategy, kind=KIND)
        self.init_controls(HEAD)
