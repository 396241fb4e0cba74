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
