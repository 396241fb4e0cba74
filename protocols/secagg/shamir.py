"""Shamir secret sharing of short byte strings, vectorised with numpy.

A secret of L bytes is read as an unsigned integer and cut into C = ceil(8L / 31) digits of
31 bits. Each digit is shared independently over the prime field GF(p), p = 2^32 - 5, with a
random polynomial of degree threshold-1 whose constant term is the digit; the share for
holder x (1 <= x < p) is the vector of C polynomial values at x, serialised as C little-endian
uint32. Sharing digit-wise loses nothing: every digit is < 2^31 < p, and t-1 shares of a
degree-(t-1) polynomial are uniformly distributed whatever the constant term, so each digit,
and therefore the secret, is perfectly hidden from fewer than `threshold` holders.

p < 2^32 keeps every product of two field elements below 2^64, so Horner evaluation and
Lagrange interpolation run in plain uint64 numpy arithmetic without overflow. No maintained
Shamir library is installed in this project, hence this module.
"""

from __future__ import annotations

import itertools
import secrets
from functools import lru_cache
from typing import Callable, Mapping, Sequence

import numpy as np

from .errors import ReconstructionError

PRIME = 2**32 - 5
DIGIT_BITS = 31


def digit_count(secret_bytes: int) -> int:
    return -(-8 * secret_bytes // DIGIT_BITS)


def share_bytes(secret_bytes: int) -> int:
    """Serialised size of one share of a secret of `secret_bytes` bytes."""
    return 4 * digit_count(secret_bytes)


def _to_digits(secret: bytes) -> list[int]:
    value = int.from_bytes(secret, "little")
    mask = (1 << DIGIT_BITS) - 1
    return [(value >> (DIGIT_BITS * i)) & mask for i in range(digit_count(len(secret)))]


def _from_digits(digits: Sequence[int], secret_bytes: int) -> bytes:
    value = sum(int(d) << (DIGIT_BITS * i) for i, d in enumerate(digits))
    if any(int(d) >> DIGIT_BITS for d in digits) or value >> (8 * secret_bytes):
        raise ReconstructionError("shares are inconsistent: the interpolated value is not a valid secret")
    return value.to_bytes(secret_bytes, "little")


def _random_field_elements(shape: tuple[int, ...]) -> np.ndarray:
    """Uniform elements of GF(p) from the OS CSPRNG (rejection of the 5 values >= p)."""
    count = int(np.prod(shape))
    out = np.frombuffer(secrets.token_bytes(4 * count), dtype="<u4").astype(np.uint64)
    bad = out >= PRIME
    while bad.any():
        out[bad] = np.frombuffer(secrets.token_bytes(4 * int(bad.sum())), dtype="<u4")
        bad = out >= PRIME
    return out.reshape(shape)


def _check_holders(holders: Sequence[int]) -> np.ndarray:
    xs = np.asarray(list(holders), dtype=np.int64)
    if xs.ndim != 1 or xs.size == 0:
        raise ValueError("need at least one holder")
    if (xs <= 0).any() or (xs >= PRIME).any():
        raise ValueError("holder coordinates must lie in 1 .. p-1 (x = 0 is the secret)")
    if np.unique(xs).size != xs.size:
        raise ValueError("holder coordinates must be distinct")
    return xs.astype(np.uint64)


def split(secrets_to_share: Sequence[bytes], threshold: int, holders: Sequence[int]) -> list[list[bytes]]:
    """Share each secret among `holders` (distinct x coordinates) so that any `threshold`
    of them reconstruct it. Returns shares[holder_index][secret_index] as bytes."""
    xs = _check_holders(holders)
    if not 1 <= threshold <= xs.size:
        raise ValueError(f"threshold must be in 1..{xs.size} (number of holders), got {threshold}")
    if not secrets_to_share:
        raise ValueError("nothing to share")
    lengths = {len(s) for s in secrets_to_share}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError("all secrets must be non-empty and have the same length")
    n_digits = digit_count(lengths.pop())
    constant = np.array([_to_digits(s) for s in secrets_to_share], dtype=np.uint64).reshape(-1)
    # coefficients[j] multiplies x^j; row 0 is the secret digits.
    coefficients = _random_field_elements((threshold, constant.size))
    coefficients[0] = constant
    x = xs[:, None]
    values = np.broadcast_to(coefficients[-1], (xs.size, constant.size)).copy()
    for row in coefficients[-2::-1]:  # Horner; (p-1)^2 + (p-1) < 2^64, so no overflow
        values = (values * x + row) % PRIME
    words = values.astype("<u4").reshape(xs.size, len(secrets_to_share), n_digits)
    return [[words[h, s].tobytes() for s in range(len(secrets_to_share))] for h in range(xs.size)]


@lru_cache(maxsize=256)
def _lagrange_at_zero(xs: tuple[int, ...]) -> np.ndarray:
    """lambda_i = prod_{j != i} x_j / (x_j - x_i) mod p, so that f(0) = sum lambda_i f(x_i)."""
    weights = []
    for i, xi in enumerate(xs):
        numerator, denominator = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                numerator = numerator * xj % PRIME
                denominator = denominator * (xj - xi) % PRIME
        weights.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    return np.array(weights, dtype=np.uint64)


def _share_values(share: bytes, n_digits: int, x: int) -> np.ndarray:
    if len(share) != 4 * n_digits:
        raise ReconstructionError(f"share of holder {x} has {len(share)} bytes, expected {4 * n_digits}")
    values = np.frombuffer(share, dtype="<u4").astype(np.uint64)
    if (values >= PRIME).any():
        raise ReconstructionError(f"share of holder {x}: value outside the field")
    return values


def _interpolate(chosen: Sequence[int], values: Mapping[int, np.ndarray], secret_bytes: int) -> bytes:
    weights = _lagrange_at_zero(tuple(chosen))
    rows = np.array([values[x] for x in chosen], dtype=np.uint64)
    # each product < 2^64 and reduced below 2^32, so a sum of < 2^32 of them cannot overflow
    digits = ((rows * weights[:, None]) % PRIME).sum(axis=0) % PRIME
    return _from_digits(digits.tolist(), secret_bytes)


def reconstruct(shares: Mapping[int, bytes], threshold: int, secret_bytes: int) -> bytes:
    """Recover a secret from at least `threshold` shares {x: share}.

    Exactly `threshold` shares (the smallest x coordinates) are interpolated; with fewer,
    ReconstructionError is raised rather than returning a wrong value. A wrong share gives a
    wrong secret: where the secret can be checked, :func:`reconstruct_verified` finds the shares
    that open to it.
    """
    if threshold < 1:
        raise ValueError("threshold must be >= 1")
    if len(shares) < threshold:
        raise ReconstructionError(f"need {threshold} shares, have {len(shares)}")
    chosen = sorted(shares)[:threshold]
    _check_holders(chosen)
    n_digits = digit_count(secret_bytes)
    values = {x: _share_values(shares[x], n_digits, x) for x in chosen}
    return _interpolate([int(x) for x in chosen], values, secret_bytes)


def _value_at(chosen: Sequence[int], values: Mapping[int, np.ndarray], x: int) -> np.ndarray:
    """The digits of the polynomial through `chosen`'s shares, at holder x."""
    basis = []
    for i, xi in enumerate(chosen):
        numerator, denominator = 1, 1
        for j, xj in enumerate(chosen):
            if j != i:
                numerator = numerator * (x - xj) % PRIME
                denominator = denominator * (xi - xj) % PRIME
        basis.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    rows = np.array([values[xi] for xi in chosen], dtype=np.uint64)
    return ((rows * np.array(basis, dtype=np.uint64)[:, None]) % PRIME).sum(axis=0) % PRIME


def _solve(matrix: np.ndarray, rhs: np.ndarray) -> np.ndarray | None:
    """One solution of matrix · x = rhs over GF(p) (free unknowns 0), or None if there is none:
    Gauss–Jordan, a row operation at a time in uint64 (every product of two elements < 2^64)."""
    rows, cols = matrix.shape
    m = np.concatenate([matrix, rhs[:, None]], axis=1).astype(np.uint64) % PRIME
    pivots: list[int] = []
    for c in range(cols):
        r = len(pivots)
        if r == rows:
            break
        nonzero = np.flatnonzero(m[r:, c])
        if nonzero.size == 0:
            continue
        m[[r, r + nonzero[0]]] = m[[r + nonzero[0], r]]
        m[r] = m[r] * np.uint64(pow(int(m[r, c]), -1, PRIME)) % PRIME
        factors = m[:, c].copy()
        factors[r] = 0
        m = (m + (PRIME - factors[:, None] * m[r][None, :] % PRIME)) % PRIME
        pivots.append(c)
    if m[len(pivots):, cols].any():
        return None
    x = np.zeros(cols, dtype=np.uint64)
    x[pivots] = m[:len(pivots), cols]
    return x


def _divide(numerator: list[int], monic: list[int]) -> tuple[list[int], list[int]]:
    """Quotient and remainder of two polynomials over GF(p) (coefficients lowest first; the
    divisor monic)."""
    rest, degree = list(numerator), len(monic) - 1
    quotient = [0] * max(len(rest) - degree, 1)
    for i in range(len(rest) - 1, degree - 1, -1):
        c = rest[i] % PRIME
        quotient[i - degree] = c
        if c:
            for j, d in enumerate(monic):
                rest[i - degree + j] = (rest[i - degree + j] - c * d) % PRIME
    return quotient, rest[:degree]


def _wrong_holders(xs: list[int], ys: list[int], threshold: int) -> set[int] | None:
    """The holders whose points lie off the one polynomial of degree < threshold that all but at
    most e = ⌊(n − threshold)/2⌋ of the n points lie on (Berlekamp–Welch: Q(x_i) = y_i E(x_i) with
    E monic of degree e; the polynomial is Q / E), or None when there is no such polynomial."""
    n, e = len(xs), (len(xs) - threshold) // 2
    x, y = np.array(xs, dtype=np.uint64), np.array(ys, dtype=np.uint64)
    powers = np.ones((n, threshold + e + 1), dtype=np.uint64)
    for k in range(1, threshold + e + 1):
        powers[:, k] = powers[:, k - 1] * x % PRIME
    matrix = np.concatenate([powers[:, :threshold + e], (PRIME - y[:, None] * powers[:, :e] % PRIME) % PRIME], axis=1)
    solution = _solve(matrix, y * powers[:, e] % PRIME)
    if solution is None:
        return None
    q = [int(v) for v in solution[:threshold + e]]
    f, remainder = _divide(q, [int(v) for v in solution[threshold + e:]] + [1])
    if any(remainder) or any(f[threshold:]):
        return None
    wrong = set()
    for xi, yi in zip(xs, ys):
        value = 0
        for coefficient in reversed(f):
            value = (value * xi + coefficient) % PRIME
        if value != yi:
            wrong.add(xi)
    return wrong if len(wrong) <= e else None


def reconstruct_verified(shares: Mapping[int, bytes], threshold: int, secret_bytes: int,
                         is_secret: Callable[[bytes], bool], suspects: set[int] | None = None,
                         budget: int = 1024, doubted: set[int] | None = None) -> bytes:
    """Recover a secret that ``is_secret`` confirms (a commitment, a public key), from shares of
    which some may be wrong: a holder that sends a corrupted share must not fail the round.

    1. The smallest x coordinates, ``suspects`` (holders already caught) last: the usual case, one
       interpolation.
    2. Refused, and r ≥ 2 shares beyond `threshold`: Berlekamp–Welch decoding finds up to ⌊r/2⌋
       wrong holders in one linear solve (on a random combination of the shares' digits, so a
       holder wrong in any digit is found with probability 1 − 1/p); the secret of the others,
       confirmed, names them in ``suspects``.
    3. Else sets that leave out one holder, then two, ... up to ``budget`` interpolations (with
       r = 1 the check on the secret finds the one wrong share decoding cannot). Holders are named
       here only when the confirmed polynomial agrees with a holder outside the set: a secret that
       a wrong share shifts to an equivalent one (an X25519 key differing in clamped bits) must not
       name the honest holders. Uncorroborated, the one holder left out goes to ``doubted``: tried
       late for the next secrets, never named (else each secret repeated this search, O(t³)).
    Raises ReconstructionError when none is confirmed (more wrong shares than can be outvoted)."""
    if threshold < 1:
        raise ValueError("threshold must be >= 1")
    suspects = set() if suspects is None else suspects
    doubted = set() if doubted is None else doubted
    if shares:
        _check_holders(sorted(shares))
    n_digits = digit_count(secret_bytes)
    values: dict[int, np.ndarray] = {}
    for x, share in shares.items():
        try:
            values[int(x)] = _share_values(share, n_digits, int(x))
        except ReconstructionError:
            suspects.add(int(x))
    if len(values) < threshold:
        raise ReconstructionError(f"need {threshold} well-formed shares, have {len(values)}")
    rank = {x: (x in suspects, x in doubted and x not in suspects) for x in values}    # trusted, doubted, caught
    order = sorted(values, key=lambda x: (rank[x][0], rank[x][1], x))
    first = tuple(order[:threshold])
    try:
        secret = _interpolate(first, values, secret_bytes)
        if is_secret(secret):
            return secret
    except ReconstructionError:
        pass
    if len(order) - threshold >= 2:
        weights = np.array([secrets.randbelow(PRIME - 1) + 1 for _ in range(n_digits)], dtype=np.uint64)
        combined = [int(((values[x] * weights) % PRIME).sum() % PRIME) for x in order]
        wrong = _wrong_holders(order, combined, threshold)
        clean = [x for x in order if x not in (wrong or ())]
        if wrong and len(clean) >= threshold:
            try:
                secret = _interpolate(tuple(clean[:threshold]), values, secret_bytes)
                if is_secret(secret):
                    suspects.update(wrong)
                    return secret
            except ReconstructionError:
                pass
    tried = {first}
    for left_out in range(1, len(order) - threshold + 1):
        pool = order[:threshold + left_out]
        for excluded in itertools.combinations(range(len(pool)), left_out):
            chosen = tuple(x for i, x in enumerate(pool) if i not in excluded)
            if chosen in tried:         # leaving out the pool's last holders gives a set already tried
                continue
            tried.add(chosen)
            if len(tried) > budget:
                raise ReconstructionError(f"shares disagree, and none of {budget} sets of {threshold} of the "
                                          f"{len(order)} opens to the confirmed secret")
            try:
                secret = _interpolate(chosen, values, secret_bytes)
            except ReconstructionError:
                continue
            if is_secret(secret):
                outside = {x: np.array_equal(_value_at(chosen, values, x), values[x]) for x in order if x not in chosen}
                if any(outside.values()):       # corroborated: the polynomial is the shares' own
                    suspects.update(x for x, agrees in outside.items() if not agrees)
                elif len(outside) == 1:         # one spare share: a hint for the next secrets
                    doubted.update(outside)
                return secret
    raise ReconstructionError(f"no set of {threshold} of the {len(order)} shares opens to the confirmed secret "
                              f"(more wrong shares than the {len(order) - threshold} spare ones can outvote)")
