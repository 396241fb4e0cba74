"""The device's secure-input ledger: one input, revealed in a sum over one member set only.

SecAgg reveals a group's sum, never a member's input, within one round. Across rounds it does
not: a device that sends the **same input** to several secure rounds (a Fed3R-Sync or FedNCM-Sync
device asked again over the same samples, without DP: its statistics are a function of its
window; a re-sent identical FedAvg task) lets an aggregator that regroups it difference the sums.
Groups {u,v,w}, {v,w,z}, {u,v,z}, {u,w,z} give four equations in four inputs, and u's statistics
come out exactly (``tests/test_secure_input_ledger.py`` runs it; So et al., "Securing Secure
Aggregation: Mitigating Multi-Round Privacy Leakage in Federated Learning").

**The rule.** An input is named by a digest of what determines it (``input_key``: Fed3R-Sync's
vector before any noise, the device's exact statistics; for an update that differs each time it is
computed, the task: its kind, params but the group, tensors; ``vector_key``, ``member_digest``: portable
definitions the Java device's ``SecureInputLedger`` reproduces bit for bit). Per input, the device
keeps the digest of one member set, the set every sum of it may be over:

* its masked input leaves only in a round whose key directory lists exactly that set (every sum
  that could reveal it is over a subset of those participants); with none kept yet, it leaves and
  the participants are kept (written before it leaves);
* it answers the unmask phase only when the survivors are exactly the set kept, except in the
  round that first sent it, where the survivors (a subset of the participants) become the set kept,
  unless another round of the same input has sent its masked input on the set kept meanwhile (two
  rounds at once, the aggregator's choice): that round may be revealed over the set, which is then
  fixed, and a first round with fewer survivors is refused (else the two sums' difference is the
  dropped members' inputs).

So two revealed sums holding the same input are over the same members; when every honest member
keeps the rule, the distinct sets sums are over are disjoint, and no difference isolates anyone.
Why the masked input, not the unmask answer, is the point where the set is kept: once it has left,
a server can rebuild this device's self-mask from its neighbours' shares without ever asking it
(it withholds this device's ``UnmaskRequest``, or sends it a ``RoundAborted``): "a round that failed
before unmasking revealed nothing" is the server's word only. So an input whose round ended after it
left is sent again only to the same participants, all of them surviving. A round that failed before
the masked input left (dropouts in the key or share phases) keeps nothing, and its retry, in any
group, is answered. The cost: a member whose masked input left in a round that then failed does not
join another group with the same input (it leaves that round, ``OTHER_MEMBERS_REASON`` logged).

**Limits.** The rule holds the device's same input; a sum can still be rebuilt by its other
holders (a strict majority, 2t' > holders) when those are corrupt or hold no kept set for their
own input. Inputs that differ but overlap (Fed3R windows [0, n) and [0, n + 8)) are different
inputs here; the sample-window ledger (``sample_windows.py``) bounds what their differences
isolate. Distributed-DP rounds are named by their params (noise scale included) before their
noise, so their re-sends are held too. docs/secure-aggregation.md, "Threat model", says more.

**Kept** in the device's state folder (``secure_inputs.json``, canonical JSON: the Java device
writes the same bytes and reads this file), else in memory for the process's life. Bounded:
``MAX_INPUTS`` entries, the oldest forgotten first (a secure FedAvg device adds one a round). A
forgotten input is never new again: its key goes into a Bloom filter of forgotten inputs (2^20
bits, ``FORGOTTEN_PROBES`` positions per key cut from the key itself: ``forgotten_positions``),
kept in the same file once something was forgotten, and a key not kept but in the filter is
refused (``FORGOTTEN_REASON``), else an aggregator could push an input out with 1,024 tasks of
other inputs and regroup it. A false positive only makes the device sit a round out (about 0.65%
of new inputs at 100,000 forgotten, 12% at 200,000). A file that cannot be read (damaged, too
large, not ours, a malformed filter) fails closed: every secure input is refused with
``LOST_REASON`` until an operator repairs it or moves it aside.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
from pathlib import Path

import numpy as np

from protocols.envelope import canonical_json, parse_strict_json
from protocols.files import write_atomic
from protocols.regular_file import read_small_file

from edge_client.state import TEMP_PREFIX

log = logging.getLogger("fedfleet.device")

SECURE_INPUTS_FILE = "secure_inputs.json"
MAX_INPUTS = 1024
DIGEST_HEX = 32         # 128 bits of SHA-256: a collision would need 2^64 inputs
FORGOTTEN_BITS = 1 << 20      # m: the forgotten inputs' Bloom filter, 128 KiB
FORGOTTEN_PROBES = 7          # k: positions per key (forgotten_positions)
FORGOTTEN_TEXT = 4 * ((FORGOTTEN_BITS // 8 + 2) // 3)     # its base64 in the file: 174,764 characters
# each entry ["<32 hex>", "<32 hex>"] is 72 bytes; "forgotten":"<base64>", is 15 more than the base64
MAX_FILE_BYTES = 80 * MAX_INPUTS + 64 + FORGOTTEN_TEXT + 16
OTHER_MEMBERS_REASON = ("this device's input to this task already went to a secure round of other members: "
                        "revealed over these too, the two sums could be differenced (multi-round leakage), so it "
                        "takes part only in a round of those same members")
FORGOTTEN_REASON = ("this device forgot which members its input to this task went to (its secure-input ledger keeps "
                    f"the newest {MAX_INPUTS} inputs): revealed over others, the sums could be differenced "
                    "(multi-round leakage), so it sends this input to no secure round again")
LOST_REASON = (f"this device's secure-input ledger ({SECURE_INPUTS_FILE} in its state folder) could not be read: it "
               "sends no secure input until an operator repairs that file or moves it aside")


def member_digest(members) -> str:
    """The digest of a member set (device ids, order not mattering): the first DIGEST_HEX lowercase
    hex digits of SHA-256 over the ids sorted by code point, joined by "\\n", UTF-8."""
    return hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()[:DIGEST_HEX]


def input_key(kind: str, params: dict, tensors: dict[str, np.ndarray]) -> str:
    """The digest naming one input: what determines it, the group (the round's routing) left out.
    No job or round id either: the same task under another job's name is the same input.

    Portable, so both SDKs name one input alike (docs/secure-aggregation.md, "The secure-input
    ledger's digests"; ``protocols/golden/secure_inputs.json``): SHA-256 over the canonical JSON
    (docs/protocol.md) of ``{"kind": kind, "params": params less "group"}``, then per tensor, by
    name in code-point order, the canonical JSON of ``[name, wire dtype, shape]`` and its
    little-endian C-order bytes; the first DIGEST_HEX hex digits."""
    h = hashlib.sha256(canonical_json({"kind": kind, "params": {k: v for k, v in params.items() if k != "group"}}))
    for name in sorted(tensors):
        array = np.asarray(tensors[name])        # not ascontiguousarray: it makes a scalar's shape [1]
        array = array.astype(array.dtype.newbyteorder("<"), order="C", copy=False)
        h.update(canonical_json([name, array.dtype.name, list(array.shape)]))
        h.update(array.tobytes())
    return h.hexdigest()[:DIGEST_HEX]


def forgotten_positions(key: str) -> list[int]:
    """The forgotten-inputs filter's bit positions of an input key (docs/secure-aggregation.md, "The
    secure-input ledger's digests"): position i (0 to FORGOTTEN_PROBES - 1) is the 20-bit number
    whose 5 hex digits start at digit 5·i of the 32-digit key, wrapping past its last digit to its
    first (the seventh: digits 30, 31, 0, 1, 2). The key is already 128 bits of SHA-256."""
    around = key + key
    return [int(around[5 * i:5 * i + 5], 16) for i in range(FORGOTTEN_PROBES)]


def vector_key(kind: str, vector: np.ndarray) -> str:
    """The key of an input named by its vector itself (Fed3R-Sync's statistics before noise): the
    ``input_key`` of ``kind``, no params, and the vector as the float64 tensor ``input``."""
    return input_key(kind, {}, {"input": np.asarray(vector, np.float64)})


class SecureInputLedger:
    """Per input key, the member set it may be revealed over (module doc). ``path``: where it is
    kept (None: in memory). Thread-safe: two rounds of one input never both pass as the first."""

    def __init__(self, path: str | Path | None = None):
        self.path = None if path is None else Path(path)
        self._lock = threading.Lock()
        self._kept: dict[str, str] = {}      # input key -> member-set digest, oldest first
        # keys whose set kept a round not the input's first sent its masked input on: fixed, its
        # first round may no longer narrow it to its survivors (the other may be revealed over it)
        self._relied: set[str] = set()
        # the Bloom filter of the keys forgotten (bit p: byte p // 8, value 1 << p % 8); None until one is
        self._forgotten: bytearray | None = None
        self.lost: str | None = None
        if self.path is not None:
            self._load()

    def release(self, key: str) -> "InputRelease":
        """The release guard of one round carrying ``key`` (``protocols.secagg.client.ReleaseGuard``)."""
        return InputRelease(self, key)

    def kept(self, key: str) -> str | None:
        """The member-set digest kept for ``key``, or None."""
        with self._lock:
            return self._kept.get(key)

    def _masked_input(self, key: str, participants: frozenset[str]) -> tuple[str | None, bool]:
        """(why it may not leave or None, whether this round is the input's first)."""
        with self._lock:
            if self.lost is not None and self._load() is not None:
                return LOST_REASON, False
            digest = member_digest(participants)
            if key not in self._kept:
                if self._was_forgotten(key):        # its set is unknown now: new it is not
                    return FORGOTTEN_REASON, False
                return self._keep(key, digest), True
            if self._kept[key] != digest:
                return OTHER_MEMBERS_REASON, False
            self._relied.add(key)
            return None, False

    def _unmask(self, key: str, survivors: frozenset[str], first: bool) -> str | None:
        with self._lock:
            if self.lost is not None and self._load() is not None:
                return LOST_REASON
            if key not in self._kept and self._was_forgotten(key):     # pushed out since its masked input left
                return FORGOTTEN_REASON
            digest = member_digest(survivors)
            if first and key not in self._relied:       # the set this round revealed it over is now known
                return self._keep(key, digest)
            return None if self._kept.get(key) == digest else OTHER_MEMBERS_REASON

    def _was_forgotten(self, key: str) -> bool:
        bits = self._forgotten
        return bits is not None and all(bits[p >> 3] >> (p & 7) & 1 for p in forgotten_positions(key))

    def _keep(self, key: str, digest: str) -> str | None:
        before = dict(self._kept), self._forgotten
        self._kept.pop(key, None)
        self._kept[key] = digest
        self._relied.discard(key)                    # kept anew: no other round sent on this set yet
        while len(self._kept) > MAX_INPUTS:          # the oldest forgotten (module doc)
            oldest = next(iter(self._kept))
            del self._kept[oldest]
            self._relied.discard(oldest)
            if self._forgotten is before[1]:         # a copy: a failed write keeps the old filter
                self._forgotten = bytearray(self._forgotten or FORGOTTEN_BITS // 8)
            for p in forgotten_positions(oldest):
                self._forgotten[p >> 3] |= 1 << (p & 7)
        if self.path is None:
            return None
        doc: dict = {"inputs": [[k, v] for k, v in self._kept.items()]}
        if self._forgotten is not None:
            doc["forgotten"] = base64.b64encode(self._forgotten).decode("ascii")
        try:
            write_atomic(self.path, canonical_json(doc), temp_prefix=TEMP_PREFIX)
        except OSError as exc:
            self._kept, self._forgotten = before     # not remembered across a restart: not sent
            log.warning("writing the device's secure inputs %s failed (%s)", self.path, str(exc)[:200])
            return f"this device could not write down its secure input ({type(exc).__name__}): it is not sent"
        return None

    def reload(self) -> str | None:
        """Read the kept file again (a lost one may have been repaired or moved aside since): why it
        cannot be read, or None."""
        with self._lock:
            return None if self.path is None else self._load()

    def _load(self) -> str | None:
        """Read the kept file (a missing one: nothing kept); ``lost`` and returned: why it cannot be."""
        try:
            self._kept, self._forgotten = checked_file(parse_strict_json(read_small_file(self.path, MAX_FILE_BYTES)))
        except FileNotFoundError:
            self._kept, self._forgotten = {}, None
        except (OSError, ValueError, RecursionError) as exc:
            why = str(exc)[:200]
            if why != self.lost:
                log.warning("the device's secure inputs %s are unreadable (%s): no secure input is sent until the "
                            "file is repaired or moved aside", self.path, why)
            self.lost = why
            return why
        self.lost = None
        return None


class InputRelease:
    """One round's release guard for one input (``SecureInputLedger.release``)."""

    def __init__(self, ledger: SecureInputLedger, key: str):
        self.ledger, self.key = ledger, key
        self.first = False           # this round sent the input first: its survivors are the set kept

    def masked_input(self, participants: frozenset[str]) -> str | None:
        reason, self.first = self.ledger._masked_input(self.key, participants)
        return reason

    def unmask(self, survivors: frozenset[str]) -> str | None:
        return self.ledger._unmask(self.key, survivors, self.first)


def checked_file(doc) -> tuple[dict[str, str], bytearray | None]:
    """The file's entries, ``{"inputs": [[key, member digest], ...]}``, distinct hex keys, oldest
    first, and its forgotten-inputs filter (``"forgotten"``, present once something was forgotten)."""
    if not isinstance(doc, dict) or set(doc) - {"forgotten"} != {"inputs"} or not isinstance(doc["inputs"], list):
        raise ValueError('not {"inputs": [...]} (and "forgotten")')
    kept: dict[str, str] = {}
    for entry in doc["inputs"]:
        if not isinstance(entry, list) or len(entry) != 2 or not all(map(_is_digest, entry)) or entry[0] in kept:
            raise ValueError("an entry that is not [key, member digest]")
        kept[entry[0]] = entry[1]
    if len(kept) > MAX_INPUTS:
        raise ValueError(f"{len(kept)} entries, at most {MAX_INPUTS}")
    return kept, None if "forgotten" not in doc else _checked_filter(doc["forgotten"])


def _checked_filter(text) -> bytearray:
    """The filter's bits from its base64 (RFC 4648, padded), exactly FORGOTTEN_BITS, written as this
    device would write them (no other spelling: the two SDKs must accept the same files)."""
    why = "a forgotten-inputs filter that is not the base64 of 2^20 bits"
    if not isinstance(text, str) or len(text) != FORGOTTEN_TEXT or not text.isascii():
        raise ValueError(why)
    try:
        bits = base64.b64decode(text, validate=True)
    except ValueError:                          # binascii.Error: a character or padding out of place
        raise ValueError(why) from None
    if len(bits) != FORGOTTEN_BITS // 8 or base64.b64encode(bits).decode("ascii") != text:
        raise ValueError(why)
    return bytearray(bits)


def _is_digest(value) -> bool:
    return isinstance(value, str) and len(value) == DIGEST_HEX and all(c in "0123456789abcdef" for c in value)


__all__ = ["FORGOTTEN_REASON", "LOST_REASON", "MAX_INPUTS", "OTHER_MEMBERS_REASON", "SECURE_INPUTS_FILE",
           "SecureInputLedger", "forgotten_positions", "input_key", "member_digest", "vector_key"]
