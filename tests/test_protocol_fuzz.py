"""Fuzzing the wire contract: whatever bytes or payload contents arrive, the decoder and the
payload parsers answer with EnvelopeError (a clear refusal the service turns into a reject),
never with another exception that would escape the service's message handler.

Inputs start from the golden vectors and are mutated by hypothesis: byte flips, truncation and
insertion for the decoder; for the parsers, well-formed envelopes (re-encoded, so they pass the
envelope checks) whose body fields hold arbitrary JSON values and whose tensors have other
dtypes, shapes or non-finite values.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols import golden
from protocols.chunking import Reassembler
from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.payloads.fed3r import parse_stats
from protocols.payloads.fedavg import parse_head_update, parse_model_update
from protocols.payloads.personalize import parse_report

VECTORS = golden.golden_messages()
PARSERS = {
    "result_fed3r_stats": lambda msg: parse_stats(msg, p=3, num_classes=3),
    "result_fedavg_head": lambda msg: parse_head_update(msg, num_classes=3, feature_dim=2),
    "result_fedavg_tail": lambda msg: parse_model_update(msg, {"tail.stages.0.0.weight": (2, 1, 1, 1)}),
    "result_oll_personalize": lambda msg: parse_report(msg, num_classes=3, with_fp=True),
}
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))

def refused_cleanly_or_accepted(function, *args) -> None:
    """Call it: returning or raising EnvelopeError passes; any other exception fails the test."""
    try:
        function(*args)
    except EnvelopeError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=10)


@st.composite
def mutated_bytes(draw):
    data = bytearray(VECTORS[draw(st.sampled_from(sorted(VECTORS)))])
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            del data[at:at + draw(st.integers(1, 8))]
    return bytes(data)


@FUZZ
@given(mutated_bytes())
def test_decoder_refuses_corrupted_bytes_with_envelope_errors_only(data):
    refused_cleanly_or_accepted(decode, data)


@FUZZ
@given(st.lists(mutated_bytes(), min_size=1, max_size=4))
def test_chunk_reassembly_never_crashes_on_corrupted_chunks(parts):
    """Corrupted chunks that still decode go to the reassembler, which refuses or ignores them."""
    assembler = Reassembler()
    for data in parts + [VECTORS["chunk_0_of_result"]]:
        try:
            message = decode(data)
            if message.type == "chunk":
                assembler.add(message, now=0.0)
        except EnvelopeError:
            pass


@st.composite
def mutated_fields(draw, fields: dict) -> dict:
    """A copy of a JSON object with 1-3 fields dropped, overwritten or added (arbitrary JSON values)."""
    out = dict(fields)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(out)) | st.text(max_size=8))
        if draw(st.booleans()) and key in out:
            del out[key]
        else:
            out[key] = draw(json_values)
    return out


@st.composite
def mutated_results(draw):
    name = draw(st.sampled_from(sorted(PARSERS)))
    original = decode(VECTORS[name])
    body = draw(mutated_fields(original.body))
    tensors = {k: np.array(v) for k, v in original.tensors.items()}
    if tensors and draw(st.booleans()):
        victim = draw(st.sampled_from(sorted(tensors)))
        change = draw(st.sampled_from(["dtype", "shape", "nonfinite", "drop", "extra"]))
        if change == "dtype":
            tensors[victim] = tensors[victim].astype(draw(st.sampled_from([np.float64, np.int64, np.uint8, np.int8])))
        elif change == "shape":
            tensors[victim] = np.zeros(draw(st.lists(st.integers(0, 4), max_size=3)), np.float32)
        elif change == "nonfinite" and tensors[victim].size and tensors[victim].dtype.kind == "f":
            tensors[victim].flat[0] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        elif change == "drop":
            del tensors[victim]
        else:
            tensors["extra"] = np.zeros(3, np.float32)
    message = Envelope(original.type, original.sender, body=body, tensors=tensors, id=original.id, ts=original.ts)
    return name, decode(encode(message))       # what a receiver holds after the envelope checks


@FUZZ
@given(mutated_results())
def test_payload_parsers_refuse_bad_contents_with_envelope_errors_only(case):
    name, message = case
    refused_cleanly_or_accepted(PARSERS[name], message)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_the_unmutated_golden_results_parse(name):
    """The fuzzing starts from valid inputs: each parser accepts its golden vector."""
    PARSERS[name](decode(VECTORS[name]))


def _secagg_messages() -> list[Envelope]:
    """One envelope of every secure-aggregation message type, from a real 5-device round (with a
    consistency check and a drop-out, so every phase's messages exist)."""
    from protocols.identity import DeviceIdentity
    from protocols.payloads.secagg import to_envelope
    from protocols.secagg import Phase, RoundConfig
    from protocols.secagg.driver import make_identities, run_round

    identities = {i.device_id: i for i in make_identities(5)}
    config = RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=4, bound=1.0, consistency_check=True)
    seen: dict[str, Envelope] = {}

    def keep(message):
        seen.setdefault(type(message).__name__, to_envelope(message))
        return [message]

    run_round(config, DeviceIdentity.generate("aggregator"), identities, lambda d: np.zeros(4),
              dropouts={config.members[0]: Phase.MASKED_INPUT}, intercept=keep)
    return [seen[name] for name in sorted(seen)]


SECAGG = _secagg_messages()


def test_every_secagg_message_type_is_fuzzed():
    assert len(SECAGG) >= 10, [e.body["secagg"].get("type") for e in SECAGG]


@st.composite
def mutated_secagg(draw):
    original = draw(st.sampled_from(SECAGG))
    header = draw(mutated_fields(original.body["secagg"]))
    tensors = {k: np.array(v) for k, v in original.tensors.items()}
    if tensors and draw(st.booleans()):
        victim = draw(st.sampled_from(sorted(tensors)))
        tensors[victim] = draw(st.sampled_from([np.zeros(0, np.uint8), np.zeros((2, 3), np.float64),
                                                np.arange(5, dtype=np.int64), tensors[victim][..., :1]]))
    message = Envelope(original.type, original.sender, body={"secagg": header}, tensors=tensors)
    return decode(encode(message))


@FUZZ
@given(mutated_secagg())
def test_secagg_payloads_refuse_bad_contents_with_envelope_errors_only(message):
    from protocols.payloads.secagg import from_envelope

    refused_cleanly_or_accepted(from_envelope, message)
