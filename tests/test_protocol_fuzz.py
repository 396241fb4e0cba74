"""Fuzzing the wire contract: whatever bytes or payload contents arrive, the decoder and the
payload parsers answer with EnvelopeError (a clear refusal the service turns into a reject),
never with another exception that would escape the service's message handler.

Inputs start from the golden vectors and are mutated by hypothesis: byte flips, truncation and
insertion for the decoder; for the parsers, well-formed envelopes (re-encoded, so they pass the
envelope checks) whose body fields hold arbitrary JSON values and whose tensors have other
dtypes, shapes or non-finite values.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.chunking import Reassembler
from protocols.envelope import EnvelopeError, decode
from protocols.payloads.fed3r import parse_stats
from protocols.payloads.fedavg import parse_head_update, parse_model_update
from protocols.payloads.personalize import parse_report

from fuzz_strategies import RESULT_VECTORS, SECAGG, VECTORS, mutated_bytes, mutated_results, mutated_secagg

PARSERS = {
    "result_fed3r_stats": lambda msg: parse_stats(msg, p=3, num_classes=3),
    "result_fedavg_head": lambda msg: parse_head_update(msg, num_classes=3, feature_dim=2),
    "result_fedavg_tail": lambda msg: parse_model_update(msg, {"tail.stages.0.0.weight": (2, 1, 1, 1)}),
    "result_oll_personalize": lambda msg: parse_report(msg, num_classes=3, with_fp=True),
}
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
assert sorted(PARSERS) == sorted(RESULT_VECTORS)


def refused_cleanly_or_accepted(function, *args) -> None:
    """Call it: returning or raising EnvelopeError passes; any other exception fails the test."""
    try:
        function(*args)
    except EnvelopeError:
        pass


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


@FUZZ
@given(mutated_results())
def test_payload_parsers_refuse_bad_contents_with_envelope_errors_only(case):
    name, message = case
    refused_cleanly_or_accepted(PARSERS[name], message)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_the_unmutated_golden_results_parse(name):
    """The fuzzing starts from valid inputs: each parser accepts its golden vector."""
    PARSERS[name](decode(VECTORS[name]))


def test_every_secagg_message_type_is_fuzzed():
    assert len(SECAGG) >= 10, [e.body["secagg"].get("type") for e in SECAGG]


@FUZZ
@given(mutated_secagg())
def test_secagg_payloads_refuse_bad_contents_with_envelope_errors_only(message):
    from protocols.payloads.secagg import from_envelope

    refused_cleanly_or_accepted(from_envelope, message)
