"""``aggregator serve --shards 2 --require-signatures`` over a real mosquitto: the shards verify
every message they read against the enrolled keys the coordinator sent them (before the job), so
a sharded job takes exactly what one aggregator takes. An intruder with access to a device's
topics reads its task and publishes a result for it (another device's statistics) signed with a
key other than the device's enrolled one, before the device answers: the forgery is refused as
"bad signature" with the reason and stored by no shard, the device's own result is taken, and the
model is one aggregator's bytes and the plain sums of every device's data."""

import json
import queue
import threading

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from aggregator.storage.store import Store
from fedfleet.emulation.broker import MosquittoBroker
from protocols import messages as M
from protocols.chunking import split
from protocols.envelope import decode, encode
from protocols.identity import DeviceIdentity
from protocols.topics import Topics

from ops_fleet import Fleet, SyntheticStats, prepare, reference_sums, run_aggregator
from shard_runs import DEVICES, ON_RAY, RAY_ALL_ONLY, SHARDED_JOB_TIMEOUT_S, shard_options

VICTIM = "dev07"


class Intruder:
    """Broker access to ``device``'s topics, not its key: publishes a forged result for its first task."""

    def __init__(self, port: int, device: str, topics: Topics = Topics()):
        self.device, self.topics, self.tasks = device, topics, queue.Queue()
        self.key = DeviceIdentity.generate(device)          # not the enrolled one
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
        self.client.on_message = lambda _c, _u, msg: self.tasks.put(decode(msg.payload))
        self.client.on_connect = lambda c, *_: c.subscribe(topics.inbox(device), qos=1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def forge(self, timeout: float = 120) -> None:
        while True:
            env = self.tasks.get(timeout=timeout)
            if env.type == M.TASK:
                break
        ref, kind, params, _ = M.parse_task(env)
        body, tensors = SyntheticStats("dev00")(params)       # another device's statistics
        forged = M.result_message(self.device, ref, kind, body, tensors)
        raw = encode(forged, self.key.sign)
        for part in split(raw, forged.id, self.device, chunk_size=4096, signer=self.key.sign):
            self.client.publish(self.topics.outbox(self.device), part, qos=1).wait_for_publish(10)

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def signed_run(work, identities, extra=()) -> tuple[dict, dict, dict]:
    """One Fed3R job whose devices are enrolled with ``identities``' keys and sign with them; the
    victim answers only after the intruder's forgery is out."""
    prepare(work, DEVICES, clients_per_round=len(DEVICES), round_timeout_s=60)
    state = work / "state.db"
    store = Store(state)
    for d, identity in identities.items():
        store.enroll_device(d, identity.public_key_bytes, None)
    store.close()
    held = threading.Event()
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, identities=identities, gates={VICTIM: held}):
        intruder = Intruder(broker.port, VICTIM)
        forging = threading.Thread(target=lambda: (intruder.forge(), threading.Timer(1.0, held.set).start()),
                                   daemon=True)
        forging.start()
        try:
            rc, log = run_aggregator(work, broker.url, state, extra=["--require-signatures", *extra],
                                     timeout=SHARDED_JOB_TIMEOUT_S)
        finally:
            held.set()
            intruder.stop()
    assert rc == 0, log[-3000:]
    out = work / "out"
    return (dict(np.load(out / "model.npz")), dict(np.load(out / "statistics.npz")),
            json.loads((out / "results.json").read_text()))


# local shard processes in the suite; Ray actors on the two-node test cluster in `make test-ray`
@pytest.mark.parametrize("on", ["local", pytest.param("ray", marks=[RAY_ALL_ONLY, *ON_RAY])])
def test_sharded_job_requiring_signatures_refuses_a_forged_result_as_one_aggregator_does(tmp_path, on, request):
    identities = {d: DeviceIdentity.generate(d) for d in DEVICES}
    runs = [signed_run(tmp_path / name, identities, extra)
            for name, extra in (("one", ()), ("sharded", shard_options(on, request)))]
    A_ref, B_ref = reference_sums(DEVICES)
    for model, stats, results in runs:
        assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
        assert results["rejections"].get("bad signature", 0) >= 1, results["rejections"]
        np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-12, atol=1e-9)        # the victim's own data
        np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-12, atol=1e-9)
    (want, want_stats, _), (got, got_stats, _) = runs
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name               # bit for bit
    for name in ("A", "B", "counts"):
        assert got_stats[name].tobytes() == want_stats[name].tobytes(), name
    stored = [(row.device, row.message_id) for i in range(2) for row in Store(
        tmp_path / "sharded" / "state.db.shards" / f"shard-{i}-of-2.db").contributions("ops", with_payload=False)]
    assert sorted(d for d, _ in stored) == DEVICES                           # the forgery in no shard's store
