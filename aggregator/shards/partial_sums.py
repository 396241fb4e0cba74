"""Bucket sums of an order-free job and their reduction: the canonical model (``buckets.py``).

A :class:`BucketSum` is one bucket's contributions summed by a fresh job in (device id, round)
order: the job's state (its exact float64 sums) and what each device contributed. Whoever holds a
bucket's contributions computes it (one aggregator, or the shard that owns the bucket); the
coordinator reduces the bucket sums in bucket order into a fresh job (:func:`reduce_buckets`).
How two states add is the job kind's: an :class:`AdditiveState` per kind (``ADDITIVE``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Callable, Iterable

import numpy as np

from aggregator.jobs.base import Job
from aggregator.jobs.registry import build_job
from aggregator.shards.buckets import bucket_of, canonical_key


class AdditiveState(ABC):
    """How two partial states of a job kind add up to the state of their union."""

    @abstractmethod
    def add(self, total: dict[str, np.ndarray], part: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ...


class SummedArrays(AdditiveState):
    """Every array of the state adds elementwise: Fed3R's Σ A_k (kept symmetric: both triangles
    see the same additions), Σ B_k and its (samples, contributions) counts."""

    def add(self, total: dict[str, np.ndarray], part: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if total.keys() != part.keys():
            raise ValueError(f"partial states hold {sorted(part)}, the total {sorted(total)}")
        return {k: total[k] + part[k] for k in total}


ADDITIVE: dict[str, AdditiveState] = {"fed3r": SummedArrays()}


@dataclass
class BucketSum:
    bucket: int
    state: dict[str, np.ndarray]
    contributed: dict[str, Any] = field(default_factory=dict)


# (device, round, payload loader): the loader parses the contribution when the sum reaches it, so
# a bucket's payloads are read and decoded one at a time
Contribution = tuple[str, int, Callable[[Job], Any]]


def bucket_sums(kind: str, config: dict, contributions: Iterable[Contribution]) -> list[BucketSum]:
    """The bucket sums of ``contributions`` (any order; a device's rounds in any order too)."""
    ordered = sorted(contributions, key=lambda c: canonical_key(c[0], c[1]))
    out = []
    for bucket, members in groupby(ordered, key=lambda c: bucket_of(c[0])):
        job = build_job(kind, config)
        for device, _round, load in members:
            job.apply(device, load(job))
        out.append(BucketSum(bucket, job.state_dict(), dict(job.contributed)))
    return out


def reduce_buckets(kind: str, config: dict, sums: Iterable[BucketSum]) -> Job:
    """A fresh job holding the bucket sums added in bucket order, starting from zero: the same
    additions whoever computed which bucket. A bucket given twice is an error (it would double)."""
    additive = ADDITIVE.get(kind)
    if additive is None:
        raise ValueError(f"job kind {kind!r} has no additive state: it cannot be summed in buckets")
    job = build_job(kind, config)
    total, contributed, seen = job.state_dict(), {}, set()
    for s in sorted(sums, key=lambda s: s.bucket):
        if s.bucket in seen:
            raise ValueError(f"bucket {s.bucket} was given twice")
        seen.add(s.bucket)
        if contributed.keys() & s.contributed.keys():
            raise ValueError(f"bucket {s.bucket} holds devices another bucket holds")
        total = additive.add(total, s.state)
        contributed.update(s.contributed)
    job.load_state_dict(total)
    job.contributed.update(sorted(contributed.items()))
    return job


def canonical_sum(kind: str, config: dict, contributions: Iterable[Contribution]) -> Job:
    """One aggregator's canonical model: its bucket sums, reduced."""
    return reduce_buckets(kind, config, bucket_sums(kind, config, contributions))
