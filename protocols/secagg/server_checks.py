"""What the server (server.py) checks of a client's message before it keeps anything: first
``authenticate`` (this round's job, round and group, addressed to the aggregator, from an enrolled
member of the group, a masked input of the round's shape, the signature), then the rules of the
message's phase (``check_*``). Each raises and changes nothing; the round goes on."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from protocols.identity import IdentityRegistry, InvalidSignature, UnknownDevice, verify_signature

from .config import RoundConfig
from .crypto import check_usable_public_key
from .derivation import SHARE_BYTES, SHARE_CIPHERTEXT_BYTES, RoundContext
from .errors import BadSignature, MalformedMessage, UnexpectedMessage, UnknownSender, WrongContext
from .messages import (AdvertiseKeys, ConsistencySignature, EncryptedShares, MaskedInput, Message, UnmaskShares,
                       consistency_statement)


def authenticate(message: Message, config: RoundConfig, context: RoundContext, members: Collection[str],
                 registry: IdentityRegistry, word: np.dtype) -> None:
    """``message`` is a client's, for this round, from one of its ``members``, and verifies under the
    sender's identity key (WrongContext, UnknownSender, BadSignature, UnexpectedMessage)."""
    if not message.FROM_CLIENT:
        raise UnexpectedMessage(f"{message.TYPE} is a server message")
    if RoundContext(message.job_id, message.round_id, message.group_id) != context:
        raise WrongContext(f"{message.TYPE} from {message.sender!r} is for job {message.job_id!r} round "
                           f"{message.round_id} group {message.group_id!r}, this round is {context}")
    if message.recipient != config.aggregator_id:
        raise WrongContext(f"{message.TYPE} is addressed to {message.recipient!r}")
    if message.sender not in members:
        raise UnknownSender(f"{message.sender!r} is not a member of group {config.group_id!r}")
    try:
        public_key = registry.public_key(message.sender)
    except UnknownDevice:
        raise UnknownSender(f"{message.sender!r} is not enrolled") from None
    if isinstance(message, MaskedInput):
        check_masked_words(message, config, word)   # before hashing a possibly huge array
    message.verify(public_key)


def check_advertised_keys(message: AdvertiseKeys) -> None:
    if message.cipher_public_key == message.mask_public_key:
        raise MalformedMessage("cipher and mask keys must differ")
    for key in (message.cipher_public_key, message.mask_public_key):     # else it is left out of U1
        check_usable_public_key(key)        # (every neighbour's agreement with it would fail the round)


def copied_key(message: AdvertiseKeys, key_owner: Mapping[bytes, str]) -> tuple[str, str] | None:
    """(which key, its owner) of the first of ``message``'s keys another member advertised already
    (``key_owner``: each advertised key's member), None when neither is."""
    return next(((name, key_owner[key]) for name, key in
                 (("cipher", message.cipher_public_key), ("mask", message.mask_public_key))
                 if key_owner.get(key, message.sender) != message.sender), None)


def check_share_rows(message: EncryptedShares, neighbours: Collection[str]) -> None:
    """One share row to each of the sender's graph ``neighbours``, in sorted order."""
    expected = tuple(sorted(neighbours))
    if message.recipients != expected:
        raise MalformedMessage(f"shares from {message.sender!r} must go exactly to its {len(expected)} "
                               "graph neighbours, in sorted order")
    if message.ciphertexts.shape != (len(expected), SHARE_CIPHERTEXT_BYTES):
        raise MalformedMessage(f"ciphertexts must have shape ({len(expected)}, {SHARE_CIPHERTEXT_BYTES})")


def check_masked_words(message: MaskedInput, config: RoundConfig, word: np.dtype) -> None:
    """The round's vector length, in the round's ring words (``word``)."""
    if message.masked_input.shape != (config.vector_length,):
        raise MalformedMessage(f"masked input of shape {message.masked_input.shape}, the round's vector "
                               f"length is {config.vector_length}")
    if message.masked_input.dtype != word:
        raise MalformedMessage(f"masked input of {message.masked_input.dtype} words in a "
                               f"{config.ring_bits}-bit ring (expected {word})")


def check_consistency_signature(message: ConsistencySignature, context: RoundContext, survivors: np.ndarray,
                                public_key: bytes) -> None:
    """The sender signed this round's ``survivors`` bitmap."""
    statement = consistency_statement(context.job_id, context.round_id, context.group_id, survivors)
    try:
        verify_signature(public_key, statement, message.survivors_signature)
    except InvalidSignature:
        raise BadSignature(f"consistency signature of {message.sender!r} does not verify") from None


def check_unmask_shares(message: UnmaskShares, survivors: Collection[str], share_senders: Mapping[str, object],
                        owners_held: Collection[str]) -> None:
    """One kind of share per owner: self-mask shares of surviving owners, mask-key shares of
    dropped ones (in ``share_senders``, U2, but not U3), each an owner the sender holds shares of
    (``owners_held``: the sender's neighbours and itself)."""
    overlap = set(message.self_mask_owners) & set(message.key_owners)
    if overlap:
        raise MalformedMessage(f"{message.sender!r} sent both shares for {sorted(overlap)}")
    if not all(o in survivors and o in owners_held for o in message.self_mask_owners):
        raise MalformedMessage("self-mask shares for devices that are not surviving neighbours")
    if not all(o in share_senders and o not in survivors and o in owners_held for o in message.key_owners):
        raise MalformedMessage("mask-key shares for devices that are not dropped neighbours")
    for array in (message.self_mask_shares, message.key_shares):
        if array.shape[1] != SHARE_BYTES:
            raise MalformedMessage(f"shares must be {SHARE_BYTES} bytes wide")
