"""A plain LADD job as the coordinator of K shards serves it: the phases, the clustering, the rounds,
the teachers and the model are the job's own; each training round's sums are the shards'.

:class:`ShardedLaddJob` wraps a freshly built ``ladd`` job. Style results reach it whole (the
devices' shards forward them: a style is a few hundred floats, and KMeans is not a sum), so the
style phase runs here exactly as in one aggregator. A training result reaches it as its shard's
receipt (``shard.py``): the coordinator checks the receipt's cluster against the assignment it
alone holds, admits it to the open round by the job's own rule and records what the job keeps
(never a tensor). At the round's close it asks the shards, in phases (``ladd_sums.py``): each
bound layer's statistic of every accepted update, per slot (φ, θ_c), the limits decided slot by
slot on all of them; then their subtree sums of the bounded, weighted updates. It adds those up
the fixed tree and hands the job the round's new (φ, {θ_c}), which the job closes the round on
(teachers, SWA, the round log) as one aggregator does on its own updates: the same bits.

Restarts: the job is checkpointed at each round close as one aggregator's is; a round open at a
crash is rebuilt from the coordinator's store, which keeps its receipts (and the styles it took
itself), and closed on the sums of the shards' stores.
"""

from __future__ import annotations

from protocols.envelope import Envelope, EnvelopeError, body_field
from protocols.payloads.ladd import KIND_STYLE
from protocols.rounds import RoundClosed

from aggregator.jobs.ladd import RoundPayload
from aggregator.shards.coordinated_job import RoundSumsCoordinator
from aggregator.shards.ladd_sums import LaddRoundContext, round_model
from aggregator.shards.shard import RECEIPT
from aggregator.shards.sum_tree import PartialSum, root_sum


class ShardedLaddJob(RoundSumsCoordinator):
    # round_accepted: device -> (message id, cluster)

    # styles whole, training results as receipts: a training round's payload is (message id, receipt)
    def parse_result(self, env: Envelope) -> RoundPayload:
        if RECEIPT not in env.body:
            if self.inner.kind == KIND_STYLE:
                return self.inner.parse_result(env)         # forwarded by the device's shard
            raise EnvelopeError("a sharded LADD job takes its training results from its shards' receipts only")
        kept = self.receipt(env)
        self.sums.check_receipt(self.inner, env.sender, kept)
        return RoundPayload(body_field(env, "round", int), body_field(env, "kind", str), (env.id, kept))

    def apply(self, device: str, result: RoundPayload) -> None:
        if result.kind == KIND_STYLE:
            self.inner.apply(device, result)
        elif self.inner.admits(device, result.round, result.kind):
            message_id, kept = result.payload
            self.round_accepted[device] = (message_id, int(kept["cluster"]))
            self.sums.record(self.inner, device, kept)

    # the round's close: a training round's model from the shards' sums
    def close_round(self, closed: RoundClosed) -> None:
        inner = self.inner
        if not inner.closes(closed.round):
            return
        if inner.kind == KIND_STYLE:       # the coordinator's own; the shards drop what they stored for it
            inner.close_round(closed)
            self.round_done(closed.round, [])
            return
        accepted = self.accepted_ids()
        clusters = [cluster for _mid, cluster in self.round_accepted.values()]
        model = round_model(inner, clusters, self._statistics(accepted), self._root(accepted))
        per_cluster = {c: clusters.count(c) for c in sorted(set(clusters))}
        inner.take_round_model(model, per_cluster)
        inner.close_round(closed)
        self.round_done(closed.round, accepted)

    def _statistics(self, accepted: list[tuple[str, str]]):
        def statistics(context: LaddRoundContext) -> dict[str, dict[str, float]]:
            return self.pool.ask("statistics", self.config.job_id, accepted, context) if accepted else {}
        return statistics

    def _root(self, accepted: list[tuple[str, str]]):
        def root(context: LaddRoundContext) -> PartialSum | None:
            return root_sum(self.sums, self.pool.ask("sums", self.config.job_id, accepted, context)) if accepted else None
        return root
