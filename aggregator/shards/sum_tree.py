"""The reduction tree every sharded sum is added up: partial sums, how two of a kind add, and the
fixed binary tree over the ``NUM_BUCKETS`` buckets (``buckets.py``).

Pure arithmetic on numpy arrays, importing no job: a job kind whose one-aggregator sum must be
the shards' bit for bit (FedAvg's round mean, ``fedavg_sums.py``) sums its own updates up this
same tree. Each node is the sum of its two children; an empty bucket is no operand at all (no
``0 + x`` changes a sign bit). Whoever holds a subtree's buckets may sum it (one aggregator all
of them; a shard the subtrees inside its range, :func:`covering_nodes`): the additions, hence
the bits, are the same for any number of shards.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from aggregator.shards.buckets import NUM_BUCKETS, bucket_of, canonical_key

Node = tuple[int, int]      # the buckets [start, end) under one node of the tree


@dataclass
class PartialSum:
    state: dict[str, np.ndarray]
    contributed: dict[str, Any] = field(default_factory=dict)


# (device, round, payload loader): the loader parses the contribution when the sum reaches it, so
# a bucket's payloads are read and decoded one at a time
Contribution = tuple[str, int, Callable[[Any], Any]]


class AdditiveState(ABC):
    """How a job kind's contributions are summed by shards: how a bucket sums its contributions
    (:meth:`sum_bucket`), how two partial states add up to the state of their union (:meth:`add`),
    how a shard checks a result (:meth:`check`) and what the job keeps of each contribution besides
    its sums: a shard puts it in its receipt (:meth:`receipt`), the coordinator's job records it
    (:meth:`record`) without ever seeing the contribution."""

    per_round: bool = False
    """The sums are one round's updates, asked for at each round close (FedAvg), not the whole
    job's contributions (Fed3R)."""

    model_from_receipts: bool = False
    """The receipts carry all the job keeps of a contribution and there is nothing to sum
    (personalization's held-out counts): the coordinator's own job is the model."""

    reads_job_only: bool = False
    """Summing reads the job it is given (its parser, its config) and changes nothing in it
    (FedAvg's round sums), so a shard lends its own job to every bucket instead of building one
    per bucket (FT(φ)'s loads its tail program). False: the sum applies contributions to the job
    (Fed3R), which must then be fresh for each bucket."""

    @abstractmethod
    def refusal(self, job: Any) -> str:
        """Why shards cannot sum this job as configured ("" when they can)."""

    @abstractmethod
    def check(self, job: Any, env: Any) -> Any:
        """The validated payload of a result (``EnvelopeError`` for an invalid one), on a shard."""

    @abstractmethod
    def sum_bucket(self, new_job: Callable[[], Any], members: list[Contribution], context: Any) -> PartialSum:
        """The sum of one bucket's ``members`` (in canonical order); ``context``: what the round's
        close decided (None for a kind that needs nothing)."""

    @abstractmethod
    def add(self, left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ...

    @abstractmethod
    def receipt(self, job: Any, payload: Any) -> dict:
        ...

    @abstractmethod
    def record(self, job: Any, device: str, receipt: dict) -> None:
        ...

    def summed_kinds(self, job: Any) -> tuple[str, ...]:
        """The result kinds a shard receipts and sums (a shard forwards the others whole): the job's
        own by default; LADD's training results, not its styles."""
        return (job.kind,)

    def check_receipt(self, job: Any, device: str, receipt: dict) -> None:
        """The coordinator's checks of a receipt against the job's state (``EnvelopeError``:
        refused with the reason), before the round machine takes it: none by default."""

    def statistics(self, new_job: Callable[[], Any], members: list[Contribution], context: Any) -> dict[str, float]:
        """Per-update statistics a round's close decides on (device -> value): none by default."""
        raise ValueError(f"{type(self).__name__} sums need no per-update statistics")


def add_elementwise(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if left.keys() != right.keys():
        raise ValueError(f"partial states hold {sorted(right)} and {sorted(left)}")
    # numpy would broadcast a (1, d) into a (c, d) and sum without a word: one config makes every
    # shard's shapes equal, so a difference is a shard of another job or version
    mismatched = sorted(k for k in left if np.shape(left[k]) != np.shape(right[k]))
    if mismatched:
        raise ValueError("partial states' shapes differ: " + ", ".join(
            f"{k} {list(np.shape(left[k]))} and {list(np.shape(right[k]))}" for k in mismatched))
    return {k: left[k] + right[k] for k in left}


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


def lazy_root(adder: AdditiveState, leaf: Callable[[int], PartialSum | None],
              node: Node = (0, NUM_BUCKETS)) -> PartialSum | None:
    """:func:`node_sum` of ``node`` with each bucket's sum ``leaf(bucket)`` taken only when the walk
    reaches it (None: an empty bucket): the same additions, holding one pending sum per level of the
    tree instead of every bucket's (one aggregator's re-sum of a Fed3R job: 7 states, not 64)."""
    start, end = node
    if end - start == 1:
        return leaf(start)
    mid = (start + end) // 2
    return combine(adder, lazy_root(adder, leaf, (start, mid)), lazy_root(adder, leaf, (mid, end)))


def subtree_sums(adder: AdditiveState, buckets: dict[int, PartialSum], lo: int, hi: int) -> dict[Node, PartialSum | None]:
    """What the owner of buckets ``[lo, hi)`` reports: the sums of its covering nodes."""
    if any(not lo <= b < hi for b in buckets):
        raise ValueError(f"buckets {sorted(b for b in buckets if not lo <= b < hi)} are outside [{lo}, {hi})")
    leaves = {(b, b + 1): s for b, s in buckets.items()}
    return {n: node_sum(adder, leaves, n) for n in covering_nodes(lo, hi)}


def root_sum(adder: AdditiveState, nodes: dict[Node, PartialSum | None]) -> PartialSum | None:
    """The tree's root from node sums that cover every bucket once (None: nothing was summed)."""
    covered = sorted(b for start, end in nodes for b in range(start, end))
    if covered != list(range(NUM_BUCKETS)):
        raise ValueError("the partial sums do not cover every bucket exactly once (a bucket given twice "
                         "would double, one missing would be lost)")
    return node_sum(adder, nodes)


def add_weighted(sums: dict[str, np.ndarray], tensors: Mapping[str, np.ndarray], weight: float = 1.0) -> None:
    """sums[name] += weight · tensors[name] in float64, in place (a name's first term is a fresh array)."""
    for name, value in tensors.items():
        term = weight * np.asarray(value, dtype=np.float64)
        if name in sums:
            sums[name] += term
        else:
            sums[name] = term


def local_tree_sum(adder: AdditiveState, items: Iterable[tuple],
                   leaf: Callable[[list[tuple]], PartialSum]) -> PartialSum | None:
    """One aggregator's sum of ``items`` ((device, ...) tuples) as shards add it: in canonical device
    order, one leaf per bucket (``leaf`` of the bucket's items), up the same tree."""
    ordered = sorted(items, key=lambda item: canonical_key(item[0], 0))
    leaves = {(bucket, bucket + 1): leaf(list(members))
              for bucket, members in groupby(ordered, key=lambda item: bucket_of(item[0]))}
    return node_sum(adder, leaves, (0, NUM_BUCKETS))
