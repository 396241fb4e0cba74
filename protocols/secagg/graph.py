"""Who masks with and holds shares of whom: the complete graph or a SecAgg+ k-regular graph.

SecAgg+ (Bell et al., CCS 2020) replaces the complete graph of SecAgg by a random k-regular
graph with k = O(log n). We build it as a Harary (circulant) graph on a random cyclic order:
the members are permuted by a Fisher-Yates shuffle driven by the AES-CTR PRG of
SHA-256(domain || public seed || member list), placed on a ring, and each one is joined to its
k/2 nearest ring neighbours on either side. Every party derives the same graph from the
signed round configuration (seed, k) and the member list, so the server cannot pick a
client's neighbours after the fact. k must be even; k >= n-1 gives the complete graph.

The shuffle reduces 64-bit PRG words modulo i+1; the bias (< n / 2^64) is irrelevant for a
public graph.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Iterable, Sequence

import numpy as np

from .crypto import expand_mask

_GRAPH_DOMAIN = b"fedfleet/secagg/graph/v1"
# The failure probabilities SecAgg+'s degree is chosen for (Bell et al. 2020 fix 2^-η for
# correctness and 2^-σ for security; we take η = 20, a group failing about once in a million
# rounds, and σ = 40, the usual statistical security parameter).
CORRECTNESS_LOG2 = -20
SECURITY_LOG2 = -40


def default_degree(n: int) -> int:
    """Even degree 2 * ceil(log2 n), the O(log n) of SecAgg+ (20 for n = 1000)."""
    return 2 * max(1, math.ceil(math.log2(max(n, 2))))


def share_threshold_for(holders: int, corruption_rate: float = 0.0) -> int:
    """t' for a neighbourhood of ``holders`` share holders: a strict majority, and more than the
    holders an adversary controlling ``corruption_rate`` of the devices is expected to hold."""
    return max(holders // 2 + 1, math.floor(corruption_rate * holders) + 1)


def degree_for(n: int, dropout_rate: float = 0.1, corruption_rate: float = 0.0,
               failure_log2: int = CORRECTNESS_LOG2) -> int:
    """The smallest even degree k (SecAgg+, Bell et al. 2020) for which every one of the n
    neighbourhoods of k + 1 share holders still reaches its share threshold when each device drops
    out independently with ``dropout_rate``: n · P[Binomial(k+1, 1 - dropout_rate) < t'] ≤
    2^failure_log2 (a union bound). n - 1 (the complete graph) when no smaller k suffices."""
    if not 0 <= dropout_rate < 0.5 or not 0 <= corruption_rate < 0.5:
        raise ValueError("dropout_rate and corruption_rate must lie in [0, 0.5)")
    keep = 1.0 - dropout_rate
    for k in range(2, n - 1, 2):
        holders = k + 1
        t = share_threshold_for(holders, corruption_rate)
        if n * binomial_below(holders, t, keep) <= 2.0 ** failure_log2:
            return k
    return n - 1


EXACT_HOLDERS = 1029    # the most holders whose every C(holders, s) is a float (C(1030, 515) > 2^1024)


def binomial_below(holders: int, t: int, keep: float) -> float:
    """P[Binomial(holders, keep) < t]: term by term (C(h, s) keep^s (1 − keep)^(h − s)) up to
    EXACT_HOLDERS, as it always was; past it C(h, s) overflows a float (OverflowError: a job with
    expected_dropout 0.45 and groups of 2,000 could not be built), so the terms are taken through
    logarithms, log C(h, s) as a running sum of log((h − s + 1) / s), summed from the largest."""
    drop = 1.0 - keep
    if holders <= EXACT_HOLDERS:
        return sum(_exact_terms(holders, t, keep, drop))
    if drop == 0.0:                 # every holder stays: fewer than t only when t exceeds them all
        return 1.0 if t > holders else 0.0
    s = np.arange(t, dtype=np.float64)
    log_comb = np.concatenate([[0.0], np.cumsum(np.log(holders - s[1:] + 1) - np.log(s[1:]))])
    log_terms = log_comb + s * math.log(keep) + (holders - s) * math.log(drop)
    top = float(log_terms.max())
    return math.exp(top) * float(np.exp(log_terms - top).sum())


def _exact_terms(holders: int, t: int, keep: float, drop: float):
    """C(h, s) keep^s (1 − keep)^(h − s) for s < t, C(h, s) kept as an exact integer from the one
    before (C(h, s + 1) = C(h, s) (h − s) / (s + 1), divisible): the same terms, bit for bit, as
    math.comb(h, s) for each, which redid the whole product each time (degree_for scans every even
    degree, so a group of 2,000 at a 0.45 drop-out rate cost ~1 CPU-s per job build)."""
    comb = 1
    for s in range(t):
        yield comb * keep ** s * drop ** (holders - s)
        comb = comb * (holders - s) // (s + 1)


def split_probability_log2(n: int, degree: int, removed_rate: float) -> float:
    """log2 of a union bound on the probability that the survivors' graph falls apart when each
    device is removed (dropped out, or corrupted and colluding with the server) independently with
    ``removed_rate``. On the Harary ring (k/2 neighbours each side) the survivors stay connected
    unless two runs of >= k/2 consecutive ring positions are all removed: any edge spans at most
    k/2 positions, so one such run only opens the ring into a path. Were it split, the server
    would learn each part's sum. P <= C(n, 2) · rate^k."""
    if degree >= n - 1:
        return -math.inf                      # the complete graph never splits
    if removed_rate <= 0:
        return -math.inf
    return math.log2(math.comb(n, 2)) + degree * math.log2(removed_rate)


def secure_degree_for(n: int, removed_rate: float, security_log2: int = SECURITY_LOG2) -> int:
    """The smallest even degree whose split probability (:func:`split_probability_log2`) is at most
    2^security_log2; n - 1 when none below it is."""
    for k in range(2, n - 1, 2):
        if split_probability_log2(n, k, removed_rate) <= security_log2:
            return k
    return n - 1


def exposure_probability_log2(n: int, degree: int, corruption_rate: float) -> float:
    """log2 of a union bound on the probability that some member's input is exposed to a server
    colluding with ``corruption_rate`` of the devices (each corrupted independently): t' of the
    member's k neighbours are corrupted and hand over their shares of its mask key, while the
    honest ones give its self-mask seed. n · P[Binomial(k, γ) ≥ t'], t' = :func:`share_threshold_for`
    (k + 1, γ); summed in log space (C(k, s) overflows a float for k in the thousands)."""
    if corruption_rate <= 0:
        return -math.inf
    t = share_threshold_for(degree + 1, corruption_rate)
    if t > degree:
        return -math.inf
    log_terms = [math.lgamma(degree + 1) - math.lgamma(s + 1) - math.lgamma(degree - s + 1)
                 + s * math.log(corruption_rate) + (degree - s) * math.log1p(-corruption_rate)
                 for s in range(t, degree + 1)]
    top = max(log_terms)
    return (math.log(n) + top + math.log(sum(math.exp(v - top) for v in log_terms))) / math.log(2)


@functools.lru_cache(maxsize=64)
def private_degree_for(n: int, corruption_rate: float, security_log2: int = SECURITY_LOG2) -> int:
    """The smallest even degree whose exposure probability (:func:`exposure_probability_log2`) is
    at most 2^security_log2. ValueError when no degree below n - 1 is: the sparse graph cannot
    protect inputs against that many corrupted devices at this size (falling back to the largest
    degree with a bare-majority t' would look protected and be far from it)."""
    largest = n - 2 - n % 2                 # the largest even degree below n - 1
    if largest < 2 or exposure_probability_log2(n, largest, corruption_rate) > security_log2:
        raise ValueError(f"no SecAgg+ degree keeps inputs private (2^{security_log2}) against a corruption "
                         f"rate of {corruption_rate} in a group of {n}: use the complete graph or a lower rate")
    for k in range(2, largest + 1, 2):
        if exposure_probability_log2(n, k, corruption_rate) <= security_log2:
            return k
    return largest


def regular_degree(n: int, dropout_rate: float = 0.1, corruption_rate: float = 0.0) -> int:
    """SecAgg+'s default degree for a group of n: the largest of the O(log n) floor
    (:func:`default_degree`), the correctness bound (:func:`degree_for`), the security bound
    (:func:`secure_degree_for`, dropouts and corruptions together) and, with corruptions declared,
    the bound on exposing an input (:func:`private_degree_for`), even and at most n - 1."""
    degree = max(default_degree(n), degree_for(n, dropout_rate, corruption_rate),
                 secure_degree_for(n, min(dropout_rate + corruption_rate, 1.0)),
                 private_degree_for(n, corruption_rate) if corruption_rate > 0 else 0)
    degree = min(degree, n - 1)
    return degree - degree % 2                # n - 1 may be odd


class NeighbourGraph:
    """Undirected graph over the round's participants; neighbours are computed on demand
    (a client only ever needs its own)."""

    def __init__(self, members: Sequence[str], ring: Sequence[str] | None = None, degree: int | None = None):
        self.members = tuple(sorted(members))
        if len(set(self.members)) != len(self.members):
            raise ValueError("graph members must be unique")
        self._ring = tuple(ring) if ring is not None else None
        self._half = degree // 2 if degree is not None else None
        self._position = {m: i for i, m in enumerate(self._ring)} if self._ring is not None else None
        self._cache: dict[str, frozenset[str]] = {}
        self._member_set = frozenset(self.members)
        self._parts: dict[frozenset[str], int] = {}

    @property
    def is_complete(self) -> bool:
        return self._ring is None

    @property
    def degree(self) -> int:
        return len(self.members) - 1 if self._ring is None else 2 * self._half

    def neighbours(self, member: str) -> frozenset[str]:
        cached = self._cache.get(member)
        if cached is not None:
            return cached
        if self._ring is None:
            if member not in self.members:
                raise KeyError(member)
            result = frozenset(self.members) - {member}
        else:
            position, n = self._position[member], len(self._ring)
            result = frozenset(self._ring[(position + offset) % n]
                               for offset in range(-self._half, self._half + 1) if offset)
        self._cache[member] = result
        return result

    def connects(self, survivors: Iterable[str]) -> bool:
        """Whether the survivors' induced subgraph is connected: else the server, which may add any
        union of its parts' masked inputs, would learn each part's sum (SecAgg+'s actively chosen
        dropouts). On the ring two survivors are adjacent across a run of fewer than k/2 removed
        positions, so the parts are as many as the runs of ≥ k/2 removed: connected iff at most one."""
        return self.parts(survivors) == 1

    def parts(self, survivors: Iterable[str]) -> int:
        """How many parts the survivors' induced subgraph has (0 for none, 1 when connected)."""
        alive = frozenset(survivors)
        known = self._parts.get(alive)
        if known is not None:
            return known
        if not alive <= self._member_set:
            raise KeyError(sorted(alive - self._member_set)[:3])
        if len(self._parts) >= 8:                  # a round asks about one or two survivor sets
            self._parts.clear()
        self._parts[alive] = result = self._ring_parts(alive)
        return result

    def _ring_parts(self, alive: frozenset[str]) -> int:
        if self._ring is None or not alive:
            return min(len(alive), 1)
        n, long_runs, run = len(self._ring), 0, 0
        start = next(i for i, m in enumerate(self._ring) if m in alive)     # a run never wraps past it
        for step in range(1, n + 1):
            if self._ring[(start + step) % n] in alive:
                long_runs += run >= self._half
                run = 0
            else:
                run += 1
        return max(long_runs, 1)            # one long run opens the ring into a path; each further one cuts it

    @classmethod
    def complete(cls, members: Sequence[str]) -> "NeighbourGraph":
        return cls(members)

    @classmethod
    def random_regular(cls, members: Sequence[str], degree: int, seed: bytes) -> "NeighbourGraph":
        if not isinstance(seed, bytes):
            raise TypeError(f"graph seed must be bytes, got {type(seed).__name__}")
        return _random_regular(cls, tuple(sorted(members)), degree, seed)

    @classmethod
    def _build_random_regular(cls, ordered: tuple[str, ...], degree: int, seed: bytes) -> "NeighbourGraph":
        n = len(ordered)
        if degree % 2 or degree < 2:
            raise ValueError(f"graph degree must be even and >= 2, got {degree}")
        if degree >= n - 1:
            return cls.complete(ordered)
        ring = list(ordered)
        digest = hashlib.sha256(_GRAPH_DOMAIN + seed + "\0".join(ordered).encode()).digest()
        words = expand_mask(digest, n).tolist()
        for i in range(n - 1, 0, -1):
            j = words[i] % (i + 1)
            ring[i], ring[j] = ring[j], ring[i]
        return cls(ordered, ring, degree)


# Every member derives the same graph from the same signed (members, degree, seed); a process hosting
# many emulated members of one group (fedfleet simulate: 500 per host) builds it once. The graph is
# read-only once built (its neighbour and connectivity memos only fill in what it would compute).
@functools.lru_cache(maxsize=8)
def _random_regular(cls: type, ordered: tuple[str, ...], degree: int, seed: bytes) -> NeighbourGraph:
    return cls._build_random_regular(ordered, degree, seed)
