"""Client side of secure aggregation as a sans-IO state machine.

Theory of operation
-------------------
One ClientSecAgg object runs one round for one device. The caller feeds it events with
`handle(event)` and sends whatever messages it returns to the aggregator; it owns no socket,
thread or clock. Events are the aggregator's messages (already decoded with
messages.decode) and Timeout(phase) from the caller's clock. The float input vector is given at
construction or later with `provide_input(x)`; it is needed only when the masked input is built.

The rules are one :class:`~protocols.transition_table.TransitionTable`, :data:`CLIENT_TABLE`
(``python -m protocols.secagg`` prints it and the server's; docs/secure-aggregation.md shows it, a test
keeps the two equal). A phase's row runs its handler, which checks the message and computes the
reply, then commits; its ``ABORTED`` is a ProtocolViolation (below).

Every incoming message must come from the aggregator, be addressed to this device, carry this
round's (job, round, group) and verify under the aggregator's identity key; otherwise
WrongContext / UnknownSender / BadSignature is raised and nothing changes. A message that
does not fit the state raises UnexpectedMessage (ReplayedMessage if it repeats one already
handled). Handlers compute everything first and commit at the end, so any error leaves the
state untouched -- except ProtocolViolation (e.g. a request for both shares of one peer, or an
unmask request that declares this device dropped), which aborts the round and erases the
secrets, because the server is then provably misbehaving.

A client answers at most one UnmaskRequest, and the request's survivor and dropped sets are
disjoint, so it never reveals both the b-share and the s-share of any peer.

``release_guard`` (optional, the device's): asked, once every check has passed, before the
masked input leaves (with the key directory's participants U1: any sum revealing it is over a
subset of them) and before the unmask shares leave (with the survivors U3: the sum revealed).
A reason it returns aborts the round (ReleaseRefused), erasing the secrets. The device uses it
against multi-round differencing (edge_client/secure_inputs.py); this package keeps no memory
across rounds.
"""

from __future__ import annotations

import enum
import functools
import os
from typing import Any, Callable, Protocol

import numpy as np

from protocols.identity import DeviceIdentity, InvalidSignature, verify_signature
from protocols.transition_table import IllegalTransition, Transition, TransitionTable

from . import shamir
from .config import RoundConfig
from .crypto import aead_decrypt, aead_encrypt, apply_masks, generate_x25519, x25519_private_bytes, \
    x25519_public_bytes
from .derivation import SECRET_BYTES, SHARE_BYTES, SHARE_CIPHERTEXT_BYTES, RoundContext, pair_mask_seed, \
    pair_mask_sign, self_mask_commitment, share_associated_data, share_encryption_key
from .errors import (BadSignature, ConfigError, DecryptionError, InputError, MalformedMessage, ProtocolViolation,
                     ReleaseRefused, ReplayedMessage, UnexpectedMessage, UnknownSender, WrongContext)
from .events import Phase, Timeout
from .graph import NeighbourGraph
from .messages import (AdvertiseKeys, ConsistencyCheckRequest, ConsistencySignature, EncryptedShares,
                       ForwardedShares, KeyDirectory, MaskedInput, Message, RoundAborted, RoundStart,
                       ShareAccusation, UnmaskRequest, UnmaskShares, consistency_statement)


class ReleaseGuard(Protocol):
    """The device's say over whether its input may leave in this round (module doc): a reason to
    refuse, or None. Each is asked at most once per round, last, so None means it leaves."""

    def masked_input(self, participants: frozenset[str]) -> str | None: ...

    def unmask(self, survivors: frozenset[str]) -> str | None: ...


class ClientState(str, enum.Enum):
    WAITING_CONFIG = "waiting_config"
    ADVERTISED = "advertised"
    SHARES_SENT = "shares_sent"
    INPUT_SENT = "input_sent"
    CONSISTENCY_SENT = "consistency_sent"
    FINISHED = "finished"
    ABORTED = "aborted"


_S = ClientState
FINAL_STATES = frozenset({_S.FINISHED, _S.ABORTED})


# Every member of a group checks the same t of the same survivors' signatures of the same statement:
# t·n Ed25519 verifications per round (667,000 for 1,000 members), and each of its k neighbours'
# signed key advertisements (34,000 for 1,000 members of degree 34), which a process hosting many
# emulated devices (fedfleet simulate: 500 per host) would otherwise repeat for each of them. A
# verification's outcome depends only on these bytes, so it is kept, for one group's worth of
# signers; a device alone in its process verifies each signature once, as before.
@functools.lru_cache(maxsize=8192)
def consistency_signature_valid(public_key: bytes, statement: bytes, signature: bytes) -> bool:
    try:
        verify_signature(public_key, statement, signature)
    except InvalidSignature:
        return False
    return True


@functools.lru_cache(maxsize=8192)
def advertisement_valid(context: RoundContext, sender: str, recipient: str, cipher_public_key: bytes,
                        mask_public_key: bytes, signature: bytes, identity_public_key: bytes) -> bool:
    """Whether ``sender``'s AdvertiseKeys to ``recipient`` with these keys carries its signature
    under ``identity_public_key`` (the key directory's entries are checked with it: the server
    cannot substitute a neighbour's keys)."""
    advertised = AdvertiseKeys(job_id=context.job_id, round_id=context.round_id, group_id=context.group_id,
                               sender=sender, recipient=recipient, cipher_public_key=cipher_public_key,
                               mask_public_key=mask_public_key, signature=signature)
    try:
        advertised.verify(identity_public_key)
    except InvalidSignature:
        return False
    return True


class ClientSecAgg:
    def __init__(self, identity: DeviceIdentity, aggregator_id: str, aggregator_public_key: bytes, *,
                 job_id: str, round_id: int, group_id: str, input_vector: np.ndarray | None = None,
                 ring_bits: int | None = None, release_guard: ReleaseGuard | None = None) -> None:
        """``ring_bits``: the ring this device's input needs (a device adding distributed-DP noise,
        scaled for the 64-bit ring, asks for 64); a round in another ring is refused at its start.
        None: whichever ring the round declares. ``release_guard``: the module doc."""
        self.identity = identity
        self.release_guard = release_guard
        self.required_ring_bits = ring_bits
        self.device_id = identity.device_id
        self.aggregator_id = aggregator_id
        self.aggregator_public_key = bytes(aggregator_public_key)
        self.context = RoundContext(job_id, round_id, group_id)
        self.state = ClientState.WAITING_CONFIG
        self.config: RoundConfig | None = None
        self._raw_input = None if input_vector is None else np.asarray(input_vector)
        self._encoded_input: np.ndarray | None = None
        self._handled: set[type] = set()
        # secrets and per-round knowledge, filled as phases complete
        self._cipher_key = self._mask_key = None
        self._self_mask_seed: bytes | None = None
        self._participants: frozenset[str] = frozenset()
        self._graph: NeighbourGraph | None = None          # over the participants, from the key directory
        self._identity_keys: dict[str, bytes] = {}
        self._neighbours: frozenset[str] = frozenset()
        self._neighbour_keys: dict[str, Any] = {}
        self._share_keys: dict[str, bytes] = {}
        self._own_shares: tuple[bytes, bytes] | None = None
        self._held_shares: dict[str, tuple[bytes, bytes]] = {}  # owner -> (share of s^SK, share of b)
        self._u2_neighbours: frozenset[str] = frozenset()
        self._signed_survivors: bytes | None = None  # the U3 bitmap this device signed
        self.revealed: dict[str, str] = {}  # peer -> "self_mask" | "mask_key": what this device disclosed
        self.abort_reason: str | None = None  # the server's, when it aborted the round
        self.accused: tuple[str, ...] = ()     # neighbours whose share rows did not decrypt

    # ---- public API --------------------------------------------------------------------
    def provide_input(self, values: np.ndarray) -> None:
        """Give (or replace) the float vector to aggregate; allowed until the masked input is sent."""
        if self.state not in (_S.WAITING_CONFIG, _S.ADVERTISED, _S.SHARES_SENT):
            raise InputError(f"input can no longer change in state {self.state.value}")
        values = np.asarray(values)
        encoded = self._encode(values, self.config) if self.config is not None else None
        self._raw_input, self._encoded_input = values, encoded

    @property
    def phase(self) -> Phase | None:
        """The phase whose opening request this client awaits (RoundStart opens ADVERTISE_KEYS, the
        KeyDirectory SHARE_KEYS, ...), None once its round is over: what the caller's clock names in
        a Timeout (any one aborts a live round: CLIENT_TABLE's Timeout row)."""
        if self.state is _S.INPUT_SENT:
            return Phase.CONSISTENCY_CHECK if self.config.consistency_check else Phase.UNMASK
        return _AWAITED_PHASE.get(self.state)

    def handle(self, event: Message | Timeout) -> list[Message]:
        """The replies to `event`, by CLIENT_TABLE. A message is authenticated first; one the table
        has no row for in this state is refused (UnexpectedMessage, ReplayedMessage), changing nothing."""
        if isinstance(event, Message):
            self._authenticate(event)
        elif not isinstance(event, Timeout):
            raise UnexpectedMessage(f"not a secagg event: {type(event).__name__}")
        try:
            return CLIENT_TABLE.fire(self, event)
        except IllegalTransition:
            raise self._refusal(event) from None

    def _refusal(self, message: Message) -> UnexpectedMessage:
        if self.state in FINAL_STATES:
            return UnexpectedMessage(f"{message.TYPE}: round already {self.state.value}")
        if type(message) in self._handled:
            return ReplayedMessage(f"{message.TYPE} already handled")
        return UnexpectedMessage(f"{message.TYPE} not expected in state {self.state.value}")

    # ---- guards and effects of CLIENT_TABLE's rows (the phase handlers are below) --------
    def _checks_consistency(self, _message) -> bool:
        return self.config.consistency_check

    def _refuse(self, message: Message) -> list[Message]:
        raise self._refusal(message)

    def _time_out(self, _timeout: Timeout) -> list[Message]:
        self._abort()
        return []

    def _server_aborted(self, message: RoundAborted) -> list[Message]:
        self.abort_reason = message.reason
        self._abort()
        return []

    def _note_abort_reason(self, message: RoundAborted) -> list[Message]:
        self.abort_reason = message.reason
        return []

    def _ignore(self, _event) -> list[Message]:
        return []

    # ---- checks ------------------------------------------------------------------------
    def _authenticate(self, message: Message) -> None:
        if message.FROM_CLIENT:
            raise UnexpectedMessage(f"{message.TYPE} is a client message")
        if RoundContext(message.job_id, message.round_id, message.group_id) != self.context:
            raise WrongContext(f"{message.TYPE} is for job {message.job_id!r} round {message.round_id} group "
                               f"{message.group_id!r}, this round is {self.context}")
        if message.recipient != self.device_id:
            raise WrongContext(f"{message.TYPE} is addressed to {message.recipient!r}")
        if message.sender != self.aggregator_id:
            raise UnknownSender(f"{message.TYPE} from {message.sender!r}, expected the aggregator")
        message.verify(self.aggregator_public_key)

    @staticmethod
    def _encode(values: np.ndarray, config: RoundConfig) -> np.ndarray:
        if values.shape != (config.vector_length,):
            raise InputError(f"input shape {values.shape} != ({config.vector_length},)")
        return config.codec.encode(values)

    def _reply(self, cls: type, **fields: Any) -> Message:
        return cls(job_id=self.context.job_id, round_id=self.context.round_id, group_id=self.context.group_id,
                   sender=self.device_id, recipient=self.aggregator_id, **fields).signed(self.identity)

    def _check_survivor_set(self, survivors: tuple[str, ...]) -> None:
        if self.device_id not in survivors:
            raise ProtocolViolation("the survivor set leaves out this device, which did send its input")
        if not set(survivors) <= self._participants:
            raise ProtocolViolation("survivor set names devices that did not advertise keys")
        if len(survivors) < self.config.threshold:
            raise ProtocolViolation(f"only {len(survivors)} survivors, threshold is {self.config.threshold}")
        stray = (set(survivors) & self._neighbours) - self._u2_neighbours
        if stray:
            raise ProtocolViolation(f"survivors {sorted(stray)} never sent their shares")
        if not self._graph.connects(survivors):
            # SecAgg+: dropouts the server chose could cut the graph; each part's sum would be unmasked
            raise ProtocolViolation("the survivors' graph falls apart: the server would learn its parts' sums")

    # ---- handlers: compute, then commit -------------------------------------------------
    def _on_round_start(self, message: RoundStart) -> list[Message]:
        config = message.config
        if (config.job_id, config.round_id, config.group_id) != \
                (self.context.job_id, self.context.round_id, self.context.group_id) \
                or config.aggregator_id != self.aggregator_id:
            raise WrongContext("round config does not describe this round")
        if self.device_id not in config.members:
            raise WrongContext(f"{self.device_id!r} is not a member of group {config.group_id!r}")
        if self.required_ring_bits is not None and config.ring_bits != self.required_ring_bits:
            raise ConfigError(f"this device's input needs the {self.required_ring_bits}-bit ring, the round "
                              f"declares ring_bits {config.ring_bits}")
        encoded = None if self._raw_input is None else self._encode(self._raw_input, config)
        cipher_key, mask_key = generate_x25519(), generate_x25519()
        reply = self._reply(AdvertiseKeys, cipher_public_key=x25519_public_bytes(cipher_key),
                            mask_public_key=x25519_public_bytes(mask_key))
        self.config, self._encoded_input = config, encoded
        # the float input is not needed once encoded (provide_input encodes anew): a device host of
        # a 1,000-member Fed3R-Sync round would otherwise hold two 6.7 MB copies per member
        self._raw_input = None
        self._cipher_key, self._mask_key = cipher_key, mask_key
        return [reply]

    def _on_key_directory(self, message: KeyDirectory) -> list[Message]:
        config = self.config
        participants = config.from_bitmap(message.participants)
        if self.device_id not in participants:
            raise ProtocolViolation("key directory leaves out this device, which advertised its keys")
        if len(participants) < config.threshold:
            raise ProtocolViolation(f"{len(participants)} participants < threshold {config.threshold}")
        graph = config.neighbour_graph(participants)
        neighbours = graph.neighbours(self.device_id)
        entries = {entry.device_id: entry for entry in message.neighbour_keys}
        if set(entries) != neighbours:
            raise ProtocolViolation("key directory does not hold exactly this device's graph neighbours")
        identity_keys = {device: entry.identity_public_key for device, entry in entries.items()}
        identity_keys[self.device_id] = self.identity.public_key_bytes
        if config.consistency_check:  # all of U1's identity keys, to check consistency signatures
            if message.identity_keys.shape[0] != len(participants):
                raise MalformedMessage("key directory must carry one identity key per participant")
            raw = message.identity_keys.tobytes()         # slicing bytes: ~5x cheaper than a row's tobytes
            width = message.identity_keys.shape[1] if message.identity_keys.ndim == 2 else 0
            everyone = {device: raw[i * width:(i + 1) * width] for i, device in enumerate(participants)}
            if any(everyone[device] != key for device, key in identity_keys.items()):
                raise ProtocolViolation("key directory lists two different identity keys for one device")
            identity_keys = everyone
        own_cipher = x25519_public_bytes(self._cipher_key)
        share_keys = {}
        for device, entry in entries.items():
            if entry.cipher_public_key == own_cipher:
                raise ProtocolViolation(f"{device!r} advertises this device's own key")
            if not advertisement_valid(self.context, device, self.aggregator_id, entry.cipher_public_key,
                                       entry.mask_public_key, entry.advertise_signature, identity_keys[device]):
                raise BadSignature(f"{AdvertiseKeys.TYPE} from {device!r}: its signature does not verify")
            share_keys[device] = share_encryption_key(self._cipher_key, entry.cipher_public_key, self.context,
                                                      self.device_id, device)
        holders = sorted(neighbours | {self.device_id})
        self_mask_seed = os.urandom(SECRET_BYTES)
        shares = shamir.split([x25519_private_bytes(self._mask_key), self_mask_seed], config.share_threshold,
                              [config.holder_x(h) for h in holders])
        share_of = dict(zip(holders, shares))
        recipients = tuple(sorted(neighbours))
        ciphertexts = np.empty((len(recipients), SHARE_CIPHERTEXT_BYTES), dtype=np.uint8)
        for row, device in enumerate(recipients):
            blob = aead_encrypt(share_keys[device], b"".join(share_of[device]),
                                share_associated_data(self.context, self.device_id, device))
            ciphertexts[row] = np.frombuffer(blob, dtype=np.uint8)
        reply = self._reply(EncryptedShares, recipients=recipients, ciphertexts=ciphertexts,
                            self_mask_commitment=self_mask_commitment(self.context, self.device_id, self_mask_seed))
        self._participants, self._identity_keys, self._graph = frozenset(participants), identity_keys, graph
        self._neighbours, self._neighbour_keys = neighbours, entries
        self._share_keys, self._self_mask_seed = share_keys, self_mask_seed
        self._own_shares = tuple(share_of[self.device_id])
        return [reply]

    def _on_forwarded_shares(self, message: ForwardedShares) -> list[Message]:
        if not set(message.senders) <= self._neighbours:
            raise ProtocolViolation("forwarded shares from devices that are not graph neighbours")
        if len(message.senders) + 1 < self.config.share_threshold:
            # y_u would carry too few pair masks: with none, y_u = x_u + PRG(b_u), and the other
            # holders (told u sent shares) reveal b_u at the unmasking (a review's finding). With
            # fewer holders than t', b_u could not be rebuilt anyway: an honest round cannot need it
            raise ProtocolViolation(f"only {len(message.senders)} neighbours' shares forwarded: fewer than "
                                    f"share threshold {self.config.share_threshold} holders, this device's input "
                                    "would be unmaskable alone")
        if message.ciphertexts.shape[1] != SHARE_CIPHERTEXT_BYTES:
            raise MalformedMessage(f"share ciphertexts must be {SHARE_CIPHERTEXT_BYTES} bytes wide")
        if self._encoded_input is None:
            raise InputError("no input vector provided before the masked-input phase")
        held, accused = {}, []
        for device, row in zip(message.senders, message.ciphertexts):
            try:
                plaintext = aead_decrypt(self._share_keys[device], row.tobytes(),
                                         share_associated_data(self.context, device, self.device_id))
            except DecryptionError:     # its shares are lost to this member; the other holders cover them
                accused.append(device)
                continue
            held[device] = (plaintext[:SHARE_BYTES], plaintext[SHARE_BYTES:])
        masked = self._encoded_input.copy()
        seeds = [(self._self_mask_seed, 1)]
        for device in message.senders:
            seed = pair_mask_seed(self._mask_key, self._neighbour_keys[device].mask_public_key, self.context,
                                  self.device_id, device)
            seeds.append((seed, pair_mask_sign(self.device_id, device)))
        apply_masks(masked, seeds)
        replies = [self._reply(ShareAccusation, accused=tuple(accused))] if accused else []
        replies.append(self._reply(MaskedInput, masked_input=masked))       # after it: it may close the phase
        if self.release_guard is not None:                                  # last: it may record the release
            _refuse_if(self.release_guard.masked_input(self._participants))
        self._held_shares, self._u2_neighbours = held, frozenset(message.senders)
        self.accused = tuple(accused)
        self._encoded_input = self._raw_input = None
        return replies

    def _on_consistency_request(self, message: ConsistencyCheckRequest) -> list[Message]:
        self._check_survivor_set(self.config.from_bitmap(message.survivors))
        statement = consistency_statement(self.context.job_id, self.context.round_id, self.context.group_id,
                                          message.survivors)
        reply = self._reply(ConsistencySignature, survivors_signature=self.identity.sign(statement))
        self._signed_survivors = message.survivors.tobytes()
        return [reply]

    def _on_unmask_request(self, message: UnmaskRequest) -> list[Message]:
        survivors = set(self.config.from_bitmap(message.survivors))
        dropped = set(self.config.from_bitmap(message.dropped))
        if survivors & dropped:
            raise ProtocolViolation(f"request asks for both shares of {sorted(survivors & dropped)}")
        self._check_survivor_set(tuple(survivors))
        if self.config.consistency_check:
            if message.survivors.tobytes() != self._signed_survivors:
                raise ProtocolViolation("survivor set differs from the one this device signed")
            self._check_consistency_signatures(message)
        self_mask_owners, key_owners = [], []
        for owner in sorted(set(self._held_shares) | {self.device_id}):     # an accused sender's: none held
            if owner in survivors:
                self_mask_owners.append(owner)
            elif owner in dropped:
                key_owners.append(owner)
        shares = dict(self._held_shares)
        shares[self.device_id] = self._own_shares

        def rows(owners: list[str], index: int) -> np.ndarray:
            out = np.empty((len(owners), SHARE_BYTES), dtype=np.uint8)
            for row, owner in enumerate(owners):
                out[row] = np.frombuffer(shares[owner][index], dtype=np.uint8)
            return out

        reply = self._reply(UnmaskShares, self_mask_owners=tuple(self_mask_owners),
                            self_mask_shares=rows(self_mask_owners, 1), key_owners=tuple(key_owners),
                            key_shares=rows(key_owners, 0))
        if self.release_guard is not None:
            _refuse_if(self.release_guard.unmask(frozenset(survivors)))
        self.revealed = {**{o: "self_mask" for o in self_mask_owners}, **{o: "mask_key" for o in key_owners}}
        self._erase_secrets()
        return [reply]

    def _check_consistency_signatures(self, message: UnmaskRequest) -> None:
        signers = self.config.from_bitmap(message.consistency_signers)
        if message.consistency_signatures.shape != (len(signers), 64):
            raise MalformedMessage("one 64-byte consistency signature per signer expected")
        statement = consistency_statement(self.context.job_id, self.context.round_id, self.context.group_id,
                                          message.survivors)
        survivors = set(self.config.from_bitmap(message.survivors))
        valid = 0
        for signer, signature in zip(signers, message.consistency_signatures):
            if signer not in survivors:
                continue
            if not consistency_signature_valid(self._identity_keys[signer], statement, signature.tobytes()):
                continue
            valid += 1
            if valid >= self.config.threshold:
                return
        raise ProtocolViolation(f"only {valid} valid consistency signatures, need {self.config.threshold}")

    # ---- teardown ----------------------------------------------------------------------
    def _erase_secrets(self) -> None:
        self._cipher_key = self._mask_key = None
        self._self_mask_seed = None
        self._share_keys, self._held_shares, self._own_shares = {}, {}, None
        self._encoded_input = self._raw_input = None

    def _abort(self) -> None:
        self._erase_secrets()
        self.state = ClientState.ABORTED


def _refuse_if(reason: str | None) -> None:
    """The release guard's answer: a reason refuses the release (the round is aborted)."""
    if reason is not None:
        raise ReleaseRefused(reason)


def _phase(handler: Callable[[ClientSecAgg, Message], list[Message]], next_state: ClientState):
    """A phase row's effect: the handler computes the reply, then the phase is recorded and the
    state moves on. A ProtocolViolation (the server provably misbehaves) or a ReleaseRefused (the
    device's release guard) aborts the round first."""
    def effect(client: ClientSecAgg, message: Message) -> list[Message]:
        try:
            outgoing = handler(client, message)
        except (ProtocolViolation, ReleaseRefused):
            client._abort()
            raise
        client._handled.add(type(message))
        client.state = next_state
        return outgoing
    return effect


# the phase each state waits in (INPUT_SENT's depends on the config: ClientSecAgg.phase)
_AWAITED_PHASE = {_S.WAITING_CONFIG: Phase.ADVERTISE_KEYS, _S.ADVERTISED: Phase.SHARE_KEYS,
                  _S.SHARES_SENT: Phase.MASKED_INPUT, _S.CONSISTENCY_SENT: Phase.UNMASK}

_C = ClientSecAgg
_LIVE = tuple(state for state in ClientState if state not in FINAL_STATES)
_OVER = (_S.FINISHED, _S.ABORTED)
CLIENT_TABLE = TransitionTable(ClientState, [
    Transition(_S.WAITING_CONFIG, RoundStart, "", _phase(_C._on_round_start, _S.ADVERTISED), (AdvertiseKeys,),
               (_S.ADVERTISED,), note="check the config, encode the input, fresh X25519 keys c_u, s_u"),
    Transition(_S.ADVERTISED, KeyDirectory, "", _phase(_C._on_key_directory, _S.SHARES_SENT), (EncryptedShares,),
               (_S.SHARES_SENT, _S.ABORTED), note="check neighbours' key signatures; Shamir-split s_u^SK, b_u; "
               "encrypt a share per neighbour"),
    Transition(_S.SHARES_SENT, ForwardedShares, "", _phase(_C._on_forwarded_shares, _S.INPUT_SENT),
               (ShareAccusation, MaskedInput), (_S.INPUT_SENT, _S.ABORTED),
               note="decrypt U2's shares (rows that do not: ShareAccusation of their senders, first); "
               "y_u = x_u + PRG(b_u) + sum_v +-PRG(s_uv)"),
    Transition(_S.INPUT_SENT, ConsistencyCheckRequest, "the config has the check",
               _phase(_C._on_consistency_request, _S.CONSISTENCY_SENT), (ConsistencySignature,),
               (_S.CONSISTENCY_SENT, _S.ABORTED), note="sign U3", guard=_C._checks_consistency),
    Transition(_S.INPUT_SENT, ConsistencyCheckRequest, "", _C._refuse, note="refused (UnexpectedMessage)"),
    Transition(_S.INPUT_SENT, UnmaskRequest, "the config has the check", _C._refuse,
               note="refused: U3 is signed first", guard=_C._checks_consistency),
    Transition(_S.INPUT_SENT, UnmaskRequest, "", _phase(_C._on_unmask_request, _S.FINISHED), (UnmaskShares,),
               (_S.FINISHED, _S.ABORTED), note="as below, no signatures to check"),
    Transition(_S.CONSISTENCY_SENT, UnmaskRequest, "", _phase(_C._on_unmask_request, _S.FINISHED), (UnmaskShares,),
               (_S.FINISHED, _S.ABORTED), note="check >= t signatures on U3; per peer the share of b_v or of "
               "s_v^SK, never both; erase secrets"),
    Transition(_LIVE, Timeout, "", _C._time_out, goes_to=(_S.ABORTED,), note="any phase's: erase secrets"),
    Transition(_OVER, Timeout, "", _C._ignore),
    Transition(_LIVE, RoundAborted, "", _C._server_aborted, goes_to=(_S.ABORTED,),
               note="the server gave up: erase secrets, keep its reason"),
    Transition(_OVER, RoundAborted, "", _C._note_abort_reason, note="keep its reason"),
])
