"""A device that leaves for good (or is revoked) before contributing no longer stalls the job: it
finishes "done" once the device has been offline past the grace period, and its summary says
who did not contribute and why. Real agents over a real mosquitto."""

import threading
import time

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from edge_client.agent import AgentHooks, DeviceAgent, DroppedOut
from protocols.mqtt_link import BrokerConfig

from test_aggregator_over_mqtt import C, D, SyntheticStats

DEVICES = [f"dev{i:02d}" for i in range(4)]


def leave_for_good(elapsed: float) -> None:
    raise DroppedOut()


def run(broker, tmp_path, grace_s, revoke=None):
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=len(DEVICES), round_timeout_s=30,
                         expected_devices=len(DEVICES))
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(tick_s=0.05, offline_grace_s=grace_s), enrolled=set(DEVICES),
                            store=Store(tmp_path / "state.db"))
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=40)), daemon=True)
    thread.start()
    gate = threading.Event()
    agents = []
    for i, d in enumerate(DEVICES):
        hooks = AgentHooks(after_compute=leave_for_good, offline_after_dropout_s=1e6) if d == "dev03" else None
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url),
                                  {"fed3r.stats": SyntheticStats(i, gate if d == revoke else None)},
                                  hooks=hooks, retry_after_s=1).start())
    if revoke:
        deadline = time.time() + 20
        while svc.job.round == 0 and time.time() < deadline:
            time.sleep(0.05)
        svc.call(lambda: svc.revoke(revoke))
    gate.set()
    t0 = time.monotonic()
    thread.join(45)
    for a in agents:
        a.stop()
    return result, time.monotonic() - t0


def test_a_device_gone_for_good_does_not_stall_the_job(broker, tmp_path):
    result, wall = run(broker, tmp_path, grace_s=1.0)
    assert result["state"] == "done", result.get("state")
    assert sorted(result["contributed"]) == DEVICES[:3]
    assert result["not_contributed"]["dev03"].startswith("offline for")
    assert wall < 30                                  # not the 40 s service timeout


def test_a_revoked_device_does_not_stall_the_job(broker, tmp_path):
    result, wall = run(broker, tmp_path, grace_s=1.0, revoke="dev01")
    assert result["state"] == "done", result.get("state")
    assert sorted(result["contributed"]) == ["dev00", "dev02"]
    assert result["not_contributed"]["dev01"] == "revoked"


def test_enrolling_a_device_does_not_change_the_fleet_mode_and_tasks_go_only_to_allowed_devices(broker, tmp_path):
    """An open aggregator stays open when one device is enrolled; switched to enrolled-only on
    purpose, it gives tasks only to enrolled devices (the others are shown, not asked, and do not
    count towards the devices a job waits for before its first round)."""
    store = Store(tmp_path / "state.db")
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=10, round_timeout_s=30, expected_devices=2)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(tick_s=0.05, offline_grace_s=1.0), store=store)
    assert svc.fleet.mode == "open" and store.setting("fleet_mode") == "open"
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=40)), daemon=True)
    thread.start()
    svc.call(lambda: svc.enroll("dev00"))
    svc.call(lambda: svc.enroll("dev01"))
    assert svc.call(lambda: svc.fleet.mode) == "open"                 # enrolling is not a mode switch
    assert svc.call(lambda: svc.set_fleet_mode("enrolled")) == "enrolled"
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(i)},
                          retry_after_s=1).start() for i, d in enumerate(DEVICES[:3])]
    thread.join(45)
    for a in agents:
        a.stop()
    assert result["state"] == "done" and sorted(result["contributed"]) == ["dev00", "dev01"]
    assert result["rejections"] == {}                                 # dev02 was never given a task
    assert "dev02" in result["not_contributed"]
    assert agents[2].stats.tasks_done == 0
    assert Store(tmp_path / "state.db").setting("fleet_mode") == "enrolled"
