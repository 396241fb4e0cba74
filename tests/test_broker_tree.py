"""Past one broker process's sockets, devices are spread over edge brokers bridged to the core one
(fedfleet.emulation.broker.BrokerTree): each device reaches the aggregator's broker and back
through its own edge, on real mosquittos."""

import threading

import pytest
import time

from fedfleet.emulation.broker import BrokerTree, broker_for, loopback_sources
from protocols.mqtt_eventloop import LoopLink, MqttEventLoop
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.topics import Topics


def test_devices_spread_over_edges_reach_the_core_and_back():
    topics, n = Topics("treetest"), 30
    replies: dict[str, bytes] = {}
    got_all = threading.Event()

    def on_reply(topic, payload):
        replies[topics.device_of(topic)] = payload
        if len(replies) == n:
            got_all.set()

    with BrokerTree.for_devices(n, topics, per_edge=12) as tree:
        assert len(tree.edges) == 3 and len(set(tree.device_urls)) == 3 and tree.url not in tree.device_urls
        loop = MqttEventLoop()
        sources = loopback_sources(1, n, per_address=10)
        assert sources == ["127.0.3.1", "127.0.3.2", "127.0.3.3"]
        devices = []
        for i in range(n):
            dev = f"d{i}"
            link = LoopLink(loop, dev, BrokerConfig.from_url(broker_for(i, tree.device_urls)),
                            on_message=lambda t, p, dev=dev: devices_by_id[dev].publish(topics.outbox(dev), p + b"!"),
                            subscriptions=[(topics.inbox(dev), 1)], source_address=sources[i // 10])
            devices.append(link)
        devices_by_id = {link.client_id: link for link in devices}
        aggregator = MqttLink("aggregator", BrokerConfig.from_url(tree.url), on_message=on_reply,
                              subscriptions=[(topics.all_outboxes, 1)])
        try:
            for link in devices:
                link.start()
            aggregator.start(timeout=10)
            assert all(link.connected.wait(15) for link in devices)
            # each device's socket goes to its own edge, an equal share per edge
            ports = [link.client.socket().getpeername()[1] for link in devices]
            edge_ports = [e.port for e in tree.edges]
            assert ports == [edge_ports[i % 3] for i in range(n)]
            # ... from its host's own loopback address (not 127.0.0.1's ephemeral ports)
            assert [link.client.socket().getsockname()[0] for link in devices] == [sources[i // 10] for i in range(n)]
            deadline = time.monotonic() + 30
            while not got_all.is_set() and time.monotonic() < deadline:    # a SUBACK may still be on its way
                for i, link in enumerate(devices):
                    if link.client_id not in replies:
                        aggregator.publish(topics.inbox(link.client_id), f"task{i}".encode())
                got_all.wait(1.0)
            assert replies == {f"d{i}": f"task{i}!".encode() for i in range(n)}
        finally:
            aggregator.stop()
            for link in devices:
                link.stop()
            loop.stop()


def test_every_topic_the_aggregator_publishes_for_a_device_reaches_it_through_its_edge():
    """Through the bridge the other way: a task, a deployment's (retained) assignment and its head,
    the broadcast, the status and the job ends; the assignment was not bridged, so devices behind
    an edge never learnt of a rollout."""
    topics, got = Topics("treedown"), {}
    arrived = threading.Event()
    wanted = {topics.inbox("d0"), topics.deploy("d0"), topics.deploy_in("d0"), topics.broadcast, topics.status,
              topics.job_ends}

    def on_message(topic, payload):
        got[topic] = payload
        if set(got) == wanted:
            arrived.set()

    with BrokerTree.for_devices(4, topics, per_edge=2) as tree:
        aggregator = MqttLink("aggregator", BrokerConfig.from_url(tree.url), on_message=lambda t, p: None)
        device = MqttLink("d0", BrokerConfig.from_url(tree.device_urls[0]), on_message=on_message,
                          subscriptions=[(t, 1) for t in sorted(wanted)])
        try:
            aggregator.start(timeout=10)
            device.start(timeout=10)
            deadline = time.monotonic() + 30
            while not arrived.is_set() and time.monotonic() < deadline:      # until the bridge has subscribed
                for t in wanted - set(got):
                    aggregator.publish(t, t.encode(), retain=t == topics.deploy("d0"))
                arrived.wait(1.0)
            assert got == {t: t.encode() for t in wanted}
        finally:
            device.stop()
            aggregator.stop()


def test_a_small_fleet_connects_to_the_core_itself():
    tree = BrokerTree.for_devices(100, Topics(), per_edge=100)
    assert tree.edges == [] and tree.device_urls == [tree.url]


def test_a_broker_whose_port_was_taken_meanwhile_moves_to_a_free_one(monkeypatch):
    """free_port() then the broker's bind is a race: another process can listen on the port in
    between. A connection accepted there is then not this broker's, so the broker is taken as
    started only once it holds the listening socket itself; on "Address already in use" it tries a
    fresh port, and a port the caller named is refused with PortTaken (one clear error)."""
    import socket

    from fedfleet.emulation import broker as broker_module

    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    taken = thief.getsockname()[1]
    real_free_port = broker_module.free_port
    picks = iter([taken])
    monkeypatch.setattr(broker_module, "free_port", lambda: next(picks, None) or real_free_port())
    try:
        with broker_module.MosquittoBroker() as moved:
            assert moved.port != taken and broker_module._listens(moved.proc.pid, moved.port) is True
            assert broker_module._listens(moved.proc.pid, taken) is False      # the thief's, not its
            assert broker_module._accepts(moved.port)
        with pytest.raises(broker_module.PortTaken, match="Address already in use"):
            broker_module.MosquittoBroker(port=taken).start()
    finally:
        thief.close()
