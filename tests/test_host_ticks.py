"""A host ticks only the devices a tick may change (DeviceAgent.wants_tick): an always-available
device whose result was lost is still retried by the host's ticker and contributes, and once
acknowledged it is left alone; a device whose availability may change is always ticked."""

import time

import numpy as np

from edge_client.agent import AgentHooks, DeviceAgent
from fedfleet.emulation.host import DeviceHost
from protocols.envelope import decode_header
from protocols.mqtt_link import BrokerConfig
from protocols.device_session import DeviceState

from ops_fleet import SyntheticStats, reference_sums
from test_fleet_hosting import start_service


def test_a_lost_result_is_retried_by_the_ticker_and_an_idle_device_is_left_alone(tmp_path, broker):
    devices = ["dev00", "dev01"]
    svc, t, result = start_service(broker.url, tmp_path, devices)
    host = DeviceHost(tick_s=0.2, source_addresses=["127.0.9.1", "127.0.9.2"])
    lost = []
    try:
        for d in devices:
            agent = host.add(lambda lf, d=d: DeviceAgent(
                d, BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(d)}, retry_after_s=1.0,
                link_factory=lf, hooks=AgentHooks(always_available=True)))
            if d == "dev00":         # its first result never reaches the broker, as over a lost link
                publish = agent.link.publish_parts

                def lose_first(topic, parts, publish=publish, **kw):
                    if decode_header(parts[0]).type in ("result", "chunk") and not lost:
                        lost.append(parts)
                        return sum(map(len, parts))
                    return publish(topic, parts, **kw)
                agent.link.publish_parts = lose_first
        t.join(30)
        sources = [host.agents[d].link.client.socket().getsockname()[0] for d in devices]
        a0 = host.agents["dev00"]
        deadline = time.monotonic() + 5
        while a0.session.state is not DeviceState.IDLE and time.monotonic() < deadline:
            time.sleep(0.05)
        idle_wants = [host.agents[d].wants_tick for d in devices]
        a0.hooks.always_available = False
        varying_wants = a0.wants_tick
    finally:
        host.stop()
    assert lost and sorted(result["contributed"]) == devices and a0.stats.acks.get("accepted") == 1
    assert len(result["rounds"]) == 1       # resent by the device's own retry, not re-asked in a later round
    assert idle_wants == [False, False] and varying_wants
    assert sources == ["127.0.9.1", "127.0.9.2"]            # the host deals its source addresses
    A_ref, _ = reference_sums(devices)
    np.testing.assert_allclose(np.load(tmp_path / "statistics.npz")["A"], A_ref, rtol=1e-12)
