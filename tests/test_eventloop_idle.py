"""The shared MQTT event loop (protocols.mqtt_eventloop) stays idle when nothing is to be sent.

A socket watched for writing while paho has nothing queued is reported writable by epoll on
every call: the loop must drop that interest itself, since paho only reports the ones it
registered. Measured as the loop thread's own CPU time (Linux thread CPU clock)."""

import threading
import time

from fedfleet.emulation.broker import free_port
from protocols.mqtt_eventloop import LoopLink, MqttEventLoop
from protocols.mqtt_link import BrokerConfig


def thread_cpu_s(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def test_an_unneeded_write_interest_does_not_keep_the_loop_busy(broker):
    loop = MqttEventLoop()
    links = [LoopLink(loop, f"idle{i}", BrokerConfig.from_url(broker.url), on_message=lambda t, p: None)
             for i in range(5)]
    try:
        for link in links:
            link.start(timeout=10)
        links[0].publish("fedfleet/test", b"x", qos=1, wait=True)      # a real write goes through
        for link in links:       # what _misc or a socket opening may leave behind: write interest, nothing queued
            sock = link.client.socket()
            loop.call_soon(lambda link=link, sock=sock: loop._watch(link, sock, True))
        time.sleep(0.3)
        before = thread_cpu_s(loop._thread)
        time.sleep(2.0)
        busy = thread_cpu_s(loop._thread) - before
        assert busy < 0.2, f"the idle loop used {busy:.2f} s of CPU in 2 s"
        assert all(link.connected.is_set() for link in links)
    finally:
        for link in links:
            link.stop()
        loop.stop()


def test_a_loop_opens_at_most_its_cap_of_connections_awaiting_their_connack(broker):
    """A host of thousands of devices opens its connections a cap at a time (a burst overflowed
    the broker's accept queue and turned into reconnect storms); every device still connects, and
    an attempt that fails (nothing listening) frees its place instead of holding it."""
    loop = MqttEventLoop()
    loop.connector.max_awaiting = 3
    dead = BrokerConfig(port=free_port())
    failing = LoopLink(loop, "nobody-listens", dead, on_message=lambda t, p: None)
    links = [LoopLink(loop, f"capped{i}", BrokerConfig.from_url(broker.url), on_message=lambda t, p: None)
             for i in range(30)]
    try:
        failing.start()
        for link in links:
            link.start()
        deadline = time.monotonic() + 30
        while not all(link.connected.is_set() for link in links) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(link.connected.is_set() for link in links)
        assert failing.connect_failures >= 1 and not failing.connected.is_set()
        assert 1 <= loop.connector.peak_awaiting <= 3
    finally:
        for link in links + [failing]:
            link.stop()
        loop.stop()
