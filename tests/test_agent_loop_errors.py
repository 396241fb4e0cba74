"""What a party's loop and its MQTT link do with what they did not catch before (the Python side
of tests/test_java_agent_errors.py):

* a task handler's BaseException that is not an Exception (an asyncio CancelledError, an
  application's own) is that task's failure: declined, and the device's next task runs. It ended
  the agent's thread (the loop caught Exception only), the device online and answering nothing;
* KeyboardInterrupt and SystemExit on the agent's thread end its loop cleanly: logged once, kept in
  ``DeviceAgent.ended_by``, presence ``offline``; a hosted agent's (pumped by a DeviceHost) the same,
  the host pumping it no more and its other devices going on;
* a paho callback of the link that raises (its on-connect hook, its on_message) no longer ends
  paho's network thread, and the link with it (no reconnect, nothing received).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

import paho.mqtt.client as mqtt

from edge_client.agent import DeviceAgent
from fedfleet.emulation.host import DeviceHost
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.message_loop import MessageLoop
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.topics import AGGREGATOR_ID, Topics
from deployment_fleet import Sniffer
from ops_fleet import wait_for

T = Topics()


class ApplicationAbort(BaseException):
    """An application's own BaseException (not an Exception)."""


def raising(params, tensors):
    if params.get("raise") == "cancelled":
        raise asyncio.CancelledError()
    if params.get("raise") == "application":
        raise ApplicationAbort("the application's own")
    if params.get("raise") == "exit":
        sys.exit("the application exits from a handler")
    return {"ok": True}, {}


def send_task(sniffer, device, job, params):
    msg = M.task_message(AGGREGATOR_ID, job, 1, "raising", params, time.time() + 60)
    sniffer.publish(T.inbox(device), encode(msg))
    return msg.id


def answers(sniffer, device) -> dict[str, object]:
    """The device's results and declines by task id."""
    return {env.body["task"]: env for env in map(decode, sniffer.seen.get(T.outbox(device), []))
            if env.type in (M.RESULT, M.DECLINE)}


def presences(sniffer, device) -> list[str]:
    return [decode(p).body.get("state") for p in sniffer.seen.get(T.presence(device), [])]


def online_agent(broker, device):
    sniffer = Sniffer(broker, [T.outbox(device), T.presence(device)])
    agent = DeviceAgent(device, BrokerConfig(port=broker.port), {"raising": raising}, tick_s=0.05).start()
    wait_for(lambda: "online" in presences(sniffer, device), what="the agent online")
    return agent, sniffer


def test_a_handlers_base_exception_is_its_tasks_failure_and_the_next_task_runs(broker):
    agent, sniffer = online_agent(broker, "dev-base")
    try:
        for throw in ("cancelled", "application"):
            failed = send_task(sniffer, "dev-base", f"job-{throw}", {"raise": throw})
            after = send_task(sniffer, "dev-base", f"job-after-{throw}", {})
            wait_for(lambda: {failed, after} <= set(answers(sniffer, "dev-base")), what=f"both answers ({throw})")
            got = answers(sniffer, "dev-base")
            assert got[failed].type == M.DECLINE and got[failed].body["reason"].startswith("error: "), got[failed].body
            assert got[after].type == M.RESULT
        assert agent.loop.alive and agent.ended_by is None
        assert (agent.stats.tasks_declined, agent.stats.tasks_done) == (2, 2)
    finally:
        agent.stop()
        sniffer.close()


def test_a_system_exit_on_the_agents_thread_ends_it_cleanly(broker, caplog):
    agent, sniffer = online_agent(broker, "dev-exit")
    try:
        with caplog.at_level(logging.CRITICAL, logger="fedfleet.loop"):
            send_task(sniffer, "dev-exit", "job-exit", {"raise": "exit"})
            wait_for(lambda: not agent.loop.alive, what="the agent's loop ended")
            wait_for(lambda: presences(sniffer, "dev-exit")[-1:] == ["offline"], what="presence offline")
        assert isinstance(agent.ended_by, SystemExit)
        ended = [r.getMessage() for r in caplog.records if "the loop ended" in r.getMessage()]
        assert ended == ["agent-dev-exit: the loop ended (SystemExit: the application exits from a handler): "
                         "it handles nothing more"]
        assert answers(sniffer, "dev-exit") == {}
    finally:
        agent.stop()
        sniffer.close()


def test_the_loop_fails_an_item_for_any_base_exception_and_ends_for_keyboard_interrupt(caplog):
    seen, failed, ends = [], [], []

    def handle(item):
        if item == "abort":
            raise ApplicationAbort("an item's")
        if item == "interrupt":
            raise KeyboardInterrupt()
        seen.append(item)

    loop = MessageLoop(handle, tick_s=0.01, name="t-base", failed=lambda item, exc: failed.append((item, type(exc))),
                       on_end=ends.append).start()
    loop.post("abort")
    loop.post("next")
    wait_for(lambda: seen == ["next"], what="the item after the failing one")
    assert failed == [("abort", ApplicationAbort)] and loop.alive
    try:
        loop.call(lambda: (_ for _ in ()).throw(ApplicationAbort("a call's")))
    except ApplicationAbort as exc:     # back to its caller, the loop serving on
        assert str(exc) == "a call's"
    assert loop.call(lambda: "still serving") == "still serving"
    with caplog.at_level(logging.CRITICAL, logger="fedfleet.loop"):
        loop.post("interrupt")
        loop.post("never")
        wait_for(lambda: not loop.alive, what="the loop ended")
    assert isinstance(loop.ended_by, KeyboardInterrupt) and ends == [loop.ended_by] and seen == ["next"]
    assert sum("t-base: the loop ended (KeyboardInterrupt" in r.getMessage() for r in caplog.records) == 1


def delivered(broker, link: MqttLink, topic: str, got: list) -> None:
    """Two messages published to ``topic``: the second reaches ``link`` (the first may raise in it).
    Probes first, until one arrives: the link says it is connected once it has sent its SUBSCRIBE, and
    a message the broker takes before that SUBSCRIBE is not the link's to receive."""
    sender = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="sender")
    sender.connect("127.0.0.1", broker.port)
    sender.loop_start()
    try:
        deadline = time.monotonic() + 10
        while b"0" not in got and time.monotonic() < deadline:
            sender.publish(topic, b"0", qos=1).wait_for_publish(5)
            time.sleep(0.1)
        for n in (1, 2):
            sender.publish(topic, str(n).encode(), qos=1).wait_for_publish(5)
        wait_for(lambda: b"2" in got, timeout=10, what="the second message received")
    finally:
        sender.loop_stop()
        sender.disconnect()


def test_a_link_whose_on_message_raises_goes_on_receiving(broker):
    got = []

    def on_message(topic, payload):
        got.append(payload)
        if payload == b"1":
            raise ValueError("a party's bug on the network thread")

    link = MqttLink("raising-receiver", BrokerConfig(port=broker.port), on_message, subscriptions=[("t/raise", 1)])
    link.start(timeout=10)
    try:
        delivered(broker, link, "t/raise", got)
        assert [p for p in got if p != b"0"] == [b"1", b"2"]
    finally:
        link.stop()


def test_a_link_whose_on_connect_hook_raises_is_connected_and_receives(broker):
    got, hooked = [], threading.Event()

    def hook():
        hooked.set()
        raise RuntimeError("presence could not be encoded")

    link = MqttLink("raising-hook", BrokerConfig(port=broker.port), lambda t, p: got.append(p),
                    subscriptions=[("t/hook", 1)], on_connect=hook)
    link.start(timeout=10)          # it timed out before: paho's thread ended in the hook, never connected
    try:
        assert hooked.is_set() and link.connected.is_set()
        delivered(broker, link, "t/hook", got)
    finally:
        link.stop()


def test_a_link_whose_held_publish_and_one_subscription_raise_on_connect_makes_every_other_step(broker, caplog):
    """Each step of the on-connect callback fails on its own: a held publish paho refuses (a
    wildcard topic) and a subscription it refuses (QoS 7) are each logged once, and every other
    subscription, the hook and ``connected`` still happen (the first error skipped them all before:
    the link connected but deaf, start() waiting until its timeout)."""
    got, hooked = [], threading.Event()
    link = MqttLink("raising-steps", BrokerConfig(port=broker.port), lambda t, p: got.append(p),
                    subscriptions=[("t/refused", 7), ("t/steps", 1)], on_connect=hooked.set)
    link._held.append(("t/wildcard/#", b"refused by paho", False))     # as if held under MAX_UNACKED
    with caplog.at_level(logging.ERROR, logger="fedfleet.mqtt"):
        link.start(timeout=5)
        try:
            assert hooked.is_set() and link.connected.is_set()
            delivered(broker, link, "t/steps", got)
        finally:
            link.stop()
    said = [r.getMessage() for r in caplog.records if r.name == "fedfleet.mqtt"]
    assert said == ["raising-steps: the MQTT link's handing over held publishes raised; the link goes on",
                    "raising-steps: the MQTT link's subscription to 't/refused' raised; the link goes on"]


class SlowPublishLink:
    """An agent's link (``link_factory``) that keeps the presence states it publishes, each publish
    taking a while (a broker slow to acknowledge): the window in which a second thread taking the
    agent offline found it still online."""

    def __init__(self, **kwargs):
        self.states: list[str] = []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def publish(self, topic, payload, **kwargs) -> None:
        time.sleep(0.2)
        self.states.append(decode(payload).body["state"])


def test_an_agent_ended_while_being_stopped_says_offline_once():
    """The loop's on_end (its thread ended by a SystemExit) and stop() (the application's thread)
    take the agent offline at once: one ``offline`` presence, not one each."""
    agent = DeviceAgent("dev-race", BrokerConfig(), {}, link_factory=SlowPublishLink).start(own_thread=False)
    both = threading.Barrier(2)

    def at_once(go_offline):
        both.wait()
        go_offline()

    racers = [threading.Thread(target=at_once, args=(agent.stop,)),
              threading.Thread(target=at_once, args=(lambda: agent._ended(SystemExit("the loop's end")),))]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(10)
    assert agent.link.states == ["offline"] and not agent.online


class StartCountingLink(SlowPublishLink):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.starts = 0

    def start(self) -> None:
        self.starts += 1


def test_a_pump_after_stop_leaves_the_agent_offline():
    """A device host's thread may pump an agent just as the application stops it: that pump finds
    the (always available) device offline and followed its availability back online, connected and
    saying nothing; a stopped agent stays offline."""
    agent = DeviceAgent("dev-late-pump", BrokerConfig(), {}, link_factory=StartCountingLink).start(own_thread=False)
    assert agent.online and agent.link.starts == 1
    agent.stop()
    agent.pump()
    assert not agent.online and agent.link.starts == 1 and agent.link.states == ["offline"]


def test_a_hosted_agent_ended_by_a_system_exit_goes_offline_and_the_hosts_other_devices_go_on(broker, caplog):
    """As a threaded agent's (test_a_system_exit_on_the_agents_thread_ends_it_cleanly): a SystemExit
    in a hosted agent's pump was held, unseen, in the host's step future, the agent online and deaf."""
    devices = ("dev-h-exit", "dev-h-on")
    sniffer = Sniffer(broker, [topic for d in devices for topic in (T.outbox(d), T.presence(d))])
    host = DeviceHost(step_threads=2, tick_s=0.05)
    try:
        for device in devices:      # not always available: the host ticks (pumps) them every tick_s
            host.add(lambda link_factory, device=device: DeviceAgent(
                device, BrokerConfig(port=broker.port), {"raising": raising}, link_factory=link_factory))
        wait_for(lambda: all("online" in presences(sniffer, d) for d in devices), what="the agents online")
        with caplog.at_level(logging.CRITICAL, logger="fedfleet.loop"):
            send_task(sniffer, "dev-h-exit", "job-exit", {"raise": "exit"})
            wait_for(lambda: presences(sniffer, "dev-h-exit")[-1:] == ["offline"], what="presence offline")
        ended = host.agents["dev-h-exit"]
        assert isinstance(ended.ended_by, SystemExit)
        said = [r.getMessage() for r in caplog.records if "the loop ended" in r.getMessage()]
        assert said == ["agent-dev-h-exit: the loop ended (SystemExit: the application exits from a handler): "
                        "it handles nothing more"]
        after = send_task(sniffer, "dev-h-on", "job-on", {})
        wait_for(lambda: after in answers(sniffer, "dev-h-on"), what="the other device's answer")
        time.sleep(10 * host.tick_s)     # ticks that would pump the ended agent, and so bring it online again
        assert presences(sniffer, "dev-h-exit")[-2:] == ["online", "offline"] and not ended.online
        assert answers(sniffer, "dev-h-exit") == {} and host.step_errors == 0
    finally:
        host.stop()
        sniffer.close()
