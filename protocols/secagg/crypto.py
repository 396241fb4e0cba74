"""Cryptographic primitives of secure aggregation: key agreement, share encryption, mask PRG.

- Key agreement: X25519, then HKDF-SHA256 with an `info` string that names the purpose and the
  round context, so that one Diffie-Hellman value never yields the same key for two purposes.
- Share encryption: AES-256-GCM with a random 96-bit nonce stored in front of the ciphertext;
  the associated data binds (job, round, group, sender, recipient).
- Mask PRG: AES-128 in counter mode from counter 0, key = SHA-256(domain || seed)[:16]; the
  keystream read as little-endian words of the round's ring (uint64, or uint32 in a 32-bit
  ring: the same keystream, cut into words half as wide) is the mask. Each seed is fresh per round, so a
  key/counter pair is never reused. AES-128 rather than AES-256: ~12 % faster here (9.2 vs
  8.2 GB/s of CPU time) and 128-bit security is what the rest of the protocol offers anyway.
  The keystream is computed through AES-GCM where GCM's counter blocks are the PRG's (`_Keystream`):
  the same bits, from OpenSSL's faster GCM loop.

`apply_masks` adds/subtracts many masks into one vector of ring words (uint64 or uint32). It walks the vector in
cache-sized blocks and, for each block, runs every seed's keystream through one small buffer,
so the accumulator block and the keystream stay in L2 instead of streaming 8 bytes per element
per seed through memory. Arithmetic is numpy uint64 (uint32), which wraps modulo 2^64 (2^32) by
itself.

With `workers` > 1 the seeds are dealt into that many groups (`key_groups`) and each thread
applies its group to the whole vector: the first into the accumulator itself, the others into
zeroed vectors of their own that are added in at the end. Sums modulo 2^r do not depend on their
order, so the result is bit-identical to the serial pass whatever the split. Splitting by seed,
not by word range, keeps every keystream starting at block 0, where the faster GCM loop can
produce it (`_Keystream`; a slice starting mid-vector would need plain CTR); it costs one vector
per extra thread and one add each, little beside the keystreams of a server's unmasking (one
per survivor and per lost pair). Threads, not processes: `cryptography` 50.0.2 (checked: a
Python thread keeps running during a long update_into) releases the GIL inside `update_into`,
and numpy releases it inside its uint64 add; with an older `cryptography` that holds the GIL the
threads still give the same bits, only slower.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import DecryptionError, MalformedMessage
from .fixedpoint import RING_WORDS

X25519_KEY_BYTES = 32
DERIVED_KEY_BYTES = 32
AEAD_NONCE_BYTES = 12
AEAD_TAG_BYTES = 16
_PRG_DOMAIN = b"fedfleet/secagg/prg/v1"
_HKDF_SALT = b"fedfleet/secagg/hkdf/v1"
# 32768 words = 256 KiB of uint64 per block: accumulator block + keystream buffer fit in a
# typical L2. A multiple of 4, so a block boundary is an AES block boundary in either ring.
MASK_BLOCK_WORDS = 1 << 15
AES_BLOCK_BYTES = 16
# Default thread count for server-side mask expansion: the usable cores, at most this many. Every
# update_into / np.add call hands the GIL over twice, so threads beyond a few queue on it: 2 700
# masks of 10^6 words on a 16-core Xeon ran 1.8x / 2.6x / 2.6x / 1.7x faster (wall) with 2 / 4 /
# 8 / 16 threads than with one, at 1.1x / 1.3x / 1.5x / 1.8x the CPU time.
MAX_DEFAULT_MASK_WORKERS = 4


def generate_x25519() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def x25519_private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def x25519_public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def x25519_from_private_bytes(raw: bytes) -> X25519PrivateKey:
    if len(raw) != X25519_KEY_BYTES:
        raise ValueError("an X25519 private key is 32 bytes")
    return X25519PrivateKey.from_private_bytes(raw)


def agree(private_key: X25519PrivateKey, peer_public: bytes, info: bytes) -> bytes:
    """HKDF-SHA256(X25519(private_key, peer_public)) bound to `info`.

    Raises MalformedMessage for a malformed or low-order peer key (all-zero shared secret).
    """
    if not isinstance(peer_public, (bytes, bytearray)) or len(peer_public) != X25519_KEY_BYTES:
        raise MalformedMessage("an X25519 public key is 32 bytes")
    try:
        shared = private_key.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
    except ValueError as exc:  # cryptography rejects low-order points
        raise MalformedMessage(f"unusable X25519 public key: {exc}") from None
    return HKDF(algorithm=hashes.SHA256(), length=DERIVED_KEY_BYTES, salt=_HKDF_SALT,
                info=info).derive(shared)


_PROBE_KEY = X25519PrivateKey.generate()


def check_usable_public_key(peer_public: bytes) -> None:
    """MalformedMessage unless ``peer_public`` is a 32-byte X25519 key every peer can agree with: a
    low-order point gives an all-zero secret, which every honest peer refuses (they then never
    answer). An X25519 secret is zero for every clamped private key or for none, so one exchange
    with a throwaway key tells."""
    agree(_PROBE_KEY, peer_public, b"fedfleet secagg: key probe")


def aead_encrypt(key: bytes, plaintext: bytes, associated_data: bytes) -> bytes:
    """nonce || AES-256-GCM(plaintext) || tag."""
    nonce = os.urandom(AEAD_NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated_data)


def aead_ciphertext_length(plaintext_length: int) -> int:
    return AEAD_NONCE_BYTES + plaintext_length + AEAD_TAG_BYTES


def aead_decrypt(key: bytes, blob: bytes, associated_data: bytes) -> bytes:
    if len(blob) < AEAD_NONCE_BYTES + AEAD_TAG_BYTES:
        raise DecryptionError("ciphertext shorter than nonce + tag")
    try:
        return AESGCM(key).decrypt(blob[:AEAD_NONCE_BYTES], blob[AEAD_NONCE_BYTES:], associated_data)
    except InvalidTag:
        raise DecryptionError("share ciphertext failed authentication (corrupted, or wrong key/context)") from None


def usable_cores() -> int:
    """CPU cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def default_mask_workers() -> int:
    """Usable CPU cores of this process, capped at MAX_DEFAULT_MASK_WORKERS."""
    return max(1, min(usable_cores(), MAX_DEFAULT_MASK_WORKERS))


def check_workers(workers: object) -> int:
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    return workers


def prg_key(seed: bytes) -> bytes:
    """The AES-128 key of the mask PRG for `seed`."""
    return hashlib.sha256(_PRG_DOMAIN + seed).digest()[:16]


def prg_keys(signed_seeds: Iterable[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
    """(AES-128 key, sign) for each (seed, sign); raises ValueError for a sign other than +-1.
    Every mask applier (this module's, or a server's accelerated one) starts from this."""
    keys: list[tuple[bytes, int]] = []
    for seed, sign in signed_seeds:
        if sign not in (1, -1):
            raise ValueError("mask sign must be +1 or -1")
        keys.append((prg_key(seed), sign))
    return keys


def check_accumulator(accumulator: np.ndarray) -> None:
    if accumulator.dtype not in RING_WORDS or accumulator.ndim != 1 or not accumulator.flags.c_contiguous:
        raise TypeError("accumulator must be a contiguous 1-D uint64 or uint32 array")


# AES-GCM with the 96-bit IV 0^96 encrypts with the counter blocks 0^96 || i (i = 2, 3, ..., the
# low 32 bits incremented): exactly the PRG's CTR blocks 2, 3, ... while i < 2^32. Its keystream
# (the ciphertext of zeros; the tag is never taken) is OpenSSL's stitched AES-NI/PCLMUL loop, which
# ran 1.5x faster than its CTR here (bench/secagg.py, "mask keystream"), GHASH included.
_GCM_FIRST_BLOCK = 2
_GCM_LAST_BLOCK = (1 << 32) - 1


class _Keystream:
    """The mask PRG's keystream from AES block `first_block` on, written chunk by chunk into a
    caller's buffer. Where the stream starts at or before block 2 and ends before block 2^32
    (every pass of apply_masks and of the server's appliers: they start at block 0) the blocks
    before 2 come from CTR and the rest from GCM's faster loop; elsewhere (a slice entered further
    on, as apply_masks_to_slice allows, where GCM cannot start) plain AES-128-CTR with the 128-bit
    big-endian counter. The same bits."""

    def __init__(self, key: bytes, first_block: int, n_blocks: int):
        if first_block <= _GCM_FIRST_BLOCK and first_block + n_blocks - 1 <= _GCM_LAST_BLOCK:
            head_blocks = min(_GCM_FIRST_BLOCK - first_block, n_blocks)
            self._head = Cipher(algorithms.AES(key), modes.CTR(first_block.to_bytes(16, "big"))).encryptor() \
                .update(bytes(head_blocks * AES_BLOCK_BYTES))
            self._cipher = Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()
        else:
            self._head = b""
            self._cipher = Cipher(algorithms.AES(key), modes.CTR(first_block.to_bytes(16, "big"))).encryptor()

    def fill(self, zeros: bytes, out: bytearray) -> None:
        """out[:len(zeros)] = the next len(zeros) bytes of the stream (``out`` has one AES block
        more room: update_into wants it, neither mode writes it)."""
        taken = min(len(self._head), len(zeros))
        if taken:
            out[:taken] = self._head[:taken]
            self._head = self._head[taken:]
        if taken < len(zeros):
            self._cipher.update_into(zeros[taken:] if taken else zeros, memoryview(out)[taken:] if taken else out)


def expand_mask(seed: bytes, length: int, dtype=np.uint64) -> np.ndarray:
    """The mask of `length` words (uint64, or uint32 for a 32-bit ring) derived from `seed` (a
    fresh array)."""
    out = np.zeros(length, dtype=dtype)
    apply_masks(out, [(seed, 1)])
    return out


def key_groups(keys: Sequence[tuple[bytes, int]], workers: int) -> list[list[tuple[bytes, int]]]:
    """The keys dealt round-robin into at most `workers` non-empty groups (sizes within one)."""
    parts = max(1, min(workers, len(keys)))
    return [list(keys[i::parts]) for i in range(parts)]


def apply_masks(accumulator: np.ndarray, signed_seeds: Iterable[tuple[bytes, int]], workers: int = 1) -> None:
    """accumulator += sum(sign * PRG(seed)) mod 2^64 (2^32 for uint32 words), in place; sign is +1 or -1. `workers`
    threads each take one group of the seeds; the result does not depend on `workers`."""
    check_accumulator(accumulator)
    check_workers(workers)
    keys = prg_keys(signed_seeds)
    if not keys or accumulator.size == 0:
        return
    groups = key_groups(keys, workers)
    if len(groups) == 1:
        apply_masks_to_slice(accumulator, keys, 0)
        return
    partials = [np.zeros_like(accumulator) for _ in groups[1:]]
    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="secagg-mask") as pool:
        futures = [pool.submit(apply_masks_to_slice, target, group, 0)
                   for target, group in zip([accumulator, *partials], groups)]
        for future in futures:
            future.result()  # re-raises a worker's exception here
    for partial in partials:
        np.add(accumulator, partial, out=accumulator)


def apply_masks_to_slice(target: np.ndarray, keys: Sequence[tuple[bytes, int]], first_word: int) -> None:
    """target (words first_word .. first_word + len - 1 of the vector) += sum(sign * PRG) there."""
    word_bytes = target.dtype.itemsize
    if (first_word * word_bytes) % AES_BLOCK_BYTES:
        raise ValueError("a mask slice must start on an AES block boundary")
    length = target.size
    first_block = first_word * word_bytes // AES_BLOCK_BYTES
    n_blocks = -(-length * word_bytes // AES_BLOCK_BYTES)
    streams = [(_Keystream(key, first_block, n_blocks), sign) for key, sign in keys]
    block = min(MASK_BLOCK_WORDS, length)
    zeros = bytes(block * word_bytes)
    # update_into wants room for one extra cipher block; neither mode writes it.
    keystream = bytearray(block * word_bytes + AES_BLOCK_BYTES)
    keystream_words = np.frombuffer(keystream, dtype=target.dtype.newbyteorder("<"), count=block)
    for start in range(0, length, block):
        stop = min(start + block, length)
        n_words = stop - start
        source = zeros if n_words == block else zeros[: n_words * word_bytes]
        words = keystream_words if n_words == block else keystream_words[:n_words]
        chunk = target[start:stop]
        for stream, sign in streams:
            stream.fill(source, keystream)
            if sign > 0:
                np.add(chunk, words, out=chunk)
            else:
                np.subtract(chunk, words, out=chunk)
