"""The held-out WMA of a job whose devices keep a personal model (``pp.head``, ``ditto.head``).

Each accepted result carries a :class:`~protocols.payloads.partial.PersonalReport`: on the
device's held-out split, how many its personal model and the task's global model get right. The
job keeps each device's latest report and reports the sample-weighted mean accuracy (WMA, the
Fed3R paper's "weighted accuracy") of both: ``personal_wma`` (each device with its own model)
and ``global_wma``. The reports travel in the round bookkeeping, so a restarted job reports the
same WMA.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.payloads.partial import PersonalReport

from aggregator.compute.evaluation import weighted_mean_accuracy
from aggregator.jobs.base import JobConfig
from aggregator.jobs.config_limits import Range, limited
from aggregator.strategies.robust_fedavg import WeightBound


@dataclass
class HeldoutReportFields(JobConfig):
    # each device's claimed n_test weighs at most this x the reports' median (0: as claimed); its
    # own setting, not the model's weight bound: a job averaging its model plainly (PLAIN_MEAN)
    # had its WMA taken over by one device claiming n_test = 10^9 (a review's finding)
    heldout_weight_bound_multiplier: float = limited(10.0, Range(0, 1e6))


class PersonalWmaJob:
    """Mixin, before the job class it extends (``class DittoJob(PersonalWmaJob, StatefulDevicesJob,
    FedAvgJob)``); the job's round updates have a ``report`` (:class:`PersonalReport`)."""

    heldout: dict[str, tuple[int, int, int]]        # device -> (n_test, correct, correct_global), latest

    def __init__(self, *args, **kwargs):
        self.heldout = {}
        super().__init__(*args, **kwargs)

    def apply(self, device: str, payload) -> None:
        accepted = payload.round == self.round and device not in self._updates
        super().apply(device, payload)
        report: PersonalReport = payload.update.report
        if accepted and device in self._updates:
            self.record_heldout(device, report.n_test, report.correct, report.correct_global)

    def record_heldout(self, device: str, n_test: int, correct: int, correct_global: int) -> None:
        """An accepted update's held-out counts, the device's latest (a device with no held-out
        split reports none). A sharded job's coordinator records them from the shards' receipts."""
        if n_test:
            self.heldout[device] = (int(n_test), int(correct), int(correct_global))

    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        """The job's own report plus the held-out WMA with each device's personal model and with the global one."""
        out = super().evaluate(features, labels)
        if self.heldout and self.config.dp:
            # exact counts from each device's own data: outside what DP noises, so never released
            out["heldout_wma"] = "withheld: the devices' held-out counts are not covered by the job's DP"
        elif self.heldout:
            reports = [self.heldout[d] for d in sorted(self.heldout)]
            totals = [n for n, _, _ in reports]
            weights = bounded_weights(totals, self.config.heldout_weight_bound_multiplier)
            out["personal_wma"] = bounded_wma([c for _, c, _ in reports], totals, weights)
            out["global_wma"] = bounded_wma([g for _, _, g in reports], totals, weights)
            out["heldout_devices"] = len(reports)
        return out

    def bookkeeping(self) -> dict:
        """With the held-out reports of the rounds closed so far (JSON, stored at each round open):
        a restarted job reports the same WMA; the open round's reports come back with its replay."""
        return {**super().bookkeeping(), "heldout": {d: list(r) for d, r in sorted(self.heldout.items())}}

    def restore_bookkeeping(self, state: dict) -> None:
        super().restore_bookkeeping(state)
        stored = {str(d): tuple(int(x) for x in r) for d, r in (state.get("heldout") or {}).items()}
        self.heldout = {**stored, **self.heldout}       # reports replayed into the open round are newer


def bounded_weights(totals: list[int], multiplier: float) -> list[float] | None:
    """Each device's held-out count capped at ``multiplier`` × the reports' median (the job's weight
    bound, ``WeightBound``), or None when no cap binds (or the bound is off): the count is the
    device's own claim, and one device reporting n_test = 10^9 made both WMAs its own accuracy."""
    limit = WeightBound(multiplier).limit(totals) if multiplier else 0.0
    if not limit or max(totals) <= limit:
        return None
    return [min(float(n), limit) for n in totals]


def bounded_wma(correct: list[int], totals: list[int], weights: list[float] | None) -> float:
    """The WMA Σ correct / Σ n, or with ``weights`` Σ w·(correct/n) / Σ w (each device's accuracy
    at its bounded weight)."""
    if weights is None:
        return weighted_mean_accuracy(correct, totals)
    return float(sum(w * c / n for w, c, n in zip(weights, correct, totals)) / sum(weights))
