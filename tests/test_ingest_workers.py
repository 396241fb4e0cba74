"""Parallel ingest workers (aggregator/service/ingest.py) over a real mosquitto, a real SQLite store and
real Ed25519 signatures: results that go through the worker processes give the centralized ridge
for a fleet mixing factor and dense uploads; a forged signature and statistics that are not a
Gram matrix are refused by the workers and change nothing; SIGKILLs mid-ingest with the workers
on resume to the model of an uninterrupted run without them, bit for bit."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from edge_client.agent import DeviceAgent
from fedfleet.emulation.broker import MosquittoBroker
from protocols.envelope import decode
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig

from ops_fleet import prepare, run_aggregator
from test_fed3r_exactness import reference_ridge
from test_fed3r_factor import MixedStats

D, C, LAM = 24, 3, 1.0
SIZES = [5, 40, 12, 60, 3, 25]                  # below and above p = 25: factor and dense uploads
DEVICES = [f"dev{i:02d}" for i in range(len(SIZES))]
CHUNK = 1024                                    # every result is chunked, so every one goes to the workers


def fleet_data():
    rng = np.random.default_rng(11)
    Z = rng.normal(size=(sum(SIZES), D))
    y = rng.integers(0, C, len(Z))
    return Z, y, np.split(np.arange(len(y)), np.cumsum(SIZES)[:-1])


class Indefinite(MixedStats):
    """Dense statistics with one off-diagonal entry of A blown up: finite, symmetric, the declared
    shapes, positive diagonal — and indefinite (not a Gram matrix)."""

    def __call__(self, params, tensors=None):
        body, tensors = super().__call__({}, tensors)
        packed = tensors["A_upper"].copy()
        packed[1] = 1e3 * abs(packed).max()
        return body, {**tensors, "A_upper": packed}


def agents_for(broker, handlers, identities, signers=None):
    signers = signers or {}
    return [DeviceAgent(dev, BrokerConfig.from_url(broker.url), {"fed3r.stats": h}, retry_after_s=1, tick_s=0.1,
                        chunk_size=CHUNK, signer=signers.get(dev, identities[dev].sign)).start()
            for dev, h in handlers.items()]


def test_workers_refuse_forged_and_non_gram_results_and_sum_the_rest_exactly(broker, tmp_path):
    Z, y, parts = fleet_data()
    forger, poisoned = "dev90", "dev91"
    identities = {d: DeviceIdentity.generate(d) for d in [*DEVICES, forger, poisoned]}
    store = Store(tmp_path / "state.db")
    for dev, identity in identities.items():
        store.enroll_device(dev, identity.public_key_bytes, None)
    config = Fed3RConfig(num_classes=C, feature_dim=D, lam=LAM, normalize_columns=False, clients_per_round=4,
                         round_timeout_s=8, max_attempts=1, expected_devices=len(identities), start_timeout_s=5)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(require_signatures=True, ingest_workers=2, tick_s=0.05), store=store)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=90)), daemon=True)
    thread.start()
    handlers = {dev: MixedStats(Z[i], y[i], C) for dev, i in zip(DEVICES, parts)}
    handlers[forger] = MixedStats(Z[parts[3]], y[parts[3]], C)
    handlers[poisoned] = Indefinite(Z[parts[3]], y[parts[3]], C)
    other_key = DeviceIdentity.generate(forger)          # signs with a key that is not the enrolled one
    agents = agents_for(broker, handlers, identities, {forger: other_key.sign})
    thread.join(95)
    for a in agents:
        a.stop()
    assert result["state"] == "done", result
    assert sorted(result["contributed"]) == DEVICES         # neither the forger nor the poisoned device
    rejections = svc.last_finished.stats.rejections
    assert rejections["bad signature"] >= 1 and rejections["invalid payload"] >= 1, rejections
    assert {c.device for c in store.contributions(config.job_id, with_payload=False)} == set(DEVICES)
    ref = reference_ridge(Z, y, C, LAM)
    W = svc.job.strategy.solve().raw_weights_
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-9


def breaks_once(job):
    """Makes the service-side parse of ``job``'s first worker-checked result raise an unexpected
    error (a stand-in for a bug on that path); returns a list that gets the device's name."""
    broken, parse = [], job.parse_accepted

    def parse_accepted(env):
        if not broken:
            broken.append(env.sender)
            raise RuntimeError("an unexpected error on the verdict's path")
        return parse(env)
    job.parse_accepted = parse_accepted
    return broken


def test_an_unexpected_error_on_a_workers_verdict_refuses_that_result_not_the_service(broker, tmp_path):
    """A review's finding: whatever one message causes on the MQTT path is that message's refusal,
    but an exception handling a worker's verdict on a large result ended ``run()`` — the whole
    aggregator, for one device's upload. Now that message is refused; the device, unanswered,
    sends it again and the round ends with every device's statistics."""
    Z, y, parts = fleet_data()
    identities = {d: DeviceIdentity.generate(d) for d in DEVICES}
    config = Fed3RConfig(num_classes=C, feature_dim=D, lam=LAM, normalize_columns=False, clients_per_round=6,
                         round_timeout_s=30, max_attempts=1, expected_devices=len(DEVICES), start_timeout_s=5)
    job = Fed3RJob(config)
    broken = breaks_once(job)
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(ingest_workers=2, tick_s=0.05), enrolled=set(DEVICES))
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    agents = agents_for(broker, {dev: MixedStats(Z[i], y[i], C) for dev, i in zip(DEVICES, parts)}, identities)
    thread.join(65)
    for a in agents:
        a.stop()
    assert result.get("state") == "done", result
    assert len(broken) == 1 and sorted(result["contributed"]) == DEVICES
    assert svc.last_finished.stats.rejections["malformed"] == 1
    ref = reference_ridge(Z, y, C, LAM)
    W = job.strategy.solve().raw_weights_
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-9


# ---------------------------------------------------------------------- crash mid-ingest, workers on
CRASHES = ["contribution_stored:2", "result_received"]       # mid-round: one stored, one being validated


def test_a_crash_mid_ingest_with_workers_resumes_bit_identically(tmp_path):
    Z, y, parts = fleet_data()
    handlers = {dev: MixedStats(Z[i], y[i], C) for dev, i in zip(DEVICES, parts)}
    identities = {d: DeviceIdentity.generate(d) for d in handlers}
    cfg = dict(num_classes=C, feature_dim=D, lam=LAM, normalize_columns=False, clients_per_round=3,
               round_timeout_s=30, start_timeout_s=60)   # starts once all 6 are online
    work = tmp_path / "workers"
    prepare(work, DEVICES, **cfg)
    reference = tmp_path / "inline"
    prepare(reference, DEVICES, **cfg)
    with MosquittoBroker() as broker:
        # the uninterrupted reference: the same job in the same kind of process, inline ingest (no
        # workers); a process of its own, so its solve runs on as many BLAS threads as the others'
        agents = agents_for(broker, handlers, identities)
        try:
            rc, log = run_aggregator(reference, broker.url, reference / "state.db")
        finally:
            for a in agents:
                a.stop()
    assert rc == 0, log[-3000:]
    assert sorted(json.loads((reference / "out" / "results.json").read_text())["contributed"]) == DEVICES
    with MosquittoBroker() as broker:
        agents = agents_for(broker, handlers, identities)
        try:
            for crash in CRASHES:
                rc, log = run_aggregator(work, broker.url, work / "state.db", crash, extra=["--ingest-workers", "1"])
                assert rc == -9, f"expected a SIGKILL at {crash}, got exit {rc}:\n{log[-3000:]}"
            rc, log = run_aggregator(work, broker.url, work / "state.db", extra=["--ingest-workers", "1"])
        finally:
            for a in agents:
                a.stop()
    assert rc == 0, log[-3000:]
    assert "contributions replayed" in log
    results = json.loads((work / "out" / "results.json").read_text())
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    forms = {decode(c.payload).body.get("a_format", "packed") for c in Store(work / "state.db").contributions("ops")}
    assert forms == {"factor", "packed"}                     # the fleet really mixed both upload forms
    got, want = dict(np.load(work / "out" / "model.npz")), dict(np.load(reference / "out" / "model.npz"))
    assert sorted(got) == sorted(want)
    for key in want:
        assert np.array_equal(got[key], want[key]), key
    ref = reference_ridge(Z, y, C, LAM)
    assert np.linalg.norm(got["raw_weights"] - ref) / np.linalg.norm(ref) <= 1e-9


def test_a_workers_verdict_classifies_what_is_wrong_with_a_message():
    """``validate_result`` as a worker runs it (in this process): each refusal has its class."""
    import dataclasses

    from aggregator.service.ingest import validate_result
    from protocols.envelope import Envelope, encode

    Z, y, parts = fleet_data()
    cfg = json.dumps(dataclasses.asdict(Fed3RConfig(num_classes=C, feature_dim=D)), sort_keys=True)
    identity = DeviceIdentity.generate("dev00")

    def result(handler, signer=identity.sign):
        return encode(Envelope("result", "dev00", *handler({"factor": True})), signer=signer)

    good = MixedStats(Z[parts[1]], y[parts[1]], C)
    key = identity.public_key_bytes
    assert validate_result("fed3r", cfg, result(good), key, 1 << 30).reason_class is None
    assert validate_result("fed3r", cfg, result(good, None), None, 1 << 30).reason_class is None
    assert validate_result("fed3r", cfg, result(good, None), key, 1 << 30).reason_class == "bad signature"
    forged = result(good, DeviceIdentity.generate("dev00").sign)
    assert validate_result("fed3r", cfg, forged, key, 1 << 30).reason_class == "bad signature"
    corrupt = bytearray(result(good))
    corrupt[-1] ^= 1
    assert validate_result("fed3r", cfg, bytes(corrupt), key, 1 << 30).reason_class == "malformed"
    poisoned = validate_result("fed3r", cfg, result(Indefinite(Z[parts[1]], y[parts[1]], C)), key, 1 << 30)
    assert poisoned.reason_class == "invalid payload" and "Gram" in poisoned.detail

    # a check that breaks on a message (a bug) is that message's refusal, read from shared memory
    # as the workers read it: raised, it kept the decoded views alive and surfaced as a BufferError
    from multiprocessing.shared_memory import SharedMemory

    from aggregator.service import ingest

    job = ingest._job_for("fed3r", cfg)
    message = result(good)
    segment = SharedMemory(create=True, size=len(message))
    try:
        segment.buf[:len(message)] = message
        job.check_payload = lambda env: 1 / 0
        verdict = ingest.validate_shared("fed3r", cfg, segment.name, len(message), key, 1 << 30)
        assert verdict.reason_class == "malformed" and "ZeroDivisionError" in verdict.detail
    finally:
        del job.check_payload
        segment.close()
        segment.unlink()


def test_transfer_buffers_are_reused_bounded_and_removed():
    """Messages reach the workers through shared memory segments that are reused (a new segment's
    pages cost a fault each), at most ``keep`` idle ones are kept, and closing removes them all."""
    from multiprocessing.shared_memory import SharedMemory

    import pytest

    from aggregator.service.ingest import TransferBuffers

    buffers = TransferBuffers(keep=2)
    first = buffers.put(b"a" * 3_000_000)
    assert bytes(first.buf[:3_000_000]) == b"a" * 3_000_000 and first.size % TransferBuffers.GRAIN == 0
    buffers.release(first)
    again = buffers.put(b"b" * 1000)                  # fits in the idle one: the same segment
    assert again.name == first.name and bytes(again.buf[:1000]) == b"b" * 1000
    held = [again, buffers.put(b"c"), buffers.put(b"d")]
    for segment in held:
        buffers.release(segment)
    names = [s.name for s in held]
    with pytest.raises(FileNotFoundError):
        SharedMemory(name=names[2])                   # a third idle one is not kept: destroyed
    in_flight = buffers.put(b"e" * 5_000_000)         # never released: its worker was stopped
    buffers.close()
    for name in names[:2] + [in_flight.name]:
        with pytest.raises(FileNotFoundError):
            SharedMemory(name=name)


# A service holding two ingest workers: prints their pids and its fork server's, then waits.
SERVICE_WITH_WORKERS = """
import multiprocessing.forkserver, os, time
from aggregator.service.ingest import IngestWorkers
workers = IngestWorkers(2)
workers._pool.apply(os.getpid)                      # both are up (a Pool starts them all at once)
print(*(p.pid for p in workers._pool._pool), multiprocessing.forkserver._forkserver._forkserver_pid, flush=True)
time.sleep(600)
"""


def _parent_and_state(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def test_ingest_workers_are_forks_of_the_fork_server_and_end_with_a_sigkilled_service():
    """The workers are the fork server's children, never the threaded service's forks, and a
    SIGKILLed service leaves none behind: the fork server exits with it, and so do they."""
    service = subprocess.Popen([sys.executable, "-c", SERVICE_WITH_WORKERS], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parents[1])
    try:
        *workers, server = (int(pid) for pid in service.stdout.readline().split())
        assert len(workers) == 2
        assert _parent_and_state(server)[0] == service.pid
        assert all(_parent_and_state(pid)[0] == server for pid in workers)
    finally:
        service.kill()
        service.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [pid for pid in (*workers, server) if (s := _parent_and_state(pid)) is not None and s[1] != "Z"]
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"processes {left} outlived the SIGKILLed service"
