"""Many real DeviceAgents on one MQTT event loop (fedfleet.emulation.host) against a real mosquitto
and the real aggregator: the statistics equal a plain numpy sum over the devices, one device's
failure (bad password, broken task, garbage message) leaves the others working, descriptors above
1024 work, and a resent chunked result that was already accepted gets its ``duplicate`` ack."""

import threading
import time
from pathlib import Path

import numpy as np

from aggregator.security.broker import BrokerSecurity, hash_password
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from fedfleet.emulation.broker import MosquittoBroker, free_port
from fedfleet.emulation.host import DeviceHost
from protocols.mqtt_link import BrokerConfig

from ops_fleet import C, D, SyntheticStats, reference_sums


def start_service(url: str, tmp_path: Path, devices, **cfg) -> tuple[AggregatorService, threading.Thread, dict]:
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=len(devices), round_timeout_s=20,
                         expected_devices=len(devices), **cfg)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(url), tmp_path,
                            ServiceSettings(evaluate_every_contribution=False), enrolled=set(devices))
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    t.start()
    return svc, t, result


class Broken:
    """A task handler with a bug."""

    def __call__(self, params, tensors=None):
        raise ZeroDivisionError("bug in this device's task")


def test_hosted_devices_with_one_bad_password_and_one_broken_task(tmp_path):
    """The production broker set-up (TLS, password file, ACL): a device with a wrong password and
    a device whose task raises leave the host's other devices contributing."""
    import dataclasses

    sec = BrokerSecurity(tmp_path / "security")
    sec.initialise()
    devices = [f"dev{i:02d}" for i in range(12)]
    passwords = {d: f"pw-{d}" for d in devices}
    sec.write_access_files({d: hash_password(p, iterations=1000) for d, p in passwords.items()})
    port = free_port()
    with MosquittoBroker(port=port, listener_config=sec.listener_config(port), workdir=tmp_path):
        base = BrokerConfig(port=port, tls_ca=str(sec.ca_cert))
        host = DeviceHost(tick_s=0.2, connect_timeout_s=2)
        try:
            healthy = devices[:10]
            config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=11, round_timeout_s=20,
                                 expected_devices=11, max_attempts=1)
            aggregator_login = dataclasses.replace(base, username="aggregator", password=sec.aggregator_password)
            svc = AggregatorService(Fed3RJob(config), aggregator_login, tmp_path / "agg",
                                    ServiceSettings(evaluate_every_contribution=False),
                                    enrolled=set(healthy + ["dev11"]))
            result: dict = {}
            t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
            t.start()
            for d in devices:
                password = "wrong" if d == "dev10" else passwords[d]
                handlers = {"fed3r.stats": Broken() if d == "dev11" else SyntheticStats(d)}
                cfg = dataclasses.replace(base, username=d, password=password)
                host.add(lambda lf, d=d, cfg=cfg, handlers=handlers: DeviceAgent(
                    d, cfg, handlers, retry_after_s=2, link_factory=lf))
            t.join(60)
            problems = host.connect_problems()
        finally:
            host.stop()
    assert set(problems) == {"dev10"}, problems
    assert host.agents["dev10"].link.connect_failures >= 1
    assert sorted(result["contributed"]) == healthy            # dev11 declined, dev10 never connected
    A_ref, _ = reference_sums(healthy)
    np.testing.assert_allclose(np.load(tmp_path / "agg" / "statistics.npz")["A"], A_ref, rtol=1e-12)


def test_descriptors_above_1024_and_refused_connections(tmp_path, broker):
    """Sockets with descriptor numbers above paho's select() limit work on the loop; a device
    pointed at a closed port keeps retrying alone."""
    import gc
    import os

    devices = [f"dev{i:02d}" for i in range(5)]
    svc, t, result = start_service(broker.url, tmp_path, devices)   # its threaded paho link needs a low fd
    assert svc.link.connected.wait(10)
    host = DeviceHost(tick_s=0.2, connect_timeout_s=2)
    gc.collect()                  # sockets left by earlier tests must not free low descriptors later
    filler = [os.open(os.devnull, os.O_RDONLY)]
    while filler[-1] <= 1100:     # fill every free descriptor (holes too): new sockets land above 1024
        filler.append(os.open(os.devnull, os.O_RDONLY))
    try:
        for d in devices:
            host.add(lambda lf, d=d: DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(d)},
                                                 link_factory=lf))
        closed = BrokerConfig.from_url("mqtt://127.0.0.1:1")
        host.add(lambda lf: DeviceAgent("nobroker", closed, {"fed3r.stats": SyntheticStats("dev99")}, link_factory=lf))
        t.join(60)
        assert min(a.link.client.socket().fileno() for d, a in host.agents.items() if d != "nobroker") > 1024
        problems = host.connect_problems()
    finally:
        host.stop()
        for fd in filler:
            os.close(fd)
    assert sorted(result["contributed"]) == devices
    assert set(problems) == {"nobroker"} and "refused" in problems["nobroker"].lower()


def test_resent_chunked_result_gets_a_duplicate_ack(tmp_path, broker):
    """A device resends its already accepted chunked result (as after a lost ack): the aggregator
    answers ``duplicate`` and applies it once."""
    gate = threading.Event()      # dev01 holds its result so the round stays open
    devices = ["dev00", "dev01"]
    svc, t, result = start_service(broker.url, tmp_path, devices)
    host = DeviceHost(tick_s=0.2)
    try:
        sent = []
        for d in devices:
            stats = SyntheticStats(d, gate if d == "dev01" else None)
            agent = host.add(lambda lf, d=d, stats=stats: DeviceAgent(
                d, BrokerConfig.from_url(broker.url), {"fed3r.stats": stats}, chunk_size=200,
                retry_after_s=600, link_factory=lf))
            if d == "dev00":            # what the device publishes: a message's payloads (chunks)
                publish = agent.link.publish_parts
                agent.link.publish_parts = lambda topic, parts, **kw: (sent.append((topic, parts, kw)),
                                                                       publish(topic, parts, **kw))[1]
        a0 = host.agents["dev00"]
        deadline = time.monotonic() + 30
        while a0.stats.acks.get("accepted", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        topic, parts, kw = next(s for s in sent if len(s[1]) > 2)      # the chunked result
        assert a0.link.publish_parts(topic, parts, **kw) > 2 * 200
        while a0.stats.acks.get("duplicate", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        gate.set()
        t.join(30)
    finally:
        host.stop()
    assert a0.stats.acks == {"accepted": 1, "duplicate": 1}
    assert result["duplicates"] >= 1 and sorted(result["contributed"]) == devices
    A_ref, _ = reference_sums(devices)
    np.testing.assert_allclose(np.load(tmp_path / "statistics.npz")["A"], A_ref, rtol=1e-12)


def test_emulated_slowdown_scales_a_devices_compute_not_its_wait_for_the_hosts_compute_slot():
    """Two devices share one compute slot: the second waits ~0.55 s for the first's task. Its
    slowdown (×3) must stretch only its own 0.2 s of compute (0.4 s more), not the wait as well
    (which would make it 1.5 s)."""
    from fedfleet.emulation.host import LazyTasks
    from fedfleet.emulation.profiles import DeviceProfile
    from fedfleet.emulation.worker import profile_hooks

    slot = threading.BoundedSemaphore(1)

    def work(seconds):
        def handler(params, tensors):
            time.sleep(seconds)
            return {}, {}
        return handler

    first = LazyTasks(lambda: {"k": work(0.6)}, ["k"], slot)
    second = LazyTasks(lambda: {"k": work(0.2)}, ["k"], slot)
    ahead = threading.Thread(target=first.run, args=("k", {}, {}))
    ahead.start()
    time.sleep(0.05)                      # the first device holds the slot
    started = time.perf_counter()
    second.run("k", {}, {})
    elapsed = time.perf_counter() - started
    ahead.join()
    assert 0.4 < second.slot_wait_s < elapsed and first.slot_wait_s < 0.05
    hooks = profile_hooks(DeviceProfile("dev", compute_slowdown=3.0), 0.0, np.random.default_rng(0),
                          lambda: second.slot_wait_s)
    slept = time.perf_counter()
    hooks.after_compute(elapsed - hooks.queued_s())        # what DeviceAgent._do_work hands it
    slept = time.perf_counter() - slept
    assert 0.35 < slept < 0.9, f"slept {slept:.2f} s for 0.2 s of compute at slowdown 3"
