"""One shard's ingest: reassemble, validate and durably store the results of the devices in its
bucket range, and hand the coordinator a small receipt for each; sum its buckets on request.

No socket here: :class:`ShardIngest` is fed ``(topic, payload)`` pairs and returns what the
coordinator must be told (``local.py`` moves the bytes: MQTT in, a pipe out). What it forwards:

* a result of the active job whose payload passes the job's checks (``check_payload``, the
  expensive part: decoding, the Gram matrix's Cholesky) is stored first — raw envelope, keyed by
  (job, message id), so a device's re-send after a crash is found, not stored twice — and then
  becomes a *receipt*: the result's reference (job, round, task, kind) and what the job records of
  it, no tensors. The coordinator runs the round rules on the receipt and acks the device; a
  receipt for a contribution it refuses (late, duplicate, revoked) leaves an orphan here that no
  sum ever counts, because sums are taken over the coordinator's accepted (device, message id)s,
  and which is deleted once the coordinator closed its round (``drop_orphans``);
* everything else it is not sure of (presence, declines, artifact requests, results of another
  job, a result that fails validation) goes to the coordinator as the whole message's bytes, to
  be judged (and refused with its reason) on the coordinator's ordinary path;
* what it refuses itself (a hosted group's machine refused a secagg message; a result its store
  cannot hold) is a *refusal*, which the coordinator counts as one aggregator counts the message.

For a secure job (``secure_groups.py``) a shard receipts nothing: it hosts the SecAgg groups its
coordinator places on it (``shard_groups.py``), reading their members' outboxes too, and takes
every secagg message for its group (one for a group hosted elsewhere is dropped).

Rounds: a shard stores a result only for the rounds after the last one its coordinator closed (kept
in its store) and at most ROUNDS_AHEAD of them (the coordinator opens a round as it closes the one
before, and this shard may hear of the close after the next round's first results): a device cannot
fill the store with results for rounds that will never open, nor name a round SQLite cannot hold.
Any other round's result goes to the coordinator, which answers it (late, or unknown round).

Crashes: a result stored but not yet receipted is re-sent by its device (it is not acked) and
receipted then; a receipt the coordinator accepted is already durable here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

from protocols import messages as M
from protocols.chunking import MessageAssembler
from protocols.envelope import Envelope, EnvelopeError, SenderNotAdmitted, decode, encode
from protocols.identity import IdentityRegistry
from protocols.payloads.secagg import SECAGG_TYPE
from protocols.topics import Topics

from aggregator.jobs.registry import build_job
from aggregator.jobs.secure_rounds import protocol_refusal
from aggregator.security.fleet import verify_enrolled
from aggregator.shards.buckets import bucket_of, bucket_range
from aggregator.shards.group_placement import SecureGroupPlacement
from aggregator.shards.partial_sums import (Contribution, Node, PartialSum, additive, bucket_sums, by_bucket, range_sums,
                                            shard_capability)
from aggregator.shards.shard_groups import ShardGroups
from aggregator.storage.store import Store, StoreError
from aggregator.storage.schema import JobState

log = logging.getLogger("fedfleet.aggregator.shard")

RECEIPT = "shard_receipt"       # the body field of a receipt: {"shard", "bytes", "job": what the job keeps}
ROUNDS_AHEAD = 2                # rounds after the last closed one whose results a shard stores
CLOSED_SETTING = "shard_closed:"    # + job id: the last round the coordinator closed, in the shard's store


@dataclass
class Forward:
    """A whole message for the coordinator's ordinary path."""
    topic: str
    payload: bytes
    # refused only because its device was not admitted here, or its key not given: the coordinator
    # hands it back once this shard has heard of an admission it made (enrolments come over the
    # shard's pipe, chunks over MQTT, in no order between the two: a first chunk forwarded, the
    # rest held here, and the result was lost until the device sent it again)
    not_admitted: bool = False


class Admission:
    """Whose outbox messages a shard takes, as its coordinator's fleet says: the enrolled devices
    (None: an open fleet, anyone) less the revoked ones, in either fleet mode (one aggregator refuses
    a revoked device's every message before any check, open fleet or not; a review's finding: an
    open fleet's shards were never told of a revocation). The pool keeps one to send each shard."""

    def __init__(self, admitted: Iterable[str] | None = None, revoked: Iterable[str] = ()):
        self.admitted = None if admitted is None else set(admitted)
        self.revoked = set(revoked)

    def changed(self, device: str, admitted: bool) -> None:
        """A device enrolled (True) or revoked (False) at the coordinator."""
        (self.revoked.discard if admitted else self.revoked.add)(device)
        if self.admitted is not None:
            (self.admitted.add if admitted else self.admitted.discard)(device)

    def allows(self, device: str) -> bool:
        return device not in self.revoked and (self.admitted is None or device in self.admitted)


@dataclass
class Publish:
    """Messages of a secure group this shard hosts, for its members' inboxes (``shard_groups.py``)."""
    sends: list[tuple[str, Envelope]]


@dataclass
class Refused:
    """A device's message refused here, unanswered (a result's device re-sends it): the coordinator
    counts it as one aggregator counts that refusal. ``reason_class``: one of its rejection classes
    (``active_job.REJECTION_CLASSES``), or "late" (a hosted group's late secagg message)."""
    topic: str
    reason_class: str
    detail: str


@dataclass
class Receipt:
    """A stored, validated result: its encoded receipt envelope (what the coordinator stores)."""
    topic: str
    raw: bytes


def receipt_envelope(env: Envelope, shard: int, kept: dict, nbytes: int) -> Envelope:
    body = {k: env.body[k] for k in ("job", "round", "task", "kind")}
    body[RECEIPT] = {"shard": shard, "bytes": nbytes, "job": kept}
    return Envelope(type=M.RESULT, sender=env.sender, body=body, id=env.id)


class ShardIngest:
    def __init__(self, index: int, shards: int, store: Store, topics: Topics = Topics(),
                 max_message_bytes: int = 256 * 1024 * 1024):
        self.index, self.shards, self.store, self.topics = index, shards, store, topics
        self.lo, self.hi = bucket_range(index, shards)
        self.admission = Admission()        # whose chunks are held (the coordinator's ``admit``)
        self.assembler = MessageAssembler(max_message_bytes=max_message_bytes, may_chunk=self.may_chunk)
        self.registry: IdentityRegistry | None = None   # --require-signatures: the coordinator's enrolled keys
        self.job_id: str | None = None
        self.closed = 0                                 # the job's last round the coordinator closed
        self.kind, self.config, self._validator = "", {}, None
        self._bytes: dict[str, int] = {}
        self._cache: dict[int, tuple[frozenset, PartialSum]] = {}      # bucket -> (its keys, its sum)
        self.stored = self.receipted = 0
        self.groups: ShardGroups | None = None          # a secure job's: the group hosted here
        # (round, device) -> the receipt sent for what is stored: a re-send (same id or a new one) is
        # answered with it, unvalidated, as one aggregator's round machine answers it from its table
        # (each re-send of a 13 MB result was validated here, a new id's twice: a review's finding)
        self._receipts: dict[tuple[int, str], bytes] = {}

    def reads(self, device: str) -> bool:
        """Whether this shard takes ``device``'s outbox: its bucket's, or a member of a group it hosts."""
        return self.owns(device) or (self.groups is not None and device in self.groups.members)

    def owns(self, device: str) -> bool:
        return self.lo <= bucket_of(device) < self.hi

    def set_job(self, job_id: str, kind: str, config: dict) -> None:
        """The job whose results this shard takes (``None``-like empty id: none)."""
        hosts_groups = isinstance(shard_capability(kind), SecureGroupPlacement)   # else refused here
        self.job_id, self.kind, self.config = job_id, kind, config
        self._validator, self._cache, self._receipts = build_job(kind, config), {}, {}
        self.groups = ShardGroups(self.index, self._validator) if hosts_groups else None
        if self.store.job(job_id) is None:
            self.store.create_job(job_id, kind, config, state=JobState.RUNNING)
        self.closed = int(self.store.setting(CLOSED_SETTING + job_id) or 0)

    def require_signatures(self, keys: dict[str, bytes]) -> None:
        """From now on every message read here must be signed by its sender's enrolled key (``keys``:
        the coordinator's registry, sent before the job; changes by :meth:`key_changed`). One that
        is not goes to the coordinator, which refuses it with the reason ("bad signature")."""
        self.registry = IdentityRegistry(keys)
        self.assembler.verifier = self._verify

    def _verify(self, sender: str, signed: bytes, signature: bytes) -> None:
        if sender not in self.registry:     # its key not (yet) here: handed back once it is (pool.py)
            raise SenderNotAdmitted(f"signature rejected for {sender!r}: no enrolled key at this shard")
        verify_enrolled(self.registry, sender, signed, signature)

    def admit(self, devices: list[str] | None, revoked: Iterable[str] = ()) -> None:
        """The devices that may contribute (the coordinator's enrolled fleet; None: its fleet is
        open), never the ``revoked`` ones. Only their chunks are held until whole: another's is
        forwarded, and refused on the coordinator's path with the reason, as the coordinator's own
        assembler (or its check of a revoked sender) refuses it."""
        self.admission = Admission(devices, revoked)

    def admission_changed(self, device: str, admitted: bool) -> None:
        """A device enrolled (True) or revoked (False) at the coordinator."""
        self.admission.changed(device, admitted)

    def may_chunk(self, device: str) -> bool:
        return self.admission.allows(device)

    def key_changed(self, device: str, public_key: bytes | None) -> None:
        """A device enrolled (its key) or revoked (None) at the coordinator."""
        if self.registry is None:
            return log.warning("shard %d: a key change for %s while signatures are not required: ignored",
                               self.index, device)
        self.registry.revoke(device)
        if public_key is not None:
            self.registry.enroll(device, public_key)

    def feed(self, topic: str, payload: bytes, now: float = 0.0) -> Forward | Receipt | Publish | Refused | None:
        device = self.topics.device_of(topic)
        if device is None or not topic.endswith("/out") or not self.reads(device):
            # another bucket's device: a secure job's shard reads it only for a group it hosts (a
            # former member's late message is its own shard's to forward)
            return None if self.groups is not None and device is not None else Forward(topic, payload)
        self._bytes[device] = self._bytes.get(device, 0) + len(payload)
        try:
            got = self.assembler.feed_whole(payload, topic_sender=device)
        except EnvelopeError as exc:
            self._bytes.pop(device, None)
            # refused on the coordinator's path, with its reason
            return Forward(topic, payload, not_admitted=isinstance(exc, SenderNotAdmitted))
        if got is None:
            return None
        env, raw = got
        nbytes = self._bytes.pop(device, len(raw))
        if not self.may_chunk(device):
            # revoked or not enrolled: one aggregator refuses its every outbox message before any
            # check, so here none reaches a hosted group's machine (which took a revoked member back
            # in) or this store; its own shard hands it back to be refused with the reason
            return Forward(topic, raw, not_admitted=True) if self.owns(device) else None
        if self.groups is not None and env.type == SECAGG_TYPE and env.sender == device:
            try:
                return Publish(self.groups.feed(device, env, now))      # never the coordinator's: it holds no group
            except EnvelopeError as exc:    # the hosted group's machine refused it: counted as one aggregator's
                log.info("shard %d: secagg message from %s refused: %s", self.index, device, exc)
                return Refused(topic, protocol_refusal(exc), str(exc))
        if not self.owns(device):
            return None             # a group member of another bucket: its own shard forwards this
        if env.type != M.RESULT or self.job_id is None or env.sender != device:
            return Forward(topic, raw)
        return self._result(topic, device, env, raw, nbytes)

    def _result(self, topic: str, device: str, env: Envelope, raw: bytes, nbytes: int) -> Forward | Receipt | Refused:
        try:
            ref, kind = M.parse_result_ref(env)
            if (ref.job != self.job_id or self.groups is not None
                    or not self.closed < ref.round <= self.closed + ROUNDS_AHEAD
                    or kind not in additive(self.kind).summed_kinds(self._validator)):
                return Forward(topic, raw)          # (a secure job's devices send no results: refused there)
            if (ref.round, device) in self._receipts:  # a re-send of what it holds: its receipt again
                self.receipted += 1
                return Receipt(topic, self._receipts[ref.round, device])
            payload = additive(self.kind).check(self._validator, env)
        except EnvelopeError:
            return Forward(topic, raw)
        try:
            self.store.add_contribution(self.job_id, ref.round, device, env.id, raw)
            self.stored += 1
        except StoreError as exc:   # stored before (a re-send): receipted again, never stored twice
            stored = self.store.contribution_of(self.job_id, ref.round, device)
            if stored is None:
                # Its id is held by another of the job's rows (another device's, another round's):
                # nothing to receipt. Refused as a write that raises here is (``local._feed``), and
                # unanswered, as one aggregator answers nothing to a result whose write failed: the
                # device re-sends it, taken once the store can hold it (that row an orphan deleted).
                log.warning("shard %d: result %s of %s not stored, not receipted", self.index, env.id, device)
                return Refused(topic, "malformed", f"result not stored: {exc}")
            if stored.message_id != env.id:
                # The shard holds another result of the device for this round (stored before a kill,
                # or sent ahead of its round): only what it holds can be summed, so that is what it
                # receipts. A receipt of an id it does not hold would stop the round's close.
                env, nbytes = decode(stored.payload), len(stored.payload)
                payload = additive(self.kind).check(self._validator, env)
        self.receipted += 1
        kept = additive(self.kind).receipt(self._validator, payload)
        receipt = self._receipts[ref.round, device] = encode(receipt_envelope(env, self.index, kept, nbytes))
        return Receipt(topic, receipt)

    def drop_orphans(self, job_id: str, round_: int, accepted: list[tuple[str, str]], earlier: bool = False) -> int:
        """The coordinator closed ``round_`` with ``accepted`` (device, message id)s (those of every
        round so far, ``earlier``): this shard's rows of that round (and the earlier ones) outside
        them are orphans no sum will ever count (refused receipts; results stored before a kill and
        re-sent by their devices under new ids), deleted now."""
        if job_id != self.job_id:
            return 0
        if round_ > self.closed:
            self.closed = round_
            self.store.set_setting(CLOSED_SETTING + job_id, str(round_))
        self._receipts = {k: v for k, v in self._receipts.items() if k[0] > self.closed}     # taken: no re-send counts
        mine = {(d, m) for d, m in accepted if self.owns(d)}
        dropped = self.store.drop_unaccepted(job_id, round_, mine, earlier)
        if dropped:
            log.info("shard %d: %d orphan result(s) of round %d deleted", self.index, dropped, round_)
        return dropped

    def expire(self, now: float) -> None:
        self._bytes = self.assembler.expire(now, self._bytes, log, f"shard {self.index}: ")

    def sums(self, job_id: str, accepted: list[tuple[str, str]], context: Any = None) -> dict[Node, PartialSum | None]:
        """The sums of this shard's covering nodes over the coordinator's accepted (device, message
        id)s in its range; a bucket is summed again only when its accepted set changed (always, for
        a kind whose sums depend on the round's ``context``)."""
        buckets = {}
        # a round's sums (a context, or DP Fed3R's rounds) are asked for once: nothing worth keeping
        cache = context is None and not self._validator.canonical_round_sums
        for bucket, members in self._accepted_members(job_id, accepted).items():
            keys = frozenset((c.device, c.message_id) for c in members)
            cached = self._cache.get(bucket) if cache else None
            if cached is None or cached[0] != keys:
                summed = bucket_sums(self.kind, self.config, self._contributions(members), context, self._summing_job)
                cached = (keys, summed[bucket])
                if cache:
                    self._cache[bucket] = cached
            buckets[bucket] = cached[1]
        return range_sums(self.kind, buckets, self.lo, self.hi)

    def statistics(self, job_id: str, accepted: list[tuple[str, str]], context: Any) -> dict[str, float]:
        """device -> the statistic a round's close asks of each accepted update this shard holds."""
        adder, members = additive(self.kind), self._accepted_members(job_id, accepted)
        ordered = [c for bucket in sorted(members) for c in self._contributions(members[bucket])]
        return adder.statistics(self._summing_job, ordered, context)

    def _summing_job(self):
        """The job a sum is taken with: this shard's own when the kind's sums only read it, else a fresh one."""
        return self._validator if additive(self.kind).reads_job_only else build_job(self.kind, self.config)

    def _accepted_members(self, job_id: str, accepted: list[tuple[str, str]]) -> dict[int, list]:
        """bucket -> the stored rows of the accepted (device, message id)s in this shard's range."""
        if job_id != self.job_id:
            raise ValueError(f"shard {self.index} serves job {self.job_id!r}, not {job_id!r}")
        mine = {(d, m) for d, m in accepted if self.owns(d)}
        stored = {(c.device, c.message_id): c for c in self.store.contributions(job_id, with_payload=False)
                  if (c.device, c.message_id) in mine}
        if len(stored) != len(mine):
            lost = sorted(mine - stored.keys())[:5]
            raise StoreError(f"shard {self.index} lacks accepted contributions {lost} (its store was replaced?)")
        by_bucket_rows: dict[int, list] = {}
        for key, c in stored.items():
            by_bucket_rows.setdefault(bucket_of(key[0]), []).append(c)
        return by_bucket_rows

    def _contributions(self, rows: list) -> list[Contribution]:
        """Stored rows as contributions in canonical order, each loaded when the sum reaches it."""
        return [c for members in by_bucket((c.device, c.round, self._loader(c.seq)) for c in rows).values()
                for c in members]

    def _loader(self, seq: int):
        job_id = self.job_id
        return lambda job: job.parse_accepted(decode(self.store.contribution_payload(job_id, seq)))
