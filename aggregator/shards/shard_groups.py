"""A shard's side of secure groups (theory of operation: ``secure_groups.py``): the server machine
of the group its coordinator placed on it, driven by the shard's loop (``local.py``).

Sans-IO like :class:`~aggregator.shards.shard.ShardIngest`, which owns one: the machine is the
job's own (:class:`~aggregator.jobs.secure_rounds.SecureGroupRounds`, built by the shard from the
job's config, so with the aggregator's identity and the enrolled keys its files name), whose
unmasked sum is handed on (:attr:`~aggregator.jobs.secure_rounds.SecureGroupRounds.hand_sums_to`)
instead of applied. Each call returns the ``(device, envelope)`` pairs to publish (signed with the
aggregator's identity, :attr:`signer`), and a message its machine refuses raises (:meth:`feed`: the
shard tells the coordinator, which counts it); :meth:`outcomes` what the coordinator must be told: the
members the group refused, as it refuses them (``("group", job_id, "refused", round, culprits,
{member: why})``, a copied public key: the round log's ``secure_refused``, as one aggregator's), and
once the group ended ``("group", job_id, "sum", round, culprits, total, survivors)`` or ``("group",
job_id, "failed", round, culprits, reason)`` (the job id: an outcome of a job the coordinator no
longer serves is dropped there; culprits: members the hosted rounds named, ``SecureGroupRounds.culprits``).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from protocols.envelope import Envelope
from protocols.secagg import RoundConfig, SecAggError

from aggregator.jobs.secure_rounds import SecureGroupRounds

log = logging.getLogger("fedfleet.aggregator.shard")

Sends = list[tuple[str, Envelope]]


class ShardGroups:
    def __init__(self, index: int, job: SecureGroupRounds):
        self.index, self.job = index, job
        job.hand_sums_to, job.hand_refusals_to = self._summed, self._refused
        self._notices: list[tuple] = []             # the hosted group's refusals, not yet told
        self.held: int | None = None                # the round whose group runs here
        self.members: set[str] = set()              # the hosted group's devices (their outboxes are read)
        self._sum: tuple[np.ndarray, tuple[str, ...]] | None = None

    @property
    def signer(self) -> Callable[[bytes], bytes]:
        return self.job.identity.sign

    def open(self, config: RoundConfig, context: dict) -> Sends:
        """Host ``config``'s group with the coordinator job's ``context`` (one at a time: a group
        still held is given up first, failed). A group this job cannot host fails with the reason."""
        sends = self.abort(self.held, "superseded by the next group") if self.held is not None else []
        self.held, self._sum = config.round_id, None
        try:
            self.job.host_group(config, context)
        except (ValueError, KeyError, TypeError, SecAggError) as exc:    # e.g. a member its device keys lack
            log.error("shard %d: cannot host secure round %d: %s", self.index, config.round_id, exc)
            self.job.group_failed(config.round_id, f"its shard cannot host it: {exc}")
            return sends
        self.members = set(config.members)
        log.info("shard %d: hosting secure round %d (%d members)", self.index, config.round_id, len(config.members))
        return sends

    def feed(self, device: str, env: Envelope, now: float) -> Sends:
        """A secagg message naming the hosted group's round: into the machine, which answers for it.
        One it refuses raises EnvelopeError (:class:`~aggregator.jobs.secure_rounds.LateProtocolMessage`:
        a late one), as anything else it raises does: the shard's caller tells the coordinator, which
        counts it as one aggregator's ``_on_protocol`` (or its loop's last resort) counts it. A
        message naming another round (a group hosted elsewhere, or ended) or none is dropped here
        uncounted: its round's host, if any, reads it too, and only one shard may count it."""
        header = env.body.get("secagg")
        if self.held is None or not isinstance(header, dict) or header.get("round_id") != self.held:
            return []
        return self.job.on_protocol(device, env, now)

    def tick(self, now: float) -> Sends:
        return self.job.on_protocol_tick(now)

    def offline(self, round_id: int, device: str, now: float) -> Sends:
        return self.job.member_offline(device, now) if round_id == self.held else []

    def abort(self, round_id: int, reason: str) -> Sends:
        """Give the group up (the coordinator closed its round); the abort notices go out now."""
        if round_id != self.held:
            return []
        self.job.abort_secure_round(round_id, reason)
        return self.job.on_protocol_tick(0.0)

    def outcomes(self) -> list[tuple]:
        notices, self._notices = self._notices, []
        return notices + self._ended()

    def _ended(self) -> list[tuple]:
        if self.held is None:
            return []
        survivors = self.job.settled(self.held)
        if survivors is None:
            return []
        round_id, self.held, self.members = self.held, None, set()
        culprits = tuple(sorted(self.job.culprits))     # the coordinator's job leaves them out of its later rounds
        if not survivors:
            return [("group", self.job.config.job_id, "failed", round_id, culprits,
                     self.job.secure_failure(round_id) or "failed")]
        total, survivors = self._sum
        self._sum = None
        return [("group", self.job.config.job_id, "sum", round_id, culprits, total, survivors)]

    def _summed(self, round_id: int, total: np.ndarray, survivors: tuple[str, ...]) -> None:
        self._sum = (total, survivors)

    def _refused(self, round_id: int, refused: dict[str, str]) -> None:
        self._notices.append(("group", self.job.config.job_id, "refused", round_id, tuple(sorted(self.job.culprits)),
                              dict(refused)))
