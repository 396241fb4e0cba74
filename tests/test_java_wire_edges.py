"""The Java device decides as the Python device on the edge cases a differential review found
(docs/protocol.md "Envelope", "Canonical JSON", "Chunking"): the same bytes go through the Java
device's receive path (tests/java_device/WireEdges: MqttAgent's inbox reader, or an InboxReader /
Reassembler of given limits) and through the Python device's (edge_client.inbox.aggregator_inbox
as edge_client/agent.py builds it, then its sender check), and every message must get the same
decision: PENDING (a chunk held), ACCEPT, or REFUSE (never a crash).

What the Java side got wrong before:
* JSON numbers took any script's digits after an ASCII first one (``1767٢٢٥600`` read as
  1767225600, ``1１``) and threw NumberFormatException out of Envelope.decode on ``1.٥``/``1e٣``;
* ``\\u`` escapes took a sign or other scripts' hex digits (``\\u+061``, four ARABIC-INDIC digits);
* headers nested up to 64 levels, where Python refuses past 32 (protocols/envelope.py
  check_json_depth: containers, the header itself counting 1);
* ``type`` had no length cap (the schema's maxLength is 64);
* the reassembler held chunks whose parent is no message id, refusing only the whole; ignored a
  completed message resent under the same parent for ever (a set that never expired); allowed 8
  partial messages per sender, dropping the oldest for a new one, with no byte budget per sender
  and none overall; and the agent held chunks of any sender, checking only the whole message's;
* integers outside -2^63 .. 2^64 - 1 were taken (a deadline of 10^400 became Infinity), and an empty
  tensor of a shape no device can hold (numpy's reshape raised out of the Python decoder).
"""

from __future__ import annotations

import json
import struct
import subprocess

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import java_build
from edge_client.inbox import aggregator_inbox
from protocols.chunking import Reassembler, split
from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.identity import sender_verifier

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

AGGREGATOR = "aggregator"
EMPTY_SHA = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
ID = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def java_cp() -> str:
    return java_build.built()


# ---- the two devices ----

def java_decisions(java_cp: str, cases: list[dict]) -> list[list[str]]:
    """Each case's decisions by the Java device (one JVM for all cases)."""
    lines = [json.dumps({"msgs": [m.hex() for m in c["msgs"]], "now": c["now"], "key": c.get("key"),
                         "reassembler": c.get("reassembler"), "bare": c.get("bare", False)}) for c in cases]
    proc = subprocess.run(java_build.java_command("-cp", java_cp, "WireEdges"), input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line)["out"] for line in proc.stdout.splitlines()]


def python_decisions(case: dict) -> list[str]:
    """The Python device's decisions: its inbox as edge_client/agent.py builds it
    (``edge_client.inbox.aggregator_inbox``, verifier for the aggregator when a key is given) and
    its sender check; ``bare``: a plain Reassembler."""
    key = bytes.fromhex(case["key"]) if case.get("key") else None
    kw = {}
    if case.get("reassembler"):
        ttl, max_bytes, per_sender, pending = case["reassembler"]
        kw = dict(max_message_bytes=max_bytes, ttl_s=ttl, max_pending_per_sender=per_sender, max_pending_bytes=pending)
    if case.get("bare"):
        reassembler = Reassembler(**kw)
    else:
        assembler = aggregator_inbox(sender_verifier(AGGREGATOR, key) if key else None, **kw)
        reassembler = assembler.reassembler
    out = []
    for payload, now in zip(case["msgs"], case["now"]):
        try:
            reassembler.expire(now)
            if case.get("bare"):
                whole = reassembler.add(decode(payload), now)
                env = None if whole is None else decode(whole)
            else:
                env = assembler.feed(payload, now)
            if env is None:
                out.append("PENDING")
            elif env.sender != AGGREGATOR and not case.get("bare"):
                out.append(f"REFUSE message from {env.sender!r}, expected the aggregator")
            else:
                out.append(f"ACCEPT {env.type} {env.id}")
        except EnvelopeError as exc:
            out.append(f"REFUSE {exc}")
        except Exception as exc:            # noqa: BLE001 - reported, and fails the comparison
            out.append(f"CRASH {type(exc).__name__}: {exc}")
    return out


def assert_same_decisions(java_cp: str, cases: list[dict], expected: list[list[str]] | None = None) -> None:
    """Java decides as Python on every message (the first word: PENDING / ACCEPT / REFUSE, and
    what was accepted); ``expected``, Python's decisions' first words, pins what the case is for."""
    java = java_decisions(java_cp, cases)
    for k, (case, got) in enumerate(zip(cases, java)):
        want = python_decisions(case)
        brief = [d if d.startswith("ACCEPT") else d.split()[0] for d in want]
        if expected is not None:
            assert [d.split()[0] for d in want] == expected[k], (case["name"], want)
        assert [d if d.startswith("ACCEPT") else d.split()[0] for d in got] == brief, (case["name"], want, got)


# ---- messages ----

def raw(header: str, payload: bytes = b"") -> bytes:
    """An envelope around the header text exactly as given (no canonical re-encoding)."""
    h = header.encode("utf-8")
    return b"FFE1" + struct.pack("<I", len(h)) + h + payload


def ack(ts: str = "1767225600.0", sender: str = AGGREGATOR, type_: str = "ack", extra: str = "") -> bytes:
    """A canonical aggregator ack with its fields' JSON text substituted."""
    return raw('{"body":{"reason":"","ref":"%s","status":"accepted"%s},"id":"%s","payload_sha256":"%s",'
               '"sender":"%s","tensors":[],"ts":%s,"type":"%s","v":1}' % (ID, extra, ID, EMPTY_SHA, sender, ts, type_))


def one(name: str, payload: bytes) -> dict:
    return {"name": name, "msgs": [payload], "now": [0.0]}


def message(k: int, sender: str = AGGREGATOR, signer=None) -> tuple[bytes, str]:
    """A whole task message of 2,710 bytes unsigned (id k), encoded."""
    env = Envelope("task", sender, {"job": "j1", "round": 3}, {"weight": np.arange(600, dtype=np.float32)},
                   id=f"{k:032x}", ts=1767225600.0)
    return encode(env, signer=signer), env.id


def chunks(k: int, sender: str = AGGREGATOR, signer=None) -> list[bytes]:
    """Its chunks of 1,000 bytes (three), each signed as the whole message is."""
    whole, mid = message(k, sender, signer)
    return split(whole, mid, sender, chunk_size=1000, signer=signer)


# ---- 1. JSON numbers: ASCII digits only ----

def test_json_numbers_take_ascii_digits_only(java_cp):
    cases = [one("ts 1767225600.0 (control)", ack()),
             one("ts with ARABIC-INDIC digits", ack(ts="1767\u0662\u0662\u0665600.0")),
             one("integer ts with ARABIC-INDIC digits", ack(ts="1767\u0662\u0662\u0665600")),
             one("body integer 1 and a FULLWIDTH 1", ack(extra=',"x":1\uff11')),
             one("fraction digit ARABIC-INDIC", ack(ts="1.\u0665")),
             one("exponent digit ARABIC-INDIC", ack(ts="1e\u0663")),
             one("exponent sign then ARABIC-INDIC", ack(ts="1e+\u0663"))]
    assert_same_decisions(java_cp, cases, [["ACCEPT"]] + [["REFUSE"]] * 6)


# ---- 2. \u escapes: exactly four [0-9a-fA-F] ----

def test_json_unicode_escapes_take_four_ascii_hex_digits(java_cp):
    cases = [one("sender \\u0061ggregator (control)", ack(sender="\\u0061ggregator")),
             one("sender \\u0041 in upper-case hex (control)", ack(extra=',"x":"\\u004A"')),
             one("sender \\u+061ggregator", ack(sender="\\u+061ggregator")),
             one("status \\u-061", ack(extra=',"x":"\\u-061"')),
             one("sender via four ARABIC-INDIC digits", ack(sender="\\u\u0660\u0660\u0666\u0661ggregator")),
             one("FULLWIDTH hex letters", ack(extra=',"x":"\\u00\uff21\uff21"'))]
    assert_same_decisions(java_cp, cases, [["ACCEPT"]] * 2 + [["REFUSE"]] * 4)


# ---- 3. nesting: refused past 32 levels, the header counting 1 ----

def test_json_nesting_is_refused_where_python_refuses_it(java_cp):
    def arrays(n):      # the header 1, the body 2, then n arrays
        return ack(extra=',"x":' + "[" * n + "]" * n)

    def objects(n):
        return ack(extra=',"x":' + '{"a":' * (n - 1) + "{}" + "}" * (n - 1))

    cases = [one("30 arrays in the body: 32 levels", arrays(30)),
             one("31 arrays in the body: 33 levels", arrays(31)),
             one("62 arrays in the body", arrays(62)),
             one("63 arrays in the body", arrays(63)),
             one("30 objects in the body: 32 levels", objects(30)),
             one("31 objects in the body: 33 levels", objects(31)),
             one("31 arrays around a scalar", ack(extra=',"x":' + "[" * 30 + "[1,2]" + "]" * 30))]
    assert_same_decisions(java_cp, cases, [["ACCEPT"], ["REFUSE"], ["REFUSE"], ["REFUSE"],
                                           ["ACCEPT"], ["REFUSE"], ["REFUSE"]])


# ---- 4. type: at most 64 characters ----

def test_envelope_type_is_at_most_64_characters(java_cp):
    cases = [one("type of 64 characters", ack(type_="a" * 64)),
             one("type of 65 characters", ack(type_="a" * 65)),
             one("dotted type of 65 characters", ack(type_="a" * 32 + "." + "b" * 32))]
    assert_same_decisions(java_cp, cases, [["ACCEPT"], ["REFUSE"], ["REFUSE"]])


# ---- 5a. a chunk's parent is refused at once when it is no message id ----

def test_a_chunk_whose_parent_is_no_message_id_is_refused_at_once(java_cp):
    def with_parent(parent):
        whole, _ = message(1)
        msgs = []
        for part in split(whole, ID, AGGREGATOR, chunk_size=1000):
            c = decode(part)
            msgs.append(encode(Envelope("chunk", AGGREGATOR, dict(c.body, parent=parent),
                                        {"data": c.tensors["data"]}, id=c.id, ts=c.ts)))
        return {"name": f"parent {parent!r}", "msgs": msgs, "now": [0.0] * len(msgs)}

    cases = [with_parent(ID.upper()), with_parent("x" * 32), with_parent(ID[:31]), with_parent(ID + "0"),
             with_parent(f"{1:032x}")]          # the message's own id: reassembled (control)
    assert_same_decisions(java_cp, cases, [["REFUSE"] * 3] * 4 + [["PENDING", "PENDING", "ACCEPT"]])


# ---- 5a'. a chunk's sha256 is refused at once when it is no lowercase hex digest ----

def test_a_chunk_whose_sha256_is_no_lowercase_hex_digest_is_refused_at_once(java_cp):
    """A differential review's finding: the Python receivers skip the announced digest (the whole's
    own payload_sha256 and signature cover its bytes, docs/protocol.md "Chunking"), so chunks naming
    an upper-case or malformed sha256 were reassembled and taken by the Python device and refused by
    the Java one, which checks it. Both refuse such a chunk at once now, before holding it."""
    def with_digest(digest):
        whole, mid = message(1)
        msgs = []
        for part in split(whole, mid, AGGREGATOR, chunk_size=1000):
            c = decode(part)
            msgs.append(encode(Envelope("chunk", AGGREGATOR, dict(c.body, sha256=digest(c.body["sha256"])),
                                        {"data": c.tensors["data"]}, id=c.id, ts=c.ts)))
        return {"name": "sha256 " + digest("d" * 64), "msgs": msgs, "now": [0.0] * len(msgs)}

    cases = [with_digest(str.upper), with_digest(lambda d: d[:63]), with_digest(lambda d: d + "0"),
             with_digest(lambda d: d + "\n"), with_digest(lambda d: "x" * 64),
             with_digest(lambda d: d)]            # the message's own digest: reassembled (control)
    assert_same_decisions(java_cp, cases, [["REFUSE"] * 3] * 5 + [["PENDING", "PENDING", "ACCEPT"]])


# ---- 5b. a completed message resent under its parent is reassembled again ----

def test_a_resent_completed_message_is_reassembled_again_and_remembered_as_python_does(java_cp):
    first = chunks(1)
    stalled = [chunks(k)[0] for k in (2, 3, 4)]
    new = chunks(9)
    cases = [
        {"name": "resend after completion", "msgs": first + first, "now": [0.0] * 6},
        # a resend's partial copy is the first to go for a new message, while its parent is remembered ...
        {"name": "resend makes room within the TTL", "msgs": first + first[:1] + stalled + new,
         "now": [0.0] * 3 + [100.0] * 7},
        # ... and not once the TTL is past: then it is a partial message like any other (the oldest
        # of the four, none making progress, goes for the new one)
        {"name": "resend after the TTL takes a slot", "msgs": first + first[:1] + stalled + new,
         "now": [0.0] * 3 + [400.0] * 7},
        # only the latest 16 completed messages of a sender are remembered
        {"name": "the 17th completed message pushes the first out",
         "msgs": first + [c for k in range(20, 36) for c in chunks(k)] + first[:1] + stalled + new,
         "now": [0.0] * (3 + 48 + 7)},
    ]
    assert_same_decisions(java_cp, cases, [
        ["PENDING", "PENDING", "ACCEPT"] * 2,
        ["PENDING", "PENDING", "ACCEPT"] + ["PENDING"] * 6 + ["ACCEPT"],
        ["PENDING", "PENDING", "ACCEPT"] + ["PENDING"] * 6 + ["ACCEPT"],
        ["PENDING", "PENDING", "ACCEPT"] * 17 + ["PENDING"] * 6 + ["ACCEPT"]])


# ---- 5c. memory bounds: partial messages per sender, bytes per sender and overall ----

def test_a_sender_past_four_partial_messages_gives_up_the_one_that_received_a_chunk_least_recently(java_cp):
    """A review's finding: the fifth was refused, so four replayed first chunks of the aggregator's
    earlier messages (chunks name no addressee) kept every chunked task out of a device for the TTL.
    A message making progress is never the one to go."""
    stalled = [chunks(k)[0] for k in (1, 2, 3, 4)]
    progressing, new = chunks(1), chunks(9)
    cases = [{"name": "4 stalled partials, then a new message", "msgs": stalled + new, "now": [0.0] * 7},
             {"name": "the stalled ones expire, then it is taken", "msgs": stalled + new, "now": [0.0] * 4 + [301.0] * 3},
             {"name": "the one making progress stays", "msgs": stalled + [progressing[1]] + new + [progressing[2]],
              "now": [0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 3.0, 3.0, 4.0]}]
    assert_same_decisions(java_cp, cases, [["PENDING"] * 6 + ["ACCEPT"], ["PENDING"] * 6 + ["ACCEPT"],
                                           ["PENDING"] * 7 + ["ACCEPT"] * 2])


def test_a_senders_reassembly_bytes_are_budgeted(java_cp):
    a, b = chunks(1), chunks(2)
    # 3,500 bytes per sender (half the overall 7,000): a message of 2,710 bytes and 2,000 of another do not fit
    limits = [300.0, 3500, 4, 7000]
    cases = [{"name": "second partial message past the budget", "msgs": [a[0], a[1], b[0], b[1], b[2], a[2]],
              "now": [0.0] * 6, "reassembler": limits},
             {"name": "default limits: the same messages fit", "msgs": [a[0], a[1], b[0], b[1], b[2], a[2]],
              "now": [0.0] * 6}]
    assert_same_decisions(java_cp, cases, [["PENDING", "PENDING", "PENDING", "REFUSE", "PENDING", "ACCEPT"],
                                           ["PENDING"] * 4 + ["ACCEPT"] * 2])


def test_a_full_reassembly_buffer_drops_the_message_and_refuses_its_later_chunks(java_cp):
    s1, s2, s3 = (chunks(k, sender=f"dev{k}") for k in (1, 2, 3))
    # 5,600 bytes over all senders (2,800 each, room for one message of 2,710): three senders' two chunks do not fit
    msgs = [s1[0], s1[1], s2[0], s2[1], s3[0], s3[1], s3[2], s1[2], s3[0], s3[1], s3[2]]
    cases = [{"name": "buffer full", "msgs": msgs, "now": [0.0] * len(msgs), "bare": True,
              "reassembler": [300.0, 3000, 4, 5600]}]
    assert_same_decisions(java_cp, cases, [["PENDING"] * 5 + ["REFUSE", "REFUSE", "ACCEPT", "PENDING", "PENDING", "ACCEPT"]])


# ---- 5d. the agent holds only the aggregator's chunks ----

def test_the_agent_refuses_a_chunk_of_another_sender_before_holding_it(java_cp):
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    forged = chunks(1, sender="dev1", signer=key.sign)          # signed by the aggregator's key, naming dev1
    cases = [{"name": "chunks naming dev1", "msgs": forged, "now": [0.0] * 3, "key": public},
             {"name": "the aggregator's chunks (control)", "msgs": chunks(2, signer=key.sign), "now": [0.0] * 3, "key": public},
             # without the aggregator's key (a development broker) as well: the Python device held
             # them then, refusing only the whole message (edge_client/inbox.py)
             {"name": "unsigned chunks naming dev1, no key", "msgs": chunks(3, sender="dev1"), "now": [0.0] * 3},
             {"name": "the aggregator's unsigned chunks, no key", "msgs": chunks(4), "now": [0.0] * 3}]
    assert_same_decisions(java_cp, cases, [["REFUSE"] * 3, ["PENDING", "PENDING", "ACCEPT"], ["REFUSE"] * 3,
                                           ["PENDING", "PENDING", "ACCEPT"]])


# ---- 7. numbers past the contract's range, empty tensors of shapes no device can hold ----

def test_integers_outside_the_contracts_range_and_overflowing_floats_are_refused_by_both(java_cp):
    """docs/protocol.md: integers within -2^63 .. 2^64 - 1, floats binary64 with no Infinity. The
    Java device took any integer (a deadline of 10^400 became Infinity), the Python device a float
    of 1e400 as Infinity and raised OverflowError out of float() on 10^400."""
    cases = [one(f"body k = {text}", ack(extra=f',"k":{text}')) for text in
             ("18446744073709551615", "18446744073709551616", "-9223372036854775808", "-9223372036854775809",
              "1" + "0" * 400, "1e308", "1e400", "-1e400")]
    assert_same_decisions(java_cp, cases, [["ACCEPT"], ["REFUSE"], ["ACCEPT"], ["REFUSE"], ["REFUSE"], ["ACCEPT"],
                                           ["REFUSE"], ["REFUSE"]])


def test_an_empty_tensor_of_a_shape_no_device_can_hold_is_refused_by_both(java_cp):
    """A shape [0, 2^32-1, 2^32-1] (no bytes) made numpy's reshape raise ValueError out of the
    Python decoder and was taken by the Java one; both refuse a shape whose non-zero dimensions
    times the item size exceed 2^63 - 1 now, and take one within it."""
    def empty(shape: list[int], dtype: str) -> bytes:
        return raw('{"body":{"reason":"","ref":"%s","status":"accepted"},"id":"%s","payload_sha256":"%s",'
                   '"sender":"aggregator","tensors":[{"dtype":"%s","name":"x","nbytes":0,"offset":0,"shape":%s}],'
                   '"ts":1767225600.0,"type":"ack","v":1}' % (ID, ID, EMPTY_SHA, dtype, json.dumps(shape).replace(" ", "")))
    cases = [one(f"{shape} {dtype}", empty(shape, dtype)) for shape, dtype in
             (([0, 2**32 - 1, 2**32 - 1], "float32"), ([0, 2**31, 2**31], "uint8"), ([0, 2**31, 2**31], "float32"),
              ([0, 2**30, 2**30], "float64"), ([0, 4], "float64"))]
    assert_same_decisions(java_cp, cases, [["REFUSE"], ["ACCEPT"], ["REFUSE"], ["REFUSE"], ["ACCEPT"]])


# ---- 8. the agent's inbox holds no more of one sender than its queue holds of one topic ----

# the largest message the aggregator legitimately sends an agent: a LADD training task at the
# segmentation spec's largest network (tests/test_device_inbox_limits.py), its model, teacher and
# KD model (3 float32 vectors of 9,331,569 values) and a header of at most 64 KiB
LARGEST_TASK_BYTES = 3 * 4 * 9_331_569 + 64 * 1024


def first_chunk(total: int, k: int) -> bytes:
    """The first of two chunks of a message announcing ``total`` bytes (the aggregator's, unsigned)."""
    return encode(Envelope("chunk", AGGREGATOR, {"parent": f"{k:032x}", "index": 0, "count": 2, "total": total,
                                                 "sha256": "ab" * 32},
                           {"data": np.zeros(1000, np.uint8)}, id=f"{k + 100:032x}", ts=1767225600.0))


def test_the_agents_inbox_takes_no_message_larger_than_its_queue_holds_of_one_topic(java_cp):
    """A review's finding: one sender's partial messages could hold 512 MiB of the Python device
    (256 MiB of the Java one) while its inbox queue holds 128 MiB of a topic (160 MiB in all). Both
    agents now take no message, and no sender's partial messages together, larger than the queue's
    128 MiB per topic: the first chunk announcing more is refused unheld, by one rule on both; the
    largest task a job sends still passes (a bundle file comes through the fetch's own assembler)."""
    from protocols.device_inbox import DEVICE_INBOX_BOUND
    bound = DEVICE_INBOX_BOUND.source_bytes
    assert LARGEST_TASK_BYTES <= bound
    totals = [LARGEST_TASK_BYTES, bound, bound + 1, 300 << 20]
    cases = [one(f"a message of {total} bytes", first_chunk(total, k)) for k, total in enumerate(totals)]
    assert_same_decisions(java_cp, cases, [["PENDING"], ["PENDING"], ["REFUSE"], ["REFUSE"]])
