"""How shards sum Fed3R: every array of its state adds elementwise (the kind's ``shard_sums`` in
``aggregator/jobs/registry.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.envelope import body_field

from aggregator.jobs.base import Job
from aggregator.shards.sum_tree import AdditiveState, Contribution, PartialSum, add_elementwise
from aggregator.strategies.robust_fed3r import energy_per_sample


class Fed3RSums(AdditiveState):
    """Every array of Fed3R's state adds elementwise: Σ A_k (kept symmetric: both triangles see the
    same additions), Σ B_k and the (samples, contributions) counts. A bucket is summed by a fresh
    job applying its contributions. Besides its sums the job keeps each device's samples and, for
    the fleet screen at round close, its energy per sample."""

    def refusal(self, job: Job) -> str:
        if not job.order_free:
            return "a fed3r job with this config is not order-free (e.g. DP noise at round close): " \
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
        for device, _round, load in members:
            job.apply(device, load(job))
        return PartialSum(job.state_dict(), dict(job.contributed))

    def add(self, left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return add_elementwise(left, right)

    def receipt(self, job: Job, payload: Any) -> dict:
        stats, start = payload
        kept = {"contributed": int(stats.n), "energy": energy_per_sample(stats, job.config.fit_intercept)}
        return kept if start is None else {**kept, "from_sample": start}

    def check_receipt(self, job: Job, device: str, receipt: dict) -> None:
        if job.config.streaming:        # the increment starts where the job's count of the device ends
            job.check_increment_start(device, int(receipt.get("from_sample", -1)))

    def record(self, job: Job, device: str, receipt: dict) -> None:
        job.record_contribution(device, int(receipt["contributed"]), float(receipt["energy"]))
