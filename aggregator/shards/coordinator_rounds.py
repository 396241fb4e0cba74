"""A FedAvg-family job as the coordinator of K shards serves it: the rounds, the participants, the
server step and the model are the job's own; each round's sum is the shards'.

:class:`ShardedRoundsJob` wraps a freshly built job whose ``shard_sums`` are round sums
(``fedavg``, ``pp``, ``scaffold``, ...). Its results are the shards' receipts (``shard.py``):
applying one admits it to the open round by the job's own rule (the round it names, a
participant, once) and records its sample count: never a tensor. At the
round's close it asks the shards, in phases (``fedavg_sums.py``): each bound layer's statistic of
every accepted update (the coordinator decides the layer's limit on all of them), then their
subtree sums of the bounded, weighted updates; it adds those up the fixed tree, divides, and the
job takes its server step (history, FedAvg / FedAvgM / FedOpt; FedGloSS's own) on that mean,
exactly as one aggregator does on its own updates: the same bits. The updates are measured from
the point the devices trained from (``round_start``: FedGloSS's w̃), and whatever else the root
sums the kind takes before the step (``take_round``: Scaffold's Σ Δc_k moving its control c).

Restarts: the job's state is checkpointed at each round close as one aggregator's is (the model,
the server optimizer's state); a round open at a crash is rebuilt from the coordinator's store,
which keeps its receipts, and closed on the sums of the shards' stores.
"""

from __future__ import annotations

import numpy as np

from protocols.envelope import Envelope, body_field
from protocols.rounds import RoundClosed

from aggregator.jobs.base import Job
from aggregator.shards.coordinated_job import RoundSumsCoordinator
from aggregator.shards.fedavg_sums import RoundContext, dp_round_step, round_mean
from aggregator.shards.sum_tree import PartialSum, root_sum
from aggregator.strategies.small_round_reference import SmallRoundReference


class ShardedRoundsJob(RoundSumsCoordinator):
    def __init__(self, inner: Job, kind: str, pool):
        super().__init__(inner, kind, pool)
        self.layers = self.sums.round_layers(inner)     # round_accepted: device -> (message id, n_k)

    # receipts in place of results
    def parse_result(self, env: Envelope) -> tuple[str, int, dict]:
        return env.id, body_field(env, "round", int), self.receipt(env)

    def apply(self, device: str, payload: tuple[str, int, dict]) -> None:
        message_id, round_, kept = payload
        if self.inner.admits(device, round_, self.round_accepted):
            self.round_accepted[device] = (message_id, int(kept["n"]))
            self.sums.record(self.inner, device, kept)

    # the round's close: the shards' sums
    def close_round(self, closed: RoundClosed) -> None:
        if not self.inner.closes(closed.round):
            return
        accepted = self.accepted_ids()
        samples = sum(n for _mid, n in self.round_accepted.values())
        if self.inner.dp is not None:        # the shards' clipped deltas, noised once here
            stepped = (dp_round_step(self.inner.dp, self._round_start(), self._root(accepted)), len(accepted), samples)
        else:
            mean, total, held = self._round_mean(accepted) if accepted else (None, None, ())
            self.sums.take_round(self.inner, total, len(accepted), held)        # Scaffold: its control step
            stepped = self.inner.server_step(mean, len(accepted) if mean is not None else 0, samples)
        self.inner.finish_round(closed, stepped)
        self.round_done(closed.round, accepted)

    def _round_start(self) -> dict[str, np.ndarray]:
        """The trained tensors as the round's devices got them (FedGloSS: w̃)."""
        start = self.inner.round_start()
        return {name: start[name] for name in self.inner.trained_shapes()}

    def _root(self, accepted: list[tuple[str, str]]):
        """context -> the root of the shards' subtree sums of the ``accepted`` updates (None: none)."""
        def root(context: RoundContext) -> PartialSum | None:
            return root_sum(self.sums, self.pool.ask("sums", self.config.job_id, accepted, context)) if accepted else None
        return root

    def _round_mean(self, accepted: list[tuple[str, str]]
                    ) -> tuple[dict[str, np.ndarray] | None, PartialSum | None, tuple[SmallRoundReference, ...]]:
        """(the round's mean, the root of the tree it was divided from, the references that held it)."""
        def statistics(context: RoundContext) -> dict[str, float]:
            return self.pool.ask("statistics", self.config.job_id, accepted, context)

        # the job's references for rounds of fewer than three updates (the model's; Scaffold's Δc
        # bound's): bounded by them and closed into them here as one aggregator's job does
        # (SmallRoundReference, in its checkpoint)
        return round_mean(self.layers, self._round_start(), statistics, self._root(accepted),
                          self.sums.references(self.inner))
