"""How shards take personalization reports: nothing to sum, the report in the receipt.

A ``personalize`` job's result is a device's held-out counts (a few integers per method, the FP
learning rate it chose): all the job keeps of it, and its summary (each method's WMA) is computed
from all of them at once, in device order. A shard validates and stores the report and hands the
coordinator the report itself in its receipt; the coordinator's job records it as one aggregator
records the report it parsed (``ShardedOwnModelJob``): the same reports, the same summary. What
sharding buys here is the ingest (the connections, the signatures, the stores), not a sum."""

from __future__ import annotations

from typing import Any

import numpy as np

from aggregator.jobs.personalize import report_entry
from aggregator.shards.sum_tree import AdditiveState, Contribution, PartialSum


class PersonalizationReports(AdditiveState):
    model_from_receipts = True
    reads_job_only = True

    def refusal(self, job) -> str:
        return ""

    def check(self, job, env) -> Any:
        return job.parse_result(env)

    def sum_bucket(self, new_job, members: list[Contribution], context: Any) -> PartialSum:
        raise ValueError("personalization reports are not summed: the receipts carry them")

    def add(self, left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise ValueError("personalization reports are not summed: the receipts carry them")

    def receipt(self, job, payload) -> dict:
        return report_entry(payload)

    def record(self, job, device: str, receipt: dict) -> None:
        job.record_report(device, receipt)
