"""How shards sum Fed3R: every array of its state adds elementwise (the kind's ``shard_sums`` in
``aggregator/jobs/registry.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

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
        if job.config.to_dict().get("streaming"):
            # an increment is checked against the samples the job holds, which only the coordinator knows
            return "streaming Fed3R cannot run on shards yet: run it without --shards"
        return ""

    def check(self, job: Job, env) -> Any:
        return job.check_payload(env)

    def sum_bucket(self, new_job, members: list[Contribution], context: Any) -> PartialSum:
        job = new_job()
        for device, _round, load in members:
            job.apply(device, load(job))
        return PartialSum(job.state_dict(), dict(job.contributed))

    def add(self, left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return add_elementwise(left, right)

    def receipt(self, job: Job, payload: Any) -> dict:
        return {"contributed": int(payload.n), "energy": energy_per_sample(payload, job.config.fit_intercept)}

    def record(self, job: Job, device: str, receipt: dict) -> None:
        job.contributed[device] = int(receipt["contributed"])
        if job.config.energy_screen().active:
            job.energies[device] = float(receipt["energy"])
