"""The model a finished Fed3R job reports is its contributions summed in device-id order, however
it gets there: the live job itself (it summed in that order), a re-sum of the contributions kept
in memory, or a re-sum read back from the store. All three give the same bytes as the store path
and as numpy's sums, whatever the arrival order; anything the record cannot vouch for (a restored
job, a forgotten device, contributions over the memory budget) goes to the store."""

import numpy as np
import pytest

from aggregator.service.canonical import AppliedContributions, canonical_job, reported_job
from aggregator.jobs.registry import build_job
from aggregator.storage.store import Store
from protocols.envelope import Envelope, decode, encode
from protocols.payloads.fed3r import encode_stats

P, C = 24, 4
# features spanning 1e-3..1e3 (a float-rounding stress test), far outside any backbone's output
# range: the bounded-influence defaults (docs/algorithms.md) would refuse them, so they are off
CONFIG = {"job_id": "fed3r-order", "num_classes": C, "feature_dim": P - 1, "clients_per_round": 8,
          "max_abs_feature": 0.0, "screen_energy_ratio": 0.0}
DEVICES = [f"dev{i:02d}" for i in range(8)]


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


def test_every_path_reports_the_store_paths_bytes_whatever_the_arrival_order(tmp_path):
    in_order, shuffled = list(range(8)), [5, 2, 7, 0, 3, 6, 1, 4]
    store, live, applied = run(tmp_path, in_order)
    assert reported_job(applied, live, store, "fed3r", CONFIG["job_id"]) is live      # no re-sum, no re-solve
    reference = model_bytes(canonical_job(store, "fed3r", CONFIG, CONFIG["job_id"]))
    assert model_bytes(live) == reference

    store2, live2, applied2 = run(tmp_path, shuffled)
    from_memory = reported_job(applied2, live2, store2, "fed3r", CONFIG["job_id"])
    assert from_memory is not live2 and model_bytes(from_memory) == reference
    # the arrival order did change the live sums' last bits (or the test proves nothing)
    assert live2.strategy.A.cpu().numpy().tobytes() != live.strategy.A.cpu().numpy().tobytes()
    # and the reported sums are numpy's
    A_ref, B_ref = sum(p[1] for p in PAYLOADS), sum(p[2] for p in PAYLOADS)
    np.testing.assert_allclose(from_memory.strategy.A.cpu().numpy(), A_ref, rtol=1e-12)
    np.testing.assert_allclose(from_memory.strategy.B.cpu().numpy(), B_ref, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("case", ["over budget", "restored", "forgotten"])
def test_what_the_record_cannot_vouch_for_is_summed_from_the_store(tmp_path, case):
    store, live, applied = run(tmp_path, [3, 1, 0, 2, 4, 5, 7, 6], budget=1 if case == "over budget" else 1 << 30)
    if case == "restored":
        applied.invalidate()
    if case == "forgotten":
        store.forget_device(CONFIG["job_id"], DEVICES[2])
    reported = reported_job(applied, live, store, "fed3r", CONFIG["job_id"])
    assert reported is not live
    assert applied.payloads is None if case != "forgotten" else applied.payloads is not None
    assert model_bytes(reported) == model_bytes(canonical_job(store, "fed3r", CONFIG, CONFIG["job_id"]))
    if case == "forgotten":
        assert DEVICES[2] not in reported.contributed and len(reported.contributed) == 7
