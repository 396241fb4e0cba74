"""Splitting large envelopes into MQTT-sized chunks and putting them back together.

Theory of operation
-------------------
Brokers cap payload sizes (mosquitto's ``message_size_limit``, managed brokers often 256 KiB to
a few MiB), while Fed3R statistics are megabytes (d=1280: 6.6 MB for the float64 upper triangle).
A sender therefore encodes the whole message, and when it is larger than ``chunk_size`` it sends
``count`` envelopes of type ``chunk``, each with one ``uint8`` tensor ``data`` and the body::

    {"parent": <id of the whole message>, "index": i, "count": n,
     "total": <bytes of the whole message>, "sha256": <hex digest of the whole message>}

The :class:`Reassembler` is a sans-IO buffer: ``add(chunk_envelope)`` returns the whole encoded
message once every index has arrived and its sha256 matches, else ``None``. A
:class:`MessageAssembler` neither hashes each chunk's payload nor the reassembled whole: it hands
the whole message to a full :func:`~protocols.envelope.decode` (eagerly, or the caller does, in an
ingest worker), whose payload sha256 and signature cover every byte of every chunk — a corrupted,
truncated or foreign chunk fails there, as a whole-message check would, and a 6.6 MB upload is
hashed once instead of three times. It is idempotent
(a duplicated chunk - QoS 1 redelivery - is ignored), refuses chunks that disagree with the first
one seen for the same parent, bounds memory per sender (``max_pending_bytes_per_sender``, below
the overall budget, so one sender can never fill the buffer for everyone) and overall, and forgets
partial messages older than ``ttl_s`` (``expire(now)``, which the receiver calls on its clock), so
a sender that vanished mid-message cannot pin memory. A chunk the overall budget cannot take drops
its whole message and the message's later chunks are refused without being held (a resend starting
at chunk 0 is taken afresh): held, they could never complete and would keep the buffer full for
every other sender until the TTL, as when 1,000 devices' 6.7 MB masked inputs arrived at once.

A sender that got no answer resends the whole message (same ``parent``). Such a resend of a message
already reassembled is reassembled again and returned again, so the receiver sees the very same
message and answers it (a result's ``duplicate`` ack) instead of staying silent while the sender
uploads it again and again. Its partial copy is the first to go when the sender needs room for a
new message, and it expires like any other. Without one, the partial that received a chunk least
recently goes (``max_pending_per_sender``): refusing the new message instead let four replayed
first chunks of the aggregator's earlier messages (chunks name no addressee) keep every chunked task
from a device for the TTL, a review found; a message arriving now makes progress, so it is never
the one to go.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .envelope import Envelope, EnvelopeError, SenderNotAdmitted, body_field, decode_header, encode, require_tensor

CHUNK_TYPE = "chunk"
DEFAULT_CHUNK_SIZE = 256 * 1024
MAX_CHUNKS = 4096
SMALL_PART_BYTES = 64 * 1024             # a part smaller than a header's limit is copied, not viewed
MESSAGE_ID = re.compile(r"[0-9a-f]{32}")  # an envelope's id (schema/envelope.schema.json): what a parent names
DIGEST = re.compile(r"[0-9a-f]{64}")      # a chunk's sha256: the whole message's, lowercase hex
RECENT_PER_SENDER = 16                   # completed / refused parents remembered per sender (the latest)


def encode_parts(env: Envelope, signer=None, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[bytes]:
    """``env`` as the MQTT payloads that carry it: itself, or its chunks. EnvelopeError when it
    cannot be sent (a header or message over the limits, too many chunks)."""
    return split(encode(env, signer=signer), env.id, env.sender, chunk_size=chunk_size, signer=signer)


def split(message: bytes, message_id: str, sender: str, chunk_size: int = DEFAULT_CHUNK_SIZE,
          signer=None) -> list[bytes]:
    """Encoded chunk envelopes for ``message``; ``[message]`` itself when it fits in one chunk."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    if len(message) <= chunk_size:
        return [message]
    count = math.ceil(len(message) / chunk_size)
    if count > MAX_CHUNKS:
        raise EnvelopeError(f"message of {len(message)} bytes needs {count} chunks > {MAX_CHUNKS}; raise chunk_size")
    digest = hashlib.sha256(message).hexdigest()
    view = np.frombuffer(message, dtype=np.uint8)
    out = []
    for i in range(count):
        part = view[i * chunk_size:(i + 1) * chunk_size]
        env = Envelope(type=CHUNK_TYPE, sender=sender,
                       body={"parent": message_id, "index": i, "count": count,
                             "total": len(message), "sha256": digest},
                       tensors={"data": part})
        out.append(encode(env, signer=signer))
    return out


@dataclass
class _Partial:
    count: int
    total: int
    sha256: str
    first_seen: float
    last_seen: float                    # when its latest chunk came: the least recent goes first for room
    parts: dict[int, bytes] = field(default_factory=dict)
    held: int = 0                       # bytes in parts (kept as a sum: an aggregator holds ~1,000 partials)


class Reassembler:
    """Collects chunk envelopes; see the module docstring."""

    def __init__(self, max_message_bytes: int = 512 * 1024 * 1024,
                 max_pending_per_sender: int = 4, max_pending_bytes: int = 1024 * 1024 * 1024,
                 ttl_s: float = 300.0, max_pending_bytes_per_sender: int | None = None,
                 check_digest: bool = True):
        self.max_message_bytes = max_message_bytes
        self.check_digest = check_digest       # False: the whole message is decoded in full afterwards
        self.max_pending_per_sender = max_pending_per_sender
        self.max_pending_bytes = max_pending_bytes
        # one sender may hold at most one largest message's worth, and never half the overall budget
        self.max_pending_bytes_per_sender = max_pending_bytes_per_sender or min(max_message_bytes,
                                                                               max_pending_bytes // 2)
        self._held_by: dict[str, int] = {}                # sender -> bytes its partials hold
        self.ttl_s = ttl_s
        self._partials: dict[tuple[str, str], _Partial] = {}
        self._held = 0                                   # bytes held over all partials
        self._per_sender: dict[str, list[tuple[str, str]]] = {}   # sender -> its partials' keys, oldest first
        # sender -> {parent: when}, the latest RECENT_PER_SENDER of each (a sender sending message
        # after message would otherwise grow them for a TTL, outside every budget):
        self._done: dict[str, dict[str, float]] = {}     # recently completed: a partial of one is a resend
        # messages dropped because the buffer was full: their later chunks are refused unheld (held,
        # they could never complete, and would pin the buffer until the TTL for everyone)
        self._refused: dict[str, dict[str, float]] = {}

    def add(self, chunk: Envelope, now: float | None = None) -> bytes | None:
        now = time.monotonic() if now is None else now
        if chunk.type != CHUNK_TYPE:
            raise EnvelopeError(f"expected a chunk, got {chunk.type!r}")
        parent = body_field(chunk, "parent", str)
        if not MESSAGE_ID.fullmatch(parent):
            raise EnvelopeError("a chunk's parent must be its message's id (32 lowercase hex digits)")
        index = body_field(chunk, "index", int)
        count = body_field(chunk, "count", int)
        total = body_field(chunk, "total", int)
        digest = body_field(chunk, "sha256", str)
        # checked even where the digest itself is not (check_digest False): a chunk naming no digest
        # is refused at once, as by the Java device, which checks the digest
        if not DIGEST.fullmatch(digest):
            raise EnvelopeError("a chunk's sha256 must be the whole message's digest (64 lowercase hex digits)")
        if set(chunk.tensors) != {"data"}:      # anything else would be held with it, uncounted
            raise EnvelopeError("a chunk carries exactly one tensor, 'data'")
        data = require_tensor(chunk, "data", "uint8", (None,))
        key = (chunk.sender, parent)
        if not (1 <= count <= MAX_CHUNKS) or not (0 <= index < count):
            raise EnvelopeError(f"chunk index {index} / count {count} out of range")
        if not (0 < total <= self.max_message_bytes):
            raise EnvelopeError(f"chunked message of {total} bytes exceeds the {self.max_message_bytes}-byte limit")
        if _recalls(self._refused, key):
            if index != 0:
                raise EnvelopeError(f"chunk {index} of {parent}: the message was dropped (reassembly buffer full)")
            del self._refused[key[0]][parent]       # the sender resends it from the start: a fresh try
        partial = self._partials.get(key)
        if partial is None:
            self._make_room(chunk.sender)
            partial = self._partials[key] = _Partial(count, total, digest, now, now)
            self._per_sender.setdefault(chunk.sender, []).append(key)
        elif (partial.count, partial.total, partial.sha256) != (count, total, digest):
            raise EnvelopeError(f"chunk {index} of {parent} disagrees with earlier chunks (count/total/sha256)")
        if index in partial.parts:
            return None  # redelivery
        if partial.held + len(data) > total:
            self._drop(key)
            raise EnvelopeError(f"chunks of {parent} exceed the announced total {total} bytes")
        if self._held_by.get(chunk.sender, 0) + len(data) > self.max_pending_bytes_per_sender:
            self._drop(key)
            raise EnvelopeError(f"sender {chunk.sender!r} exceeds its reassembly budget "
                                f"({self.max_pending_bytes_per_sender} bytes)")
        if self._held + len(data) > self.max_pending_bytes:
            self._drop(key)
            _remember(self._refused, key, now)
            raise EnvelopeError(f"reassembly buffer full: message {parent} dropped")
        # a view on the chunk's bytes (copied once, by the join) keeps the chunk's whole message
        # alive, header included (up to 64 KiB): a small part is copied, so what is held is at most
        # about twice what the budgets count
        partial.parts[index] = data if len(data) >= SMALL_PART_BYTES else bytes(data)
        partial.held += len(data)
        partial.last_seen = now
        self._held += len(data)
        self._held_by[chunk.sender] = self._held_by.get(chunk.sender, 0) + len(data)
        if len(partial.parts) < count:
            return None
        self._drop(key)
        whole = b"".join(partial.parts[i] for i in range(count))
        if len(whole) != total or (self.check_digest and hashlib.sha256(whole).hexdigest() != digest):
            raise EnvelopeError(f"reassembled message {parent} fails its size/sha256 check")
        _remember(self._done, key, now)
        return whole

    def _make_room(self, sender: str) -> None:
        """Room for one more partial message of ``sender``, at its limit: drop its oldest resend of an
        already reassembled message, else its partial that received a chunk least recently (the
        oldest of those tied)."""
        pending = self._per_sender.get(sender, [])
        if len(pending) < self.max_pending_per_sender:
            return
        resend = next((k for k in pending if _recalls(self._done, k)), None)     # oldest first
        self._drop(resend if resend is not None else min(pending, key=lambda k: self._partials[k].last_seen))

    def _drop(self, key: tuple[str, str]) -> None:
        partial = self._partials.pop(key)
        self._held -= partial.held
        left = self._held_by.pop(key[0], 0) - partial.held
        if left > 0:
            self._held_by[key[0]] = left
        keys = self._per_sender[key[0]]
        keys.remove(key)
        if not keys:
            del self._per_sender[key[0]]

    def pending_bytes(self) -> int:
        return self._held

    def senders(self) -> set[str]:
        """Senders holding a partial message now."""
        return set(self._per_sender)

    def expire(self, now: float | None = None) -> list[tuple[str, str]]:
        """Drop partial messages older than ttl_s; returns the (sender, parent) pairs dropped."""
        now = time.monotonic() if now is None else now
        stale = [k for k, p in self._partials.items() if now - p.first_seen > self.ttl_s]
        for k in stale:
            self._drop(k)
        for table in (self._done, self._refused):
            for sender in list(table):
                kept = {parent: t for parent, t in table[sender].items() if now - t <= self.ttl_s}
                if kept:
                    table[sender] = kept
                else:
                    del table[sender]
        return stale


def _remember(table: dict[str, dict[str, float]], key: tuple[str, str], now: float) -> None:
    """Note (sender, parent) at ``now``, keeping only the sender's latest RECENT_PER_SENDER."""
    recent = table.setdefault(key[0], {})
    recent.pop(key[1], None)
    recent[key[1]] = now
    while len(recent) > RECENT_PER_SENDER:
        del recent[next(iter(recent))]


def _recalls(table: dict[str, dict[str, float]], key: tuple[str, str]) -> bool:
    return key[1] in table.get(key[0], ())


class MessageAssembler:
    """Decodes raw payloads into whole envelopes: single messages pass through, chunks are
    collected by a :class:`Reassembler`. ``feed`` returns the envelope, or None while a chunked
    message is incomplete; it raises EnvelopeError for anything malformed."""

    def __init__(self, verifier=None, max_message_bytes: int = 512 * 1024 * 1024,
                 may_chunk: Callable[[str], bool] = lambda sender: True, **reassembler_kw):
        """``may_chunk(sender)``: whether chunks of this sender are held at all (an aggregator's:
        only devices that may contribute send it large messages)."""
        from .envelope import decode

        self._decode = decode
        self.verifier, self.may_chunk = verifier, may_chunk
        self.max_message_bytes = max_message_bytes
        self.reassembler = Reassembler(max_message_bytes=max_message_bytes, check_digest=False, **reassembler_kw)

    def expire(self, now: float, counted: dict[str, int], log, who: str = "") -> dict[str, int]:
        """Drop the partial messages older than the reassembler's ttl (each logged on ``log``, its
        line prefixed with ``who``), and return ``counted`` (a receiver's bytes per sender of the
        message being reassembled) without the senders that no longer hold one: the counts go
        with their partials (refused ones go at once, where the receiver refuses them)."""
        for sender, parent in self.reassembler.expire(now):
            log.warning("%spartial message %s from %s expired unfinished", who, parent, sender)
        holding = self.reassembler.senders()
        return {d: n for d, n in counted.items() if d in holding}

    def feed(self, payload: bytes, now: float | None = None) -> Envelope | None:
        whole = self.feed_whole(payload, now)
        return None if whole is None else whole[0]

    def feed_whole(self, payload: bytes, now: float | None = None,
                   topic_sender: str | None = None) -> tuple[Envelope, bytes] | None:
        """Like :meth:`feed`, also returning the whole encoded message (what a durable store keeps)."""
        got = self.feed_lazy(payload, now, lazy=False, topic_sender=topic_sender)
        return None if got is None else got[:2]

    def feed_lazy(self, payload: bytes, now: float | None = None, lazy: bool = True,
                  topic_sender: str | None = None) -> tuple[Envelope, bytes, bool] | None:
        """Like :meth:`feed_whole`, but a reassembled (chunked, so large) message comes back with
        its header only (``decode_header``; its chunks' headers were checked, signatures included,
        not their bytes) and ``False``:
        the caller decodes it in full — payload sha256, signature, tensors — wherever it likes
        (an aggregator's ingest workers) before acting on it. Single messages come back decoded
        in full, with ``True``.

        ``topic_sender``: the device whose topic the payload came on; a chunk claiming another
        sender is refused before anything is held (held under the name it claims, one device's
        chunks filled another's budget and slots)."""
        env = self._decode(payload, self.verifier, max_bytes=self.max_message_bytes,
                           hash_payload=lambda kind: kind != CHUNK_TYPE)
        if env.type != CHUNK_TYPE:
            return env, payload, True
        if topic_sender is not None and env.sender != topic_sender:
            raise EnvelopeError(f"a chunk from {env.sender!r} on {topic_sender!r}'s topic")
        if not self.may_chunk(env.sender):
            raise SenderNotAdmitted(f"{env.sender!r} may not send chunked messages here")
        whole = self.reassembler.add(env, now)
        if whole is None:
            return None
        if lazy:
            inner = decode_header(whole, max_bytes=self.max_message_bytes)
        else:
            inner = self._decode(whole, self.verifier, max_bytes=self.max_message_bytes)
        if inner.sender != env.sender or inner.id != env.body["parent"]:
            raise EnvelopeError("reassembled message's sender/id do not match its chunks")
        return inner, whole, not lazy
