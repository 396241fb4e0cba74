"""A job's participant draw: the generator that samples each round's devices, its saved state,
and its restoration from a checkpoint.

Where the accountant counts on sampling (DP with q < 1), who was drawn must stay secret: the
amplification holds only while nobody can tell. Devices see part of every draw (each knows whether
it was asked), and Python's Mersenne Twister is linear over GF(2): enough observed outputs give
its state, and with it every later draw. Such a draw therefore comes from :class:`KeyedDraw`, AES
in counter mode under the job's secret 128-bit key (a cryptographic generator), which the store
keeps sealed (``aggregator/service/sealed_draws.py``): its saved state is the key. Every other job
draws from a ``random.Random`` seeded with its config's ``seed``, reproducible by design.
"""

from __future__ import annotations

import logging
import random
import secrets

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

log = logging.getLogger("fedfleet.aggregator")

BLOCK_BITS = 128
WORD = (1 << 32) - 1


class KeyedDraw(random.Random):
    """``random.Random`` whose bits are AES-128-CTR's keystream under ``key`` (an int < 2^128):
    ``getrandbits(k)`` takes the next ⌈k/128⌉ blocks whole (their top k bits), so the state is the
    key and a block counter, saved and restored as ``random.Random``'s ``getstate`` tuple shape
    (``VERSION``, four 32-bit words of the key then the counter's two, None). ``sample``, ``choice``
    and ``randrange`` draw through ``getrandbits``; ``random()`` takes 53 bits."""

    VERSION = "fedfleet-aes128-ctr-1"

    def __init__(self, key: int):
        if not 0 <= key < 1 << BLOCK_BITS:
            raise ValueError("a keyed draw's key is an integer in [0, 2^128)")
        self._key, self._block = key, 0
        super().__init__()

    @classmethod
    def fresh(cls) -> "KeyedDraw":
        """A draw under a new secret key (a new job's; one whose key was stored in the clear)."""
        return cls(secrets.randbits(BLOCK_BITS))

    def seed(self, a=None, version=2) -> None:
        """Ignored: the key is the seed (``random.Random.__init__`` calls this)."""

    def getrandbits(self, k: int) -> int:
        if k < 0:
            raise ValueError("number of bits must be non-negative")
        blocks = -(-k // BLOCK_BITS)
        if not blocks:
            return 0
        counter = self._block.to_bytes(16, "big")
        stream = Cipher(algorithms.AES(self._key.to_bytes(16, "big")), modes.CTR(counter)).encryptor().update(
            bytes(16 * blocks))
        self._block += blocks
        return int.from_bytes(stream, "big") >> (BLOCK_BITS * blocks - k)

    def random(self) -> float:
        return self.getrandbits(53) * 2.0 ** -53

    def getstate(self) -> tuple:
        key, block = self._key, self._block
        return (self.VERSION, tuple((key >> s) & WORD for s in (96, 64, 32, 0)) + (block >> 32, block & WORD), None)

    def setstate(self, state) -> None:
        version, words, _ = state
        if version != self.VERSION or len(words) != 6 or not all(type(w) is int and 0 <= w <= WORD for w in words):
            raise ValueError("not a keyed draw's saved state")
        self._key = (words[0] << 96) | (words[1] << 64) | (words[2] << 32) | words[3]
        self._block = (words[4] << 32) | words[5]


def draw_state(draw: random.Random) -> list:
    """The draw's state as JSON-able data (the bookkeeping each round stores)."""
    version, internal, gauss = draw.getstate()
    return [version, list(internal), gauss]


def restored_draw(state) -> random.Random:
    """The draw ``draw_state`` saved: a keyed one, or a Mersenne Twister (every other job's, and
    every checkpoint written before keyed draws)."""
    version, internal, gauss = state
    draw = KeyedDraw(0) if version == KeyedDraw.VERSION else random.Random()
    draw.setstate((version, tuple(internal), gauss))
    return draw


def resumed_draw(state, fresh: random.Random) -> random.Random:
    """The draw a job resumes with from its saved ``state``: the saved one, unless the job now draws
    keyed (``fresh``, the draw its config gives a new job, is a :class:`KeyedDraw`) and the saved one
    is a Mersenne Twister, as a sampled DP job's bookkeeping from before keyed draws holds. Why:
    a job resumed on it drew every later round from a generator whose state follows from enough of
    its outputs (``KeyedDraw`` says why that matters; a review's finding); ``fresh`` then draws from
    here on, under a new key."""
    saved = restored_draw(state)
    if isinstance(fresh, KeyedDraw) and not isinstance(saved, KeyedDraw):
        log.warning("the participant draw was saved by a version before keyed draws: drawn keyed from now on")
        return fresh
    return saved
