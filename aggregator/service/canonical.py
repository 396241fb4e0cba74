"""The model an order-free job reports: its contributions summed in the canonical bucketed order.

Floating-point addition is not associative, so the live sums of an order-free job (Fed3R) depend
on the order results arrived in. What a finished job reports is defined instead as the sum in
canonical order (``aggregator/shards/buckets.py``): each bucket of devices (a fixed hash of the
device id) summed in (device id, round) order from zero, then the bucket sums added in bucket
order. Its model depends only on *which* devices contributed: any arrival order, any number of
ingest workers or shards (a shard owns whole buckets), any crash and restart give the same bytes.

:class:`AppliedContributions` spares the re-sum the store's reads when it can. It records what the
live job was given, in order, since the job was built empty:

* the parsed contributions it kept in memory (up to ``budget_bytes``) are summed again in
  canonical order, without reading or decoding the store;
* a job restored from the store (a restart, a rebuild after a quarantine), or one whose kept
  contributions outgrew the budget, falls back to the store (``canonical_job``).

Either way the record must agree with the store exactly (the same message ids): a contribution
the store no longer holds (a forgotten device) sends the job to the store path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocols.envelope import decode

from aggregator.jobs.base import Job
from aggregator.shards.partial_sums import canonical_root, canonical_sum
from aggregator.storage.store import Store

DEFAULT_BUDGET_BYTES = 1 << 30


@dataclass
class AppliedContributions:
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    valid: bool = True          # every contribution of the live job went through record()
    keys: list[tuple[str, int, str]] = field(default_factory=list)     # (device, round, message id), applied order
    payloads: list[Any] | None = field(default_factory=list)           # parsed payloads, None past the budget
    held_bytes: int = 0

    def record(self, device: str, round_: int, message_id: str, payload: Any, nbytes: int) -> None:
        """The live job has just applied ``payload`` (``nbytes``: its size on the wire)."""
        self.keys.append((device, round_, message_id))
        if self.payloads is not None:
            self.held_bytes += nbytes
            if self.held_bytes > self.budget_bytes:
                self.payloads, self.held_bytes = None, 0
            else:
                self.payloads.append(payload)

    def invalidate(self) -> None:
        """The live job holds state this record never saw (restored from a checkpoint, replayed)."""
        self.valid, self.payloads, self.held_bytes = False, None, 0


def reported_job(applied: AppliedContributions, live: Job, store: Store, kind: str, job_id: str) -> Job:
    """The job whose model a finished order-free job reports: a fresh job summed in canonical
    order, from the contributions kept in memory when the record vouches for them, else the store."""
    stored = {c.message_id for c in store.contributions(job_id, with_payload=False)}
    if applied.valid and applied.payloads is not None and stored == {k[2] for k in applied.keys} \
            and len(stored) == len(applied.keys):
        kept = [(key[0], key[1], lambda _job, p=payload: p) for key, payload in zip(applied.keys, applied.payloads)]
        return canonical_sum(kind, live.config.to_dict(), kept)
    return canonical_job(store, kind, live.config.to_dict(), job_id)


def canonical_job(store: Store, kind: str, config: dict, job_id: str):
    """An order-free job (Fed3R) rebuilt from its stored contributions in canonical order: what
    the finished job reports, so its model depends only on which devices contributed. Payloads
    are read and decoded one at a time, as the sum reaches them."""
    return canonical_sum(kind, config, _stored(store, job_id))


def hand_round_sum(job: Job, store: Store, kind: str, job_id: str, round_: int) -> None:
    """Before a ``canonical_round_sums`` job (DP Fed3R) closes ``round_`` (live, or replayed after a
    restart), hand it the round's stored contributions summed canonically; other jobs: nothing."""
    if job.canonical_round_sums:
        job.take_round_sum(canonical_round_sum(store, kind, job.config.to_dict(), job_id, round_))


def canonical_round_sum(store: Store, kind: str, config: dict, job_id: str, round_: int) -> dict | None:
    """A ``canonical_round_sums`` job's (DP Fed3R's) closing round: its stored contributions summed
    up the canonical bucket tree, the state its ``take_round_sum`` takes (None: none stored)."""
    root = canonical_root(kind, config, _stored(store, job_id, round_))
    return None if root is None else root.state


def _stored(store: Store, job_id: str, round_: int | None = None) -> list:
    """(device, round, loader) of the job's stored contributions (of one round); each payload read
    and decoded when a sum reaches it."""
    def loader(seq: int):
        # the stored bytes were validated when they were accepted
        return lambda job: job.parse_accepted(decode(store.contribution_payload(job_id, seq)))
    after = 0 if round_ is None else round_ - 1
    return [(c.device, c.round, loader(c.seq)) for c in store.contributions(job_id, with_payload=False,
                                                                            after_round=after)
            if round_ is None or c.round == round_]
