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


def reconstruct_verified(shares: Mapping[int, bytes], threshold: int, secret_bytes: int,
                         is_secret: Callable[[bytes], bool], suspects: set[int] | None = None,
                         budget: int = 1024) -> bytes:
    """Recover a secret that ``is_secret`` confirms (a commitment, a public key), from shares of
    which some may be wrong: a holder that sends a corrupted share must not fail the round.

    The smallest x coordinates are tried first, skipping ``suspects`` (holders already caught);
    when the secret they open to is refused, sets that leave out one holder of the chosen ones,
    then two, ... up to ``budget`` interpolations (any `threshold` honest shares open to the
    secret, so with r more shares than `threshold`, up to r wrong ones are found if the budget
    allows). When the first set was refused, the holders whose shares disagree with the confirmed
    secret's polynomial are added to ``suspects`` (malformed shares always are), so the round's
    next secret starts without them; the usual case costs one interpolation.
    Raises ReconstructionError when no set within the budget is confirmed."""
    if threshold < 1:
        raise ValueError("threshold must be >= 1")
    suspects = set() if suspects is None else suspects
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
    order = sorted(x for x in values if x not in suspects) + sorted(x for x in values if x in suspects)
    tried: set[tuple[int, ...]] = set()
    for left_out in range(len(order) - threshold + 1):
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
                if len(tried) > 1:      # some holder's share was wrong: name every such holder (O(n t²), rare)
                    suspects.update(x for x in order if x not in chosen
                                    and not np.array_equal(_value_at(chosen, values, x), values[x]))
                return secret
    raise ReconstructionError(f"no set of {threshold} of the {len(order)} shares opens to the confirmed secret "
                              f"(more wrong shares than the {len(order) - threshold} spare ones can outvote)")
