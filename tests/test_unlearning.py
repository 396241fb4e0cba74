"""Exact unlearning: ``fedfleet admin device forget ID`` removes a device's statistics from a
plaintext Fed3R job and re-solves; the result equals, bit for bit, a fresh run without that
device, and the forgetting survives a restart (the store no longer holds the device's data)."""

import io
import json
import time

import numpy as np

from aggregator.api.app import create_app
from aggregator.api.server import ApiServer
from aggregator.service.canonical import canonical_job
from aggregator.storage.store import Store
from fedfleet.admin import main as admin

from ops_fleet import Fleet, reference_sums
from test_admin_api import TOKEN, start_service

DEVICES = ["dev01", "dev02", "dev03", "dev04", "dev05"]
FORGET = "dev03"


def wait_done(store, job_id="ops", timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        row = store.job(job_id)
        if row and row["state"] == "done":
            return
        time.sleep(0.1)
    raise AssertionError(f"job not done: {store.job(job_id)}")


def final_arrays(store, job_id="ops"):
    final = [m for m in store.models(job_id) if m["final"]]
    assert len(final) == 1
    with np.load(io.BytesIO(store.model_bytes(final[0]["model_id"]))) as z:
        return final[0], {k: z[k] for k in z.files}


def fresh_run(broker, tmp_path, devices):
    svc, store, thread = start_service(broker, tmp_path, devices, clients_per_round=2)
    with Fleet(broker.url, devices):
        thread.join(60)
    assert store.job("ops")["state"] == "done"
    return store


def test_forgetting_a_device_equals_a_fresh_run_without_it_bit_for_bit(broker, tmp_path, capsys):
    without = fresh_run(broker, tmp_path / "without", [d for d in DEVICES if d != FORGET])
    svc, store, thread = start_service(broker, tmp_path / "with", DEVICES, keep_serving=True, clients_per_round=2)
    api = ApiServer(create_app(store, TOKEN, svc)).start()
    try:
        with Fleet(broker.url, DEVICES):
            wait_done(store)
        before_row, before = final_arrays(store)
        capsys.readouterr()
        assert admin(["--url", api.url, "--token", TOKEN, "--json", "device", "forget", FORGET]) == 0
        lines = json.loads(capsys.readouterr().out)
        assert [(x["job_id"], x["forgotten"], x["contributions_deleted"]) for x in lines] == [("ops", True, 1)]
        # a job that holds nothing of the device: a clear 404, nothing changed
        assert admin(["--url", api.url, "--token", TOKEN, "device", "forget", "dev01", "--job", "nope"]) != 0
    finally:
        svc.stop()
        thread.join(30)
        api.stop()
    after_row, after = final_arrays(store)
    _, fresh = final_arrays(without)
    assert after_row["model_id"] == lines[0]["model_id"] and after_row["parent_id"] == before_row["model_id"]
    assert after.keys() == fresh.keys()
    for k in fresh:
        assert np.array_equal(after[k], fresh[k]), k                  # bit for bit
        assert not np.array_equal(before[k], fresh[k]), k             # ...and the device did matter
    # durable: a reopened store holds no contribution of the device, remembers it, and re-sums the same
    reopened = Store(store.path)
    assert FORGET not in {c.device for c in reopened.contributions("ops")}
    assert reopened.forgotten("ops") == [FORGET] and reopened.checkpoint("ops") is None
    job = canonical_job(reopened, "fed3r", reopened.job("ops")["config"], "ops")
    for k, v in job.model_arrays().items():
        assert np.array_equal(v, fresh[k])
    # ...and what is left is exactly the other devices' data (independent numpy sums)
    A_ref, B_ref = reference_sums([d for d in DEVICES if d != FORGET])
    np.testing.assert_allclose(job.strategy.A.cpu().numpy(), A_ref, rtol=1e-12)
    np.testing.assert_allclose(job.strategy.B.cpu().numpy(), B_ref, rtol=1e-12, atol=1e-12)


def test_forgetting_during_a_running_job_rebuilds_it_and_never_asks_the_device_again(broker, tmp_path):
    import threading

    without = fresh_run(broker, tmp_path / "without", [d for d in DEVICES if d != FORGET])
    gate = threading.Event()                     # dev01 holds the round open while dev03 is forgotten
    svc, store, thread = start_service(broker, tmp_path / "with", DEVICES, clients_per_round=5)
    with Fleet(broker.url, DEVICES, gates={"dev01": gate}):
        deadline = time.time() + 30
        while "ops" not in store.jobs_of_device(FORGET) and time.time() < deadline:
            time.sleep(0.05)
        lines = svc.call(lambda: svc.forget_device(FORGET))
        assert [(x["forgotten"], x["contributions_deleted"]) for x in lines] == [(True, 1)]
        assert FORGET not in svc.job.contributed and svc.job.strategy.n_contributions <= 3
        gate.set()
        thread.join(60)
    assert store.job("ops")["state"] == "done"
    assert FORGET not in {c.device for c in store.contributions("ops")}
    _, after = final_arrays(store)
    _, fresh = final_arrays(without)
    for k in fresh:
        assert np.array_equal(after[k], fresh[k]), k


def test_jobs_that_cannot_forget_exactly_say_why_and_keep_their_data(tmp_path):
    from aggregator.service.unlearning import forget_stored

    store = Store(tmp_path / "s.db")
    jobs = {"fedavg": ("fedavg", {}), "fed3r-sync": ("fed3r-sync", {}),
            "dp-fed3r": ("fed3r", {"dp_noise_multiplier": 2.0, "feature_clip_norm": 8.0})}
    for job_id, (kind, config) in jobs.items():
        store.create_job(job_id, kind, {"job_id": job_id, **config}, state="done")
        store.open_round(job_id, 1, ["dev01"], {"dev01": "t"}, {}, time.time() + 60)
        store.add_contribution(job_id, 1, "dev01", f"m-{job_id}", b"x")
        line = forget_stored(store, store.job(job_id), "dev01")
        assert not line["forgotten"] and line["reason"]
        assert [c.device for c in store.contributions(job_id)] == ["dev01"] and store.forgotten(job_id) == []
    assert "masked sum" in forget_stored(store, store.job("fed3r-sync"), "dev01")["reason"]
    # a DP job's model is its noisy releases: re-solving without the device would release the rest again
    assert "noisy releases" in forget_stored(store, store.job("dp-fed3r"), "dev01")["reason"]


def test_forgetting_in_a_finished_sharded_fed3r_job_is_refused_before_anything_is_deleted(tmp_path):
    """The coordinator of a sharded job stores the shards' receipts, no statistics: forgetting
    deleted the device's rows and the checkpoint, then failed to re-solve from receipts (a review's
    finding), leaving the old model and a store that said the device was gone. Refused now, with
    the reason, and nothing changes."""
    from aggregator.jobs.registry import build_job
    from aggregator.service import unlearning
    from aggregator.shards.buckets import shard_of
    from aggregator.shards.coordinator_job import ShardedJob
    from aggregator.shards.partial_sums import reduce_nodes
    from aggregator.shards.shard import ShardIngest
    from aggregator.storage.schema import JobState
    from aggregator.storage.store import Store
    from protocols.envelope import decode
    from test_shard_ingest import CONFIG, DEVICES, feed, result

    shards = [ShardIngest(k, 2, Store(tmp_path / f"s{k}.db")) for k in range(2)]
    for s in shards:
        s.set_job("sharded", "fed3r", CONFIG)
    coord_store = Store(tmp_path / "coord.db")
    coord_store.create_job("sharded", "fed3r", CONFIG, state=JobState.RUNNING)
    coord_store.open_round("sharded", 1, DEVICES, {d: "t" for d in DEVICES}, {}, 0.0)
    job = ShardedJob(build_job("fed3r", CONFIG), "fed3r",
                     lambda kind, config, job_id, accepted: reduce_nodes(kind, config, {
                         n: v for s in shards for n, v in s.sums(job_id, accepted).items()}))
    for i, d in enumerate(DEVICES):
        receipt = feed(shards[shard_of(d, 2)], i, result(i))
        env = decode(receipt.raw)
        coord_store.add_contribution("sharded", 1, d, env.id, receipt.raw)   # what the runner stores
        job.apply(d, job.parse_result(env))
    coord_store.close_round("sharded", 1, {"accepted": DEVICES, "dropped": [], "declined": [], "rejected": []},
                            checkpoint=(job.state_dict(), job.contributed))
    coord_store.finish_job("sharded", JobState.DONE, {}, {}, job.model_arrays(), {}, 1)
    row = coord_store.job("sharded")
    forget = DEVICES[3]
    before = sorted(c.device for c in coord_store.contributions("sharded", with_payload=False))
    line = unlearning.forget_stored(coord_store, row, forget)
    assert line["forgotten"] is False and line["reason"] == unlearning.SHARDED
    assert sorted(c.device for c in coord_store.contributions("sharded", with_payload=False)) == before
    assert coord_store.checkpoint("sharded") is not None and coord_store.forgotten("sharded") == []
