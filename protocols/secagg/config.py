"""The signed configuration of one secure-aggregation round, and its safety checks.

The aggregator builds a RoundConfig, validates it (refusing unsafe ones before any message is
sent), and ships it signed in RoundStart; each client validates it again before taking part.
Everything that changes the meaning of the sum or the privacy guarantee is in here: the group,
thresholds, the fixed-point scale and bound, the vector length, and the neighbour graph.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import ConfigError, MalformedMessage
from .fixedpoint import RING_BITS, FixedPointCodec, check_ring_bits, max_scale_bits
from .graph import NeighbourGraph, regular_degree, share_threshold_for

GRAPH_COMPLETE = "complete"
GRAPH_REGULAR = "regular"
GRAPH_AUTO = "auto"            # RoundConfig.create picks one of the two from the group size
GRAPHS = (GRAPH_AUTO, GRAPH_COMPLETE, GRAPH_REGULAR)
# graph="auto": groups up to this size use the complete graph. Its cost per device grows with n
# (n mask expansions, n - 1 key agreements and AEAD shares, a key directory of n entries that
# outgrows the 64 KiB envelope header at about 250 members), while SecAgg+'s degree for the
# default 10 % dropout is about 30 from n = 50 on; at 128 members the complete graph costs about
# 4x SecAgg+'s per device and its key directory still fits the header with room to spare. Above
# it the sparse graph is the only one that scales; the complete graph stays the stronger choice
# against an actively malicious server (docs/secure-aggregation.md, "Choosing the graph").
AUTO_COMPLETE_MAX_MEMBERS = 128
GRAPH_SEED_BYTES = 32
# 2^27 words = 1 GiB per vector: far above any model here, low enough to bound memory per message.
MAX_VECTOR_LENGTH = 1 << 27
MIN_GROUP_SIZE = 3
# The most members a group may have. A RoundStart carries the member list in its envelope's header
# (64 KiB), which cannot name more than 11,454 members even with the shortest ids there are (1 to 3
# characters) and reaches its limit at about 5,500 with 8-character ids; a secure job's
# clients_per_round is held to this (aggregator/jobs/secure_fields.py), so no aggregator sends a
# larger group. A device refuses one at once, before reading the list: each member costs it work
# over the round (a key directory of n identity keys, t consistency signatures to verify), seconds
# of its agent thread at 10,000 members. The Java client holds the same limit (RoundConfig.java).
MAX_GROUP_SIZE = 10_000
# The most mask words a round may ask one member to expand (mask_expansions × vector_length): each
# pairwise mask and the self mask is vector_length words of AES-CTR keystream (crypto.expand_mask),
# worked out on the device outside any task's deadline. Without a cap a signed config could name
# 9,999 neighbours and a Fed3R-Sync vector (~8.3·10^9 words: hours of a phone and gigabytes of
# keystream). The largest round an aggregator builds by default (graph "auto", 10 % dropouts) asks
# 128 masks (the complete graph at 128 members; SecAgg+ above asks at most 41, at 10,000) of
# Fed3R-Sync's 833,932 words (d = 1280 + the intercept, 10 classes): 1.07·10^8 words, a fifth of
# this. A device refuses a config past it when it reads RoundStart, before any key; the aggregator
# refuses to build one, and a secure job whose largest round would ask more when it is built. The
# Java client holds the same limit and words (RoundConfig.java MAX_MASK_WORDS).
MAX_MASK_WORDS = 1 << 29


def default_threshold(n: int) -> int:
    """ceil(2n/3): the SecAgg paper's choice; always a strict majority."""
    return max(2, math.ceil(2 * n / 3))


def threshold_at_least(n: int, fraction: float) -> int:
    """t for a group of n that must keep ``fraction`` of its members: ⌈fraction·n⌉, never below
    :func:`default_threshold` (a distributed-DP job's members each add σ²/t: a larger t is less
    noise in a group whose members survive, and fewer drop-outs tolerated)."""
    return min(n, max(default_threshold(n), math.ceil(fraction * n - 1e-9)))


def resolve_graph(graph: str, n: int) -> str:
    """The graph a round of n members runs: ``graph`` itself, or for "auto" the complete graph up
    to AUTO_COMPLETE_MAX_MEMBERS members and SecAgg+'s regular graph above."""
    if graph == GRAPH_AUTO:
        return GRAPH_COMPLETE if n <= AUTO_COMPLETE_MAX_MEMBERS else GRAPH_REGULAR
    return graph


def _check_id(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ConfigError(f"{name} must be a non-empty string (<= 256 chars), got {value!r}")
    return value


# Every member of a group checks the same member list (n ids) when its round starts; a process
# hosting many emulated members (fedfleet simulate: 500 per host) checks a list once. Only lists
# that pass are kept, so a bad one is refused every time.
@functools.lru_cache(maxsize=8)
def _checked_member_list(members: tuple) -> None:
    for member in members:
        _check_id("member id", member)
    if list(members) != sorted(set(members)):
        raise ConfigError("members must be sorted and unique")


def _check_group_size(n: int) -> None:
    """At most MAX_GROUP_SIZE members: said before the list is read (Java's RoundConfig says the same)."""
    if n > MAX_GROUP_SIZE:
        raise ConfigError(f"a group has at most {MAX_GROUP_SIZE} members, got {n}")


def mask_expansions(n: int, degree: int) -> int:
    """The masks a member of an n-member round of graph degree k expands: one pairwise mask per
    neighbour (k of them, n − 1 at most: a degree past the group is the complete graph) and its self mask."""
    return min(degree, n - 1) + 1


# A count of up to this many digits is written whole. Every count a RoundConfig can hold is (at most
# 10,000 masks of 2^27 words: 1.3·10^12), as the Java client writes it; only a caller's own count
# goes past it (a review found a 401-digit one written whole across a log line).
WHOLE_DIGITS = 15


def readable_count(n: int) -> str:
    """``n`` whole, or past WHOLE_DIGITS digits in scientific notation to three significant digits
    (Decimal: a float overflows past 10^308, and str() refuses an int of over 4,300 digits)."""
    return str(n) if abs(n) < 10 ** WHOLE_DIGITS else format(Decimal(n), ".2e")


def check_mask_words(masks: int, vector_length: int) -> None:
    """At most MAX_MASK_WORDS words for a member expanding ``masks`` masks (:func:`mask_expansions`)
    of ``vector_length`` words (Java's RoundConfig says the same)."""
    words = masks * vector_length
    if words > MAX_MASK_WORDS:
        raise ConfigError(f"the round asks each member to expand {readable_count(masks)} masks of "
                          f"{readable_count(vector_length)} words ({readable_count(words)} words), "
                          f"more than a device expands ({MAX_MASK_WORDS})")


def largest_mask_expansions(graph: str, max_members: int, dropout_rate: float = 0.1) -> int:
    """The most masks a member of a group :meth:`RoundConfig.create` builds on ``graph`` ("auto" too)
    with at most ``max_members`` members expands. On either graph the count grows with n, so it is
    the largest group's, and with "auto" also the largest complete group's (AUTO_COMPLETE_MAX_MEMBERS)."""
    complete = {GRAPH_AUTO: min(max_members, AUTO_COMPLETE_MAX_MEMBERS), GRAPH_COMPLETE: max_members}.get(graph, 0)
    if resolve_graph(graph, max_members) != GRAPH_REGULAR:
        return complete
    return max(complete, mask_expansions(max_members, regular_degree(max_members, dropout_rate)))


def _check_member_list(members: tuple) -> None:
    _check_group_size(len(members))
    try:
        hash(members)
    except TypeError:
        raise ConfigError("member ids must be strings") from None
    _checked_member_list(members)


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return value


@dataclass(frozen=True)
class RoundConfig:
    job_id: str
    round_id: int
    group_id: str
    aggregator_id: str
    members: tuple[str, ...]
    vector_length: int
    threshold: int
    scale_bits: int
    bound: float
    graph: str = GRAPH_COMPLETE
    degree: int = 0
    share_threshold: int = 0
    graph_seed: bytes = field(default=bytes(GRAPH_SEED_BYTES), repr=False)
    consistency_check: bool = True
    # the width of Z_{2^r} (fixedpoint.py); 64 unless the round declares 32, which only
    # precision-tolerant jobs do. Off the wire when 64, so a 64-bit config is byte for byte the
    # one every client (and golden vector) knew before the field existed.
    ring_bits: int = RING_BITS

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def create(cls, *, job_id: str, round_id: int, group_id: str, aggregator_id: str,
               members: Sequence[str], vector_length: int, bound: float,
               scale_bits: int | None = None, threshold: int | None = None,
               graph: str = GRAPH_AUTO, degree: int | None = None,
               share_threshold: int | None = None, graph_seed: bytes | None = None,
               consistency_check: bool = True, dropout_rate: float = 0.1,
               corruption_rate: float = 0.0, ring_bits: int = RING_BITS) -> "RoundConfig":
        """Fill the defaults: the graph ("auto": :func:`resolve_graph`), t = ceil(2n/3), the finest
        safe scale, and for SecAgg+ the degree k and share threshold t' that the declared dropout
        and corruption rates need (:func:`~protocols.secagg.graph.regular_degree`), a fresh random
        graph seed."""
        ordered = tuple(sorted(members))
        n = len(ordered)
        graph = resolve_graph(graph, n)
        if scale_bits is None:
            scale_bits = max_scale_bits(max(n, 1), bound, check_ring_bits(ring_bits))
        threshold = default_threshold(n) if threshold is None else threshold
        if graph == GRAPH_REGULAR:
            if degree is None:                         # O(log n), more if dropouts or corruptions need it
                degree = regular_degree(n, dropout_rate, corruption_rate)
            holders = min(degree, n - 1) + 1
            if share_threshold is None:
                share_threshold = min(share_threshold_for(holders, corruption_rate), threshold)
            graph_seed = os.urandom(GRAPH_SEED_BYTES) if graph_seed is None else graph_seed
        else:
            degree = n - 1
            share_threshold = threshold
            graph_seed = bytes(GRAPH_SEED_BYTES) if graph_seed is None else graph_seed
        return cls(job_id=job_id, round_id=round_id, group_id=group_id, aggregator_id=aggregator_id,
                   members=ordered, vector_length=vector_length, threshold=threshold,
                   scale_bits=scale_bits, bound=float(bound), graph=graph, degree=degree,
                   share_threshold=share_threshold, graph_seed=graph_seed,
                   consistency_check=consistency_check, ring_bits=ring_bits)

    def validate(self) -> None:
        _check_id("job_id", self.job_id)
        _check_int("round_id", self.round_id, 0, 2**63 - 1)
        _check_id("group_id", self.group_id)
        _check_id("aggregator_id", self.aggregator_id)
        if not isinstance(self.members, tuple):
            raise ConfigError("members must be a tuple")
        _check_member_list(self.members)
        n = len(self.members)
        if n < MIN_GROUP_SIZE:
            raise ConfigError(f"a group needs at least {MIN_GROUP_SIZE} members, got {n}")
        if self.aggregator_id in self.members:
            raise ConfigError("the aggregator cannot be a member of the group")
        _check_int("vector_length", self.vector_length, 1, MAX_VECTOR_LENGTH)
        _check_int("threshold", self.threshold, 2, n)
        check_ring_bits(self.ring_bits)
        if 2 * self.threshold <= n:
            raise ConfigError(f"threshold {self.threshold} must be a strict majority of {n} members "
                              "(otherwise two disjoint survivor sets could each unmask)")
        self.codec.check_capacity(n)
        if not isinstance(self.consistency_check, bool):
            raise ConfigError("consistency_check must be a bool")
        if not isinstance(self.graph_seed, bytes) or len(self.graph_seed) != GRAPH_SEED_BYTES:
            raise ConfigError(f"graph_seed must be {GRAPH_SEED_BYTES} bytes")
        _check_int("degree", self.degree, 0, MAX_VECTOR_LENGTH)           # integers whatever the graph
        _check_int("share_threshold", self.share_threshold, 0, MAX_VECTOR_LENGTH)
        if self.graph == GRAPH_COMPLETE:
            if self.degree != n - 1 or self.share_threshold != self.threshold:
                raise ConfigError("complete graph: degree must be n-1 and share_threshold == threshold")
        elif self.graph == GRAPH_REGULAR:
            _check_int("degree", self.degree, 2, MAX_VECTOR_LENGTH)
            if self.degree % 2:
                raise ConfigError(f"graph degree must be even, got {self.degree}")
            holders = min(self.degree, n - 1) + 1
            _check_int("share_threshold", self.share_threshold, 1, min(holders, self.threshold))
            if 2 * self.share_threshold <= holders:
                raise ConfigError(f"share_threshold {self.share_threshold} must be a strict majority of the "
                                  f"{holders} share holders of a neighbourhood")
        else:
            raise ConfigError(f"graph must be {GRAPH_COMPLETE!r} or {GRAPH_REGULAR!r}, got {self.graph!r}")
        check_mask_words(mask_expansions(n, self.degree), self.vector_length)

    @property
    def codec(self) -> FixedPointCodec:
        try:
            return FixedPointCodec(self.scale_bits, self.bound, self.ring_bits)
        except ConfigError:
            raise
        except Exception as exc:  # a non-numeric bound from the wire
            raise ConfigError(f"bad fixed-point parameters: {exc}") from None

    @cached_property
    def _member_index(self) -> dict[str, int]:
        return {member: index for index, member in enumerate(self.members)}

    def holder_x(self, member: str) -> int:
        """The member's Shamir x coordinate: its 1-based position in the sorted member list."""
        return self._member_index[member] + 1

    def to_bitmap(self, devices) -> np.ndarray:
        """A subset of the members as a bitmap over the sorted member list (ceil(n/8) bytes on the
        wire instead of a list of ids, which would make U1/U3 broadcasts O(n^2) in total)."""
        flags = np.zeros(len(self.members), dtype=bool)
        flags[[self._member_index[d] for d in devices]] = True
        return np.packbits(flags)

    def from_bitmap(self, bitmap: np.ndarray) -> tuple[str, ...]:
        n = len(self.members)
        if bitmap.dtype != np.uint8 or bitmap.shape != ((n + 7) // 8,):
            raise MalformedMessage(f"member bitmap must be {(n + 7) // 8} bytes")
        flags = np.unpackbits(bitmap)
        if flags[n:].any():
            raise MalformedMessage("member bitmap has bits set past the last member")
        return tuple(self._member_array[flags[:n].astype(bool)].tolist())

    @cached_property
    def _member_array(self) -> np.ndarray:
        # every phase decodes a bitmap or two over all n members: a numpy selection, not n lookups
        members = np.array(self.members, dtype=object)
        members.flags.writeable = False              # shared by every decode of this config
        return members

    def neighbour_graph(self, participants: Sequence[str]) -> NeighbourGraph:
        """The graph over the members that advertised keys (U1)."""
        if self.graph == GRAPH_REGULAR:
            return NeighbourGraph.random_regular(participants, self.degree, self.graph_seed)
        return NeighbourGraph.complete(participants)

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "round_id": self.round_id, "group_id": self.group_id,
                "aggregator_id": self.aggregator_id, "members": list(self.members),
                "vector_length": self.vector_length, "threshold": self.threshold,
                "scale_bits": self.scale_bits, "bound": self.bound, "graph": self.graph,
                "degree": self.degree, "share_threshold": self.share_threshold,
                "graph_seed": self.graph_seed.hex(), "consistency_check": self.consistency_check,
                **({} if self.ring_bits == RING_BITS else {"ring_bits": self.ring_bits})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RoundConfig":
        expected = set(cls.__dataclass_fields__)
        if not isinstance(data, Mapping) or not expected - {"ring_bits"} <= set(data) <= expected:
            raise ConfigError(f"round config must have exactly the keys {sorted(expected - {'ring_bits'})} "
                              "and optionally ring_bits")
        if "ring_bits" in data and check_ring_bits(data["ring_bits"]) == RING_BITS:
            # one config, one JSON form: what the server signed is what every client re-encodes
            raise ConfigError(f"ring_bits is written only for a 32-bit ring (absent means {RING_BITS})")
        members = data["members"]
        if not isinstance(members, list):
            raise ConfigError("members must be a list")
        _check_group_size(len(members))
        # one config, one JSON form (the Java client reads it so too): lower-case hex, a float bound
        seed = data["graph_seed"]
        if not isinstance(seed, str) or not re.fullmatch(r"[0-9a-f]{64}", seed):
            raise ConfigError("graph_seed must be 32 bytes of lower-case hex")
        seed = bytes.fromhex(seed)
        bound = data["bound"]
        if not isinstance(bound, float):
            raise ConfigError("bound must be a JSON number with a fraction or exponent (a float)")
        return cls(**{**data, "members": tuple(members), "graph_seed": seed, "bound": float(bound)})
