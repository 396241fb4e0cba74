"""How shards sum Fed3R: every array of its state adds elementwise (the kind's ``shard_sums`` in
``aggregator/jobs/registry.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.envelope import EnvelopeError, body_field
from protocols.payloads.fed3r import KIND

from aggregator.jobs.base import Job
from aggregator.shards.sum_tree import AdditiveState, Contribution, PartialSum, add_elementwise
from aggregator.strategies.fed3r import Fed3R
from aggregator.strategies.robust_fed3r import dominant_class, energy_per_sample


CENTRED_CLIP = "centred_clip"       # DP with a center: why the statistics break F_c ("": within it)


def round_sum(job: Job, members: list[Contribution]) -> PartialSum:
    """A DP job's bucket of one round: the plain Fed3R sums of its members' statistics (the job's
    ``take_round_sum`` state), in the order given; the noise is the job's, added to the root."""
    c = job.config
    sums, contributed = Fed3R(c.num_classes, c.p, c.lam, c.fit_intercept, c.normalize_columns), {}
    for device, _round, load in members:
        stats = load(job)
        sums.add(stats)
        contributed[device] = contributed.get(device, 0) + int(stats.n)
    return PartialSum(sums.sums_state(), contributed)


class Fed3RSums(AdditiveState):
    """Every array of Fed3R's state adds elementwise: Σ A_k (its packed upper triangle,
    ``Fed3R.sums_state``), Σ B_k and the (samples, contributions) counts. A bucket is summed by a fresh
    job applying its contributions. Besides its sums the job keeps each device's samples and, for
    the fleet screen at round close, its energy per sample."""

    def refusal(self, job: Job) -> str:
        if not (job.order_free or job.canonical_round_sums):
            return "a fed3r job with this config is neither order-free nor released in round sums: " \
                   "it cannot be summed by shards"
        return ""

    def check(self, job: Job, env) -> Any:
        """The statistics (message-only checks) and, streaming, the sample the increment starts at:
        whether that is the job's count of the device is the coordinator's to check (the shard's job
        holds no device's count)."""
        start = body_field(env, "from_sample", int) if job.config.streaming else None
        return job.check_payload(env), start

    def sum_bucket(self, new_job, members: list[Contribution], context: Any) -> PartialSum:
        job = new_job()
        if job.canonical_round_sums:        # DP: the plain sums of a round, released by the coordinator's job
            return round_sum(job, members)
        for device, _round, load in members:
            job.apply(device, load(job))
        return PartialSum(job.strategy.sums_state(), dict(job.contributed))

    def add(self, left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return add_elementwise(left, right)

    def receipt(self, job: Job, payload: Any) -> dict:
        stats, start = payload
        intercept = job.config.fit_intercept
        kept = {"contributed": int(stats.n), "energy": energy_per_sample(stats, intercept),
                "class": dominant_class(stats, intercept)}
        if job.config.dp and job.config.dp_center_devices:     # whether a centred round may take it
            kept[CENTRED_CLIP] = job.centred_clip_breach(stats)
        return kept if start is None else {**kept, "from_sample": start}

    def check_receipt(self, job: Job, device: str, receipt: dict) -> None:
        if job.config.streaming:        # the increment starts where the job's count of the device ends
            job.check_increment_start(device, int(receipt.get("from_sample", -1)), int(receipt["contributed"]))
        if job.config.dp and job.config.dp_center_devices:
            breach = receipt.get(CENTRED_CLIP)
            if not isinstance(breach, str):
                raise EnvelopeError(f"{KIND}: a DP receipt without its centred clip")
            job.check_centred_clip(breach)

    def record(self, job: Job, device: str, receipt: dict) -> None:
        dominant = receipt.get("class")          # a receipt of a shard before the screen's classes: none
        job.record_contribution(device, int(receipt["contributed"]), float(receipt["energy"]),
                                None if dominant is None else int(dominant))
