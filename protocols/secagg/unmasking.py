"""The server's last step (``ServerSecAgg._finish``, server.py): every mask left in the sum of the
survivors' masked inputs, found from the shares U5 sent, as (seed, sign) pairs for the mask applier.

The server subtracts PRG(b_u) for every survivor and, for every dropped v with surviving
neighbours u, the pair mask sign(u, v) PRG(s_uv) that u included, re-derived from the
reconstructed s_v^SK and u's advertised public key. A reconstructed b_u must match u's
self-mask commitment, and a reconstructed s_v^SK v's advertised public key, which catches
corrupted shares: a holder whose share is wrong is outvoted by the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import shamir
from .config import RoundConfig
from .crypto import x25519_from_private_bytes, x25519_public_bytes
from .derivation import SECRET_BYTES, RoundContext, pair_mask_seed, pair_mask_sign, self_mask_commitment
from .errors import ReconstructionError
from .events import Phase
from .graph import NeighbourGraph
from .messages import UnmaskShares

Shares = dict[str, dict[int, bytes]]        # owner -> its holder's x -> the holder's share


def collect_shares(config: RoundConfig, answers: Mapping[str, UnmaskShares]) -> tuple[Shares, Shares]:
    """(self-mask shares, mask-key shares) of every owner U5's ``answers`` hold shares of."""
    self_mask_shares: Shares = {}
    key_shares: Shares = {}
    for holder, message in answers.items():
        x = config.holder_x(holder)
        for owner, share in zip(message.self_mask_owners, message.self_mask_shares):
            self_mask_shares.setdefault(owner, {})[x] = share.tobytes()
        for owner, share in zip(message.key_owners, message.key_shares):
            key_shares.setdefault(owner, {})[x] = share.tobytes()
    return self_mask_shares, key_shares


def reconstruct_secret(config: RoundConfig, shares: Shares, owner: str, what: str, is_secret: Callable[[bytes], bool],
                       suspects: set[int], doubted: set[int]) -> bytes:
    """``owner``'s secret from its holders' shares, confirmed by ``is_secret``: a holder whose
    shares are wrong is outvoted by the others (``shamir.reconstruct_verified``)."""
    try:
        return shamir.reconstruct_verified(shares.get(owner, {}), config.share_threshold, SECRET_BYTES,
                                           is_secret, suspects, doubted=doubted)
    except ReconstructionError as exc:
        # a member that dealt shares of another secret than it committed to, or shares on no one
        # polynomial, looks the same as holders that lied: said, never named (docs: Known gaps)
        raise ReconstructionError(f"{what} of {owner!r}: {exc}, or {owner!r} dealt its shares wrong "
                                  "(the server cannot tell which)") from None


def mask_seeds_to_remove(config: RoundConfig, context: RoundContext, graph: NeighbourGraph,
                         received: Mapping[Phase, Mapping[str, Any]],
                         dropped: Sequence[str]) -> list[tuple[bytes, int]]:
    """(seed, sign) of every mask left in the accumulator: -b_u for each survivor u, and for
    each dropped v the opposite of the pair mask each surviving neighbour u added. ``received``:
    what each phase received, by sender. Raises ReconstructionError when shares are missing or do
    not match a commitment / public key."""
    survivors = tuple(sorted(received[Phase.MASKED_INPUT]))
    advertised = received[Phase.ADVERTISE_KEYS]
    self_mask_shares, key_shares = collect_shares(config, received[Phase.UNMASK])
    signed_seeds: list[tuple[bytes, int]] = []
    commitments = received[Phase.SHARE_KEYS]
    suspects: set[int] = set()        # holders caught with a wrong share: tried last for the next secret
    doubted: set[int] = set()         # left out of a confirmed set, uncorroborated: tried late (a hint)
    for owner in survivors:
        commitment = commitments[owner].self_mask_commitment
        seed = reconstruct_secret(config, self_mask_shares, owner, "self-mask seed",
                                  lambda s: self_mask_commitment(context, owner, s) == commitment,
                                  suspects, doubted)
        signed_seeds.append((seed, -1))
    for gone in dropped:
        masked_with = sorted(graph.neighbours(gone) & set(survivors))
        if not masked_with:
            continue
        public = advertised[gone].mask_public_key
        mask_key = x25519_from_private_bytes(reconstruct_secret(
            config, key_shares, gone, "mask key",
            lambda s: x25519_public_bytes(x25519_from_private_bytes(s)) == public, suspects, doubted))
        for survivor in masked_with:
            seed = pair_mask_seed(mask_key, advertised[survivor].mask_public_key, context, gone, survivor)
            signed_seeds.append((seed, -pair_mask_sign(survivor, gone)))
    return signed_seeds
