"""Bucket sums of an order-free job and their reduction up a fixed tree: the canonical model.

A bucket's sum is its contributions summed by a fresh job in (device id, round) order: the job's
state (its exact float64 sums) and what each device contributed (:class:`PartialSum`). The model
is the root of a fixed binary tree over the ``NUM_BUCKETS`` buckets, each node the sum of its two
children (an empty bucket is no operand at all, so no ``0 + x`` changes a sign bit). Whoever
holds a subtree's buckets may sum it (one aggregator all of them; a shard the subtrees inside
its range, :func:`covering_nodes`): the additions, hence the bits, are the same for any K.
How two states add is the job kind's: the :class:`AdditiveState` its registry entry declares
(``JobKind.shard_sums``: Fed3R's ``fed3r_sums.py``, FedAvg's ``fedavg_sums.py``); the tree
itself is ``sum_tree.py``'s, which FedAvg's round sums (``fedavg_sums.py``) share.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any, Callable, Iterable

from aggregator.jobs.base import Job
from aggregator.jobs.registry import KINDS, build_job, kind_of
from aggregator.shards.buckets import bucket_of, canonical_key
from aggregator.shards.group_placement import SecureGroupPlacement
from aggregator.shards.sum_tree import (AdditiveState, Contribution, Node, PartialSum, lazy_root, root_sum,
                                        subtree_sums)

__all__ = ["Contribution", "Node", "PartialSum", "additive", "bucket_sums", "canonical_root", "canonical_sum",
           "range_sums", "reduce_nodes", "shard_capability"]


def additive(kind: str) -> AdditiveState:
    """How shards sum ``kind``: the capability its registry entry declares (``JobKind.shard_sums``)."""
    sums = kind_of(kind).shard_sums if kind in KINDS else None
    if sums is None:
        raise ValueError(f"job kind {kind!r} has no additive state: it cannot be summed in buckets")
    return sums


def shard_capability(kind: str) -> AdditiveState | SecureGroupPlacement:
    """What shards do for ``kind``, as its registry entry declares: sum its contributions in
    buckets (``JobKind.shard_sums``) or host its secure groups (``JobKind.shard_groups``)."""
    spec = kind_of(kind) if kind in KINDS else None
    capability = spec and (spec.shard_sums or spec.shard_groups)
    if capability is None:
        raise ValueError(f"job kind {kind!r} has no additive state and no secure groups shards can host: it "
                         "cannot run on shards")
    return capability


def by_bucket(contributions: Iterable[Contribution]) -> dict[int, list[Contribution]]:
    """Each non-empty bucket's contributions, in canonical (device id, round) order."""
    ordered = sorted(contributions, key=lambda c: canonical_key(c[0], c[1]))
    return {bucket: list(members) for bucket, members in groupby(ordered, key=lambda c: bucket_of(c[0]))}


def bucket_sums(kind: str, config: dict, contributions: Iterable[Contribution], context: Any = None,
                new_job: Callable[[], Job] | None = None) -> dict[int, PartialSum]:
    """The sum of each non-empty bucket of ``contributions`` (given in any order); ``new_job``: the
    job each bucket is summed with (default: a fresh one built from ``config``)."""
    adder = additive(kind)
    return {bucket: adder.sum_bucket(new_job or (lambda: build_job(kind, config)), members, context)
            for bucket, members in by_bucket(contributions).items()}


def range_sums(kind: str, buckets: dict[int, PartialSum], lo: int, hi: int) -> dict[Node, PartialSum | None]:
    """What the owner of buckets ``[lo, hi)`` reports: the sums of its covering nodes."""
    return subtree_sums(additive(kind), buckets, lo, hi)


def reduce_nodes(kind: str, config: dict, nodes: dict[Node, PartialSum | None]) -> Job:
    """A fresh job holding the root of the tree, from node sums that cover every bucket once."""
    return job_of_root(kind, config, root_sum(additive(kind), nodes))


def job_of_root(kind: str, config: dict, root: PartialSum | None) -> Job:
    """A fresh job holding ``root`` (None: nothing summed)."""
    job = build_job(kind, config)
    if root is not None:
        job.load_state_dict(root.state)
        job.contributed.update(sorted(root.contributed.items()))
    return job


def canonical_sum(kind: str, config: dict, contributions: Iterable[Contribution]) -> Job:
    """One aggregator's canonical model: the whole tree over its bucket sums. An order-free kind
    with no float sums to bucket (personalization's counts, ``model_from_receipts``: any order gives
    the same state) is applied in plain (device, round) order instead."""
    sums = kind_of(kind).shard_sums if kind in KINDS else None
    if sums is None or sums.model_from_receipts:
        job = build_job(kind, config)
        for device, _round, load in sorted(contributions, key=lambda c: canonical_key(c[0], c[1])):
            job.apply(device, load(job))
        return job
    return job_of_root(kind, config, canonical_root(kind, config, contributions))


def canonical_root(kind: str, config: dict, contributions: Iterable[Contribution]) -> PartialSum | None:
    """The root of the tree over ``contributions``' bucket sums (None: none), each bucket summed when
    the walk reaches it (``lazy_root``): one aggregator's canonical model, and a DP Fed3R round's sum
    as the service hands it to its job; K shards' root bit for bit."""
    adder, members = additive(kind), by_bucket(contributions)

    def new_job() -> Job:
        return build_job(kind, config)
    return lazy_root(adder, lambda b: adder.sum_bucket(new_job, members[b], None) if b in members else None)
