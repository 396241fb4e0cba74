"""Secure aggregation rounds for jobs whose devices send one fixed-shape vector each.

A job mixing in :class:`SecureGroupRounds` runs each of its rounds as one SecAgg (or SecAgg+)
group: it calls :meth:`open_secure_round` with the round's members, the vector length and the
per-entry bound, and receives the group sum in :meth:`on_secure_sum` (or the failure in
:meth:`on_secure_failure`; then *nothing* may be applied). The aggregator only ever holds
masked vectors and that sum.

The service speaks the sub-protocol through the hooks ``on_protocol`` (a ``secagg`` envelope
from a device), ``on_protocol_tick`` (phase timers) and ``member_offline`` (a member known to be
gone: its phase is not held open for it until the timeout) — all return ``(device, envelope)``
pairs to publish — and ``settled(round)``, which tells it once which devices' data the round's sum
holds, so the round machine records them as accepted; ``secure_round_live(round)`` tells it
whether a round can still produce a sum (not after a restart: secrets are never persisted, the
job's state is checkpointed at each round close). ``abort_secure_round`` is for the deadline.
The final unmasking runs on the GPU when there is one (aggregator/compute/mask_expansion.py).

A job declares it by subclassing :class:`SecureGroupRounds` (``secure_rounds`` is then True) and
calling :meth:`~SecureGroupRounds._init_secure` from its constructor; its config is a
:class:`~aggregator.jobs.secure_fields.SecureAggregationFields`, whose files name the
aggregator's Ed25519 identity and the enrolled device keys.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Callable

import numpy as np

from protocols.envelope import Envelope, EnvelopeError
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import UnsendableMessage, from_envelope, to_envelope
from protocols.secagg import (AggregateReady, MaskedInput, MemberOffline, Message, Phase, RoundConfig, RoundFailed,
                              ShareAccusation,
                              SecAggError, ServerSecAgg, ServerState, Timeout)
from protocols.secagg.errors import ConfigError, LateMessage
from protocols.secagg.config import MAX_GROUP_SIZE, MAX_VECTOR_LENGTH, check_mask_words, largest_mask_expansions
from protocols.secagg.distributed_dp import device_stddev, noise_scale_bits, noisy_bound
from protocols.topics import AGGREGATOR_ID

from aggregator.compute.mask_expansion import pick_mask_applier
from aggregator.compute.privacy import UNPUBLISHED_PREFIX
from aggregator.jobs.base import Job
from aggregator.jobs.phase_clock import PhaseClock
from aggregator.jobs.secure_fields import SecureAggregationFields
from aggregator.jobs.upload_window import MaskedUploadWindow, window_size

log = logging.getLogger("fedfleet.aggregator.secagg")
MIN_GROUP = 3      # fewer devices cannot hide anyone's update in a sum


def checked_vector_length(length: int, config: SecureAggregationFields,
                          smaller: str = "train a smaller model (num_classes x feature_dim)") -> int:
    """``length``, the job's secure vector, refused when the job is built (one clear config error)
    rather than at its first round's opening when SecAgg cannot sum that many entries, or when its
    largest round (``config``'s clients_per_round, and the stragglers that join the last group, on
    its graph) would ask a member to expand more mask words than a device does (MAX_MASK_WORDS:
    every device would refuse it). ``smaller``: what shortens this job's vector, said in the error."""
    if length > MAX_VECTOR_LENGTH:
        raise ValueError(f"the secure vector would hold {length:,} entries, more than SecAgg's {MAX_VECTOR_LENGTH:,}: "
                         f"{smaller} or run without secure aggregation")
    members = min(config.clients_per_round + MIN_GROUP - 1, MAX_GROUP_SIZE)
    try:
        check_mask_words(largest_mask_expansions(config.graph, members, config.expected_dropout), length)
    except ConfigError as exc:
        raise ValueError(f"a round of up to {members:,} members on the {config.graph!r} graph: {exc} "
                         "(protocols/secagg/config.py MAX_MASK_WORDS): draw fewer clients_per_round, use the graph "
                         f"\"auto\" or \"regular\", or {smaller}") from None
    return length


def config_vector_length(config: SecureAggregationFields) -> int | None:
    """``config.secure_vector_length()`` held to ``checked_vector_length``'s limits, or None where
    the length takes the initial model (checked when the job is built from it). The registry's
    ``checked_config`` calls it, so every entry point that accepts a config refuses one the job
    would refuse when built, before anything is stored; the jobs call it for their own length."""
    length = config.secure_vector_length()
    return None if length is None else checked_vector_length(length, config, config.secure_vector_remedy())


KEPT_ROUNDS = 64        # the latest rounds a job's per-round bookkeeping keeps unread


class BoundedByRound(dict):
    """A dict by round that keeps the KEPT_ROUNDS entries set last (the oldest go)."""

    def __setitem__(self, round_: int, value) -> None:
        super().__setitem__(round_, value)
        while len(self) > KEPT_ROUNDS:
            del self[next(iter(self))]

    def setdefault(self, round_: int, default=None):
        if round_ not in self:
            self[round_] = default
        return self[round_]

class GroupSumOutOfBound(ValueError):
    """A group's unmasked sum breaks the bound its members' honest inputs respect
    (``on_secure_sum`` raises it): the group is discarded like a failed round and reported."""


class LateProtocolMessage(EnvelopeError):
    """A secure-aggregation message for a round that already ended: answered with silence and
    counted as late, like a late result (a slow device's unmask share after the sum was made)."""


def protocol_refusal(exc: EnvelopeError) -> str:
    """How a refused secure-aggregation message is counted, by one aggregator and by the shard
    hosting its group alike: "late" (a :class:`LateProtocolMessage`, ``ServiceStats.late``), else
    the rejection class "protocol"."""
    return "late" if isinstance(exc, LateProtocolMessage) else "protocol"


CULPRITS_STATE = UNPUBLISHED_PREFIX + "secagg_culprits"      # SecureGroupRounds.culprits in a checkpoint


class SecureGroupRounds(Job):
    secure_rounds = True

    def _init_secure(self, identity: DeviceIdentity | None, registry: IdentityRegistry | None) -> None:
        """The aggregator's identity and the enrolled device keys: those given, else the files the
        config names (a job built from its config alone)."""
        if identity is None or registry is None:
            loaded_identity, loaded_registry = self.config.load_identities()
            identity, registry = identity or loaded_identity, registry or loaded_registry
        self.identity, self.registry = identity, registry
        self._newest_round = 0
        self.secure: ServerSecAgg | None = None
        self._uploads: MaskedUploadWindow | None = None    # the running round's paced masked inputs
        self._start_pending = False
        self._clock: PhaseClock | None = None      # when the running round's open phase gives up waiting
        self._phase_opened = 0.0
        # round -> phase -> seconds it stayed open; round -> who is in its sum: each read once, by the
        # runner; bounded (KEPT_ROUNDS), since a shard hosting groups, or a round aborted after it
        # closed, leaves entries nobody reads (a review's finding: a few hundred bytes a round)
        self._phase_s: dict[int, dict[str, float]] = BoundedByRound()
        self._settled: dict[int, tuple[str, ...]] = BoundedByRound()
        self._refused: dict[int, dict[str, str]] = BoundedByRound()    # round -> member -> why it was left out
        self._opened_here: set[int] = set()     # the secure rounds this process opened (not restored)
        self.failed_rounds: list[tuple[int, str]] = []
        # senders of share rows a majority of their recipients could not decrypt (ServerSecAgg.culprits):
        # the runner leaves them out of this job's later rounds, so one such device fails at most
        # the round it was drawn into
        self.culprits: set[str] = set()
        self._pending_sends: list[tuple[str, Envelope]] = []   # abort notices of a round closed by its deadline
        self.reachable: set[str] = set()       # online, or offline within the grace period (the runner's view)
        # set on a shard hosting the job's groups: (round, unmasked sum, survivors) go there, unapplied
        self.hand_sums_to: Callable[[int, np.ndarray, tuple[str, ...]], None] | None = None
        # and the members its group refuses, as it refuses them (round, member -> why): the round log's there
        self.hand_refusals_to: Callable[[int, dict[str, str]], None] | None = None

    def note_reachable(self, devices: set[str]) -> None:
        """Who may still answer (the runner tells before each round): a group can wait for them."""
        self.reachable = set(devices)

    # ---------------------------------------------------------------- for the job
    def open_secure_round(self, round_id: int, members: list[str], vector_length: int, bound: float,
                          group_id: str | None = None, scale_bits: int | None = None,
                          threshold: int | None = None) -> None:
        """``group_id`` (default ``g<round>``) is signed into the round configuration; a job can
        bind more of the round's contract to it (e.g. a digest of the vector layout).
        ``scale_bits``: pinned for distributed DP (default: the finest safe scale)."""
        self._opened_here.add(round_id)
        config = RoundConfig.create(job_id=self.config.job_id, round_id=round_id, group_id=group_id or f"g{round_id}",
                                    aggregator_id=AGGREGATOR_ID, members=members, vector_length=vector_length,
                                    bound=bound, graph=self.config.graph, scale_bits=scale_bits, threshold=threshold,
                                    dropout_rate=self.config.expected_dropout, ring_bits=self.config.ring_bits)
        self.host_group(config)

    def host_group(self, config: RoundConfig, context: dict | None = None) -> None:
        """Run the group's server machine in this process: the job's own, or on the shard a shard
        coordinator placed the group on (``aggregator/shards/shard_groups.py``), with what the
        coordinator's job gave besides the configuration (``hosting_context``)."""
        self.secure = ServerSecAgg(config, self.identity, self.registry, mask_applier=pick_mask_applier())
        # a slot is leased for half the phase timeout: a member silent that long gives it up before
        # the phase would time out on everyone held behind it
        self._uploads = MaskedUploadWindow(window_size(self.config.upload_window_bytes, config.vector_length,
                                                       config.codec.word.itemsize), self.config.phase_timeout_s / 2)
        self._clock = PhaseClock(self.config.phase_timeout_s, self.config.round_timeout_s,
                                 len(Phase) if config.consistency_check else len(Phase) - 1)
        self._newest_round = max(self._newest_round, config.round_id)
        self._start_pending = True

    @property
    def has_unstarted_group(self) -> bool:
        """Whether the round just opened has a group to start (a plaintext round has none)."""
        return self.secure is not None and self._start_pending

    def release_group(self) -> tuple[RoundConfig, dict]:
        """Give the group just opened away, unstarted (a shard coordinator places it on a shard,
        ``aggregator/shards/secure_groups.py``): its signed configuration and its hosting context;
        this job holds no machine."""
        if not self.has_unstarted_group:
            raise RuntimeError("no unstarted secure group to release")
        config, self.secure, self._start_pending = self.secure.config, None, False
        return config, self.hosting_context(config)

    def hosting_context(self, config: RoundConfig) -> dict:
        """What a host of ``config``'s group needs besides the signed configuration: nothing, for a
        job whose server machine runs the protocol alone; a job that checks more between its phases
        (secure LADD's cluster slots) hands its host what the check reads. Plain data: it crosses
        a pipe or a Ray call."""
        return {}

    def runs_plaintext(self, round_: int) -> bool:
        """Whether round ``round_`` sums no group (secure LADD's style rounds): its results come in
        the clear and the round machine closes it as usual."""
        return False

    def open_dp_round(self, round_id: int, members: list[str], vector_length: int, data_bound: float,
                      total_stddev: float, group_id: str | None = None) -> dict:
        """A secure round under distributed DP: each member adds noise of stddev σ/√t (t the round's
        threshold, ``group_threshold``: no sum is revealed with fewer survivors), the bound makes room for it and the
        scale is pinned; returns the ``dp`` task params the members need."""
        threshold = self.config.group_threshold(len(members))
        stddev = device_stddev(total_stddev, threshold)
        bound = noisy_bound(data_bound, stddev)
        scale_bits = noise_scale_bits(stddev, bound, len(members))
        self.open_secure_round(round_id, members, vector_length, bound, group_id=group_id, scale_bits=scale_bits,
                               threshold=threshold)
        assert self.secure.config.threshold == threshold
        return {"stddev": stddev, "scale_bits": scale_bits, "threshold": threshold}

    @abstractmethod
    def on_secure_sum(self, total: np.ndarray, survivors: tuple[str, ...]) -> None:
        """The round's group sum is in: add it to the model (``survivors``: whose data it holds)."""

    def on_secure_failure(self, round_id: int, reason: str) -> None:
        """Nothing was applied; jobs may count the failure (the default records it)."""

    def abort_secure_round(self, round_id: int, reason: str) -> None:
        """Give a running round up (its deadline); the members' abort notices go out with the
        next ``on_protocol_tick``."""
        if self.secure is not None and self.secure.config.round_id == round_id:
            log.warning("secure round %d: %s: aborted, nothing applied", round_id, reason)
            self._pending_sends.extend(self._route(self.secure.abort(reason)))

    # ---------------------------------------------------------------- for the service
    def on_protocol_tick(self, now: float) -> list[tuple[str, Envelope]]:
        if self._pending_sends:
            sends, self._pending_sends = self._pending_sends, []
            return sends
        if self.secure is None:
            return []
        if self._start_pending:          # tasks went out when the round opened; now the keys phase
            self._start_pending, self._phase_opened = False, now
            self._clock.start(now)
            return self._route(self.secure.start())
        if self.secure.phase is not None and self._clock.due(now):
            return self._route(self._timed(Timeout(self.secure.phase), now))
        return self._expire_upload_slots(now) if self._uploads is not None else []

    def _expire_upload_slots(self, now: float) -> list[tuple[str, Envelope]]:
        """Slots held past their lease go to the next members held; the operator hears how many."""
        before = self._uploads.overdue
        released = self._uploads.expire(now)
        if self._uploads.overdue > before:
            log.info("secure round %d: %d member(s) asked for their masked input sent nothing within %.0f s; "
                     "their upload slots go to the next members", self.secure.config.round_id,
                     self._uploads.overdue - before, self._uploads.lease_s)
        return self._route(released, paced=True)

    def on_protocol(self, device: str, env: Envelope, now: float) -> list[tuple[str, Envelope]]:
        msg = from_envelope(env)
        if msg.sender != device:
            raise EnvelopeError(f"secagg message from {device!r} claims sender {msg.sender!r}")
        if self.secure is None or msg.round_id != self.secure.config.round_id:
            if isinstance(msg.round_id, int) and 0 < msg.round_id <= self._newest_round:
                raise LateProtocolMessage(f"secure round {msg.round_id} has ended")
            raise EnvelopeError(f"no secure round {msg.round_id} open")
        try:
            sends = self._feed(msg, now)
        except LateMessage as exc:       # a slow member's message for a phase that has closed
            raise LateProtocolMessage(f"secagg: {exc}") from exc
        except SecAggError as exc:
            raise EnvelopeError(f"secagg: {type(exc).__name__}: {exc}") from exc
        return sends + self._next_uploads(device) if isinstance(msg, MaskedInput) else sends

    def _feed(self, event, now: float) -> list[tuple[str, Envelope]]:
        """One event into the running round. Every accepted answer (and every closed phase) restarts
        the phase's idle timer: a phase times out after ``phase_timeout_s`` without progress, not
        ``phase_timeout_s`` after it opened, or at its share of the round's time (``PhaseClock``). A group of 1,000 devices that each compute their
        statistics and upload megabytes keeps answering for longer than any one device needs;
        a fixed timer cut such phases off and turned the slower devices' answers late (the round
        deadline still bounds the whole round). A member going offline is no progress unless it
        closes the phase: a device flapping its presence held the phase open to the deadline. Nor is
        an accusation (it precedes its sender's masked input, which is the answer)."""
        before = self.secure.phase
        out = self._timed(event, now)
        if self.secure is not None and (not isinstance(event, (MemberOffline, ShareAccusation))
                                        or self.secure.phase is not before):
            self._clock.progress(now)
        return self._route(out)

    def _timed(self, event, now: float) -> list:
        """The machine's outputs for ``event``; when a phase closes, how long it was open (the
        round log's ``secure_phase_s``: where a large group's round spends its time)."""
        before, round_id = self.secure.phase, self.secure.config.round_id
        out = self.secure.handle(event)
        if before is not None and self.secure.phase is not before:
            self._phase_s.setdefault(round_id, {})[before.value] = round(now - self._phase_opened, 3)
            self._phase_opened = now
            if self.secure.phase is not None:
                self._clock.opened(now)
        return out

    def secure_phase_times(self, round_: int) -> dict[str, float] | None:
        """Seconds each closed phase of round ``round_`` stayed open, once."""
        return self._phase_s.pop(round_, None)

    def member_offline(self, device: str, now: float) -> list[tuple[str, Envelope]]:
        """A member of the running round went offline (or was revoked): stop waiting for it."""
        if self.secure is None:
            return []
        return self._feed(MemberOffline(device), now) + self._next_uploads(device)

    def _next_uploads(self, device: str) -> list[tuple[str, Envelope]]:
        """``device`` uploaded its masked input or went away: the next paced members' shares."""
        return self._route(self._uploads.answered(device), paced=True) if self._uploads is not None else []

    def secure_round_live(self, round_: int) -> bool:
        """Whether round ``round_`` has a running SecAgg instance (False after a restart), or is
        a plaintext round (its results, not a group, settle it)."""
        if self.runs_plaintext(round_):
            return True
        return self.secure is not None and self.secure.config.round_id == round_

    def lost_to_restart(self, round_: int) -> bool:
        """Round ``round_`` is a secure round another process opened (restored after a restart): its
        group died with that process, and whether it unmasked its sum first is not known here."""
        return round_ not in self._opened_here and not self.runs_plaintext(round_)

    def settled(self, round_: int) -> tuple[str, ...] | None:
        """Devices whose data the round's sum holds (empty: failed), once; None while running."""
        return self._settled.pop(round_, None)

    def _route(self, outputs, paced: bool = False) -> list[tuple[str, Envelope]]:
        """The machine's outputs: messages as envelopes to send (forwarded shares through the upload
        window, unless ``paced``: the window released them), sums and failures applied."""
        if self.secure is not None:
            self.note_culprits(self.secure.config.round_id, self.secure.culprits)
            self.note_refused(self.secure.config.round_id, self.secure.refused)
        if self._uploads is not None and not paced:
            outputs = self._uploads.admit(list(outputs))
            if self.secure is None or self.secure.state is not ServerState.WAIT_MASKED:
                summary = self._uploads.clear()    # the masked phase is over (or never began): nobody more is asked
                if summary is not None:
                    log.info("secure round %d: %s", self._newest_round, summary)
        sends = []
        for o in outputs:
            if isinstance(o, Message):
                try:
                    sends.append((o.recipient, to_envelope(o)))
                except UnsendableMessage as exc:
                    return self._unsendable(exc)
            elif isinstance(o, AggregateReady):
                round_id = self.secure.config.round_id
                # Who is in the sum is decided here, by the protocol, not by the round machine's view
                # of presence: a device may go offline right after sending its masked input.
                survivors = tuple(sorted(o.survivors))
                self.secure = None
                if self.hand_sums_to is not None:       # a shard hosting the group: its coordinator applies it
                    self.hand_sums_to(round_id, o.decode(), survivors)
                    self._settled[round_id] = survivors
                else:
                    self.group_summed(round_id, o.decode(), survivors)
            elif isinstance(o, RoundFailed):
                round_id = self.secure.config.round_id
                log.warning("secure round %d failed: %s (nothing applied)", round_id, o.reason)
                self.group_failed(round_id, str(o.reason))
        return sends

    def group_summed(self, round_id: int, total: np.ndarray, survivors: tuple[str, ...]) -> None:
        """Apply a group's unmasked sum (made here, or on the shard hosting the group), or discard
        it, failed, when it breaks its members' bound."""
        try:
            self.on_secure_sum(total, survivors)
        except GroupSumOutOfBound as exc:        # bounded influence: nothing of it is applied
            log.warning("secure round %d: group sum discarded: %s", round_id, exc)
            self.group_failed(round_id, f"group sum out of bound: {exc}")
            return
        self._settled[round_id] = survivors
        log.info("secure round %d: sum of %d devices", round_id, len(survivors))

    def _unsendable(self, exc: UnsendableMessage) -> list[tuple[str, Envelope]]:
        """A message of the round cannot be built (e.g. a complete graph's key directory beyond the
        envelope's header limit): the round cannot go on, so it fails now with that reason, once,
        and its members are told to erase their secrets; nothing the phase produced is sent."""
        round_id = self.secure.config.round_id
        log.error("secure round %d: a message cannot be sent (%s): round failed, nothing applied", round_id, exc)
        return self._route(self.secure.abort(f"message cannot be sent: {exc}"))

    def note_culprits(self, round_id: int, named) -> None:
        """Members round ``round_id``'s server machine named (here, or on the shard that hosted the
        group): left out of this job's later rounds, said once each."""
        new = sorted(set(named) - self.culprits)
        if new:
            self.culprits.update(new)
            log.warning("secure round %d: %s sent share rows a majority of their recipients could not decrypt: "
                        "left out of this job's later rounds", round_id, ", ".join(new))

    def note_refused(self, round_id: int, refused: dict[str, str]) -> None:
        """Members round ``round_id``'s server machine left out (``ServerSecAgg.refused``, here or on
        the shard that hosts the group): said once each, kept for the round's log entry
        (``secure_refusals``), and on a shard hosting the group handed to its coordinator."""
        known = self._refused.get(round_id, {})
        new = {device: why for device, why in refused.items() if device not in known}
        for device in sorted(new):
            log.warning("secure round %d: %s refused for the round (a dropout): %s", round_id, device, new[device])
        if new:
            self._refused[round_id] = {**known, **new}
            if self.hand_refusals_to is not None:
                self.hand_refusals_to(round_id, new)

    def secure_refusals(self, round_: int) -> dict[str, str] | None:
        """Members round ``round_``'s group refused, with why, once (the round log's ``secure_refused``)."""
        return self._refused.pop(round_, None)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The culprits go with the checkpoint every round's close writes (a secure job needs them),
        the close of the round that named them included, so a restarted aggregator keeps them out
        (kept in memory only, each cost a round again); unpublished: never in the job's files."""
        return {**super().state_dict(), CULPRITS_STATE: np.array(sorted(self.culprits), dtype=str)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        state = dict(state)
        named = state.pop(CULPRITS_STATE, None)         # a checkpoint written before they were kept has none
        super().load_state_dict(state)
        if named is not None:
            self.culprits.update(str(device) for device in np.asarray(named).reshape(-1))

    def secure_failure(self, round_: int) -> str | None:
        """Why round ``round_`` produced no sum (None: it did, or has not ended)."""
        return next((reason for failed, reason in reversed(self.failed_rounds) if failed == round_), None)

    def group_failed(self, round_id: int, reason: str) -> None:
        """The group produced no sum (here, or on the shard hosting it): nothing applied, the reason kept."""
        self.failed_rounds.append((round_id, reason))
        self._settled[round_id] = ()
        self.secure = None
        self.on_secure_failure(round_id, reason)
