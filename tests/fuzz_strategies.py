"""Hypothesis strategies for hostile wire input, shared by the fuzz tests
(tests/test_protocol_fuzz.py) and the fuzz bench (bench/fuzz_storm.py): mutated bytes of the
golden vectors, well-formed envelopes whose fields and tensors are wrong, and mutated
secure-aggregation messages of every type; ``draw_examples`` draws a fixed pool of them outside
a test (for the bench)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from protocols import golden
from protocols.envelope import Envelope, decode, encode

VECTORS = golden.golden_messages()
# the golden results whose contents mutated_results garbles (each has a payload parser)
RESULT_VECTORS = ("result_fed3r_stats", "result_fedavg_head", "result_fedavg_tail", "result_oll_personalize")


def draw_examples(strategy, n: int, seed_: int = 0) -> list:
    """``n`` examples of ``strategy`` (reproducible for a seed), drawn by hypothesis itself."""
    out: list = []

    @seed(seed_)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example):
        out.append(example)

    collect()
    return out


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
    name = draw(st.sampled_from(RESULT_VECTORS))
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
