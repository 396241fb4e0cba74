"""Local (never on the wire) inputs and outputs of the state machines: phases, timeouts, results."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from .fixedpoint import FixedPointCodec


class Phase(str, enum.Enum):
    """The phases of a round, in order. A server phase ends when every expected participant
    answered or when the caller feeds Timeout(phase)."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    CONSISTENCY_CHECK = "consistency_check"
    UNMASK = "unmask"


@dataclass(frozen=True)
class Timeout:
    """The caller's clock says `phase` is over. Stale timeouts (for a phase already closed) are
    ignored; on a client any timeout aborts the round."""

    phase: Phase


@dataclass(frozen=True)
class MemberOffline:
    """The caller knows this member is gone (its presence said offline, or it was revoked): the
    server stops waiting for it, so a phase closes as soon as every member still expected in it
    that is not known offline has answered, instead of at the phase's timeout. A member reported
    offline that answers after all (it came back while its phase was open) is accepted as usual."""

    device: str


@dataclass(frozen=True, eq=False)
class AggregateReady:
    """Server output: the exact sum mod 2^r of the survivors' encoded inputs, as the ring's
    unsigned words (uint64, or uint32 in a 32-bit ring)."""

    sum_words: np.ndarray
    survivors: tuple[str, ...]
    codec: FixedPointCodec

    def decode(self) -> np.ndarray:
        """The sum as float64 (sum of q / 2^f)."""
        return self.codec.decode(self.sum_words)


@dataclass(frozen=True)
class RoundFailed:
    """Server output: the round ended without a result; no partial sum is released."""

    reason: str
    phase: Phase


@dataclass(frozen=True)
class StartRound:
    """The server's own event behind ``ServerSecAgg.start()``: send the round's config to every member."""


@dataclass(frozen=True)
class AbortRound:
    """The server's own event behind ``ServerSecAgg.abort(reason)``: the caller's deadline gave the round up."""

    reason: str
