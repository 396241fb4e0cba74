"""Server (aggregator) side of secure aggregation as a sans-IO state machine.

Theory of operation
-------------------
One ServerSecAgg object runs one round for one group. `start()` returns a signed RoundStart
for every member; afterwards the caller feeds `handle(event)` with decoded client messages
and Timeout(phase) events from its own clock, and sends out whatever it returns. Outputs
addressed to devices are Message objects; the final output is AggregateReady (exact sum of the
survivors' encoded inputs modulo 2^r, r the round's ring_bits) or RoundFailed (no partial sum). A phase closes as soon
as every device expected in it has answered (members the caller reported with MemberOffline are
not waited for), or when Timeout(that phase) arrives.

The rules are one :class:`~protocols.transition_table.TransitionTable`, :data:`SERVER_TABLE`
(``python -m protocols.secagg`` prints it and the client's; docs/secure-aggregation.md shows
them, a test keeps the two equal). Each wait state has one :class:`PhaseRule`: the message it
accepts (U1 .. U5 are who delivered it), the check run before anything is kept, and what closing
it sends; a phase with fewer than t participants, or a failed reconstruction, ends in FAILED, and so
does the close of the masked or consistency phase when its members can no longer unmask the round
(:class:`~protocols.secagg.coverage.UnmaskCoverage`: a split survivors' graph, or a secret short of
t' live share holders), before anyone is asked for a share.

Masked inputs are added into one accumulator of ring words as they arrive (nothing per-client is
kept). At the end the masks left in it are found from the survivors' shares (unmasking.py: each
survivor's self mask, each dropped member's pair masks with its surviving neighbours, every
reconstructed secret checked against what its owner committed to). Removing them is one pure
call, mask_applier(accumulator, signed seeds): by default crypto.apply_masks with the expansion
split over `workers` threads (default: the usable cores, capped), bit-identical to one thread.
A server with an accelerator passes its own applier (the aggregator's CUDA kernel,
aggregator/compute/mask_expansion.py); it must produce exactly crypto.apply_masks' bits.

Every incoming message must name this round's (job, round, group), be addressed to the
aggregator, come from an enrolled member of the group, and verify under that member's
identity key; otherwise WrongContext / UnknownSender / BadSignature is raised and nothing
changes (server_checks.py). A message of another phase raises UnexpectedMessage (ReplayedMessage
if the sender already delivered it); malformed content raises MalformedMessage; in all cases the
state is untouched and the round goes on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.transition_table import ANY, IllegalTransition, Transition, TransitionTable

from .accusations import ShareAccusations
from .config import RoundConfig
from .coverage import UnmaskCoverage
from .crypto import apply_masks, check_workers, default_mask_workers
from .derivation import SHARE_CIPHERTEXT_BYTES, RoundContext
from .errors import ConfigError, LateMessage, ReconstructionError, ReplayedMessage, UnexpectedMessage
from .events import AbortRound, AggregateReady, MemberOffline, Phase, RoundFailed, StartRound, Timeout
from .graph import NeighbourGraph
from .messages import (AdvertisedKeys, AdvertiseKeys, ConsistencyCheckRequest, ConsistencySignature,
                       EncryptedShares, ForwardedShares, KeyDirectory, MaskedInput, Message, RoundAborted, RoundStart,
                       ShareAccusation, UnmaskRequest, UnmaskShares)
from .server_checks import (authenticate, check_advertised_keys, check_consistency_signature, check_share_rows,
                            check_unmask_shares, copied_key)
from .unmasking import mask_seeds_to_remove


# accumulator += sum(sign * PRG(seed)) mod 2^64 in place, for (seed, sign) pairs
MaskApplier = Callable[[np.ndarray, Sequence[tuple[bytes, int]]], None]


class ServerState(str, enum.Enum):
    IDLE = "idle"
    WAIT_ADVERTISE = "wait_advertise"
    WAIT_SHARES = "wait_shares"
    WAIT_MASKED = "wait_masked"
    WAIT_CONSISTENCY = "wait_consistency"
    WAIT_UNMASK = "wait_unmask"
    DONE = "done"
    FAILED = "failed"


_S = ServerState
FINAL_STATES = frozenset({_S.DONE, _S.FAILED})
_PHASE_ORDER = list(Phase)
Output = Message | AggregateReady | RoundFailed


class ServerSecAgg:
    def __init__(self, config: RoundConfig, identity: DeviceIdentity, registry: IdentityRegistry, *,
                 workers: int | None = None, mask_applier: MaskApplier | None = None) -> None:
        """`workers`: threads for the final mask expansion (None: default_mask_workers());
        `mask_applier` replaces crypto.apply_masks for that expansion (then `workers` is unused).
        Local resource choices, not part of the signed round configuration: they never change
        the sum."""
        config.validate()
        try:
            self.workers = default_mask_workers() if workers is None else check_workers(workers)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.mask_applier: MaskApplier = mask_applier or partial(apply_masks, workers=self.workers)
        self._word = config.codec.word
        if identity.device_id != config.aggregator_id:
            raise ConfigError(f"aggregator identity {identity.device_id!r} != config {config.aggregator_id!r}")
        missing = [m for m in config.members if m not in registry]
        if missing:
            raise ConfigError(f"members not enrolled: {missing[:5]}{'...' if len(missing) > 5 else ''}")
        self.config = config
        self.identity = identity
        self.registry = registry
        self.context = RoundContext(config.job_id, config.round_id, config.group_id)
        self.state = ServerState.IDLE
        self.outcome: AggregateReady | RoundFailed | None = None
        # what each phase received, keyed by sender
        self._received: dict[Phase, dict[str, Any]] = {phase: {} for phase in Phase}
        self._graph: NeighbourGraph | None = None
        self._accumulator: np.ndarray | None = None
        self._dropped: tuple[str, ...] = ()
        self._members = frozenset(config.members)
        self._offline: set[str] = set()      # members the caller knows are gone: not waited for
        self._accusations = ShareAccusations()     # whose rows members of U2 could not decrypt
        # senders of share rows that a majority of their recipients could not decrypt
        # (ShareAccusation): the caller may leave them out of its next rounds
        self.culprits: set[str] = set()
        # members left out of this round, with why (a key another member advertised first): not
        # waited for, nothing more taken from them; the caller logs them
        self.refused: dict[str, str] = {}
        self._key_owner: dict[bytes, str] = {}      # every public key U1 advertised -> its member

    # ---- public API --------------------------------------------------------------------
    def start(self) -> list[Output]:
        try:
            return SERVER_TABLE.fire(self, StartRound())
        except IllegalTransition:
            raise UnexpectedMessage("round already started") from None

    @property
    def phase(self) -> Phase | None:
        rule = PHASES.get(self.state)
        return rule.phase if rule else None

    def participants(self, phase: Phase) -> tuple[str, ...]:
        """Who has delivered the message of `phase` so far (U1 .. U5)."""
        return tuple(sorted(self._received[phase]))

    def handle(self, event: Message | Timeout | MemberOffline) -> list[Output]:
        """The outputs for `event`, by SERVER_TABLE. A message is authenticated first; one the table
        has no row for in this state is refused (LateMessage, ReplayedMessage, UnexpectedMessage)."""
        if isinstance(event, Message):
            self._authenticate(event)
        elif not isinstance(event, (Timeout, MemberOffline)):
            raise UnexpectedMessage(f"not a secagg event: {type(event).__name__}")
        try:
            return SERVER_TABLE.fire(self, event)
        except IllegalTransition:
            raise self._refusal(event) from None

    def _refusal(self, message: Message) -> UnexpectedMessage:
        """Why `message` does not fit the round now (the first that applies)."""
        if self.state not in PHASES:
            return LateMessage(f"{message.TYPE} from {message.sender!r}: round is {self.state.value}")
        phase = self.phase
        if message.sender in self._received[message.PHASE]:
            return ReplayedMessage(f"{message.TYPE} from {message.sender!r} already received")
        if _PHASE_ORDER.index(message.PHASE) < _PHASE_ORDER.index(phase):
            return LateMessage(f"{message.TYPE} from {message.sender!r}: phase {message.PHASE.value} has closed")
        return UnexpectedMessage(f"{message.TYPE} from {message.sender!r} does not belong to phase {phase.value}")

    # ---- guards and effects of SERVER_TABLE's rows ---------------------------------------
    def _send_round_start(self, _ev: StartRound) -> list[Output]:
        outgoing = [self._message(RoundStart, member, config=self.config) for member in self.config.members]
        self.state = ServerState.WAIT_ADVERTISE
        return outgoing

    def _receive(self, message: Message) -> list[Output]:
        """Check, keep, and close the phase once everyone expected answered."""
        phase = self.phase
        if message.sender in self._received[phase]:
            raise self._refusal(message)
        if message.sender in self.refused:
            raise UnexpectedMessage(f"{message.sender!r} was refused for this round: {self.refused[message.sender]}")
        if message.sender not in self._expected(phase):
            raise UnexpectedMessage(f"{message.sender!r} is not a participant of phase {phase.value}")
        self._received[phase][message.sender] = PHASES[self.state].check(self, message)
        self._offline.discard(message.sender)          # it answered: it is back
        return self._close_phase() if self._phase_answered() else []

    def _note_accusation(self, accusation: ShareAccusation) -> list[Output]:
        """Keep who a member of U2 says sent it share rows that do not decrypt (``ShareAccusations.note``:
        once per member, while its masked input is awaited, each accused one of the neighbours whose
        rows it was forwarded); counted when the phase closes."""
        accuser = accusation.sender
        awaited = accuser in self._expected(Phase.MASKED_INPUT) and accuser not in self._received[Phase.MASKED_INPUT]
        # only a member of U2 is in the graph: another's accusation is refused as not awaited
        forwarded = self._graph.neighbours(accuser) & set(self._received[Phase.SHARE_KEYS]) if awaited else set()
        self._accusations.note(accusation, awaited, forwarded)
        return []

    def _convict(self) -> None:
        """The masked phase is closing: its culprits (``ShareAccusations.culprits``) are named."""
        uploads = self._received[Phase.SHARE_KEYS]
        self.culprits |= self._accusations.culprits(lambda device: len(uploads[device].recipients))

    def _copies_a_key(self, message: AdvertiseKeys) -> bool:
        """A first advert whose cipher or mask key another member advertised already."""
        if message.sender in self._received[Phase.ADVERTISE_KEYS] or message.sender in self.refused:
            return False            # a replay, or a refused member again: _receive says so
        return copied_key(message, self._key_owner) is not None

    def _refuse_copied_key(self, message: AdvertiseKeys) -> list[Output]:
        """Leave the copier out of the round, as a dropout. Kept, the copy would reach the owner's
        neighbours in the key directory; the owner, seeing its own cipher key as a neighbour's,
        aborts and erases its secrets (a mask key copied would leave pair masks nobody can cancel).
        The first advert of a key keeps it: the server cannot tell who made it, and one that came
        in first was in no key directory yet, so it cannot be a copy of one."""
        which, owner = copied_key(message, self._key_owner)
        self.refused[message.sender] = f"its {which} public key is the one {owner!r} advertised"
        return self._close_phase() if self._phase_answered() else []

    def _times_out_open_phase(self, timeout: Timeout) -> bool:
        return timeout.phase == self.phase

    def _close_on_timeout(self, _timeout: Timeout) -> list[Output]:
        return self._close_phase()

    def _not_a_member(self, event: MemberOffline) -> bool:
        return event.device not in self._members

    def _offline_completes_phase(self, event: MemberOffline) -> bool:
        return self._phase_answered(self._offline | {event.device})

    def _offline_closes(self, event: MemberOffline) -> list[Output]:
        self._offline.add(event.device)
        return self._close_phase()

    def _note_offline(self, event: MemberOffline) -> list[Output]:
        self._offline.add(event.device)
        return []

    def _abort_round(self, event: AbortRound) -> list[Output]:
        return self._fail(f"aborted: {event.reason}")

    def _ignore(self, _event) -> list[Output]:
        return []

    # ---- helpers -----------------------------------------------------------------------
    def _message(self, cls: type, recipient: str, **fields: Any) -> Message:
        return cls(job_id=self.context.job_id, round_id=self.context.round_id, group_id=self.context.group_id,
                   sender=self.config.aggregator_id, recipient=recipient, **fields).signed(self.identity)

    def _authenticate(self, message: Message) -> None:
        authenticate(message, self.config, self.context, self._members, self.registry, self._word)

    def _expected(self, phase: Phase) -> dict[str, Any] | frozenset[str]:
        """Who may send in `phase`: everyone of the previous phase's set."""
        previous = {Phase.ADVERTISE_KEYS: None, Phase.SHARE_KEYS: Phase.ADVERTISE_KEYS,
                    Phase.MASKED_INPUT: Phase.SHARE_KEYS, Phase.CONSISTENCY_CHECK: Phase.MASKED_INPUT,
                    Phase.UNMASK: (Phase.CONSISTENCY_CHECK if self.config.consistency_check
                                   else Phase.MASKED_INPUT)}[phase]
        if previous is None:
            return self._members - self.refused.keys() if self.refused else self._members
        return self._received[previous]

    def _phase_answered(self, offline: set[str] | None = None) -> bool:
        """Everyone expected in the current phase answered, except members known to be offline
        (`offline`: those, the members known so far by default)."""
        offline = self._offline if offline is None else offline
        phase = self.phase
        expected, received = self._expected(phase), self._received[phase]
        if len(received) + len(offline) < len(expected):
            return False            # more are missing than are known offline: O(1) for all but the last answers
        return set(expected) - set(received) <= offline

    # ---- per-message checks (server_checks.py): raise before anything is stored, else return what to keep ---
    def _check_advertise(self, message: AdvertiseKeys) -> AdvertiseKeys:
        check_advertised_keys(message)
        # checked: it is kept, so its keys are now taken (_copies_a_key)
        self._key_owner.update({message.cipher_public_key: message.sender, message.mask_public_key: message.sender})
        return message

    def _check_shares(self, message: EncryptedShares) -> EncryptedShares:
        check_share_rows(message, self._graph.neighbours(message.sender))
        return message

    def _accumulate(self, message: MaskedInput) -> bool:
        np.add(self._accumulator, message.masked_input, out=self._accumulator)
        return True  # the vector lives on only inside the accumulator

    def _check_consistency(self, message: ConsistencySignature) -> ConsistencySignature:
        survivors = self.config.to_bitmap(self.participants(Phase.MASKED_INPUT))
        check_consistency_signature(message, self.context, survivors, self.registry.public_key(message.sender))
        return message

    def _check_unmask(self, message: UnmaskShares) -> UnmaskShares:
        owners_held = self._graph.neighbours(message.sender) | {message.sender}
        check_unmask_shares(message, self._received[Phase.MASKED_INPUT], self._received[Phase.SHARE_KEYS], owners_held)
        return message

    # ---- phase transitions -------------------------------------------------------------
    def abort(self, reason: str) -> list[Output]:
        """Give the round up now (the caller's deadline): RoundFailed plus a RoundAborted notice
        for every member. [] when the round is already over."""
        return SERVER_TABLE.fire(self, AbortRound(reason))

    def _fail(self, reason: str) -> list[Output]:
        if self.state is ServerState.WAIT_MASKED:      # the caller's deadline too: the accusations still count
            self._convict()
        if self.culprits:
            reason += f" (share rows a majority of their recipients could not decrypt: {', '.join(sorted(self.culprits))})"
        failed = RoundFailed(reason, self.phase)
        self.state, self.outcome = ServerState.FAILED, failed
        self._accumulator = None
        # tell every member, so devices erase their secrets now rather than at their own timeout
        notices = [self._message(RoundAborted, member, reason=reason[:RoundAborted.MAX_REASON])
                   for member in self.config.members]
        return [failed, *notices]

    def _close_phase(self) -> list[Output]:
        phase = self.phase
        if phase is Phase.MASKED_INPUT:
            self._convict()
        count = len(self._received[phase])
        if count < self.config.threshold:
            return self._fail(f"{phase.value}: {count} participants < threshold {self.config.threshold}")
        doomed = self._unmask_shortfall(phase) if PHASES[self.state].checks_unmask else None
        if doomed:
            return self._fail(f"{phase.value}: {doomed}")
        return PHASES[self.state].close(self)

    def _unmask_shortfall(self, phase: Phase) -> str | None:
        """Why the members who answered ``phase`` (the next phases' only askable ones) can no longer
        unmask U3's sum, if they cannot: found now, the round fails at once, rather than after
        asking them for shares it cannot use, or a phase timeout spent waiting for members who all
        refused survivors whose graph falls apart."""
        survivors = self._received[Phase.MASKED_INPUT]
        dropped = self._received[Phase.SHARE_KEYS].keys() - survivors.keys()
        coverage = UnmaskCoverage(self._graph, self.config.share_threshold, self._accusations.accusers_of())
        return coverage.shortfall(survivors, dropped, self._received[phase])

    def _send_key_directories(self) -> list[Output]:
        advertised = self._received[Phase.ADVERTISE_KEYS]
        u1 = sorted(advertised)
        self._graph = self.config.neighbour_graph(u1)
        participants = self.config.to_bitmap(u1)
        identity_keys = np.array([np.frombuffer(self.registry.public_key(d), np.uint8) for d in u1], np.uint8) \
            if self.config.consistency_check else np.zeros((0, 32), np.uint8)
        entries = {device: AdvertisedKeys(device, self.registry.public_key(device), m.cipher_public_key,
                                          m.mask_public_key, m.signature) for device, m in advertised.items()}
        outgoing = [self._message(KeyDirectory, device, participants=participants, identity_keys=identity_keys,
                                  neighbour_keys=tuple(entries[v] for v in sorted(self._graph.neighbours(device))))
                    for device in u1]
        self.state = ServerState.WAIT_SHARES
        return outgoing

    def _forward_shares(self) -> list[Output]:
        uploads = self._received[Phase.SHARE_KEYS]
        row_of = {sender: {r: i for i, r in enumerate(m.recipients)} for sender, m in uploads.items()}
        outgoing = []
        for recipient in sorted(uploads):
            senders = tuple(v for v in sorted(self._graph.neighbours(recipient)) if v in uploads)
            ciphertexts = np.empty((len(senders), SHARE_CIPHERTEXT_BYTES), dtype=np.uint8)
            for row, sender in enumerate(senders):
                ciphertexts[row] = uploads[sender].ciphertexts[row_of[sender][recipient]]
            outgoing.append(self._message(ForwardedShares, recipient, senders=senders, ciphertexts=ciphertexts))
        self._accumulator = np.zeros(self.config.vector_length, dtype=self._word)
        self.state = ServerState.WAIT_MASKED
        return outgoing

    def _request_consistency_or_unmask(self) -> list[Output]:
        u3 = self.participants(Phase.MASKED_INPUT)
        self._dropped = tuple(sorted(set(self._received[Phase.SHARE_KEYS]) - set(u3)))
        if self.config.consistency_check:
            self.state = ServerState.WAIT_CONSISTENCY
            survivors = self.config.to_bitmap(u3)
            return [self._message(ConsistencyCheckRequest, device, survivors=survivors) for device in u3]
        self.state = ServerState.WAIT_UNMASK
        return self._unmask_requests(u3, np.zeros((0, 64), np.uint8))

    def _request_unmask(self) -> list[Output]:
        signed = self._received[Phase.CONSISTENCY_CHECK]
        signers = tuple(sorted(signed))  # member order, as the signers bitmap is read
        signatures = np.array([np.frombuffer(signed[d].survivors_signature, np.uint8) for d in signers], np.uint8)
        self.state = ServerState.WAIT_UNMASK
        return self._unmask_requests(signers, signatures)

    def _unmask_requests(self, recipients: tuple[str, ...], signatures: np.ndarray) -> list[Output]:
        """UnmaskRequest to each recipient; with the consistency check the recipients are the signers."""
        fields = {"survivors": self.config.to_bitmap(self.participants(Phase.MASKED_INPUT)),
                  "dropped": self.config.to_bitmap(self._dropped),
                  "consistency_signers": self.config.to_bitmap(recipients if len(signatures) else ()),
                  "consistency_signatures": signatures}
        return [self._message(UnmaskRequest, device, **fields) for device in recipients]

    def _finish(self) -> list[Output]:
        survivors = self.participants(Phase.MASKED_INPUT)
        try:
            signed_seeds = mask_seeds_to_remove(self.config, self.context, self._graph, self._received, self._dropped)
        except ReconstructionError as exc:
            return self._fail(f"unmask: {exc}")
        total = self._accumulator
        self.mask_applier(total, signed_seeds)
        self._accumulator = None
        ready = AggregateReady(total, survivors, self.config.codec)
        self.state, self.outcome = ServerState.DONE, ready
        return [ready]


@dataclass(frozen=True)
class PhaseRule:
    """What one wait state of the server does."""
    phase: Phase
    message: type                                  # the one message type the phase accepts
    check: Callable[[ServerSecAgg, Message], Any]  # raises before anything is kept, else returns what to keep
    close: Callable[[ServerSecAgg], list[Output]]  # with >= t participants: the next phase's messages
    sends: tuple[type, ...]                        # what `close` sends
    closes_into: tuple[ServerState, ...]
    # its close fails the round when its members can no longer unmask (UnmaskCoverage)
    checks_unmask: bool = False


_V = ServerSecAgg
PHASES: dict[ServerState, PhaseRule] = {
    _S.WAIT_ADVERTISE: PhaseRule(Phase.ADVERTISE_KEYS, AdvertiseKeys, _V._check_advertise, _V._send_key_directories,
                                 (KeyDirectory,), (_S.WAIT_SHARES,)),
    _S.WAIT_SHARES: PhaseRule(Phase.SHARE_KEYS, EncryptedShares, _V._check_shares, _V._forward_shares,
                              (ForwardedShares,), (_S.WAIT_MASKED,)),
    _S.WAIT_MASKED: PhaseRule(Phase.MASKED_INPUT, MaskedInput, _V._accumulate, _V._request_consistency_or_unmask,
                              (ConsistencyCheckRequest, UnmaskRequest), (_S.WAIT_CONSISTENCY, _S.WAIT_UNMASK),
                              checks_unmask=True),
    _S.WAIT_CONSISTENCY: PhaseRule(Phase.CONSISTENCY_CHECK, ConsistencySignature, _V._check_consistency,
                                   _V._request_unmask, (UnmaskRequest,), (_S.WAIT_UNMASK,), checks_unmask=True),
    _S.WAIT_UNMASK: PhaseRule(Phase.UNMASK, UnmaskShares, _V._check_unmask, _V._finish, (AggregateReady,), (_S.DONE,)),
}
_FAILS = (RoundFailed, RoundAborted)           # a phase ending with fewer than t: the round fails, members told


def _phase_rows(state: ServerState, rule: PhaseRule) -> list[Transition]:
    sends, goes_to = (*rule.sends, *_FAILS), (*rule.closes_into, _S.FAILED)
    closes = "closes the phase" + ("; FAILED at once if its members cannot unmask (UnmaskCoverage: survivors' "
                                   "graph split, a secret < t' live holders)" if rule.checks_unmask else "")
    return [
        Transition(state, rule.message, "", _V._receive, sends, goes_to,
                   note="check, keep; " + closes.replace("phase", "phase when every expected member answered", 1)),
        Transition(state, Timeout, f"Timeout({rule.phase.value})", _V._close_on_timeout, sends, goes_to,
                   note=closes, guard=_V._times_out_open_phase),
        Transition(state, MemberOffline, "the others all answered", _V._offline_closes, sends, goes_to,
                   note=closes, guard=_V._offline_completes_phase),
    ]


SERVER_TABLE = TransitionTable(ServerState, [
    Transition(_S.IDLE, StartRound, "", _V._send_round_start, (RoundStart,), (_S.WAIT_ADVERTISE,),
               note="start(): the signed config to every member"),
    Transition(ANY, MemberOffline, "not a member", _V._ignore, guard=_V._not_a_member),
    Transition(_S.WAIT_ADVERTISE, AdvertiseKeys, "a key another member advertised", _V._refuse_copied_key,
               (KeyDirectory, *_FAILS), (_S.WAIT_SHARES, _S.FAILED), guard=_V._copies_a_key,
               note="the sender is refused for the round (a dropout, its reason kept); closes the phase when "
                    "every other expected member answered"),
    *(row for state, rule in PHASES.items() for row in _phase_rows(state, rule)),
    Transition(_S.WAIT_MASKED, ShareAccusation, "", _V._note_accusation,
               note="keep whose rows the member could not decrypt; at the phase's close, a sender accused by a "
                    "majority of its recipients, at least MIN_ACCUSERS, is a culprit"),
    Transition(ANY, Timeout, "", _V._ignore, note="a stale timeout (its phase closed)"),
    Transition(ANY, MemberOffline, "", _V._note_offline, note="not waited for from now on"),
    Transition((_S.IDLE, *PHASES), AbortRound, "", _V._abort_round, _FAILS, (_S.FAILED,),
               note="abort(reason): the caller's deadline"),
    Transition((_S.DONE, _S.FAILED), AbortRound, "", _V._ignore, note="the round is over"),
])
