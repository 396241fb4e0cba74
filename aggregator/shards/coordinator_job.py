"""The job as the coordinator of K shards serves it: the round rules and the scheduling are the
job's own; the sums are the shards'.

:class:`ShardedJob` wraps a freshly built order-free job (Fed3R). Its results are the shards'
receipts (``shard.py``): applying one records what the device contributed and the accepted
(device, message id) — never a tensor; the kind's checks against the job's state run on the
receipt first (``check_receipt``: where a streaming increment starts). Its model is the shards'
node sums over exactly those ids, reduced in the canonical tree (``partial_sums.py``), so it
equals one aggregator's bit for bit; it is recomputed only when the accepted set grew (each shard
re-sums only the buckets that changed).
The accepted ids are what its state restores: checkpointed at each round close (beside the reduced
sums, for the reader), replayed from the coordinator's store (which keeps the receipts) after a
restart, exactly like any job's contributions.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from protocols.envelope import Envelope
from protocols.rounds import RoundClosed

from aggregator.jobs.base import Job
from aggregator.shards.coordinated_job import CoordinatedJob
from aggregator.shards.partial_sums import PartialSum, additive

# (kind, config, job id, accepted (device, message id)s) -> the reduced job
Reducer = Callable[[str, dict, str, list[tuple[str, str]]], Job]
# (job id, round, accepted (device, message id)s, earlier): the shards delete that round's (and with
# ``earlier`` every earlier round's) other rows
RoundClosedHook = Callable[[str, int, list[tuple[str, str]], bool], None]
ACCEPTED = "shard_accepted"         # the state's one array: "device\tmessage id" per accepted receipt


class ShardedJob(CoordinatedJob):
    order_free = False              # the reduction is canonical already: nothing to re-sum at the end

    def __init__(self, inner: Job, kind: str, reduce: Reducer, round_closed: RoundClosedHook | None = None):
        super().__init__(inner, kind)
        self._reduce, self._round_closed = reduce, round_closed
        self.accepted: list[tuple[str, str]] = []
        self._model: tuple[int, Job] | None = None      # (len(accepted) it holds, the reduced job)

    @property
    def contributions(self) -> int:
        return len(self.accepted)

    def close_round(self, closed: RoundClosed) -> None:
        self.inner.close_round(closed)
        if self._round_closed is not None:      # every round's accepted ids: earlier rounds' orphans go too
            self._round_closed(self.config.job_id, closed.round, list(self.accepted), True)

    # receipts in place of results
    def parse_result(self, env: Envelope) -> tuple[str, Any]:
        kept = self.receipt(env)
        additive(self.kind_name).check_receipt(self.inner, env.sender, kept)    # streaming: where it starts
        return env.id, kept

    def apply(self, device: str, payload: tuple[str, dict]) -> None:
        message_id, kept = payload
        additive(self.kind_name).record(self.inner, device, kept)     # (refuses a repeat the job does not take)
        self.accepted.append((device, message_id))

    def screened_devices(self) -> dict[str, str]:
        """The job's fleet screen over the energies the receipts carried: the service quarantines
        those devices and rebuilds this job from its store without their receipts."""
        return self.inner.screened_devices()

    # the model: the shards' sums, reduced
    def reduced(self) -> Job:
        if self._model is None or self._model[0] != len(self.accepted):
            job = self._reduce(self.kind_name, self.config.to_dict(), self.config.job_id, list(self.accepted))
            job.round = self.inner.round
            self._model = (len(self.accepted), job)
        return self._model[1]

    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        return self.reduced().evaluate(features, labels)

    def model_arrays(self) -> dict[str, np.ndarray]:
        return self.reduced().model_arrays()

    def state_dict(self) -> dict[str, np.ndarray]:
        """The reduced sums (what ``statistics.npz`` shows, as one aggregator's would) and the
        accepted ids (all a restart needs: the sums are the shards')."""
        return {**self.reduced().state_dict(), ACCEPTED: self._accepted_ids()}

    def _accepted_ids(self) -> np.ndarray:
        return np.array([f"{d}\t{m}" for d, m in self.accepted], dtype=str)

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.accepted = [tuple(str(x).split("\t", 1)) for x in state[ACCEPTED]]
        self._model = None


# (job id, the round's accepted (device, message id)s) -> the root of the shards' sums of them (None: none)
RoundRoot = Callable[[str, list[tuple[str, str]]], PartialSum | None]


class ShardedOwnModelJob(ShardedJob):
    """A job on shards whose model is the wrapped job's own, never a reduction over the shards: its
    receipts carry all it keeps of a contribution (personalization: a device's held-out counts,
    ``AdditiveState.model_from_receipts``), so the shards validate and store and sum nothing. The
    checkpoint is the job's state and the accepted ids."""

    def __init__(self, inner: Job, kind: str, round_closed: RoundClosedHook | None = None):
        super().__init__(inner, kind, lambda *_: inner, round_closed)

    @property
    def contributions(self) -> int:
        return self.inner.contributions

    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        return self.inner.evaluate(features, labels)

    def model_arrays(self) -> dict[str, np.ndarray]:
        return self.inner.model_arrays()

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**self.inner.state_dict(), ACCEPTED: self._accepted_ids()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.inner.load_state_dict(state)
        super().load_state_dict(state)


class ShardedNoisyRoundsJob(ShardedOwnModelJob):
    """A job released in noisy round sums (``canonical_round_sums``: DP Fed3R) on shards. Receipts are
    recorded as for an order-free job; at each round's close the shards sum that round's accepted
    statistics up the canonical tree (``fed3r_sums.round_sum`` per bucket) and the job takes the
    root (``take_round_sum``) before its own close noises it: the release one aggregator makes of its
    stored round (``aggregator/service/canonical.py``), bit for bit. The model is the job's released
    sums (the contributions counted: the released ones, not the center round's, not the open round's)."""

    def __init__(self, inner: Job, kind: str, round_root: RoundRoot, round_closed: RoundClosedHook | None = None):
        super().__init__(inner, kind, round_closed)
        self._round_root = round_root
        self._round_from = 0            # accepted[_round_from:] are the open round's

    def close_round(self, closed: RoundClosed) -> None:
        ids = self.accepted[self._round_from:]
        root = self._round_root(self.config.job_id, ids) if ids else None
        self.inner.take_round_sum(None if root is None else root.state)
        super().close_round(closed)
        self._round_from = len(self.accepted)

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        self._round_from = len(self.accepted)
