"""Contributions are stored on their own thread (``aggregator/service/contribution_writer.py``) while the
service goes on; a result's ack waits until it is durable. A write that fails (the disk, not the
device) must never be acknowledged: the job is rebuilt from the store, which lacks it, the device
sends it again, and the job ends exactly as a run where nothing failed — over mosquitto, with
real device agents."""

import io
import threading

import numpy as np

from aggregator.service.canonical import canonical_job
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from protocols.mqtt_link import BrokerConfig

from ops_fleet import Fleet, job_config, reference_sums

DEVICES = ["dev01", "dev02", "dev03", "dev04"]


class FailingOnce(Store):
    """A store whose disk fails once, writing the first payload file of ``device`` (its envelope
    names its sender): a fault injected where no real one can be made on demand (the tests run as
    root, which no permission stops). It fails on a file thread, as a full disk would."""

    def __init__(self, path, device: str):
        super().__init__(path)
        self.device, self.failed = device, threading.Event()
        write = self.blobs.write

        def failing_write(seq, data):
            if f'"{self.device}"'.encode() in data[:4096] and not self.failed.is_set():
                self.failed.set()
                raise OSError(28, "No space left on device (injected)")
            return write(seq, data)

        self.blobs.write = failing_write


def serve(broker, tmp_path, store):
    job = Fed3RJob(Fed3RConfig(**job_config(DEVICES, clients_per_round=4)))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "out", ServiceSettings(tick_s=0.05),
                            enrolled=set(DEVICES), store=store)
    thread = threading.Thread(target=svc.run, kwargs={"timeout_s": 90}, daemon=True)
    thread.start()
    with Fleet(broker.url, DEVICES):
        thread.join(90)


def final_model(store, job_id="ops"):
    final = [m for m in store.models(job_id) if m["final"]]
    with np.load(io.BytesIO(store.model_bytes(final[0]["model_id"]))) as z:
        return {k: z[k] for k in z.files}


def test_a_failed_store_write_is_never_acknowledged_and_the_job_ends_as_if_it_had_not_failed(broker, tmp_path):
    clean = Store(tmp_path / "clean" / "state.db")
    serve(broker, tmp_path / "clean", clean)
    store = FailingOnce(tmp_path / "failing" / "state.db", device="dev03")
    serve(broker, tmp_path / "failing", store)
    assert store.failed.is_set() and store.job("ops")["state"] == "done"
    # had dev03's lost result been acknowledged, it would not have sent it again: the round would
    # have waited for it until its timeout and a second round asked it anew
    assert sorted(c.device for c in store.contributions("ops")) == DEVICES
    assert len(store.rounds("ops")) == 1
    got, want = final_model(store), final_model(clean)
    for k in want:
        assert np.array_equal(got[k], want[k]), k              # bit for bit: summed in canonical order
    A_ref, _ = reference_sums(DEVICES)
    rebuilt = canonical_job(store, "fed3r", store.job("ops")["config"], "ops")
    np.testing.assert_allclose(rebuilt.strategy.A.cpu().numpy(), A_ref, rtol=1e-12)
