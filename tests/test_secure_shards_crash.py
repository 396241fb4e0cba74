"""A shard SIGKILLed while hosting a secure group, over a real mosquitto with the aggregator as a
process of its own: the group fails at once with its reason, nothing of it applied, and the job goes
on to the plain sums with the restarted shard and the other one hosting the later groups."""

import os
import signal
import subprocess
import threading
import time

import numpy as np

from fedfleet.emulation.broker import MosquittoBroker

from protocols.payloads.secagg import SECAGG_TYPE

from ops_fleet import (REPO, Fleet, SecureKeys, aggregator_cmd, aggregator_env, prepare, reference_sums,
                       secure_fed3r_handlers)
from secure_shard_runs import DEVICES, SHARDS, outputs


class HeldProtocol:
    """A device's secagg handler that holds the group's first message (its server machine's start:
    the group is running on its shard) until ``gate`` is set."""

    def __init__(self, handler, gate: threading.Event, reached: threading.Event):
        self.handler, self.gate, self.reached = handler, gate, reached

    def on_message(self, env):
        self.reached.set()
        self.gate.wait(60)
        return self.handler.on_message(env)


def held_fed3r_handlers(keys, gate: threading.Event, reached: threading.Event):
    def build(device: str) -> tuple[dict, dict]:
        handlers = secure_fed3r_handlers(device, keys)
        return {}, {**handlers, SECAGG_TYPE: HeldProtocol(handlers[SECAGG_TYPE], gate, reached)}
    return build


def test_a_shard_sigkilled_hosting_a_group_fails_it_with_the_reason_and_the_job_goes_on(tmp_path):
    """Round 1's group runs on shard 1; it is SIGKILLed mid-round. The group fails at once with
    the reason (its secrets died with the shard), nothing of it applied; the restarted shard and
    shard 0 host the next groups, which take every device: the plain sums."""
    keys = SecureKeys.create(tmp_path, DEVICES)
    prepare(tmp_path, DEVICES, kind="fed3r-sync", max_samples=100, phase_timeout_s=5, **keys.job_fields(tmp_path))
    state, gate, reached = tmp_path / "state.db", threading.Event(), threading.Event()
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, handlers=held_fed3r_handlers(keys, gate, reached),
                                            aggregator_key=keys.aggregator.public_key_bytes):
        proc = subprocess.Popen(aggregator_cmd(tmp_path, broker.url, state, SHARDS), env=aggregator_env(), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert reached.wait(60), "round 1's group never started"
            os.kill(int((tmp_path / "state.db.shards" / "shard-1.pid").read_text()), signal.SIGKILL)
            time.sleep(1.0)                     # the coordinator notices within its tick; no key has come
            gate.set()
            out, _ = proc.communicate(timeout=120)           # aggregator_cmd's default wait: the service ends itself first
        finally:
            gate.set()
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "shard 1 exited" in out
    assert "secure round 1 failed on its shard: shard 1 hosting the group exited" in out
    _, results = outputs(tmp_path / "out")
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    stats = dict(np.load(tmp_path / "out" / "statistics.npz"))
    A_ref, B_ref = reference_sums(DEVICES, dtype=np.float32)       # every device once, in the later groups
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-10, atol=1e-8)
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-10, atol=1e-8)
