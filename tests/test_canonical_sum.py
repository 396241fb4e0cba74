"""The model a finished Fed3R job reports is its contributions summed in the canonical bucketed
order (aggregator/shards/buckets.py), however it gets there: a re-sum of the contributions kept in
memory, or a re-sum read back from the store. Both give the bytes of numpy adding the same
matrices in that order, whatever the arrival order and however the buckets are split between
shards; anything the record cannot vouch for (a restored job, a forgotten device, contributions
over the memory budget) goes to the store."""

import numpy as np
import pytest

from aggregator.service.canonical import AppliedContributions, canonical_job, reported_job
from aggregator.shards.buckets import NUM_BUCKETS, bucket_of, bucket_range
from aggregator.shards.partial_sums import bucket_sums, range_sums, reduce_nodes
from aggregator.jobs.registry import build_job
from aggregator.storage.store import Store
from protocols.envelope import Envelope, decode, encode
from protocols.payloads.fed3r import encode_stats

P, C = 24, 4
# features spanning 1e-3..1e3 (a float-rounding stress test), far outside any backbone's output
# range: the bounded-influence defaults (docs/algorithms.md) would refuse them, so they are off
CONFIG = {"job_id": "fed3r-order", "num_classes": C, "feature_dim": P - 1, "clients_per_round": 12,
          "max_abs_feature": 0.0, "screen_energy_ratio": 0.0}
DEVICES = [f"dev{i:02d}" for i in range(12)]


def device_payload(i: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A device's encoded statistics, and its A and B from numpy (the independent reference)."""
    rng = np.random.default_rng(i)
    n = 5 + 3 * i
    Z = np.hstack([rng.normal(size=(n, P - 1)) * 10.0 ** rng.integers(-3, 4), np.ones((n, 1))])
    y = rng.integers(0, C, n)
    ids = np.unique(y)
    b = np.stack([Z[y == c].sum(0) for c in ids])
    body, tensors = encode_stats(Z.T @ Z, ids, b, n, C)
    B = np.zeros((P, C))
    B[:, ids] = b.T
    return encode(Envelope(type="result", sender=DEVICES[i], body=body, tensors=tensors, id=f"{i:032x}")), Z.T @ Z, B


PAYLOADS = [device_payload(i) for i in range(len(DEVICES))]


def run(tmp_path, order, budget=1 << 30):
    """A live job fed in ``order``, its store and its record, as the job runner keeps them."""
    store = Store(tmp_path / f"s{'-'.join(map(str, order))}-{budget}.db")
    store.create_job(CONFIG["job_id"], "fed3r", CONFIG, state="running")
    store.open_round(CONFIG["job_id"], 1, DEVICES, {d: "t" for d in DEVICES}, {}, 0.0)
    live, applied = build_job("fed3r", CONFIG), AppliedContributions(budget_bytes=budget)
    for i in order:
        raw = PAYLOADS[i][0]
        stats = live.parse_result(decode(raw))
        store.add_contribution(CONFIG["job_id"], 1, DEVICES[i], f"m{i}", raw)
        live.apply(DEVICES[i], stats)
        applied.record(DEVICES[i], 1, f"m{i}", stats, len(raw))
    return store, live, applied


def model_bytes(job) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in job.model_arrays().items()}


def bucketed_reference(devices: list[int]) -> np.ndarray:
    """Σ A_k's upper triangle as numpy adds it by the definition: each bucket from zero in device-id
    order, then the buckets pairwise up a binary tree (an empty bucket adds nothing)."""
    buckets: dict[int, np.ndarray] = {}
    for i in sorted(devices, key=lambda i: (bucket_of(DEVICES[i]), DEVICES[i])):
        b = bucket_of(DEVICES[i])
        buckets[b] = buckets.get(b, np.zeros((P, P))) + np.triu(PAYLOADS[i][1])

    def node(start, end):
        if end - start == 1:
            return buckets.get(start)
        left, right = node(start, (start + end) // 2), node((start + end) // 2, end)
        return left if right is None else right if left is None else left + right
    return node(0, NUM_BUCKETS)


def test_the_devices_fill_several_buckets_with_several_devices_in_one():
    buckets = [bucket_of(d) for d in DEVICES]
    assert len(set(buckets)) >= 3 and len(set(buckets)) < len(DEVICES)    # or the order proves little


def test_every_path_reports_the_bucketed_sum_whatever_the_arrival_order(tmp_path):
    in_order, shuffled = list(range(len(DEVICES))), [5, 2, 11, 7, 0, 9, 3, 6, 10, 1, 8, 4]
    store, live, applied = run(tmp_path, in_order)
    from_memory = reported_job(applied, live, store, "fed3r", CONFIG["job_id"])
    reference = model_bytes(canonical_job(store, "fed3r", CONFIG, CONFIG["job_id"]))
    assert from_memory is not live and model_bytes(from_memory) == reference

    store2, live2, applied2 = run(tmp_path, shuffled)
    assert model_bytes(reported_job(applied2, live2, store2, "fed3r", CONFIG["job_id"])) == reference
    assert model_bytes(canonical_job(store2, "fed3r", CONFIG, CONFIG["job_id"])) == reference
    # the arrival order did change the live sums' last bits (or the test proves nothing)
    assert live2.strategy.A.cpu().numpy().tobytes() != live.strategy.A.cpu().numpy().tobytes()
    # the reported sums are numpy's, bit for bit, added in the bucketed order
    A = from_memory.strategy.A.cpu().numpy()
    assert np.triu(A).tobytes() == bucketed_reference(in_order).tobytes()
    B_ref = sum(p[2] for p in PAYLOADS)
    np.testing.assert_allclose(from_memory.strategy.B.cpu().numpy(), B_ref, rtol=1e-12, atol=1e-9)
    assert from_memory.contributed == {d: live.contributed[d] for d in sorted(DEVICES)}


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7, 64])
def test_shards_owning_bucket_ranges_reduce_to_one_aggregators_bits(shards):
    parsed = {i: build_job("fed3r", CONFIG).parse_result(decode(PAYLOADS[i][0])) for i in range(len(DEVICES))}
    everything = [(DEVICES[i], 1, lambda _j, i=i: parsed[i]) for i in range(len(DEVICES))]
    one = reduce_nodes("fed3r", CONFIG, range_sums("fed3r", bucket_sums("fed3r", CONFIG, everything), 0, NUM_BUCKETS))
    nodes = {}
    for shard in reversed(range(shards)):           # shards report in any order, their devices in any order
        lo, hi = bucket_range(shard, shards)
        mine = [c for c in reversed(everything) if lo <= bucket_of(c[0]) < hi]
        nodes.update(range_sums("fed3r", bucket_sums("fed3r", CONFIG, mine), lo, hi))
    assert len(nodes) <= 2 * 6 * shards
    assert model_bytes(reduce_nodes("fed3r", CONFIG, nodes)) == model_bytes(one)
    assert reduce_nodes("fed3r", CONFIG, nodes).contributed == one.contributed
    if shards > 1:                                   # a shard missing, or one reported twice, is refused
        lo, hi = bucket_range(0, shards)
        missing = {n: v for n, v in nodes.items() if n[0] >= hi}
        with pytest.raises(ValueError, match="exactly once"):
            reduce_nodes("fed3r", CONFIG, missing)
        with pytest.raises(ValueError, match="exactly once"):
            reduce_nodes("fed3r", CONFIG, {**nodes, (0, NUM_BUCKETS): None})


@pytest.mark.parametrize("case", ["over budget", "restored", "forgotten"])
def test_what_the_record_cannot_vouch_for_is_summed_from_the_store(tmp_path, case):
    store, live, applied = run(tmp_path, [3, 1, 0, 2, 4, 5, 7, 6, 11, 9, 10, 8], budget=1 if case == "over budget" else 1 << 30)
    if case == "restored":
        applied.invalidate()
    if case == "forgotten":
        store.forget_device(CONFIG["job_id"], DEVICES[2])
    reported = reported_job(applied, live, store, "fed3r", CONFIG["job_id"])
    assert reported is not live
    assert applied.payloads is None if case != "forgotten" else applied.payloads is not None
    assert model_bytes(reported) == model_bytes(canonical_job(store, "fed3r", CONFIG, CONFIG["job_id"]))
    if case == "forgotten":
        assert DEVICES[2] not in reported.contributed and len(reported.contributed) == len(DEVICES) - 1


def test_a_bucket_sum_travels_as_its_packed_triangle_and_loads_as_a_checkpoint_does():
    """Partial sums carry A's packed upper triangle (half a dense A's bytes); loaded, they give the
    job a checkpoint would: the same dense A (numpy's Σ A_k) and B, bit for bit. A triangle of
    another size is refused, nothing loaded."""
    job = build_job("fed3r", CONFIG)
    for raw, _A, _B in PAYLOADS[:3]:
        env = decode(raw)
        job.apply(env.sender, job.parse_result(env))
    packed = job.strategy.sums_state()
    assert set(packed) == {"A_upper", "B", "counts"} and packed["A_upper"].shape == (P * (P + 1) // 2,)
    from_packed, from_dense = build_job("fed3r", CONFIG), build_job("fed3r", CONFIG)
    from_packed.load_state_dict(packed)
    from_dense.load_state_dict(job.state_dict())
    dense = from_packed.state_dict()
    assert all(np.array_equal(dense[k], from_dense.state_dict()[k]) for k in ("A", "B", "counts"))
    np.testing.assert_allclose(dense["A"], sum(a for _raw, a, _b in PAYLOADS[:3]), rtol=1e-12)
    with pytest.raises(ValueError, match="packed triangle"):
        from_packed.load_state_dict({**packed, "A_upper": packed["A_upper"][:-1]})
    assert np.array_equal(from_packed.state_dict()["A"], dense["A"])
