"""What every job served by a shard coordinator shares: the wrapped job's own scheduling (its
round, participants, tasks, end and bookkeeping) and results that are its shards' receipts,
never a device's tensors. :class:`~aggregator.shards.coordinator_job.ShardedJob` (order-free
sums: Fed3R) and :class:`~aggregator.shards.coordinator_rounds.ShardedRoundsJob` (round sums:
FedAvg) differ in what a receipt adds to and how the model is reduced."""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.envelope import Envelope, EnvelopeError

from aggregator.jobs.base import Job
from aggregator.shards.shard import RECEIPT


class CoordinatedJob(Job):
    evaluate_at_round_close = True  # a model is a reduction over the shards: once per round

    def __init__(self, inner: Job, kind: str):
        self.inner, self.kind_name = inner, kind
        self.config = inner.config

    # the job's own scheduling
    kind = property(lambda self: self.inner.kind)
    round = property(lambda self: self.inner.round)
    contributed = property(lambda self: self.inner.contributed,
                           lambda self, value: setattr(self.inner, "contributed", value))

    def next_participants(self, online: set[str]) -> list[str]:
        return self.inner.next_participants(online)

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        return self.inner.task_for(device)

    def finished(self, online: set[str], known: set[str]) -> bool:
        return self.inner.finished(online, known)

    def bookkeeping(self) -> dict:
        return self.inner.bookkeeping()

    def restore_bookkeeping(self, state: dict) -> None:
        self.inner.restore_bookkeeping(state)

    # the model: the job's (a coordinator whose model is a reduction over the shards overrides these)
    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        return self.inner.evaluate(features, labels)

    def model_arrays(self) -> dict[str, np.ndarray]:
        return self.inner.model_arrays()

    def state_dict(self) -> dict[str, np.ndarray]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    @staticmethod
    def receipt(env: Envelope) -> dict[str, Any]:
        """What the shard kept of the device's result (EnvelopeError: not a shard's receipt)."""
        receipt = env.body.get(RECEIPT)
        if not isinstance(receipt, dict) or not isinstance(receipt.get("job"), dict):
            raise EnvelopeError("a sharded job takes its results from its shards' receipts only")
        return receipt["job"]
