"""What the device's stateful head tasks (``pp.head``, ``scaffold.head``, ``fedgloss.head``, ``ditto.head``) share: reading a task
that carries a global head and a state binding, the device's features, the state store's answer.

Both train the linear head with the numpy step (``edge_client.tasks.numpy_head``) on every
device, torch or not: the same float32 arithmetic everywhere, and nothing a torch-free device
lacks. Each keeps its per-job state in the device's :class:`~edge_client.state.DeviceStateStore`
and writes it *before* the result goes out, with the stored value it started from: a task
redelivered for the same round (the device was killed before its result was acknowledged) starts
again from that value, so a redelivery computes the same result instead of training twice. A round
that started fresh (no usable state: the start is a function of the task alone, zeros or the task's
global head) stores no start value, so its redelivery starts fresh again, from the same task, and
reports ``restarted`` as the first delivery did.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocols.payloads.partial import PersonalReport
from protocols.payloads.stateful import StateBinding, StatefulHeadParams

from ..agent import TaskDeclined
from ..state import DeviceStateStore, StateBudgetExceeded, StateEntry, state_bytes
from .extractors import ExtractorFactory
from .task_inputs import check_global_head, check_local_labels, extractor_of_dim, local_samples
from .params import read_params

PREVIOUS = "previous."          # the stored value a round started from (redelivery starts there again)
# the stored value a restarted round replaced (a state too stale to start from): Scaffold measures
# Δc from it, and a redelivery of that round from the same value
REPLACED = "replaced."


@dataclass(frozen=True)
class HeadTask:
    """A validated stateful head task: its params, the job, its head, the state binding, the local features."""

    params: StatefulHeadParams
    job_id: str
    weight: np.ndarray
    bias: np.ndarray
    binding: StateBinding
    features: np.ndarray
    holdout: np.ndarray | None


@dataclass(frozen=True)
class StateKey:
    """Where a task's state lives in the store: its job and the binding (a :class:`HeadTask` is one too)."""

    job_id: str
    binding: StateBinding


class DeviceStateKeeper:
    """The state store's side of a stateful task (``self.store``), shared by the head tasks and
    Scaffold on the tail (``edge_client/tasks/scaffold_tail.py``): the budget check, the value a
    round starts from (with the staleness and redelivery rules) and the write before the result goes out."""

    store: DeviceStateStore | None
    kind = ""
    params_type: type = StatefulHeadParams      # the kind's declared params (they name the job)

    @contextmanager
    def state_put_back_on_failure(self, params: dict[str, Any], kind: str | None = None):
        """The task run, and its result built and encoded, within: the handler saves the round's
        state before its result goes out, and a task that then sends nothing (declined, failed,
        stopped past its deadline, its result too large to send, a secure wrapper's decline) puts the
        job's entry back to what it was, so the server's state never counted a step the device
        never sent (Scaffold's c = mean c_k stays true) and the next round starts where this one
        did. The agent (edge_client/agent.py KeepsState) and the secure wrappers use it; ``kind``:
        the wire kind named in a decline (default the handler's)."""
        if self.store is None:
            yield
            return
        job_id = read_params(self.params_type, params, kind or self.kind).job_id
        before = self.store.load(job_id, None)
        try:
            yield
        except BaseException:   # any failure sends nothing: a declined task, one whose result could not be built, or
            # a BaseException of the application's (the agent declines it and goes on: message_loop.ENDS_THE_LOOP)
            put_back(self.store, job_id, before)
            raise                       # the decline, whatever the store did (as Java's putBack)

    def require_store(self) -> None:
        if self.store is None:
            raise TaskDeclined(f"{self.kind} keeps state on the device and this device has no state store "
                               "(fedfleet device --state-dir)")

    def admit(self, task: StateKey | HeadTask, state: dict[str, np.ndarray]) -> None:
        """Decline unless the job's state (kept twice: the value and the one it started from) fits."""
        try:
            self.store.admit(task.job_id, 2 * state_bytes(state))
        except StateBudgetExceeded as exc:
            raise TaskDeclined(str(exc)) from exc

    def start_value(self, task: StateKey | HeadTask, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
        """The stored state this round starts from, or None (none, another run's, stale, malformed).
        A task of the round the state was written at (a redelivery) starts from what that round started
        from. A task of an earlier round than the state's is declined: an old task (replayed, or one
        that lost its way) would start afresh and its state replace the newer one (a review's
        finding: a re-published round-1 task rolled a device's personal part back from round 6)."""
        return self.stored_values(task, shapes)[0]

    def stored_values(self, task: StateKey | HeadTask, shapes: dict[str, tuple[int, ...]]
                      ) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
        """(:meth:`start_value`, and for a round that starts fresh the state it replaces), from one
        read of the store. The replaced state is the stored value itself when it was too stale to
        start from, or, for a redelivery of the round, what the first delivery replaced; None when
        there is none (never stored, dropped, expired, another run's). Scaffold's Δc is measured
        from it: the server's c still counts that c_k, and c stays the mean of the devices'
        controls only if the new c_k replaces it there too (a review's finding: measured from 0, c
        drifted, 0.83 of its norm in 16 rounds of N = 4)."""
        b = task.binding
        entry = self.store.load(task.job_id, b.run)
        if entry is None:
            return None, None
        if entry.round > b.round:
            raise TaskDeclined(f"this device holds the job's state of round {entry.round}, later than the task's "
                               f"round {b.round}: an older round is not run (its state would replace the newer one)")
        redelivery = entry.round == b.round
        start = None if entry.too_stale_for(b.round, b.max_staleness) else _checked(entry.arrays, PREVIOUS if redelivery else "", shapes)
        if start is not None:
            return start, None
        return None, _checked(entry.arrays, REPLACED if redelivery else "", shapes)

    def keep(self, task: StateKey | HeadTask, stored: dict[str, np.ndarray] | None,
             now: dict[str, np.ndarray], replaced: dict[str, np.ndarray] | None = None) -> None:
        """Store this round's state before the result goes out, with ``stored`` (the stored value the
        round started from, :meth:`start_value`'s answer; None when it started fresh) and, for a
        round that started fresh, ``replaced`` (:meth:`stored_values`' second answer)."""
        arrays = {**{name: np.asarray(v, np.float32) for name, v in now.items()},
                  **{PREVIOUS + name: np.asarray(v, np.float32) for name, v in (stored or {}).items()},
                  **{REPLACED + name: np.asarray(v, np.float32) for name, v in (replaced or {}).items()}}
        try:
            self.store.save(task.job_id, task.binding.run, task.binding.round, arrays, task.binding.ttl_s)
        except StateBudgetExceeded as exc:
            raise TaskDeclined(str(exc)) from exc


def put_back(store: DeviceStateStore, job_id: str, before: StateEntry | None) -> None:
    """The job's entry back to ``before`` (what ``store.load`` gave before the task; None: none)."""
    try:
        if before is None:
            store.drop(job_id)
        else:
            store.restore(before)
    except (StateBudgetExceeded, OSError):
        store.drop(job_id)      # the old entry cannot be written back: start fresh rather than drift


def _checked(arrays: dict[str, np.ndarray], prefix: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """The stored arrays ``prefix + name``, each finite float32 of its shape, or None."""
    value = {name: arrays.get(prefix + name) for name in shapes}
    if any(v is None or v.shape != shape or v.dtype != np.float32 or not np.isfinite(v).all()
           for (name, shape), v in zip(shapes.items(), value.values())):
        return None
    return value


class StatefulHeadTask(DeviceStateKeeper):
    """Base of the stateful head handlers: local data, features, the state store (None: the
    device keeps no state and declines)."""

    kind = ""

    def __init__(self, images: np.ndarray, labels: np.ndarray, extractor_factory: ExtractorFactory,
                 store: DeviceStateStore | None, holdout_images: np.ndarray | None = None,
                 holdout_labels: np.ndarray | None = None):
        self.images, self.labels = local_samples(images, labels)
        self.holdout_images = holdout_images
        self.holdout_labels = None if holdout_labels is None else np.asarray(holdout_labels, dtype=np.int64)
        self.extractor_factory, self.store = extractor_factory, store

    def read(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None) -> HeadTask:
        """The task's inputs, checked; TaskDeclined with the reason otherwise."""
        self.require_store()
        if len(self.images) == 0:
            raise TaskDeclined("no local training data")
        p = read_params(self.params_type, params, self.kind)
        num_classes, feature_dim = p.model.num_classes, p.feature_dim
        tensors = tensors or {}
        weight, bias = np.asarray(tensors.get("weight")), np.asarray(tensors.get("bias"))
        if weight.shape != (num_classes, feature_dim) or bias.shape != (num_classes,) \
                or weight.dtype != np.float32 or bias.dtype != np.float32:
            raise TaskDeclined(f"{self.kind} task must carry float32 weight ({num_classes}, {feature_dim}) "
                               f"and bias ({num_classes},)")
        check_global_head(weight, bias)
        check_local_labels(self.labels, num_classes)
        extractor = extractor_of_dim(self.extractor_factory, p.model, feature_dim)
        features = extractor.extract(self.images)
        holdout = None
        if self.holdout_labels is not None and len(self.holdout_labels) \
                and self.holdout_labels.max() < num_classes and self.holdout_labels.min() >= 0:
            holdout = extractor.extract(self.holdout_images)
        return HeadTask(p, p.job_id, weight, bias, p.state, features, holdout)

    def personal_report(self, task: HeadTask, personal: dict[str, np.ndarray], restarted: bool) -> PersonalReport:
        """The held-out counts with the device's personal head and with the task's global head."""
        n_test = 0 if task.holdout is None else len(self.holdout_labels)
        return PersonalReport(n_test,
                              holdout_correct(personal["weight"], personal["bias"], task.holdout, self.holdout_labels),
                              holdout_correct(task.weight, task.bias, task.holdout, self.holdout_labels), restarted)


def holdout_correct(weight: np.ndarray, bias: np.ndarray, features: np.ndarray | None,
                    labels: np.ndarray | None) -> int:
    if features is None:
        return 0
    return int(((features @ weight.T + bias).argmax(axis=1) == labels).sum())
