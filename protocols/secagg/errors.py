"""Exceptions raised by the secure-aggregation state machines.

Rule shared by both sides: when `handle()` raises one of these for an incoming message, the
state machine's state is exactly what it was before the call (the message is simply not
applied), except for ProtocolViolation and ReleaseRefused on the client, which also abort the client's round and
erases its secrets. The caller logs the error and keeps going.
"""

from __future__ import annotations

from protocols.identity import InvalidSignature, UnknownDevice


class SecAggError(Exception):
    """Base class of every secure-aggregation error."""


class ConfigError(SecAggError):
    """The round configuration is invalid or unsafe (e.g. the fixed-point sum could overflow)."""


class InputError(SecAggError):
    """The client's own input vector cannot be encoded (wrong shape, non-finite, out of bound)."""


class MalformedMessage(SecAggError):
    """A message cannot be decoded, or its fields/arrays have the wrong type, shape or size."""


class AuthenticationError(SecAggError):
    """A message's origin cannot be established."""


class UnknownSender(AuthenticationError, UnknownDevice):
    """The sender is not enrolled or not a member of this round's group."""


class BadSignature(AuthenticationError, InvalidSignature):
    """The signature is missing or does not verify under the sender's identity key."""


class WrongContext(SecAggError):
    """Job id, round id, group id or recipient do not match this round."""


class UnexpectedMessage(SecAggError):
    """The message is valid but does not belong to the current phase (late or out of order)."""


class LateMessage(UnexpectedMessage):
    """The message belongs to a phase this round already closed, or to a round already over: a
    slow participant's, harmless, to be counted as late rather than as a protocol violation."""


class ReplayedMessage(UnexpectedMessage):
    """The sender already delivered this kind of message in this round."""


class DecryptionError(SecAggError):
    """An AEAD ciphertext (encrypted Shamir shares) failed authentication or has the wrong size."""


class ProtocolViolation(SecAggError):
    """An authenticated peer asked for something the protocol forbids (e.g. both shares of one
    peer); on the client this aborts the round."""


class ReleaseRefused(SecAggError):
    """The device's own rule forbids this input to leave in this round (its ``release_guard``:
    e.g. the same input already went to a round of other members, whose sums could be
    differenced); like ProtocolViolation, this aborts the client's round."""


class ReconstructionError(SecAggError):
    """Shamir shares are too few or inconsistent to recover a secret."""
