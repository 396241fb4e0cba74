"""The aggregator service over a real mosquitto: real device agents, plus a hostile raw client.

Features here are synthetic (the backbone is tested elsewhere) so the test is about transport,
validation and state: bad input is rejected with a reason and leaves the sums untouched.
"""

import threading
import time

import numpy as np
import paho.mqtt.client as mqtt

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from edge_client.fed3r import Fed3RAccumulator
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fed3r import encode_stats
from protocols.topics import Topics

import ops_fleet

D, C = 6, 3


def data_for(i):
    rng = np.random.default_rng(i)
    return rng.normal(size=(30, D)), rng.integers(0, C, 30)


class SyntheticStats(ops_fleet.SyntheticStats):
    """A task handler computing real Fed3R statistics of this file's synthetic features."""

    def __init__(self, i, gate=None):
        super().__init__(i, gate, data=data_for)


def start_service(broker, tmp_path, devices, **cfg):
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=len(devices), round_timeout_s=20,
                         expected_devices=len(devices), **cfg)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path, enrolled=set(devices))
    result = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    t.start()
    return svc, t, result


def raw_client(broker):
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    return c


def test_fed3r_over_mosquitto_with_hostile_traffic_equals_plain_sum(broker, tmp_path):
    devices = [f"dev{i:02d}" for i in range(4)]
    gate = threading.Event()       # devices hold their results until the hostile traffic is in
    svc, thread, result = start_service(broker, tmp_path, devices)
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(i, gate)},
                          retry_after_s=2).start() for i, d in enumerate(devices)]
    topics = Topics()
    bad = raw_client(broker)
    deadline = time.time() + 20
    while svc.job.round == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert svc.job.round == 1
    ref = M.TaskRef(svc.job.config.job_id, 1, svc.call(lambda: svc.active.rounds[1].tasks["dev00"]))     # dev00's own task

    def stats_msg(sender, mutate=None, ref=ref, **body_over):
        Z, y = data_for(99)
        acc = Fed3RAccumulator(C, D)
        acc.update(Z, y)
        A, ids, b = acc.sparse()
        body, tensors = encode_stats(A, ids, b, acc.n, C)
        if mutate:
            mutate(tensors)
        body.update(body_over)
        return M.result_message(sender, ref, "fed3r.stats", body, tensors)

    hostile = [
        (topics.outbox("dev00"), b"garbage"),                                                  # not an envelope
        (topics.outbox("dev00"), encode(stats_msg("dev01"))),                                  # spoofed sender
        (topics.outbox("stranger"), encode(stats_msg("stranger"))),                            # unknown device
        (topics.outbox("dev00"), encode(stats_msg("dev00", ref=M.TaskRef(ref.job, 1, "x" * 32)))),  # not its task: an
        # older run's answer (a job created again under its id); refused, dev00's answer not spent
        (topics.outbox("dev00"), encode(stats_msg("dev00", lambda t: t.__setitem__("b", t["b"] * np.nan)))),
        (topics.outbox("dev00"), encode(stats_msg("dev00", lambda t: t.__setitem__("A_upper", t["A_upper"][:-1])))),
        (topics.outbox("dev00"), encode(stats_msg("dev00", p=D + 5))),                         # wrong shape claim
        (topics.outbox("dev00"), encode(stats_msg("dev00", n=-3))),
        (topics.outbox("dev00"), encode(stats_msg("dev00", ref=M.TaskRef("other-job", 1, ref.task)))),
        (topics.outbox("dev00"), encode(stats_msg("dev00", ref=M.TaskRef(ref.job, 7, ref.task)))),
    ]
    for topic, payload in hostile:
        bad.publish(topic, payload, qos=1).wait_for_publish(5)
    time.sleep(1.0)
    assert svc.job.strategy.n_contributions == 0 and np.count_nonzero(svc.job.strategy.A.cpu().numpy()) == 0
    gate.set()
    thread.join(60)
    for a in agents:
        a.stop()
    bad.loop_stop()
    assert result["state"] == "done"
    # the invalid-payload messages from dev00 were rejected, but dev00 still contributed its real result
    assert set(result["contributed"]) == set(devices)
    rej = result["rejections"]
    assert rej.get("malformed", 0) >= 1 and rej.get("not enrolled", 0) == 1 and rej.get("unknown task") == 1
    assert rej.get("unknown job") == 1 and rej.get("unknown round") == 1
    # the first invalid payload rejects dev00 for the round; its next three are answered unread
    # (duplicates: the device already answered), never validated or applied
    assert rej.get("invalid payload") == 1 and result["duplicates"] >= 3 and sum(rej.values()) >= 4
    # accumulated statistics == plain numpy sum over the four devices
    A_ref = sum(np.hstack([data_for(i)[0], np.ones((30, 1))]).T @ np.hstack([data_for(i)[0], np.ones((30, 1))])
                for i in range(4))
    state = np.load(tmp_path / "statistics.npz")
    np.testing.assert_allclose(state["A"], A_ref, rtol=1e-12)


def test_duplicate_deliveries_are_applied_once(broker, tmp_path):
    devices = ["solo"]
    svc, thread, result = start_service(broker, tmp_path, devices)
    agent = DeviceAgent("solo", BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(0)},
                        retry_after_s=0.3)  # aggressive retries -> the server sees the same id several times
    agent.start()
    thread.join(60)
    agent.stop()
    assert result["state"] == "done" and result["results_accepted"] == 1
    assert svc.job.strategy.n_samples == 30



def test_a_result_sent_again_is_answered_without_a_second_validation(broker, tmp_path):
    """A device's re-sent result (same id) is a duplicate by the round's table alone: validating its
    payload again (a 6.6 MB Fed3R upload: a full Gram check) was CPU a device could make the server spend."""
    import queue

    svc, thread, result = start_service(broker, tmp_path, ["solo", "other"])
    parsed, original = [], svc.job.parse_result
    svc.job.parse_result = lambda env: (parsed.append(env.id), original(env))[1]
    tasks = queue.Queue()
    raw = raw_client(broker)
    raw.on_message = lambda c, u, m: tasks.put(m.payload)
    raw.subscribe(Topics().inbox("solo"), qos=1)
    from protocols.envelope import decode

    raw.publish(Topics().presence("solo"), encode(M.presence_message("solo", "online", {"kinds": ["fed3r.stats"]})),
                qos=1, retain=True).wait_for_publish(5)
    gate = threading.Event()            # "other" answers only after the copies: the round stays open
    agent = DeviceAgent("other", BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(1, gate)}).start()
    task = decode(tasks.get(timeout=30))
    ref, kind, params, _ = M.parse_task(task)
    body, tensors = SyntheticStats(0)(params, dict(task.tensors))
    message = encode(M.result_message("solo", ref, kind, body, tensors))
    for _ in range(3):
        raw.publish(Topics().outbox("solo"), message, qos=1).wait_for_publish(5)
    ops_fleet.wait_for(lambda: svc.active is not None and svc.active.stats.duplicates >= 2, what="two duplicates")
    gate.set()
    thread.join(60)
    agent.stop()
    raw.loop_stop()
    assert result["state"] == "done" and result["results_accepted"] == 2
    assert parsed.count(decode(message).id) == 1, parsed
    assert svc.job.strategy.n_samples == 60

def test_signed_agents_are_accepted_and_wrongly_signed_ones_rejected(broker, tmp_path):
    from protocols.identity import DeviceIdentity

    devices = ["good", "forger"]
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=2, round_timeout_s=8, expected_devices=1,
                         start_timeout_s=3, max_attempts=1)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path,
                            ServiceSettings(require_signatures=True), enrolled=set(devices))
    keys = {d: DeviceIdentity.generate(d) for d in devices}
    for d in devices:
        svc.registry.enroll(d, keys[d].public_key_bytes)
    impostor = DeviceIdentity.generate("forger")          # not the enrolled key
    result = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    t.start()
    agents = [DeviceAgent("good", BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(0)},
                          signer=keys["good"].sign).start(),
              DeviceAgent("forger", BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(1)},
                          signer=impostor.sign).start()]
    t.join(60)
    for a in agents:
        a.stop()
    assert list(result["contributed"]) == ["good"]
    assert result["rejections"].get("bad signature", 0) >= 1


def test_a_failing_protocol_handler_declines_and_the_agent_lives_on(broker):
    """A multi-message handler that raises (bad local data, a bug) must not kill the agent thread:
    the device declines the task and keeps answering later tasks."""
    import queue

    from protocols.chunking import MessageAssembler

    class Flaky:
        calls = 0

        def on_task(self, job, round_, params, tensors):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise ValueError("features contain NaN")
            return []

        def on_message(self, env):
            return []

    topics = Topics()
    got: queue.Queue = queue.Queue()
    spy = raw_client(broker)
    spy.on_message = lambda c, u, m: got.put(m.payload)
    spy.subscribe(topics.outbox("flaky"), qos=1)
    agent = DeviceAgent("flaky", BrokerConfig.from_url(broker.url), {},
                        protocol_handlers={"fed3r.secure": Flaky()}).start()
    time.sleep(0.5)
    for r in (1, 2):
        task = M.task_message("aggregator", "j", r, "fed3r.secure", {}, time.time() + 60)
        spy.publish(topics.inbox("flaky"), encode(task), qos=1)
    deadline = time.time() + 10
    declines = []
    while time.time() < deadline and not (declines and Flaky.calls == 2):
        try:
            env = MessageAssembler().feed(got.get(timeout=0.2))
        except queue.Empty:
            continue
        if env is not None and env.type == M.DECLINE:
            declines.append(env.body)
    agent.stop()
    spy.loop_stop()
    assert [d["round"] for d in declines] == [1] and "NaN" in declines[0]["reason"]
    assert Flaky.calls == 2            # the second task still reached the handler


def _random_json(rng, depth=0):
    choice = rng.integers(0, 8 if depth < 2 else 5)
    if choice == 0:
        return None
    if choice == 1:
        return bool(rng.integers(0, 2))
    if choice == 2:
        return int(rng.choice([-1, 0, 1, 7, 2**31, -2**63, 2**64 - 1]))
    if choice == 3:
        return float(rng.choice([0.5, -1e300, 1e-300, 3.0]))
    if choice == 4:
        return "".join(rng.choice(list("ab☃/\\\"\n{}")) for _ in range(rng.integers(0, 6)))
    if choice in (5, 6):
        return [_random_json(rng, depth + 1) for _ in range(rng.integers(0, 4))]
    return {str(rng.integers(0, 5)): _random_json(rng, depth + 1) for _ in range(rng.integers(0, 4))}


def hostile_storm(job_id: str, sender: str, count: int, seed: int = 0) -> list[bytes]:
    """Well-formed envelopes from an enrolled device that make no sense: every message type the
    aggregator knows (and unknown ones), bodies whose fields hold arbitrary JSON, tensors of odd
    dtypes and shapes -- some aimed at the open round (right job, round 1), the rest at nothing."""
    rng = np.random.default_rng(seed)
    # no declines: a device may decline its own task (the job then asks it again later)
    kinds = [M.RESULT, M.PRESENCE, "secagg", "artifact.get", "chunk", M.TASK, M.ACK, "bogus"]
    fields = ["job", "round", "task", "kind", "n", "p", "num_classes", "format", "state", "info", "secagg",
              "sha256", "parent", "index", "count", "total", "reason"]
    out = []
    for _ in range(count):
        body = {"job": job_id, "round": 1, "kind": "fed3r.stats"} if rng.random() < 0.6 else {}
        for key in rng.choice(fields, size=rng.integers(1, 6)):
            body[str(key)] = _random_json(rng)
        tensors = {}
        for name in rng.choice(["A_upper", "b", "class_ids", "data", "x"], size=rng.integers(0, 3), replace=False):
            dtype = rng.choice([np.float64, np.float32, np.int64, np.uint8])
            tensors[str(name)] = rng.normal(size=tuple(rng.integers(0, 5, size=rng.integers(0, 3)))).astype(dtype)
        out.append(encode(M.Envelope(str(rng.choice(kinds)), sender, body=body, tensors=tensors)))
    return out


def test_a_storm_of_random_hostile_messages_changes_nothing(broker, tmp_path):
    """300 nonsensical but well-formed envelopes from an enrolled device (plus their byte-flipped
    twins) reach the service mid-round: it survives, rejects them, and the job still ends with
    every device's real statistics summed exactly."""
    devices = [f"dev{i:02d}" for i in range(3)]
    gate = threading.Event()
    svc, thread, result = start_service(broker, tmp_path, devices)
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(i, gate)},
                          retry_after_s=2).start() for i, d in enumerate(devices)]
    deadline = time.time() + 20
    while svc.job.round == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert svc.job.round == 1
    storm = hostile_storm(svc.job.config.job_id, "dev00", 300)
    rng = np.random.default_rng(1)
    flipped = []
    for payload in storm[:100]:
        data = bytearray(payload)
        data[rng.integers(0, len(data))] ^= 1 << rng.integers(0, 8)
        flipped.append(bytes(data))
    bad = raw_client(broker)
    outbox = Topics().outbox("dev00")
    for payload in storm + flipped:
        bad.publish(outbox, payload, qos=1)
    bad.publish(outbox, b"", qos=1).wait_for_publish(10)
    time.sleep(1.5)
    assert thread.is_alive() and svc.job.strategy.n_contributions == 0
    gate.set()
    thread.join(60)
    for a in agents:
        a.stop()
    bad.loop_stop()
    assert result["state"] == "done" and set(result["contributed"]) == set(devices), {
        k: v for k, v in result.items() if k not in ("history",)}
    rejections = result["rejections"]
    assert sum(rejections.values()) >= 200, rejections
    assert rejections.get("result", 0) >= 10, rejections     # results that reached the round machine
    assert rejections.get("presence", 0) >= 10, rejections   # garbled presence: refused, device stays online
    Za = [np.hstack([data_for(i)[0], np.ones((30, 1))]) for i in range(3)]
    np.testing.assert_allclose(np.load(tmp_path / "statistics.npz")["A"], sum(z.T @ z for z in Za), rtol=1e-12)


def test_closed_rounds_are_let_go_and_still_answer_a_resend_and_a_late_result(broker, tmp_path):
    """A closed round's machine, task ids and counters are let go once its close is committed (the
    service grew ~2 KB a round for ever: every dispatch of an asynchronous job is a round). What it
    answered is kept: a resent accepted result is acked ``duplicate`` (the device learns it
    counted), any other result for it ``late``; one for a round the job never had ``rejected``."""
    from test_broker_security import RawDevice

    devices = ["dev00", "dev01", "dev02"]
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=1, round_timeout_s=60,
                         expected_devices=3, seed=1)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path,
                            ServiceSettings(tick_s=0.05), enrolled=set(devices))
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    topics = Topics()
    raw = {d: RawDevice(broker.port, None, client_id=d, tls=False) for d in devices}
    for d, c in raw.items():
        c.c.subscribe(topics.inbox(d), 1)
    time.sleep(0.3)
    for d, c in raw.items():
        c.publish(topics.presence(d), encode(M.presence_message(d, "online")))

    def answer(device, ref, body_tensors):
        message = encode(M.result_message(device, ref, "fed3r.stats", *body_tensors))
        raw[device].inbox.clear()                        # its answer is the next ack
        raw[device].publish(topics.outbox(device), message)
        return message, M.parse_result_ref(decode(message))[0], decode(message).id

    def ack_of(device, message_id, timeout=15):
        return raw[device].wait_for(lambda m: m.type == M.ACK and m.body["ref"] == message_id, timeout).body["status"]

    sent = []
    for _ in range(2):                                   # two rounds answered and closed; the third left open
        deadline = time.time() + 20
        while time.time() < deadline:
            tasks = [(d, m) for d, c in raw.items() for m in list(c.inbox) if m.type == M.TASK
                     and d not in [s[0] for s in sent]]
            if tasks:
                break
            time.sleep(0.05)
        device, task = tasks[0]
        ref = M.parse_task(task)[0]
        message, _, message_id = answer(device, ref, SyntheticStats(devices.index(device))({}))
        assert ack_of(device, message_id) == "accepted"
        sent.append((device, ref, message, message_id))
    wait_for_open = time.time() + 20
    while svc.call(lambda: svc.active.job.round) < 3 and time.time() < wait_for_open:
        time.sleep(0.05)
    kept = svc.call(lambda: (sorted(svc.active.rounds), sorted(svc.active.deadlines), sorted(svc.active.opened_at),
                             len(svc.active.closed)))
    assert kept == ([3], [3], [3], 2)                     # round 3 open; 1 and 2 let go, their two ids kept
    first_device, first_ref, first_message, first_id = sent[0]
    raw[first_device].inbox.clear()
    raw[first_device].publish(topics.outbox(first_device), first_message)         # its ack was lost: resent
    assert ack_of(first_device, first_id) == "duplicate"
    _, _, fresh_id = answer(first_device, first_ref, SyntheticStats(0)({}))       # a new result for a closed round
    assert ack_of(first_device, fresh_id) == "late"
    before = svc.call(lambda: svc.active.stats.rejections.get("unknown round", 0))
    never = M.TaskRef(first_ref.job, 99, first_ref.task)
    _, _, never_id = answer(first_device, never, SyntheticStats(0)({}))
    assert ack_of(first_device, never_id) == "rejected"      # answered: the device stops re-sending it
    assert svc.call(lambda: svc.active.stats.rejections.get("unknown round", 0)) == before + 1
    last = next(d for d in devices if d not in (sent[0][0], sent[1][0]))
    task = M.parse_task(raw[last].wait_for(lambda m: m.type == M.TASK))[0]
    _, _, other_id = answer(last, M.TaskRef(task.job, task.round, "ab" * 16), SyntheticStats(devices.index(last))({}))
    assert ack_of(last, other_id) == "rejected"          # not its task (an older run's): its answer is not spent
    before = svc.call(lambda: svc.active.stats.rejections.get("unknown task", 0))
    raw[last].publish(topics.outbox(last), encode(M.decline_message(last, M.TaskRef(task.job, task.round, "cd" * 16),
                                                                    "an older run's decline")))
    deadline = time.time() + 10
    while svc.call(lambda: svc.active.stats.rejections.get("unknown task", 0)) == before and time.time() < deadline:
        time.sleep(0.05)
    assert svc.call(lambda: svc.active.stats.rejections.get("unknown task", 0)) == before + 1   # nor a decline
    answer(last, task, SyntheticStats(devices.index(last))({}))
    thread.join(30)
    for c in raw.values():
        c.close()
    assert result["state"] == "done" and sorted(result["contributed"]) == devices
    assert svc.last_finished.rounds == {} and svc.last_finished.deadlines == {}



def test_a_result_for_no_running_round_is_acked_unless_its_job_may_run_again(broker, tmp_path):
    """A device whose result gets no ack re-sends the whole upload up to ``max_retries`` times
    (before, a result for a job that had ended, or for a job or round that never existed, was only
    logged). Now a result for a job that ended is acked ``late``, one for a job the service never
    had ``rejected``; one for a job the store holds unfinished (stopped: it may be resumed) gets
    no answer, so the device's retries reach the job once it runs again."""
    from aggregator.storage.schema import JobState
    from aggregator.storage.store import Store
    from test_broker_security import RawDevice

    store = Store(tmp_path / "state.db")
    store.create_job("finished", "fed3r", {}, JobState.DONE)
    store.create_job("resting", "fed3r", {}, JobState.STOPPED)
    svc = AggregatorService(None, BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(keep_serving=True, tick_s=0.05), enrolled={"dev-b"}, store=store)
    thread = threading.Thread(target=svc.run, kwargs={"timeout_s": 60}, daemon=True)
    thread.start()
    topics = Topics()
    device = RawDevice(broker.port, None, client_id="dev-b", tls=False)
    device.c.subscribe(topics.inbox("dev-b"), 1)
    time.sleep(0.3)
    sent = {job: M.result_message("dev-b", M.TaskRef(job, 1, "cd" * 16), "fed3r.stats", {}, {})
            for job in ("resting", "finished", "never-run")}      # in this order, on one connection
    try:
        for message in sent.values():
            assert device.publish(topics.outbox("dev-b"), encode(message)) == "Success"
        ops_fleet.wait_for(lambda: sum(m.type == M.ACK for m in device.inbox) >= 2, what="two acks")
        # the aggregator answers in arrival order: an ack for "resting" would have come first
        acks = {m.body["ref"]: (m.body["status"], m.body["reason"]) for m in device.inbox if m.type == M.ACK}
        assert acks == {sent["finished"].id: ("late", "job 'finished' has ended"),
                        sent["never-run"].id: ("rejected", "unknown job 'never-run'")}, acks
        assert svc.call(lambda: (svc.stats.late, svc.stats.rejections["unknown job"])) == (1, 2)
    finally:
        svc.stop()
        thread.join(30)
        device.c.loop_stop()


def test_an_answer_to_a_job_that_ended_is_counted_late_not_rejected(broker, tmp_path, caplog):
    """A device whose work stopped at its round's end declines once, usually after the job's last
    round closed (docs/protocol.md): such answers to a job that ended are counted late, without a
    warning per device (before: "rejected message ...: unknown job", counted against the service or
    the next job); an answer naming a job never run is still rejected."""
    from protocols.messages import TaskRef
    from protocols.device_session import EXPIRED_AT_WORK_DECLINE

    devices = ["dev-a", "dev-b"]
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=2, round_timeout_s=20, expected_devices=2)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path, enrolled=set(devices),
                            settings=ServiceSettings(keep_serving=True))
    thread = threading.Thread(target=svc.run, kwargs={"timeout_s": 60}, daemon=True)
    thread.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(i)}).start()
              for i, d in enumerate(devices)]
    topics, client = Topics(), raw_client(broker)
    try:
        ops_fleet.wait_for(lambda: svc.active is None and svc.last_finished is not None, what="the job ended")
        ended = svc.last_finished.job_id
        straggler = M.result_message("dev-b", TaskRef(ended, 1, "cd" * 16), "fed3r.stats", {}, {})   # a late result
        for device, msg in (("dev-a", M.decline_message("dev-a", TaskRef(ended, 1, "ab" * 16), EXPIRED_AT_WORK_DECLINE)),
                            ("dev-b", straggler),
                            ("dev-b", M.decline_message("dev-b", TaskRef("never-run", 1, "ab" * 16), "no data"))):
            client.publish(topics.outbox(device), encode(msg), qos=1).wait_for_publish(5)
        ops_fleet.wait_for(lambda: svc.stats.rejections["unknown job"] == 1 and svc.stats.late == 2,
                           what="two late answers and one rejection")
        assert caplog.text.count("rejected message") == 1
        assert "rejected message from dev-b: unknown job: 'never-run'" in caplog.text
    finally:
        client.loop_stop()
        client.disconnect()
        for agent in agents:
            agent.stop()
        svc.stop()
        thread.join(10)


def test_a_task_the_job_cannot_build_fails_the_job_with_no_round_left_open(broker, tmp_path):
    """A review's finding: a job whose task params the wire refused (a config accepted at create)
    stopped with "scheduling failed", but its round 1 had been stored first and stayed open for
    ever, its first device's task already sent. Every task of a round is built before the round is
    stored: nothing is opened, nothing is sent, the job stops with the reason."""
    from aggregator.storage.store import Store

    class OneTaskRefused(Fed3RJob):
        def task_for(self, device):
            if device == "dev-b":
                raise ValueError("lr must be a finite number > 0, got 0.0")
            return super().task_for(device)

    devices = ["dev-a", "dev-b"]
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=2, round_timeout_s=20, expected_devices=2)
    store = Store(tmp_path / "state.db")
    svc = AggregatorService(OneTaskRefused(config), BrokerConfig.from_url(broker.url), tmp_path, enrolled=set(devices),
                            store=store)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    ran = []

    def handler(i):
        stats = SyntheticStats(i)
        return lambda params, tensors=None: ran.append(i) or stats(params, tensors)
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": handler(i)}).start()
              for i, d in enumerate(devices)]
    try:
        thread.join(30)
        assert not thread.is_alive()
        job_id = config.job_id
        assert "scheduling failed: ValueError: lr must be a finite number > 0" in str(result) + str(store.job(job_id))
        assert store.rounds(job_id) == []                      # no round stored, none left open
        assert ran == []                                       # no task reached a device
    finally:
        for agent in agents:
            agent.stop()
        svc.stop()
