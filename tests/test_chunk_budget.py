"""Reassembly buffers are bounded per device (one device never blocks another's chunked results)
and expire on the receiver's clock. (A resend of a reassembled message: tests/test_protocol_envelope.py.)"""

import numpy as np
import pytest

from protocols.chunking import MessageAssembler, split
from protocols.envelope import Envelope, EnvelopeError, encode


def mid(name: str) -> str:
    return name.encode().hex().ljust(32, "0")          # message ids are 32 hex digits


def chunked(sender: str, name: str, nbytes: int, chunk: int = 1000) -> list[bytes]:
    env = Envelope(type="result", sender=sender, id=mid(name), body={},
                   tensors={"x": np.frombuffer(np.random.default_rng(nbytes).bytes(nbytes), np.uint8)})
    return split(encode(env), env.id, sender, chunk_size=chunk)


def test_one_device_filling_its_budget_never_blocks_another_device():
    asm = MessageAssembler(max_message_bytes=20_000, max_pending_bytes=30_000)
    assert asm.reassembler.max_pending_bytes_per_sender == 15_000
    hog = [chunked("hog", f"m{i}", 9_000) for i in range(3)]
    with pytest.raises(EnvelopeError, match="budget"):
        for message in hog:
            for part in message[:-1]:                # never completes: pins what it can
                asm.feed(part, now=0.0)
    assert asm.reassembler.pending_bytes() <= 15_000
    honest = chunked("honest", "h1", 12_000)
    got = [asm.feed(part, now=1.0) for part in honest]
    assert got[-1] is not None and got[-1].id == mid("h1") and all(g is None for g in got[:-1])


def test_partials_expire_after_the_ttl_and_free_their_budget():
    asm = MessageAssembler(max_message_bytes=20_000, ttl_s=300.0)
    parts = chunked("dev", "m1", 9_000)
    for part in parts[:-1]:
        asm.feed(part, now=0.0)
    assert asm.reassembler.pending_bytes() > 0
    assert asm.reassembler.expire(now=299.0) == []
    assert asm.reassembler.expire(now=301.0) == [("dev", mid("m1"))]
    assert asm.reassembler.pending_bytes() == 0
    assert asm.feed(parts[-1], now=302.0) is None        # the late last chunk starts a new partial, never a message
