"""SecAgg messages inside fedfleet envelopes, and the Fed3R-Sync vector layout."""

import numpy as np
import pytest

from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.fed3r import packed_len
from protocols.payloads.secagg import (from_envelope, pack_sync_vector, sync_vector_length, to_envelope,
                                       unpack_sync_vector)
from protocols.secagg import RoundConfig, ServerSecAgg


def round_start():
    members = ["a", "b", "c"]
    reg = IdentityRegistry({m: DeviceIdentity.generate(m).public_key_bytes for m in members})
    cfg = RoundConfig.create(job_id="j", round_id=1, group_id="g1", aggregator_id="aggregator", members=members,
                             vector_length=4, bound=10.0)
    return ServerSecAgg(cfg, DeviceIdentity.generate("aggregator"), reg).start()[0]


def test_round_trip_through_the_envelope_codec():
    msg = round_start()
    back = from_envelope(decode(encode(to_envelope(msg))))
    assert type(back) is type(msg) and back.to_wire()[0] == msg.to_wire()[0]


def test_garbage_and_impersonation_are_rejected():
    with pytest.raises(EnvelopeError, match="not a secagg"):
        from_envelope(Envelope("secagg", "a", {"secagg": "nope"}))
    with pytest.raises(EnvelopeError, match="malformed"):
        from_envelope(Envelope("secagg", "a", {"secagg": {"type": "no-such-message"}}))
    env = to_envelope(round_start())
    forged = Envelope("secagg", "b", env.body, env.tensors)       # relayed under another sender's name
    with pytest.raises(EnvelopeError, match="differs"):
        from_envelope(forged)


def signed_masked_input(words: np.ndarray):
    from protocols.secagg.messages import MaskedInput
    device = DeviceIdentity.generate("a")
    msg = MaskedInput(job_id="j", round_id=1, group_id="g1", sender="a", recipient="aggregator",
                      masked_input=words).signed(device)
    return msg, device.public_key_bytes


def test_a_received_masked_input_is_hashed_once_and_its_signature_still_binds_its_bytes(monkeypatch):
    import hashlib as real_hashlib
    from protocols.secagg import messages
    from protocols.secagg.errors import BadSignature
    words = np.random.default_rng(0).integers(0, 2**63, 5000, dtype=np.uint64)
    msg, public_key = signed_masked_input(words)
    data = encode(to_envelope(msg))
    hashed = []

    class CountingHashlib:
        @staticmethod
        def sha256(data=b""):
            hashed.append(memoryview(data).nbytes)
            return real_hashlib.sha256(data)

    monkeypatch.setattr(messages, "hashlib", CountingHashlib)
    back = from_envelope(decode(data))        # decode hashes the payload (the words) once
    back.verify(public_key)
    assert back.verified_digests and words.nbytes not in hashed       # the signature check reused it
    assert back.canonical_bytes() == msg.canonical_bytes()
    # the digest the envelope vouched for is used for those bytes only: other memory is hashed
    tampered = decode(data)
    tampered.tensors["masked_input"] = np.array(tampered.tensors["masked_input"])
    tampered.tensors["masked_input"][0] ^= np.uint64(1)
    tampered.tensors["masked_input"].flags.writeable = False
    forged = from_envelope(tampered)
    assert not forged.verified_digests and words.nbytes in hashed
    with pytest.raises(BadSignature):
        forged.verify(public_key)
    # bytes that could still change (a writable buffer), or a decode that skipped the payload's
    # hash (a chunk), vouch for nothing
    assert not from_envelope(decode(bytearray(data))).verified_digests
    assert not from_envelope(decode(data, hash_payload=False)).verified_digests
    assert from_envelope(decode(memoryview(data)[0:])).verified_digests     # a view of bytes: still bytes


def _read_only_views_of_writable_memory(data: bytes):
    """(what can write the memory, a read-only view of it): a bytearray behind .toreadonly(), a
    read-only numpy array over a bytearray, a second mapping of a shared memory segment."""
    from multiprocessing.shared_memory import SharedMemory
    buf = bytearray(data)
    yield buf, memoryview(buf).toreadonly()
    buf = bytearray(data)
    array = np.frombuffer(buf, np.uint8)
    array.flags.writeable = False
    yield buf, memoryview(array)
    segment = SharedMemory(create=True, size=len(data))
    other = SharedMemory(name=segment.name)
    try:
        segment.buf[:len(data)] = data
        yield other.buf, segment.buf[:len(data)].toreadonly()
    finally:
        import gc
        gc.collect()
        for mapping in (other, segment):
            try:
                mapping.close()
            except BufferError:         # a test's view still alive: the unlink below still frees it
                pass
        segment.unlink()


def test_a_read_only_view_of_memory_that_can_change_vouches_for_nothing():
    """Read-only *views* are not read-only *memory*: bytes written after decode through the
    bytearray, the array's base or another mapping must fail the signature check, so decode
    records no reusable digest for them (the signature check hashes the array itself)."""
    from protocols.secagg.errors import BadSignature
    words = np.arange(1000, dtype=np.uint64)
    msg, public_key = signed_masked_input(words)
    data = encode(to_envelope(msg))
    for writable, view in _read_only_views_of_writable_memory(data):
        back = from_envelope(decode(view))
        back.verify(public_key)
        assert not back.verified_digests
        writable[len(data) - words.nbytes] ^= 0xFF          # word 0 of the masked input, after decode
        assert back.masked_input[0] != words[0]
        with pytest.raises(BadSignature):
            back.verify(public_key)
        del back, view


def test_sync_vector_layout_round_trips_and_checks_its_length():
    p, C = 4, 3
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=packed_len(p)), rng.normal(size=(C, p))
    v = pack_sync_vector(a, b, 17)
    assert v.shape == (sync_vector_length(p, C),)
    a2, b2, n = unpack_sync_vector(v, p, C)
    assert np.array_equal(a2, a) and np.array_equal(b2, b) and n == 17
    with pytest.raises(ValueError, match="shape"):
        unpack_sync_vector(v[:-1], p, C)


# ---- the messages' wire declarations --------------------------------------------------------
def one_of_each_message():
    """Every secagg message type from a real round (consistency check on, one drop-out, so every
    phase's messages exist) plus a RoundAborted and a ShareAccusation, as decoded from its wire form."""
    from protocols.secagg import Phase
    from protocols.secagg.driver import make_identities, run_round
    from protocols.secagg.messages import RoundAborted, ShareAccusation

    identities = {i.device_id: i for i in make_identities(5)}
    config = RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=4, bound=1.0, consistency_check=True)
    seen = {}

    def keep(message):
        seen.setdefault(type(message), message)
        return [message]

    run_round(config, DeviceIdentity.generate("aggregator"), identities, lambda d: np.zeros(4),
              dropouts={config.members[0]: Phase.MASKED_INPUT}, intercept=keep)
    seen[RoundAborted] = RoundAborted(job_id="j", round_id=1, group_id="g", sender="aggregator", recipient="x",
                                      reason="too few")
    accuser = config.members[1]         # (tests/test_secagg_share_accusations.py runs the accusations)
    seen[ShareAccusation] = ShareAccusation(job_id="j", round_id=1, group_id="g", sender=accuser,
                                            recipient="aggregator", accused=(config.members[2],)
                                            ).signed(identities[accuser])
    return seen


MESSAGES = one_of_each_message()


def test_every_message_type_is_exercised_and_declares_every_field_it_carries():
    from dataclasses import fields

    from protocols.secagg.messages import MESSAGE_TYPES, Message

    assert set(MESSAGES) == set(MESSAGE_TYPES.values())
    common = {f.name for f in fields(Message)}
    for cls in MESSAGE_TYPES.values():
        assert set(cls.WIRE_FIELDS) == {f.name for f in fields(cls)} - common, cls.__name__
        header, arrays = MESSAGES[cls].to_wire()
        assert set(header) - common - {"type"} == set(cls.PAYLOAD) and set(arrays) == set(cls.ARRAYS)


def _refused(cls, header, arrays):
    from protocols.secagg import MalformedMessage
    from protocols.secagg.messages import decode as decode_message

    with pytest.raises(MalformedMessage):
        decode_message(header, arrays)


@pytest.mark.parametrize("cls", sorted(MESSAGES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_a_message_with_any_field_of_the_wrong_kind_or_shape_is_refused(cls):
    """Every header field with a value of the wrong JSON type, every array of the wrong dtype or
    rank, every row-indexed array with a row too few and every fixed-width array with a byte too
    few per row is refused with MalformedMessage; the untouched message decodes to the same bytes."""
    from protocols.secagg.messages import decode as decode_message

    header, arrays = MESSAGES[cls].to_wire()
    assert decode_message(header, arrays).canonical_bytes() == MESSAGES[cls].canonical_bytes()
    for name in cls.PAYLOAD:
        _refused(cls, {**header, name: 7}, arrays)
    for name, array in arrays.items():
        _refused(cls, header, {**arrays, name: array.astype(np.int64)})
        _refused(cls, header, {**arrays, name: array[None]})
        if cls.ARRAYS[name].rows_per is not None:
            _refused(cls, header, {**arrays, name: array[:-1]})
        if cls.ARRAYS[name].row_bytes is not None:
            _refused(cls, header, {**arrays, name: array[:, :-1]})
    for key in ("job_id", "signature", *cls.PAYLOAD):
        _refused(cls, {k: v for k, v in header.items() if k != key}, arrays)
