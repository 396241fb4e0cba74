"""``fedavg.secure`` / ``fedavg.tail.secure``: FedAvg rounds whose updates reach the
aggregator only as a sum.

The device trains exactly as for the plain kind (the wrapped handler: ``fedavg.head``'s
``HeadTrainingTask`` or ``fedavg.tail``'s ``TailTrainingTask``, same recipe) and contributes
``[n·t_1 | … | n·t_m | n]`` over the tensors it trained, in the task's ``vector_order``
(``protocols.payloads.secagg``; default weight, bias): the group sum gives Σ n_k θ_k and
Σ n_k, hence the FedAvg mean, without any θ_k being seen. A trained tensor with an entry beyond
the round's ``max_abs_param`` is refused here (declined), before secure aggregation would
overflow its fixed-point range. With the task's ``update_clip_norm`` C the device first clips its
update θ − θ_t to norm C (the aggregator checks each group's sum against Σ n_k·C). Under distributed DP (the task's ``dp``) the device sends its
clipped update instead, with its share of the noise (``dp_vector``), and under adaptive clipping
its clipped-indicator bit beside it.

The same wrapper serves ``pp.head.secure`` and ``ditto.head.secure`` around their stateful
handlers (the personal part stays in the device's store), and :class:`SecureScaffoldTraining`
``scaffold.head.secure``, whose vector carries the device's clipped Δc beside its weighted head.
Its c_k⁺ holds only where the round FINISHED on the device (its input in the unmasked sum): a
round that ends any other way puts the job's entry back to the c_k the round started from, as a
decline does (:meth:`SecureScaffoldTraining.round_end`), else c drifts from the mean of the c_k.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import numpy as np

from protocols.clipping import clip_update
from protocols.identity import DeviceIdentity
from protocols.payloads.scaffold import DELTA_CONTROL
from protocols.payloads.secagg import SECURE_FEDAVG_KIND, SECURE_SCAFFOLD_KIND, pack_controlled, pack_weighted
from protocols.payloads.secure_tasks import SecureControlRound, SecureUpdateRound
from protocols.payloads.task_params import DpRound
from protocols.secagg.distributed_dp import clip_bit

from ..agent import TaskDeclined
from .params import read_params
from .secure_update import RoundEnd, SecAggSessions, SecureUpdate
from .stateful_head import DeviceStateKeeper, StatefulHeadTask, put_back

log = logging.getLogger("fedfleet.device.secagg")


class SecureFedAvgTraining(SecureUpdate):
    """``training``: a FedAvg-family handler, ``(params, tensors) -> (body with n, trained tensors)``."""

    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, training,
                 sessions: SecAggSessions | None = None, noise_rng: np.random.Generator | None = None,
                 kind: str = SECURE_FEDAVG_KIND):
        super().__init__(identity, aggregator_public_key, sessions, noise_rng)
        self.training, self.kind = training, kind     # kind: the wire kind served, named in a decline

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        secure = read_params(SecureUpdateRound, params, self.kind)
        self.check_samples(secure)
        with state_restored_on_decline(self.training, params, self.kind):
            body, trained = self.training(params, tensors)      # the plain handler reads the plain kind's params
            if secure.dp is not None:
                return self.dp_vector(secure.dp, self.order(secure, trained), trained, tensors)
            return pack_weighted(self.bounded(secure, body, trained, tensors), self.order(secure, trained), body["n"])

    def check_samples(self, secure: SecureUpdateRound) -> None:
        """A stateful handler (Scaffold, Ditto, pp: n is its local sample count) declined before it
        runs and keeps its state: a device with more samples than the round's bound can never be
        summed, and must not advance its c_k / v_k round after round while declining. The others
        are checked on the n they trained on (``bounded``)."""
        if not isinstance(self.training, StatefulHeadTask):
            return
        n = len(self.training.labels)
        if n > secure.max_samples:
            raise TaskDeclined(f"{n} local samples exceed the round's bound of {secure.max_samples}")

    @staticmethod
    def order(secure: SecureUpdateRound, trained: dict[str, np.ndarray]) -> list[str]:
        """The task's vector order, declined unless it names exactly the tensors the device trained."""
        order = list(secure.vector_order)
        if sorted(order) != sorted(trained):
            raise TaskDeclined(f"vector_order {order!r} does not name exactly the trained tensors {sorted(trained)}")
        return order

    def bounded(self, secure: SecureUpdateRound, body: dict, trained: dict[str, np.ndarray],
                tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The trained tensors as they enter the sum (bounded influence's clip applied), declined
        when the samples or an entry break the round's bounds."""
        n, limit = body["n"], float(secure.max_abs_param)
        if n > secure.max_samples:
            raise TaskDeclined(f"{n} local samples exceed the round's bound of {secure.max_samples}")
        if secure.update_clip_norm:     # bounded influence: the server checks the group's sum against n·C
            clipped = self.clipped_delta(secure.update_clip_norm, trained, tensors)
            trained = {k: np.asarray(tensors[k], np.float64) + clipped[k] for k in trained}
        largest = max(float(np.abs(t).max()) for t in trained.values())
        if largest > limit:
            raise TaskDeclined(f"trained model has |θ| = {largest:.3g} > the round's bound {limit:g}")
        return trained

    def dp_vector(self, dp: DpRound, order: list, trained: dict[str, np.ndarray],
                  start: dict[str, np.ndarray]) -> np.ndarray:
        """Distributed DP-FedAvg: [clip(θ_k − θ_t) | 1] plus this device's share of noise; devices are
        unweighted (n_k would make the sensitivity data-dependent), the server divides by κ. With
        the round's ``clip_bit_scale`` s (adaptive clipping): [clip(θ_k − θ_t) | (b_k − ½)·s | 1],
        b_k = 1[‖θ_k − θ_t‖ ≤ C], the bit noised as the update (``distributed_dp.clip_bit``)."""
        clipped, norm = self.clipped_delta_and_norm(dp.clip_norm, trained, start)
        vector = pack_weighted(clipped, order, 1)
        if dp.clip_bit_scale is not None:
            vector = np.insert(vector, len(vector) - 1, clip_bit(norm, dp.clip_norm, dp.clip_bit_scale))
        return self.add_noise(vector, dp)


class SecureScaffoldTraining(SecureFedAvgTraining):
    """``scaffold.head.secure`` around ``scaffold.head``'s handler (which keeps c_k in the device's
    store, as in plain rounds): contributes ``[n·y | clip(Δc) | n]`` (``pack_controlled``), Δc
    clipped to the task's ``control_clip_norm`` as the plain server clips it."""

    round_type = SecureControlRound

    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, training,
                 sessions: SecAggSessions | None = None, noise_rng: np.random.Generator | None = None,
                 kind: str = SECURE_SCAFFOLD_KIND):
        super().__init__(identity, aggregator_public_key, training, sessions, noise_rng, kind)

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        secure = read_params(SecureControlRound, params, self.kind)
        self.check_samples(secure)
        with state_restored_on_decline(self.training, params, self.kind):
            body, out = self.training(params, tensors)
            trained = {k: v for k, v in out.items() if not k.startswith(DELTA_CONTROL)}
            deltas = {k[len(DELTA_CONTROL):]: v for k, v in out.items() if k.startswith(DELTA_CONTROL)}
            order = self.order(secure, trained)
            if sorted(deltas) != sorted(trained):
                raise TaskDeclined(f"the control deltas {sorted(deltas)} are not those of the trained tensors")
            clipped, _ = clip_update(deltas, secure.control_clip_norm)
            return pack_controlled(self.bounded(secure, body, trained, tensors), clipped, order, body["n"])

    def round_end(self, params: dict) -> RoundEnd | None:
        """The plain handler keeps c_k⁺ as it trains, before the round decides whether this device's
        masked input is summed; the server's c counts its Δc only if it is. A round that ends here
        without FINISHED (aborted, declared dropped, past its deadline, pushed out, its answer
        unsendable) puts the job's entry back to what it was before this task (the c_k, run and
        round it started from; none: dropped), so c stays the mean of the devices' c_k and the next
        task measures Δc from that c_k. Only this round's own entry is put back: one a later task
        wrote is left alone."""
        training = self.training
        if not isinstance(training, StatefulHeadTask) or training.store is None:
            return None         # no state kept: the plain handler declines the task
        p = read_params(training.params_type, params, self.kind)
        store, binding = training.store, p.state
        before = store.load(p.job_id, None)

        def ended(summed: bool) -> None:
            if summed:
                return
            now = store.load(p.job_id, None)
            if now is None or (now.run, now.round) != (binding.run, binding.round):
                return          # not this round's entry (never kept, expired, or a later task's)
            log.info("secure round %s of %s ended without this device's input summed: its c_k put back",
                     binding.round, p.job_id)
            put_back(store, p.job_id, before)
        return ended


def state_restored_on_decline(training, params: dict, kind: str):
    """A secure wrapper's contribution from a stateful handler (one that saves its c_k / v_k before
    its result goes out): a device that then declines (its trained head beyond the round's |θ|
    bound, a vector order it cannot follow) or fails sends nothing, so the job's entry goes back to
    what it was (:meth:`DeviceStateKeeper.state_put_back_on_failure`, as for the plain kinds). A
    handler that keeps no state passes."""
    if not isinstance(training, DeviceStateKeeper):
        return nullcontext()
    return training.state_put_back_on_failure(params, kind)


__all__ = ["SecureFedAvgTraining", "SecureScaffoldTraining"]

