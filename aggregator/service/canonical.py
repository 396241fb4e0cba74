"""The model an order-free job reports: its contributions summed in device-id order.

Floating-point addition is not associative, so the live sums of an order-free job (Fed3R) depend
on the order results arrived in. What a finished job reports is defined instead as the sum in
canonical order (device id, then round), so that its model depends only on *which* devices
contributed: any arrival order, any number of ingest workers, any crash and restart give the same
bytes. Computing it used to mean reading every stored contribution back, decoding and summing
it again after the last one arrived, the largest cost at the end of a large job.

:class:`AppliedContributions` removes that cost when it can. It records what the live job was
given, in order, since the job was built empty:

* when that order already is the canonical one, the live job *is* the canonical sum (the same
  additions in the same order from the same zeros): nothing is re-summed, nothing re-solved;
* otherwise the parsed contributions it kept in memory (up to ``budget_bytes``) are summed again
  in canonical order, without reading or decoding the store;
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
from aggregator.jobs.registry import build_job
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

    def in_canonical_order(self) -> bool:
        order = [k[:2] for k in self.keys]
        return order == sorted(order)


def reported_job(applied: AppliedContributions, live: Job, store: Store, kind: str, job_id: str) -> Job:
    """The job whose model a finished order-free job reports: ``live`` itself when it summed in
    canonical order, else a fresh job summed in that order, from memory when it can."""
    stored = {c.message_id for c in store.contributions(job_id, with_payload=False)}
    if applied.valid and stored == {k[2] for k in applied.keys} and len(stored) == len(applied.keys):
        if applied.in_canonical_order():
            return live
        if applied.payloads is not None:
            fresh = build_job(kind, live.config.to_dict())
            for i in sorted(range(len(applied.keys)), key=lambda i: applied.keys[i][:2]):
                fresh.apply(applied.keys[i][0], applied.payloads[i])
            return fresh
    return canonical_job(store, kind, live.config.to_dict(), job_id)


def canonical_job(store: Store, kind: str, config: dict, job_id: str):
    """An order-free job (Fed3R) rebuilt from its stored contributions in device-id order: what
    the finished job reports, so its model depends only on which devices contributed."""
    fresh = build_job(kind, config)
    parse = fresh.parse_accepted        # the stored bytes were validated when they were accepted
    for c in store.contributions(job_id, canonical=True):
        fresh.apply(c.device, parse(decode(c.payload)))
    return fresh
