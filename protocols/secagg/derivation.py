"""Round-bound key derivations shared by the client and the server.

Both sides must derive bit-identical keys, so the HKDF `info` strings, the AEAD associated
data, the encrypted share layout and the mask signs live here and nowhere else.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from . import shamir
from .crypto import aead_ciphertext_length, agree

SECRET_BYTES = 32  # s_u^SK (X25519 private key) and b_u (self-mask seed)
SHARE_BYTES = shamir.share_bytes(SECRET_BYTES)
# plaintext of one encrypted share: share of s_u^SK || share of b_u
SHARE_PLAINTEXT_BYTES = 2 * SHARE_BYTES
SHARE_CIPHERTEXT_BYTES = aead_ciphertext_length(SHARE_PLAINTEXT_BYTES)


@dataclass(frozen=True)
class RoundContext:
    job_id: str
    round_id: int
    group_id: str

    def encode(self, purpose: str, *parties: str) -> bytes:
        """``fedfleet/secagg/<purpose>/v1\n`` + the compact JSON array [job, round, group, *parties]
        (what the Java device builds too). Written item by item, each string's JSON kept and the
        round's three items once: a round derives ~70 of these per member, and json.dumps of the
        whole list was a tenth of its CPU."""
        items = ",".join([self._round_items, *map(_json_string, parties)])
        return f"fedfleet/secagg/{purpose}/v1\n[{items}]".encode()

    @functools.cached_property
    def _round_items(self) -> str:
        return ",".join([json.dumps(self.job_id), json.dumps(self.round_id), json.dumps(self.group_id)])


@functools.lru_cache(maxsize=65536, typed=True)
def _json_string(value: str) -> str:
    return json.dumps(value)


def share_encryption_key(cipher_private: X25519PrivateKey, peer_cipher_public: bytes,
                         context: RoundContext, a: str, b: str) -> bytes:
    """Symmetric in (a, b): both ends of an edge derive the same AES-GCM key."""
    low, high = sorted((a, b))
    return agree(cipher_private, peer_cipher_public, context.encode("share-key", low, high))


def pair_mask_seed(mask_private: X25519PrivateKey, peer_mask_public: bytes,
                   context: RoundContext, a: str, b: str) -> bytes:
    """s_ab = HKDF(X25519(s_a^SK, s_b^PK)); symmetric in (a, b)."""
    low, high = sorted((a, b))
    return agree(mask_private, peer_mask_public, context.encode("pair-mask", low, high))


def share_associated_data(context: RoundContext, sender: str, recipient: str) -> bytes:
    return context.encode("share-aad", sender, recipient)


def pair_mask_sign(owner: str, peer: str) -> int:
    """y_owner includes +PRG(s_owner,peer) if owner < peer, else -PRG(...), so the pair cancels."""
    return 1 if owner < peer else -1


def self_mask_commitment(context: RoundContext, owner: str, self_mask_seed: bytes) -> bytes:
    """SHA-256 commitment to b_owner, sent with the encrypted shares, so that the server can
    tell a correctly reconstructed b_owner from one built from corrupted shares. b is 256
    uniformly random bits, so the hash reveals nothing usable about it."""
    return hashlib.sha256(context.encode("self-mask-commitment", owner) + self_mask_seed).digest()
