"""Whatever one message causes is that message's refusal, never the process's exit: headers nested
20,000 levels deep on the outbox and the presence topics of a live job over mosquitto (once a
RecursionError that killed the aggregator), sent to a device's inbox too. The job still sums
every honest device's statistics exactly."""

import struct
import threading
import time

import numpy as np
import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from protocols.envelope import MAGIC, MAX_JSON_DEPTH, EnvelopeError, check_json_depth, decode
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from ops_fleet import wait_for
from test_aggregator_over_mqtt import C, D, SyntheticStats, data_for, raw_client

def deep_envelope(levels: int, kind: str = "[") -> bytes:
    close = {"[": "]", "{": "}"}[kind]
    opener = "[" if kind == "[" else '{"a":'
    header = (opener * levels + "1" + close * levels).encode()
    return MAGIC + struct.pack("<I", len(header)) + header


@pytest.mark.parametrize("kind", ["[", "{"])
def test_deep_nesting_is_refused_without_recursion(kind):
    with pytest.raises(ValueError, match="nested deeper"):
        check_json_depth((kind * 20000) + ("]" if kind == "[" else "}") * 20000)
    check_json_depth('{"s": "' + "[" * 1000 + '"}')                 # brackets inside strings do not count
    check_json_depth("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)


def test_a_string_that_never_closes_ends_the_depth_check_at_once():
    """A review's finding: stripping strings with a regex first began a scan to the header's end
    at each of 32,000 escaped quotes — 12 s of the service's thread for one unsigned 64 KiB header
    from any client. A string that never closes is refused when it is first met."""
    hostile = '"' + '\\"' * 32000
    with pytest.raises(ValueError, match="never closes"):
        check_json_depth(hostile)
    with pytest.raises(EnvelopeError, match="never closes"):
        decode(MAGIC + struct.pack("<I", len(hostile)) + hostile.encode())
    check_json_depth('{"s": "a \\" [ { quoted", "t": ["\\\\", "x"]}')      # escapes inside strings count as text
    with pytest.raises(ValueError, match="nested deeper"):
        check_json_depth('["\\"]"' + "[" * (MAX_JSON_DEPTH + 1))


def test_a_live_job_survives_deeply_nested_headers_on_every_topic(broker, tmp_path):
    with pytest.raises(EnvelopeError):
        decode(deep_envelope(20000))
    devices = [f"dev{i:02d}" for i in range(3)]
    gate = threading.Event()
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=3, round_timeout_s=20, expected_devices=3)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path, enrolled=set(devices))
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(i, gate)},
                          retry_after_s=2).start() for i, d in enumerate(devices)]
    topics, bad = Topics(), raw_client(broker)
    # The aggregator counts only what arrives after it subscribed (seen at 2 of 6 once, under
    # load): every device's presence seen means its subscriptions (outboxes, then presence) hold.
    deadline = time.monotonic() + 30
    while svc.call(lambda: len(svc.online)) < len(devices):
        assert time.monotonic() < deadline, "the aggregator did not see every device online"
        time.sleep(0.05)
    for payload in (deep_envelope(20000), deep_envelope(20000, "{"), deep_envelope(5000)):
        for topic in (topics.outbox("dev00"), topics.presence("dev01"), topics.inbox("dev02")):
            bad.publish(topic, payload, qos=1).wait_for_publish(5)
    time.sleep(1.0)
    assert thread.is_alive() and all(a.loop.alive for a in agents)
    gate.set()
    thread.join(60)
    for a in agents:
        a.stop()
    bad.loop_stop()
    assert result["state"] == "done" and sorted(result["contributed"]) == devices
    assert result["rejections"].get("malformed", 0) >= 6
    Zb = [np.hstack([data_for(i)[0], np.ones((30, 1))]) for i in range(3)]
    np.testing.assert_allclose(np.load(tmp_path / "statistics.npz")["A"], sum(z.T @ z for z in Zb), rtol=1e-12)


def test_a_presence_from_an_id_not_enrolled_neither_starts_nor_ends_a_job(broker, tmp_path):
    """A review's finding: the start gate counted every device online, so one "online" presence from
    an id that is not enrolled (signatures off, a broker without ACLs) started the job, whose first
    tick found no eligible device and ended it failed. Only devices that may contribute count now:
    the job waits, and runs when its enrolled device comes."""
    from protocols import messages as M
    from protocols.envelope import Envelope, encode

    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=1, round_timeout_s=20, expected_devices=1,
                         start_timeout_s=0)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path, enrolled={"dev00"})
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    ghost = raw_client(broker)
    deadline = time.time() + 20
    while "ghost" not in svc.call(lambda: set(svc.fleet.online)) and time.time() < deadline:
        ghost.publish(Topics().presence("ghost"), encode(Envelope(M.PRESENCE, "ghost", {"state": "online"})),
                      qos=1).wait_for_publish()         # again until the service, subscribing, has heard it
        time.sleep(0.2)
    assert "ghost" in svc.call(lambda: set(svc.fleet.online))
    time.sleep(1.0)                                      # many ticks of the service (0.2 s each)
    assert thread.is_alive() and not result and svc.call(lambda: not svc.active.started)
    agent = DeviceAgent("dev00", BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(0)}).start()
    thread.join(60)
    agent.stop()
    ghost.loop_stop()
    assert result["state"] == "done" and sorted(result["contributed"]) == ["dev00"], result


def test_ids_not_enrolled_heard_from_are_kept_to_a_bounded_latest_few(tmp_path):
    """A review's finding: each presence from an invented id (an open broker, signatures off) was
    kept for ever in the fleet's online, seen and last-seen maps and every live snapshot: 15,728
    ids in 100 s from one client, +57 MB and rising. Ids that may not contribute are kept to the
    latest MAX_STRANGERS (shown to the operator); enrolled devices are never dropped."""
    from aggregator.security.fleet import MAX_STRANGERS
    from protocols import messages as M
    from protocols.envelope import Envelope, encode

    svc = AggregatorService(None, BrokerConfig(port=1), tmp_path, enrolled={"dev00"})     # link never started
    topics = Topics()

    def online(device):
        svc._on_payload(topics.presence(device), encode(Envelope(M.PRESENCE, device, {"state": "online"})))

    online("dev00")
    for i in range(MAX_STRANGERS + 500):
        online(f"fake{i:05d}")
    fleet = svc.fleet
    strangers = {f"fake{i:05d}" for i in range(500, MAX_STRANGERS + 500)}          # the latest ones
    assert fleet.online == strangers | {"dev00"} and fleet.seen == fleet.online
    assert set(fleet.last_seen) == fleet.online and fleet.online_not_enrolled() == strangers
    online("fake00600")                                  # heard again: now the latest, the oldest goes
    online("fake99999")
    assert "fake00600" in fleet.online and "fake00500" not in fleet.online and "fake99999" in fleet.online
    assert len(fleet.online) == MAX_STRANGERS + 1 and "dev00" in fleet.eligible_online()


def test_a_connected_device_forgotten_with_the_strangers_comes_back_when_it_may_contribute(broker, tmp_path,
                                                                                           monkeypatch):
    """A review's finding on the bound above: a device still connected but forgotten with the
    strangers (its presence is published once, retained) was never online again after it was
    enrolled or the fleet opened, until it reconnected. Its retained presence is read again then."""
    import aggregator.security.fleet as fleet_module
    from aggregator.storage.store import Store
    from protocols import messages as M
    from protocols.envelope import Envelope, encode

    monkeypatch.setattr(fleet_module, "MAX_STRANGERS", 3)
    svc = AggregatorService(None, BrokerConfig.from_url(broker.url), tmp_path, ServiceSettings(keep_serving=True),
                            enrolled={"dev00"}, store=Store(tmp_path / "state.db"))
    thread = threading.Thread(target=lambda: svc.run(timeout_s=60), daemon=True)
    thread.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {}).start() for d in ("laptop", "cam9")]
    def online():
        return svc.call(lambda: set(svc.fleet.online))

    def eligible():
        return svc.call(lambda: svc.fleet.eligible_online())

    wait_for(lambda: {"laptop", "cam9"} <= online(), 20, "both connected")
    flood = raw_client(broker)
    for i in range(5):                                   # newer strangers push both out
        flood.publish(Topics().presence(f"fake{i}"), encode(Envelope(M.PRESENCE, f"fake{i}", {"state": "online"})),
                      qos=1).wait_for_publish()
    wait_for(lambda: not {"laptop", "cam9"} & online(), 20, "both forgotten")
    svc.call(lambda: svc.enroll("laptop"))
    wait_for(lambda: "laptop" in eligible(), 20, "the enrolled device online again")
    svc.call(lambda: svc.set_fleet_mode("open"))
    wait_for(lambda: "cam9" in eligible(), 20, "the open fleet's device online again")
    for agent in agents:
        agent.stop()
    flood.loop_stop()
    svc.stop()
    thread.join(30)

