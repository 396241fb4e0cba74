"""A secure job (Fed3R-Sync, FedNCM-Sync, the secure FedAvg family, secure LADD) as the coordinator
of K shards serves it: the rounds, the groups and the model are the job's own; each group's server machine runs on a shard.

Theory of operation
-------------------
A secure job runs every round as one SecAgg(+) group (``aggregator/jobs/secure_rounds.py``): the
round's participants, the vector length, the bound and the fixed-point scale make one signed
``RoundConfig``. Unmasking is the costly part, and the masked vectors are the large messages.

* **Placement.** The coordinator's job chooses the round's members and builds its ``RoundConfig``
  exactly as one aggregator's would, then releases the group unstarted
  (``SecureGroupRounds.release_group``) with its *hosting context*: what the job's server machine
  reads besides the protocol (``{}``, but secure LADD's gate before the unmasking reads the round's
  slot layout and its members' clusters, which only the coordinator's style round knows).
  :class:`ShardedSecureJob` hands both to the shard ``round % K`` (``group_placement.py``): a fixed
  rule, consecutive groups on consecutive shards. That shard builds the job from its config (the
  aggregator's identity, the enrolled keys), checks the context against the signed configuration,
  and runs the group's server machine (``shard_groups.py``): every phase, the phase timers, the
  consistency check, the job's own checks between them, the unmasking (on its GPU when it has
  one). A round that opens no group (secure LADD's plaintext style round) is the coordinator's:
  its results are forwarded by the devices' shards like any message the shard does not take.
* **Routing.** A device's outbox is read by the shard owning its bucket (``buckets.py``, as for
  plain shards) and, while it is a member of a group hosted elsewhere, by that group's shard too:
  the host subscribes to its members' outboxes when the group is placed, before it sends the
  group's first message (one MQTT connection: the broker sees the subscription first), and
  unsubscribes from those of other buckets when the group ends (else every shard would come to
  read every device). A secagg
  message is taken only by the shard hosting its round and dropped by every other (the coordinator
  never sees one); everything else (presence, declines) goes to the coordinator through the
  device's own shard only. The host publishes the group's messages to its members' inboxes,
  signed with the aggregator's identity, as the coordinator signs its own.
* **Refusals.** A member the group's server machine refuses (one advertising a public key another
  member advertised first) is told to the coordinator as it is refused, before the group's end, so
  the round's log entry carries it as ``secure_refused`` exactly as one aggregator's does.
* **Sums.** The host sends the coordinator the unmasked group sum (the exact fixed-point sum,
  decoded) and its survivors, or the group's failure and its reason; the coordinator's job applies
  it (``SecureGroupRounds.group_summed``: the bound check, then the job's own ``on_secure_sum``)
  in round order, exactly as one aggregator applies the sum it unmasked itself. Same members, same
  configuration, same integers: the model is one aggregator's bit for bit. (Groups are the job's
  rounds, one at a time, so no reduction tree is needed; what a shard saves the coordinator is the
  masked vectors' traffic and the unmasking, not concurrency.)
* **Deadline.** When the coordinator closes a round whose group is still running it decides: the
  group fails with the reason ("deadline") and the host is told to abort it (its members erase
  their secrets); a sum the host sends after that is dropped.
* **A host SIGKILLed mid-round** loses the group's secrets (never persisted, as in one aggregator
  after a restart): the coordinator restarts the shard on its store and **fails the group at
  once, with the reason** (``shard i hosting the group exited ...: its secrets died with it``);
  nothing of it is applied and the job goes on, its next round placed on the next shard. The
  devices of the lost group stay eligible, so a later group takes them (Fed3R-Sync: every device
  still counts once, in different groups than an uninterrupted run's, so the model equals the
  plain sums to the fixed-point resolution, not the uninterrupted run's bits).
* **The coordinator SIGKILLed** takes its shards with it; restarted, it finds the open round's
  group nowhere (``secure_round_live`` is False) and closes it with nothing applied, exactly as
  one aggregator does after a restart.
"""

from __future__ import annotations

import logging
import queue
from typing import Any

import numpy as np

from protocols.envelope import Envelope, EnvelopeError
from protocols.rounds import RoundClosed
from protocols.secagg import RoundConfig

from aggregator.jobs.base import Job
from aggregator.shards.coordinated_job import CoordinatedJob
from aggregator.shards.group_placement import SecureGroupPlacement

log = logging.getLogger("fedfleet.aggregator.shards")


class ShardedSecureJob(CoordinatedJob):
    secure_rounds = True

    def __init__(self, inner: Job, kind: str, pool):
        super().__init__(inner, kind)
        self.pool = pool
        self.identity = inner.identity          # the service signs with the job's identity
        self._unplaced: tuple[RoundConfig, dict] | None = None     # (config, hosting context)
        self._offline_unplaced: set[str] = set()     # its members gone before it was placed: told its host then

    contributions = property(lambda self: self.inner.contributions)
    failed_rounds = property(lambda self: self.inner.failed_rounds)
    culprits = property(lambda self: self.inner.culprits)      # named by the shards hosting the groups
    order_free = property(lambda self: self.inner.order_free)
    evaluate_at_round_close = property(lambda self: self.inner.evaluate_at_round_close)

    def screened_devices(self) -> dict[str, str]:
        return self.inner.screened_devices()

    def note_reachable(self, devices: set[str]) -> None:
        self.inner.note_reachable(devices)

    def next_participants(self, online: set[str]) -> list[str]:
        chosen = self.inner.next_participants(online)
        if chosen and self.inner.has_unstarted_group:       # (a plaintext round opens none)
            self._unplaced, self._offline_unplaced = self.inner.release_group(), set()
        return chosen

    # ---------------------------------------------------------------- the service's hooks
    def on_protocol_tick(self, now: float) -> list[tuple[str, Envelope]]:
        """Place the round's group (the first tick after its tasks went out, as one aggregator
        starts it), then apply what the hosts sent: a group's sum or its failure."""
        if self._unplaced is not None:
            (config, context), self._unplaced = self._unplaced, None
            self.pool.open_group(SecureGroupPlacement.shard_of(config.round_id, self.pool.shards), config, context)
            for device in sorted(self._offline_unplaced & set(config.members)):
                self.pool.tell_group(config.round_id, "group_offline", device)
            self._offline_unplaced = set()
        while True:
            try:
                outcome = self.pool.group_outcomes.get_nowait()
            except queue.Empty:
                return []
            self._group_outcome(*outcome)

    def _group_outcome(self, job_id: str, what: str, round_id: int, culprits: tuple[str, ...], *details: Any) -> None:
        if job_id != self.inner.config.job_id:
            return log.info("a %s of job %s's secure round %d, not this job's: dropped", what, job_id, round_id)
        # as one aggregator does: out of the later rounds, whether or not the round is still open here
        # (a round closed at its deadline while its host convicted them: dropped, they came back)
        self.inner.note_culprits(round_id, culprits)
        if round_id not in self.pool.placed:
            return log.info("secure round %d: its host's %s came after the round closed: dropped", round_id, what)
        if what == "refused":       # members the group left out, each with why: the round log's, as one aggregator's
            return self.inner.note_refused(round_id, dict(details[0]))
        self.pool.group_ended(round_id)
        if what == "sum":
            total, survivors = details
            self.inner.group_summed(round_id, np.asarray(total), tuple(survivors))
        else:
            log.warning("secure round %d failed on its shard: %s (nothing applied)", round_id, details[0])
            self.inner.group_failed(round_id, str(details[0]))

    def on_protocol(self, device: str, env: Envelope, now: float) -> list[tuple[str, Envelope]]:
        raise EnvelopeError("a secure-aggregation message belongs to the shard hosting its group, not here")

    def member_offline(self, device: str, now: float) -> list[tuple[str, Envelope]]:
        if self._unplaced is not None:      # told its host once placed (one aggregator's idle server keeps it too)
            self._offline_unplaced.add(device)
        for round_id in list(self.pool.placed):
            self.pool.tell_group(round_id, "group_offline", device)
        return []

    def secure_round_live(self, round_: int) -> bool:
        placing = self._unplaced is not None and self._unplaced[0].round_id == round_
        return placing or round_ in self.pool.placed or self.inner.runs_plaintext(round_)

    def settled(self, round_: int) -> tuple[str, ...] | None:
        return self.inner.settled(round_)

    def secure_failure(self, round_: int) -> str | None:
        return self.inner.secure_failure(round_)

    def secure_phase_times(self, round_: int) -> dict[str, float] | None:
        return None          # the group's phases ran on the shard hosting it, which logs them

    def secure_refusals(self, round_: int) -> dict[str, str] | None:
        return self.inner.secure_refusals(round_)      # told by the group's host as it refused them

    def abort_secure_round(self, round_id: int, reason: str) -> None:
        """The coordinator decides: the group fails now; its host is told to abort it."""
        if self._unplaced is not None and self._unplaced[0].round_id == round_id:
            self._unplaced, self._offline_unplaced = None, set()
        elif round_id not in self.pool.placed:
            return
        self.pool.tell_group(round_id, "group_abort", reason)
        self.pool.group_ended(round_id)
        log.warning("secure round %d: %s: aborted, nothing applied", round_id, reason)
        self.inner.group_failed(round_id, reason)

    def close_round(self, closed: RoundClosed) -> None:
        self.abort_secure_round(closed.round, "deadline")
        self.inner.close_round(closed)

    # ---------------------------------------------------------------- the job's own
    def parse_result(self, env: Envelope) -> Any:
        return self.inner.parse_result(env)

    def apply(self, device: str, payload: Any) -> None:
        self.inner.apply(device, payload)
