"""Bucket sums of an order-free job and their reduction up a fixed tree: the canonical model.

A bucket's sum is its contributions summed by a fresh job in (device id, round) order: the job's
state (its exact float64 sums) and what each device contributed (:class:`PartialSum`). The model
is the root of a fixed binary tree over the ``NUM_BUCKETS`` buckets, each node the sum of its two
children (an empty bucket is no operand at all, so no ``0 + x`` changes a sign bit). Whoever
holds a subtree's buckets may sum it (one aggregator all of them; a shard the subtrees inside
its range, :func:`covering_nodes`): the additions, hence the bits, are the same for any K.
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
from aggregator.shards.buckets import NUM_BUCKETS, bucket_of, canonical_key

Node = tuple[int, int]      # the buckets [start, end) under one node of the tree


class AdditiveState(ABC):
    """How two partial states of a job kind add up to the state of their union, and what the job
    keeps of each contribution besides its sums: a shard puts it in its receipt (:meth:`receipt`),
    the coordinator's job records it (:meth:`record`) without ever seeing the contribution."""

    @abstractmethod
    def add(self, left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ...

    @abstractmethod
    def receipt(self, job: Job, payload: Any) -> dict:
        ...

    @abstractmethod
    def record(self, job: Job, device: str, receipt: dict) -> None:
        ...


class Fed3RSums(AdditiveState):
    """Every array of Fed3R's state adds elementwise: Σ A_k (kept symmetric: both triangles see the
    same additions), Σ B_k and the (samples, contributions) counts. Besides its sums the job keeps
    each device's samples and, for the fleet screen at round close, its energy per sample."""

    def add(self, left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if left.keys() != right.keys():
            raise ValueError(f"partial states hold {sorted(right)} and {sorted(left)}")
        return {k: left[k] + right[k] for k in left}

    def receipt(self, job: Job, payload: Any) -> dict:
        from aggregator.strategies.robust_fed3r import energy_per_sample

        return {"contributed": int(payload.n), "energy": energy_per_sample(payload, job.config.fit_intercept)}

    def record(self, job: Job, device: str, receipt: dict) -> None:
        job.contributed[device] = int(receipt["contributed"])
        if job.config.energy_screen().active:
            job.energies[device] = float(receipt["energy"])


ADDITIVE: dict[str, AdditiveState] = {"fed3r": Fed3RSums()}


@dataclass
class PartialSum:
    state: dict[str, np.ndarray]
    contributed: dict[str, Any] = field(default_factory=dict)


# (device, round, payload loader): the loader parses the contribution when the sum reaches it, so
# a bucket's payloads are read and decoded one at a time
Contribution = tuple[str, int, Callable[[Job], Any]]


def additive(kind: str) -> AdditiveState:
    if kind not in ADDITIVE:
        raise ValueError(f"job kind {kind!r} has no additive state: it cannot be summed in buckets")
    return ADDITIVE[kind]


def bucket_sums(kind: str, config: dict, contributions: Iterable[Contribution]) -> dict[int, PartialSum]:
    """The sum of each non-empty bucket of ``contributions`` (given in any order)."""
    ordered = sorted(contributions, key=lambda c: canonical_key(c[0], c[1]))
    out = {}
    for bucket, members in groupby(ordered, key=lambda c: bucket_of(c[0])):
        job = build_job(kind, config)
        for device, _round, load in members:
            job.apply(device, load(job))
        out[bucket] = PartialSum(job.state_dict(), dict(job.contributed))
    return out


def covering_nodes(lo: int, hi: int, node: Node = (0, NUM_BUCKETS)) -> list[Node]:
    """The largest nodes of the tree whose buckets all lie in ``[lo, hi)``, left to right."""
    start, end = node
    if hi <= start or end <= lo:
        return []
    if lo <= start and end <= hi:
        return [node]
    mid = (start + end) // 2
    return covering_nodes(lo, hi, (start, mid)) + covering_nodes(lo, hi, (mid, end))


def combine(adder: AdditiveState, left: PartialSum | None, right: PartialSum | None) -> PartialSum | None:
    if left is None or right is None:
        return left if right is None else right
    if left.contributed.keys() & right.contributed.keys():
        raise ValueError("two partial sums hold the same device")
    return PartialSum(adder.add(left.state, right.state), {**left.contributed, **right.contributed})


def node_sum(adder: AdditiveState, known: dict[Node, PartialSum | None], node: Node = (0, NUM_BUCKETS)):
    """A node's sum: given in ``known``, else its children's (an unknown bucket is empty)."""
    if node in known:
        return known[node]
    start, end = node
    if end - start == 1:
        return None
    mid = (start + end) // 2
    return combine(adder, node_sum(adder, known, (start, mid)), node_sum(adder, known, (mid, end)))


def range_sums(kind: str, buckets: dict[int, PartialSum], lo: int, hi: int) -> dict[Node, PartialSum | None]:
    """What the owner of buckets ``[lo, hi)`` reports: the sums of its covering nodes."""
    if any(not lo <= b < hi for b in buckets):
        raise ValueError(f"buckets {sorted(b for b in buckets if not lo <= b < hi)} are outside [{lo}, {hi})")
    leaves = {(b, b + 1): s for b, s in buckets.items()}
    return {n: node_sum(additive(kind), leaves, n) for n in covering_nodes(lo, hi)}


def reduce_nodes(kind: str, config: dict, nodes: dict[Node, PartialSum | None]) -> Job:
    """A fresh job holding the root of the tree, from node sums that cover every bucket once."""
    covered = sorted(b for start, end in nodes for b in range(start, end))
    if covered != list(range(NUM_BUCKETS)):
        raise ValueError("the partial sums do not cover every bucket exactly once (a bucket given twice "
                         "would double, one missing would be lost)")
    job = build_job(kind, config)
    root = node_sum(additive(kind), nodes)
    if root is not None:
        job.load_state_dict(root.state)
        job.contributed.update(sorted(root.contributed.items()))
    return job


def canonical_sum(kind: str, config: dict, contributions: Iterable[Contribution]) -> Job:
    """One aggregator's canonical model: the whole tree over its bucket sums. An order-free kind
    with no float sums to bucket (personalization's counts: any order gives the same state) is
    applied in plain (device, round) order instead."""
    if kind not in ADDITIVE:
        job = build_job(kind, config)
        for device, _round, load in sorted(contributions, key=lambda c: canonical_key(c[0], c[1])):
            job.apply(device, load(job))
        return job
    buckets = bucket_sums(kind, config, contributions)
    return reduce_nodes(kind, config, range_sums(kind, buckets, 0, NUM_BUCKETS))
