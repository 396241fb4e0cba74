"""Wire contract: envelope, chunking, topics, golden vectors, and rejection of bad input."""

import hashlib
import json
import struct

import numpy as np
import pytest

from protocols import golden
from protocols.chunking import MessageAssembler, Reassembler, split
from protocols.envelope import (MAX_HEADER_BYTES, Envelope, EnvelopeError, canonical_json, decode, encode,
                                require_finite, require_tensor)
from protocols.identity import verify_signature
from protocols.topics import Topics, check_device_id


def sample(**kw):
    t = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "ids": np.array([1, 5], dtype=np.int64)}
    return Envelope("result", "dev0001", {"job": "j", "round": 1}, t, **kw)


def test_round_trip_preserves_tensors_and_fields():
    m = sample()
    d = decode(encode(m))
    assert (d.type, d.sender, d.body, d.id) == (m.type, m.sender, m.body, m.id)
    for k in m.tensors:
        assert d.tensors[k].dtype == m.tensors[k].dtype.newbyteorder("<")
        np.testing.assert_array_equal(d.tensors[k], m.tensors[k])


def test_big_endian_input_is_written_little_endian():
    be = np.arange(4, dtype=">f8")
    data = encode(Envelope("x", "d", {}, {"v": be}))
    assert data.endswith(np.arange(4, dtype="<f8").tobytes())


def _raw(header: dict, payload: bytes) -> bytes:
    h = canonical_json(header)
    return b"FFE1" + struct.pack("<I", len(h)) + h + payload


def _header_and_payload(m):
    data = encode(m)
    hlen = struct.unpack_from("<I", data, 4)[0]
    return json.loads(data[8:8 + hlen]), data[8 + hlen:]


@pytest.mark.parametrize("mutate, msg", [
    (lambda d: b"XXXX" + d[4:], "bad magic"),
    (lambda d: d[:6], "too short"),
    (lambda d: d[:-3], "sha256"),
    (lambda d: d + b"\0", "sha256"),
    (lambda d: d[:4] + struct.pack("<I", 10**7) + d[8:], "header length"),
    (lambda d: d[:8] + b"!" + d[9:], "header"),
])
def test_malformed_bytes_are_rejected(mutate, msg):
    with pytest.raises(EnvelopeError, match=msg if msg != "bad magic" else "magic"):
        decode(mutate(encode(sample())))


def test_header_schema_violations_are_rejected():
    header, payload = _header_and_payload(sample())
    for key, value in [("v", "1"), ("id", "xyz"), ("sender", "a/b"), ("type", "Bad Type"), ("extra", 1)]:
        h = dict(header, **{key: value})
        with pytest.raises(EnvelopeError, match="header invalid"):
            decode(_raw(h, payload))
    h = dict(header)
    del h["payload_sha256"]
    with pytest.raises(EnvelopeError, match="payload_sha256"):
        decode(_raw(h, payload))


def _raw_text(text: str, payload: bytes) -> bytes:
    h = text.encode("utf-8")
    return b"FFE1" + struct.pack("<I", len(h)) + h + payload


def test_header_json_is_parsed_strictly():
    """What Python's json module accepts but RFC 8259 and docs/protocol.md do not: NaN/Infinity
    tokens, duplicate keys, lone surrogates; and JSON floats where the contract wants integers."""
    header, payload = _header_and_payload(sample())
    text = canonical_json(header).decode()
    ts = json.dumps(header["ts"])
    cases = [(text.replace(f'"ts":{ts}', '"ts":NaN'), "NaN is not JSON"),
             (text.replace(f'"ts":{ts}', '"ts":Infinity'), "Infinity is not JSON"),
             (text.replace('"body":{', '"body":{"k":1,"k":2,', 1), "duplicate key 'k'"),
             (text.replace('"type":', '"type":"a","type":', 1), "duplicate key 'type'"),
             (text.replace('"body":{', '"body":{"s":"\\ud800",', 1), "surrogate"),
             (text.replace('"v":1', '"v":1.0'), "v: 1.0 is not a JSON integer"),
             (text.replace('"offset":0', '"offset":0.0', 1), "offset: 0.0 is not a JSON integer")]
    shape = json.dumps(header["tensors"][0]["shape"], separators=(",", ":"))
    float_shape = "[" + ",".join(f"{d}.0" for d in header["tensors"][0]["shape"]) + "]"
    cases.append((text.replace(f'"shape":{shape}', f'"shape":{float_shape}', 1), "shape: .* holds a non-integer"))
    for bad, match in cases:
        assert bad != text, match                               # the mutation applied
        with pytest.raises(EnvelopeError, match=match):
            decode(_raw_text(bad, payload))
    decode(_raw_text(text, payload))                            # the unmutated header still decodes


def test_tensor_table_must_tile_the_payload():
    header, payload = _header_and_payload(sample())
    bad = json.loads(json.dumps(header))
    bad["tensors"][0]["shape"] = [3, 3]                    # nbytes no longer matches
    with pytest.raises(EnvelopeError, match="nbytes"):
        decode(_raw(bad, payload))
    bad = json.loads(json.dumps(header))
    bad["tensors"][1]["offset"] += 8                        # gap
    with pytest.raises(EnvelopeError, match="gap or overlap"):
        decode(_raw(bad, payload))
    bad = json.loads(json.dumps(header))
    bad["tensors"] = bad["tensors"][:1]                     # undescribed trailing bytes
    with pytest.raises(EnvelopeError, match="trailing"):
        decode(_raw(bad, payload))


def test_unsupported_version_and_oversize():
    header, payload = _header_and_payload(sample())
    with pytest.raises(EnvelopeError, match="version"):
        decode(_raw(dict(header, v=2), payload))
    with pytest.raises(EnvelopeError, match="too large"):
        decode(encode(sample()), max_bytes=100)
    with pytest.raises(EnvelopeError, match="header too large"):
        encode(Envelope("x", "d", {"blob": "a" * (MAX_HEADER_BYTES + 1)}))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_every_non_finite_value_anywhere_is_refused_and_finite_tensors_pass(dtype):
    """require_finite against numpy's isfinite: NaN, +Inf or -Inf at the start, middle or end of
    a tensor (alone or together), in every float wire dtype; extremes that are finite pass."""
    big = float(np.finfo(dtype).max)
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, 500, 999):
            v = np.linspace(-1, 1, 1000).astype(dtype)
            v[where] = bad
            assert not np.isfinite(v).all()
            with pytest.raises(EnvelopeError, match="NaN or Inf"):
                require_finite(decode(encode(Envelope("x", "d", {}, {"ok": np.ones(3), "v": v}))))
    mixed = np.array([np.inf, 1.0, -np.inf], dtype=dtype)
    with pytest.raises(EnvelopeError, match="NaN or Inf"):
        require_finite(decode(encode(Envelope("x", "d", {}, {"v": mixed}))))
    edges = np.array([big, -big, 0.0, -0.0, np.finfo(dtype).tiny], dtype=dtype)
    require_finite(decode(encode(Envelope("x", "d", {}, {"v": edges, "empty": np.zeros(0, dtype)}))))


def test_nan_and_shape_checks():
    m = decode(encode(Envelope("x", "d", {}, {"v": np.array([1.0, np.nan])})))
    with pytest.raises(EnvelopeError, match="NaN"):
        require_finite(m)
    with pytest.raises(EnvelopeError, match="shape"):
        require_tensor(m, "v", "float64", (3,))
    with pytest.raises(EnvelopeError, match="dtype"):
        require_tensor(m, "v", "float32", (2,))
    with pytest.raises(EnvelopeError, match="missing"):
        require_tensor(m, "w", "float64", (2,))
    with pytest.raises(EnvelopeError, match="JSON"):
        encode(Envelope("x", "d", {"bad": float("inf")}))


def test_signature_binds_header_and_payload():
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    pub = key.public_key()

    def verifier(sender, data, sig):
        try:
            pub.verify(sig, data)
        except InvalidSignature:
            raise EnvelopeError(f"bad signature from {sender}")

    data = encode(sample(), signer=key.sign)
    assert decode(data, verifier).sender == "dev0001"
    with pytest.raises(EnvelopeError, match="unsigned"):
        decode(encode(sample()), verifier)
    header, payload = _header_and_payload(sample())
    forged = dict(header, sig=key.sign(b"something else").hex())
    with pytest.raises(EnvelopeError, match="bad signature"):
        decode(_raw(forged, payload), verifier)


def test_a_signature_is_verified_over_the_bytes_received_not_a_re_encoding():
    """A sender whose float formatter writes 2^-24 with 17 digits (``5.9604644775390625e-08``;
    repr writes 16) signs its own bytes: the signature holds here, where a re-encoding would write
    repr's digits; the received member ``"sig"`` must be there once, canonically written."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from protocols.envelope import signed_header_bytes

    key = Ed25519PrivateKey.generate()
    raw_public = key.public_key().public_bytes_raw()
    header, payload = _header_and_payload(sample())
    header["body"]["lr"] = 2.0 ** -24
    other_writer = canonical_json(header).replace(b"5.960464477539063e-08", b"5.9604644775390625e-08")
    assert other_writer != canonical_json(header) and json.loads(other_writer) == header
    sig = key.sign(other_writer).hex()
    received = other_writer[:-1] + b',"sig":"' + sig.encode() + b'"}'    # "v" sorts before nothing: sig last
    assert signed_header_bytes(received, sig) == other_writer
    canonical_order = canonical_json({**header, "sig": sig})
    assert signed_header_bytes(canonical_order, sig) == canonical_json(header)
    verify = lambda sender, data, signature: verify_signature(raw_public, data, signature)
    message = b"FFE1" + struct.pack("<I", len(received)) + received + payload
    assert decode(message, verify).body["lr"] == 2.0 ** -24
    with pytest.raises(Exception, match="signature"):              # re-encoding would have refused it
        verify_signature(raw_public, canonical_json(header), bytes.fromhex(sig))
    for bad in (received.replace(b'"sig":"', b'"sig": "'),                       # spaced: not canonical
                received.replace(b'"body":{', b'"body":{"sig":"' + sig.encode() + b'",')):   # twice
        with pytest.raises(EnvelopeError, match="exactly once"):
            decode(b"FFE1" + struct.pack("<I", len(bad)) + bad + payload, verify)


def test_chunking_round_trip_with_duplicates_and_reordering():
    m = Envelope("result", "dev1", {}, {"x": np.random.default_rng(0).normal(size=5000)})
    data = encode(m)
    parts = split(data, m.id, "dev1", chunk_size=4096)
    assert len(parts) > 5
    asm = MessageAssembler()
    order = list(reversed(parts)) + parts[:2]                 # reordered + redelivered
    outs = [asm.feed(p) for p in order]
    whole = [o for o in outs if o is not None]
    assert len(whole) == 1 and whole[0].id == m.id
    np.testing.assert_array_equal(whole[0].tensors["x"], m.tensors["x"])
    # the two redelivered chunks may start a resend; completing it yields the same message again
    again = [asm.feed(p) for p in parts[2:]]
    assert [o.id for o in again if o is not None] == [m.id] and again[-1] is not None
    np.testing.assert_array_equal(again[-1].tensors["x"], m.tensors["x"])
    assert asm.reassembler.pending_bytes() == 0


def test_resent_chunked_message_is_returned_again_and_never_blocks_new_messages():
    """A device that got no ack resends its whole chunked result: the receiver must see it again
    (to answer it ``duplicate``); stray resent chunks never keep the sender's new messages out."""
    r = Reassembler(max_pending_per_sender=2)
    msgs = [Envelope("result", "dev1", {"i": i}, {"x": np.full(3000, float(i))}) for i in range(4)]
    parts = [[decode(p) for p in split(encode(m), m.id, "dev1", chunk_size=2048)] for m in msgs]
    wholes = [[w for w in (r.add(c, now=0) for c in ps) if w is not None] for ps in parts[:2]]
    assert [decode(w[0]).id for w in wholes] == [msgs[0].id, msgs[1].id]
    resent = [w for w in (r.add(c, now=1) for c in parts[0]) if w is not None]
    assert len(resent) == 1 and decode(resent[0]).id == msgs[0].id
    # stray first chunks of both done messages fill the sender's two slots ...
    r.add(parts[0][0], now=2)
    r.add(parts[1][0], now=3)
    # ... and still two new messages get through (the oldest resends make room)
    for ps, m in zip(parts[2:], msgs[2:]):
        got = [w for w in (r.add(c, now=4) for c in ps) if w is not None]
        assert decode(got[0]).id == m.id
    # a sender with two genuinely new partial messages: a third takes the room of the one that
    # received a chunk least recently (a review's finding: refused, four replayed first chunks kept
    # a device's every chunked task out for the TTL)
    r2 = Reassembler(max_pending_per_sender=2)
    r2.add(parts[0][0], now=0)
    r2.add(parts[1][0], now=1)
    r2.add(parts[0][1], now=2)                      # message 0 makes progress, message 1 not
    r2.add(parts[2][0], now=3)
    assert sorted(r2._partials) == sorted([("dev1", msgs[0].id), ("dev1", msgs[2].id)])
    got = [w for w in (r2.add(c, now=4) for c in parts[0][2:]) if w is not None]
    assert decode(got[0]).id == msgs[0].id          # the one in progress went on to the end


def test_chunk_tampering_and_limits():
    m = Envelope("result", "dev1", {}, {"x": np.arange(3000.0)})
    data = encode(m)
    parts = split(data, m.id, "dev1", chunk_size=2048)
    # a chunk claiming a different total for the same parent
    first = decode(parts[0])
    other = Envelope("chunk", "dev1", dict(first.body, total=first.body["total"] + 1), {"data": first.tensors["data"]})
    r = Reassembler()
    r.add(first, now=0)
    with pytest.raises(EnvelopeError, match="disagrees"):
        r.add(decode(encode(other)), now=0)
    # oversized announced total
    with pytest.raises(EnvelopeError, match="limit"):
        Reassembler(max_message_bytes=1000).add(first, now=0)
    # corrupted content: same sizes, wrong bytes -> sha256 check fails, nothing returned
    r = Reassembler()
    bad = [decode(p) for p in parts]
    flipped = bad[1].tensors["data"].copy()
    flipped[0] ^= 0xFF
    bad[1] = Envelope("chunk", "dev1", bad[1].body, {"data": flipped})
    with pytest.raises(EnvelopeError, match="sha256"):
        for c in bad:
            r.add(c, now=0)
    # stale partial messages expire
    r = Reassembler(ttl_s=10)
    r.add(decode(parts[0]), now=0)
    assert r.expire(now=11) == [("dev1", m.id)] and r.pending_bytes() == 0


def test_an_assembler_refuses_a_chunk_corrupted_in_transit_though_it_hashes_no_chunk():
    """A MessageAssembler hashes neither chunks nor the reassembled whole: a chunk whose bytes
    changed under an intact header must still fail, at the whole message's full decode (eagerly,
    or where the caller decodes a lazily returned message, as an aggregator's ingest worker does)."""
    m = Envelope("result", "dev1", {}, {"x": np.arange(3000.0)})
    parts = split(encode(m), m.id, "dev1", chunk_size=2048)
    corrupt = bytearray(parts[1])
    corrupt[-1] ^= 0xFF                     # the chunk's last data byte; its header is untouched
    parts[1] = bytes(corrupt)
    eager = MessageAssembler()
    with pytest.raises(EnvelopeError, match="sha256"):
        for part in parts:
            eager.feed(part)
    lazy = MessageAssembler()
    got = [lazy.feed_lazy(part) for part in parts]
    header, whole, checked = got[-1]
    assert header.id == m.id and not checked            # routed on its header only...
    with pytest.raises(EnvelopeError, match="sha256"):
        decode(whole)                                    # ...and refused by the full decode


def test_topics_layout_and_device_id_validation():
    t = Topics("fleet")
    assert t.inbox("dev7") == "fleet/v1/dev/dev7/in" and t.device_of("fleet/v1/dev/dev7/out") == "dev7"
    assert t.device_of("fleet/v1/presence/dev7") == "dev7" and t.device_of("other/v1/dev/x/out") is None
    for bad in ["a/b", "a+b", "#", "", "x" * 65, "aggregator", "dev7\n"]:
        with pytest.raises(ValueError):
            check_device_id(bad)
    # a trailing newline is no part of an id or a root (a regex's "$" would let it through)
    assert t.device_of("fleet/v1/dev/dev7\n/out") is None and t.device_of("fleet/v1/presence/dev7\n") is None
    assert Topics("fleet").deploy_device_of("fleet/v1/deploy/dev7\n/out") is None
    assert Topics("site/a").base == "site/a/v1"
    for bad_root in ["/fleet", "a+b", "a#", "", "x" * 129, "fleet\n", "fl\x00eet"]:
        with pytest.raises(ValueError, match="topic root"):
            Topics(bad_root)


def test_golden_vectors_on_disk_match_the_codec():
    """The bytes in protocols/golden/ are what this codec produces and decodes (other languages test against them)."""
    d = golden.golden_dir()
    index = json.loads((d / "index.json").read_text())
    produced = golden.golden_messages()
    assert set(index) == set(produced)
    for name, data in produced.items():
        on_disk = (d / index[name]["file"]).read_bytes()
        assert on_disk == data, f"{name}: codec output differs from the golden vector"
        decoded = decode(on_disk)
        assert decoded.id == index[name]["header"]["id"]
        if "public_key" in index[name]:           # the signed vector verifies under its published key
            key = bytes.fromhex(index[name]["public_key"])
            decode(on_disk, lambda sender, data, sig: verify_signature(key, data, sig))
            with pytest.raises(Exception, match="signature"):
                decode(on_disk, lambda sender, data, sig: verify_signature(bytes(32 * [1]), data, sig))
    asm = MessageAssembler()
    chunks = sorted(n for n in index if n.startswith("chunk_"))
    res = [asm.feed((d / f"{c}.bin").read_bytes()) for c in chunks]
    assert res[-1] is not None and encode(res[-1]) == (d / "chunked_whole.bin").read_bytes()


def test_presence_is_parsed_strictly():
    from protocols import messages as M

    assert M.parse_presence(M.presence_message("dev7", "online", {"kinds": ["x"]})) == (True, {"kinds": ["x"]})
    assert M.parse_presence(M.presence_message("dev7", "offline")) == (False, {})
    for body, match in [({"state": "asleep"}, "online/offline"), ({"state": 1}, "state"), ({}, "state"),
                        ({"state": "online", "info": [1]}, "info must be an object")]:
        with pytest.raises(EnvelopeError, match=match):
            M.parse_presence(decode(encode(Envelope(M.PRESENCE, "dev7", body=body))))
    with pytest.raises(EnvelopeError, match="presence"):
        M.parse_presence(decode(encode(Envelope(M.RESULT, "dev7", body={"state": "online"}))))


def test_numbers_past_the_contracts_range_are_refused():
    """A differential review (Python against the Java device on the same bytes): ``1e400`` became
    Infinity here (a task's deadline infinite) where docs/protocol.md has binary64 and no Infinity,
    and an integer past 2^64 - 1 raised OverflowError out of ``float()`` (a deadline of 10^400) or
    was kept. Both are refused now as JSON the contract forbids; the range's ends still decode."""
    header, payload = _header_and_payload(sample())
    text = canonical_json(header).decode()
    at = '"body":{'
    for member, match in [('"k":1e400', "overflows a binary64 float"), ('"k":-1e400', "overflows a binary64 float"),
                          ('"k":18446744073709551616', r"outside -2\^63"), ('"k":-9223372036854775809', r"outside -2\^63"),
                          ('"k":' + "9" * 5000, "integer")]:
        with pytest.raises(EnvelopeError, match=match):
            decode(_raw_text(text.replace(at, at + member + ",", 1), payload))
    for member, value in [('"k":1e308', 1e308), ('"k":18446744073709551615', 2**64 - 1),
                          ('"k":-9223372036854775808', -2**63)]:
        assert decode(_raw_text(text.replace(at, at + member + ",", 1), payload)).body["k"] == value


def test_an_empty_tensor_of_a_shape_numpy_cannot_hold_is_refused_not_raised():
    """A review's finding: shape [0, 2^32-1, 2^32-1] (no bytes, within the schema's per-dimension
    bound) made numpy's reshape raise ValueError out of ``decode``, which promises EnvelopeError."""
    header = {"v": 1, "type": "t", "id": "0" * 32, "sender": "s", "ts": 1.0, "body": {},
              "tensors": [{"name": "x", "dtype": "float32", "shape": [0, 2**32 - 1, 2**32 - 1], "offset": 0,
                           "nbytes": 0}],
              "payload_sha256": hashlib.sha256(b"").hexdigest()}
    with pytest.raises(EnvelopeError, match="cannot be held"):
        decode(_raw(header, b""))
    # the bound: non-zero dimensions times the item size at most 2^63 - 1 (2^62 float32s: 2^64 bytes)
    for shape, dtype, ok in [([0, 2**31, 2**31], "uint8", True), ([0, 2**31, 2**31], "float32", False),
                             ([0, 2**30, 2**30], "float32", True), ([0, 2**30, 2**30], "float64", False),
                             ([0, 4], "float64", True)]:
        header["tensors"][0].update(shape=shape, dtype=dtype)
        if ok:
            assert decode(_raw(header, b"")).tensors["x"].shape == tuple(shape)
        else:
            with pytest.raises(EnvelopeError, match="cannot be held"):
                decode(_raw(header, b""))


def test_a_task_round_outside_what_every_device_holds_is_refused():
    """The Java device holds a round in a long with room (|round| < 2^62) and refused a larger
    one that the Python device took: both refuse it now."""
    from protocols import messages as M

    for round_, ok in [(2**62 - 1, True), (2**62, False), (-(2**62), True), (-(2**62) - 1, False)]:
        env = decode(encode(M.task_message("aggregator", "j", round_, "k", {}, 1.0)))
        if ok:
            assert M.parse_task(env)[0].round == round_
        else:
            with pytest.raises(EnvelopeError, match="outside -2\\^62"):
                M.parse_task(env)


def test_params_version_1_0_is_not_the_integer_1():
    from protocols.payloads.fed3r import Fed3RStatsParams
    from protocols.payloads.task_params import ModelSpec

    params = Fed3RStatsParams(model=ModelSpec(backbone="b", image_size=8, num_classes=3)).to_params()
    Fed3RStatsParams.from_params({**params, "params_version": 1})
    with pytest.raises(ValueError, match="params_version 1.0"):
        Fed3RStatsParams.from_params({**params, "params_version": 1.0})
