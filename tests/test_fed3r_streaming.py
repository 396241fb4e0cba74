"""Streaming Fed3R: a device that gathers new data sends the statistics of its new samples only;
after every increment the model is exactly the centralized ridge on all samples so far (sklearn),
and no retry, stale task or gap can make a sample count twice or be skipped."""

import json

import numpy as np
import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.storage.store import Store
from edge_client.agent import TaskDeclined
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from protocols import messages as M
from protocols.envelope import EnvelopeError, decode, encode
from protocols.payloads.fed3r import KIND

from ops_fleet import Features, Fleet, kept_windows, prepare, run_aggregator, serve_until_done
from test_fed3r_exactness import reference_ridge

D, C, LAM = 5, 3, 0.5


def batches(seed, sizes):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, D)).astype(np.float32), rng.integers(0, C, n)) for n in sizes]


def answer(job, device, handler, round_):
    """One task through the wire (JSON-safe params) to the device's real handler and back."""
    params, _ = job.task_for(device)
    task = decode(encode(M.task_message("aggregator", job.config.job_id, round_, KIND, params, 1e9)))
    body, tensors = handler(task.body["params"])
    return decode(encode(M.result_message(device, M.TaskRef(job.config.job_id, round_, task.id), KIND, body,
                                          tensors)))


def test_each_increment_gives_the_centralized_ridge_on_everything_so_far(tmp_path):
    job = Fed3RJob(Fed3RConfig(num_classes=C, feature_dim=D, lam=LAM, streaming=True, normalize_columns=False))
    # increments of at least MIN_DIFFERENCE (8) samples: a smaller one waits (edge_client/sample_windows.py)
    data = {"a": batches(1, [12, 9, 10]), "b": batches(2, [7, 20])}
    # each keeps its sample windows in its state folder: without one a device answers no increment
    handlers = {d: Fed3RStatsTask(*bs[0], lambda *a: Features(D), windows=kept_windows(tmp_path / d))
                for d, bs in data.items()}
    seen = {d: 1 for d in data}                         # batches each device holds
    sent = {d: 0 for d in data}                         # batches the job holds
    schedule = ["a", "b", "a", "b", "a"]                # who reports next; new data arrives in between
    for step, device in enumerate(schedule, start=1):
        if step > 2:                                    # the device gathered a new batch since it last sent
            handlers[device].add_samples(*data[device][seen[device]])
            seen[device] += 1
        env = answer(job, device, handlers[device], step)
        assert env.body["from_sample"] == job.contributed.get(device, 0)
        job.apply(device, job.parse_result(env))
        sent[device] = seen[device]
        Z = np.concatenate([x for d in data for x, _ in data[d][:sent[d]]]).astype(np.float64)
        y = np.concatenate([y for d in data for _, y in data[d][:sent[d]]])
        ref = reference_ridge(Z, y, C, LAM)
        W = job.model().raw_weights_
        assert np.linalg.norm(W - ref) / np.linalg.norm(ref) < 1e-10, step
        assert job.strategy.n_samples == len(y)
        # a retry of the increment just counted (or any stale from_sample) is refused: nothing changes
        with pytest.raises(EnvelopeError, match="already counted"):
            job.parse_result(env)
    assert job.contributed == {"a": 31, "b": 27}
    # nothing new: the device declines rather than sending an empty or repeated increment
    with pytest.raises(TaskDeclined, match="no new samples"):
        handlers["a"](job.task_for("a")[0])
    # a gap (the job claims more than the device has) declines too: the device never guesses
    params = {**job.task_for("b")[0], "from_sample": 99}
    with pytest.raises(TaskDeclined, match="holds 99"):
        handlers["b"](params)


class Gathering:
    """A device that gathers its next batch of data between tasks (while it has one left), its
    sample windows kept in its state folder ``folder``."""

    def __init__(self, bs, folder):
        self.bs, self.next, self.calls = bs, 1, 0
        self.task = Fed3RStatsTask(*bs[0], lambda *a: Features(D), windows=kept_windows(folder))

    def __call__(self, params, tensors=None):
        self.calls += 1
        if self.calls > 1 and self.next < len(self.bs):
            self.task.add_samples(*self.bs[self.next])
            self.next += 1
        return self.task(params, tensors)


def test_streaming_job_over_mosquitto_ingests_every_increment_once(broker, tmp_path):
    data = {"dev00": batches(3, [10, 8, 9]), "dev01": batches(4, [8]), "dev02": batches(5, [5, 15])}
    config = Fed3RConfig(num_classes=C, feature_dim=D, lam=LAM, streaming=True, clients_per_round=3, max_attempts=1,
                         round_timeout_s=20, expected_devices=3)
    store = Store(tmp_path / "s.db")
    devices = {d: {KIND: Gathering(bs, tmp_path / "devices" / d)} for d, bs in data.items()}
    _, result = serve_until_done(Fed3RJob(config), broker.url, tmp_path, devices, store)
    assert result["state"] == "done"
    assert result["contributed"] == {d: sum(len(y) for _, y in bs) for d, bs in data.items()}
    stored = [c.device for c in store.contributions(config.job_id)]
    assert sorted(stored) == ["dev00"] * 3 + ["dev01"] + ["dev02"] * 2          # one row per increment
    Z = np.concatenate([x for bs in data.values() for x, _ in bs]).astype(np.float64)
    y = np.concatenate([y for bs in data.values() for _, y in bs])
    W = np.load(tmp_path / "model.npz")["raw_weights"]
    ref = reference_ridge(Z, y, C, LAM)
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) < 1e-10


def test_streaming_job_on_two_shards_gives_one_aggregators_model(tmp_path):
    """``aggregator serve --shards 2``: each shard stores and sums its devices' increments (its
    bucket sums apply them in (device, round) order, each checked to start where the last ended);
    the coordinator checks where each receipted increment starts against its count of the device
    (tests/test_shard_ingest.py). The model is one aggregator's bytes, and the centralized ridge on
    every sample."""
    from fedfleet.emulation.broker import MosquittoBroker
    from aggregator.shards.buckets import shard_of

    data = {"dev00": batches(3, [10, 8, 9]), "dev02": batches(4, [8]), "dev08": batches(5, [5, 15])}
    assert {shard_of(d, 2) for d in data} == {0, 1}
    runs = []
    for name, extra in (("one", []), ("sharded", ["--shards", "2"])):
        work = tmp_path / name
        prepare(work, sorted(data), num_classes=C, feature_dim=D, lam=LAM, streaming=True, clients_per_round=3,
                max_attempts=1, round_timeout_s=20)
        devices = tmp_path / "devices" / name
        with MosquittoBroker() as broker, Fleet(broker.url, sorted(data),
                                                handlers=lambda d: ({KIND: Gathering(data[d], devices / d)}, {})):
            rc, log = run_aggregator(work, broker.url, work / "state.db", extra=extra, timeout=240)
        assert rc == 0, log[-3000:]
        results = json.loads((work / "out" / "results.json").read_text())
        assert results["state"] == "done"
        assert results["contributed"] == {d: sum(len(y) for _, y in bs) for d, bs in data.items()}
        runs.append(dict(np.load(work / "out" / "model.npz")))
    for key in runs[0]:
        assert runs[1][key].tobytes() == runs[0][key].tobytes(), key         # bit for bit
    Z = np.concatenate([x for bs in data.values() for x, _ in bs]).astype(np.float64)
    y = np.concatenate([y for bs in data.values() for _, y in bs])
    ref = reference_ridge(Z, y, C, LAM)
    assert np.linalg.norm(runs[1]["raw_weights"] - ref) / np.linalg.norm(ref) < 1e-10


def test_a_devices_increments_stay_within_the_per_device_cap_in_all(tmp_path):
    """A review's finding: each increment was held to the per-device cap alone, so a device claiming
    the cap in every round grew its weight without end. The device's samples in all are capped."""
    job = Fed3RJob(Fed3RConfig(num_classes=C, feature_dim=D, lam=LAM, streaming=True, normalize_columns=False,
                               max_device_samples=30))
    first, second = batches(3, [20, 15])
    task = Fed3RStatsTask(*first, lambda *a: Features(D), windows=kept_windows(tmp_path))
    job.apply("a", job.parse_result(answer(job, "a", task, 1)))
    task.add_samples(*second)
    with pytest.raises(EnvelopeError, match="20 \\+ 15 samples of a exceed the job's cap of 30"):
        job.parse_result(answer(job, "a", task, 2))
    assert job.contributed == {"a": 20}
