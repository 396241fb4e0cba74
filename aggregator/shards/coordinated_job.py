"""What every job served by a shard coordinator shares: the wrapped job's own scheduling (its
round, participants, tasks, end and bookkeeping) and results that are its shards' receipts,
never a device's tensors. :class:`~aggregator.shards.coordinator_job.ShardedJob` (order-free
sums: Fed3R) and the :class:`RoundSumsCoordinator` s (each round's sums: FedAvg's
``ShardedRoundsJob``, LADD's ``ShardedLaddJob``) differ in what a receipt adds to and how the
model is reduced."""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.envelope import Envelope, EnvelopeError

from aggregator.jobs.base import Job
from aggregator.shards.partial_sums import additive
from aggregator.shards.shard import RECEIPT


class CoordinatedJob(Job):
    evaluate_at_round_close = True  # a model is a reduction over the shards: once per round

    def __init__(self, inner: Job, kind: str):
        self.inner, self.kind_name = inner, kind
        self.config = inner.config

    # the job's own scheduling
    kind = property(lambda self: self.inner.kind)
    round = property(lambda self: self.inner.round)
    waiting = property(lambda self: self.inner.waiting)
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

    def finalize(self) -> bool:
        return self.inner.finalize()

    @property
    def model_held(self) -> bool:
        return self.inner.model_held

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


class RoundSumsCoordinator(CoordinatedJob):
    """A coordinator whose model moves at each round's close by the shards' sums of that round's
    accepted updates: it keeps the open round's receipts (device -> what the close needs of it),
    and at each close the shards drop that round's orphans, and the round before's (a late result
    stored after its close)."""

    def __init__(self, inner: Job, kind: str, pool):
        super().__init__(inner, kind)
        self.pool = pool
        self.sums = additive(kind)
        self.round_accepted: dict[str, tuple] = {}          # device -> (message id, ...), open round
        self.last_close: tuple[int, list[tuple[str, str]]] | None = None   # (round, accepted) of the last close

    contributions = property(lambda self: self.inner.contributions)

    def next_participants(self, online: set[str]) -> list[str]:
        chosen = self.inner.next_participants(online)
        if chosen:
            self.round_accepted = {}
        return chosen

    # The last close rides in the round's bookkeeping (stored as the next round opens): a restarted
    # coordinator's next close still has the shards drop that round's late rows, stored after it.
    LAST_CLOSE = "shard_last_close"

    def bookkeeping(self) -> dict:
        book = self.inner.bookkeeping()
        if self.last_close is None:
            return book
        return {**book, self.LAST_CLOSE: [self.last_close[0], [list(pair) for pair in self.last_close[1]]]}

    def restore_bookkeeping(self, state: dict) -> None:
        state = dict(state)
        last_close = state.pop(self.LAST_CLOSE, None)
        before = self.inner.round
        self.inner.restore_bookkeeping(state)
        if self.inner.round != before:          # it entered the stored round: nothing applied to it yet
            self.round_accepted = {}
        if last_close is not None:
            self.last_close = (int(last_close[0]), [(str(d), str(m)) for d, m in last_close[1]])

    def accepted_ids(self) -> list[tuple[str, str]]:
        """The open round's accepted (device, message id)s, in device order."""
        return sorted((device, kept[0]) for device, kept in self.round_accepted.items())

    def round_done(self, round_: int, accepted: list[tuple[str, str]]) -> None:
        """After the job closed ``round_`` on the sums of ``accepted``: the shards drop its orphans."""
        self.pool.round_closed(self.config.job_id, round_, accepted)
        if self.last_close is not None:
            self.pool.round_closed(self.config.job_id, *self.last_close)
        self.last_close, self.round_accepted = (round_, accepted), {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.round_accepted = {}
