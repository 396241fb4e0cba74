"""A device SIGKILLed mid-job (inside a pp.head task) and restarted resumes with its personal part:
real mosquitto, the aggregator in process, the device as its own process with its state on disk."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from aggregator.jobs.partial import PartialConfig, PartialPersonalizationJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from edge_client.state import DeviceStateStore
from fedfleet.emulation.broker import MosquittoBroker
from protocols.mqtt_link import BrokerConfig

from ops_fleet import C, D, REPO, wait_for
from pp_device_process import handler_for

VICTIM, OTHER = "dev00", "dev01"


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def device_process(broker_url: str, state: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(REPO / "tests" / "pp_device_process.py"), VICTIM, broker_url,
                             str(state), str(log), *extra], env=env, cwd=REPO)


class Slow:
    """The other device's handler, slowed so the job's rounds outlast the victim's restart (its
    killed connection is noticed at once, and rounds go on without it meanwhile)."""

    def __init__(self, handler, delay_s: float = 0.4):
        self.handler, self.delay_s = handler, delay_s

    def __call__(self, params, tensors=None):
        time.sleep(self.delay_s)
        return self.handler(params, tensors)


def test_killed_device_resumes_with_its_personal_state(tmp_path):
    job = PartialPersonalizationJob(PartialConfig(
        job_id="pp-restart", num_classes=C, feature_dim=D, clients_per_round=2, rounds=12, local_epochs=1,
        batch_size=8, client_lr=0.05, round_timeout_s=30, expected_devices=2, start_timeout_s=20, **PLAIN_MEAN))
    state, log = tmp_path / "victim-state", tmp_path / "victim.jsonl"
    with MosquittoBroker() as broker:
        svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "agg",
                                ServiceSettings(tick_s=0.05), enrolled={VICTIM, OTHER})
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=120)), daemon=True)
        thread.start()
        other = DeviceAgent(OTHER, BrokerConfig.from_url(broker.url),
                            {"pp.head": Slow(handler_for(OTHER, tmp_path / "other-state"))}, retry_after_s=1,
                            tick_s=0.05).start()
        first = device_process(broker.url, state, log, "--block-round", "3")
        try:
            wait_for(lambda: any(r["round"] == 3 and r["event"] == "start" for r in records(log)), 60,
                     "the victim inside round 3's task")
            persisted = DeviceStateStore(state).load("pp-restart", None)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            second = device_process(broker.url, state, log)
            thread.join(120)
        finally:
            for proc in (first, locals().get("second")):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            other.stop()
    assert job.round == 12 and not job._open, result
    after_restart = [r for r in records(log) if r["event"] == "done" and r["round"] >= 3]
    assert after_restart, records(log)
    resumed = after_restart[0]
    # the first task after the restart found the state written at round 2, and continued from it
    assert persisted.round == 2 and resumed["stored_round"] == 2 and resumed["restarted"] is False
    np.testing.assert_array_equal(np.asarray(resumed["stored_bias"], np.float32), persisted.arrays["bias"])
    assert not np.array_equal(persisted.arrays["bias"], job.params["bias"])      # a personal part, not the global v
    final = DeviceStateStore(state).load("pp-restart", None)
    assert final.round == max(r["round"] for r in after_restart)
