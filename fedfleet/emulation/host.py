"""Hosting thousands of emulated devices in one process, without a thread per device.

Each device is still a real :class:`edge_client.agent.DeviceAgent` with its own MQTT connection
(client id, credentials, session, presence, last will) and the same task code a phone runs; only
the I/O around it changes:

* network: every device's link is a :class:`protocols.mqtt_eventloop.LoopLink` on one shared
  :class:`~protocols.mqtt_eventloop.MqttEventLoop` (epoll, no ``select()`` limit); keepalives go on
  while devices compute, because no computation runs on the loop thread;
* logic: a device's agent is *pumped* (:meth:`DeviceAgent.pump`: queued messages, then a tick) on
  a small pool of step threads when its link queued a message, and every ``tick_s`` for retries
  and availability while it has any (:attr:`DeviceAgent.wants_tick`); a device is never pumped by
  two threads at once;
* compute: task handlers run inside :class:`LazyTasks`, which takes one of the host's compute slots
  (one per host by default, as a 2-core machine runs two hosts) and builds the device's data and
  handlers only for the task's duration, so an idle device holds ids, profile and shard indices.

Isolation: a device whose connection fails keeps retrying on its own (``connect_failures``,
``last_connect_error``); an exception from one device's pump or handler is logged and only that
task fails; other devices never notice. A KeyboardInterrupt or SystemExit in one device's pump ends
that device as it ends a threaded agent (``ended_by``, one log line, presence offline), and the host
pumps it no more.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from edge_client.agent import DeviceAgent
from protocols.message_loop import ENDS_THE_LOOP
from protocols.mqtt_eventloop import LoopLink, MqttEventLoop, raise_open_file_limit

from .processes import process_rss_mb

log = logging.getLogger("fedfleet.host")

LOOP_GIL_SWITCH_S = 0.001      # the interpreter's GIL switch interval in a process hosting devices


class LazyTasks:
    """One device's task handlers, built by ``build()`` when a task starts and dropped when it
    ends, under the host's compute slot (a bounded semaphore shared by the host's devices)."""

    def __init__(self, build: Callable[[], dict], kinds: Iterable[str], compute_slot: threading.Semaphore):
        self._build, self._slot = build, compute_slot
        self.kinds = tuple(sorted(kinds))
        self.slot_wait_s = 0.0      # how long the last task waited for the compute slot (no device compute)

    def handlers(self) -> dict[str, "LazyTask"]:
        return {k: LazyTask(self, k) for k in self.kinds}

    def run(self, kind: str, params: dict[str, Any], tensors: dict[str, np.ndarray]):
        asked = time.perf_counter()
        with self._slot:
            self.slot_wait_s = time.perf_counter() - asked
            handler = self._build()[kind]
            return handler(params, tensors)


class LazyTask:
    """A task handler that exists only while it runs (see :class:`LazyTasks`)."""

    def __init__(self, tasks: LazyTasks, kind: str):
        self._tasks, self.kind = tasks, kind

    def __call__(self, params, tensors=None):
        return self._tasks.run(self.kind, params, tensors or {})


class DeviceHost:
    """Many :class:`DeviceAgent` s on one MQTT event loop and a few step threads."""

    def __init__(self, step_threads: int = 8, tick_s: float = 2.0, compute_slots: int = 1,
                 connect_timeout_s: float = 15.0, source_addresses: Sequence[str] = ()):
        self.open_file_limit = raise_open_file_limit()
        # The MQTT loop thread waits for the GIL after each socket call while step and compute
        # threads hold it; at the default 5 ms hand-over a host of 12,500 devices fell 95 s behind
        # its keepalives and lost its connections (docs/deployment.md, fleet-100k). Process-wide:
        # a host process is there to host.
        sys.setswitchinterval(min(sys.getswitchinterval(), LOOP_GIL_SWITCH_S))
        self.loop = MqttEventLoop()
        self.compute_slot = threading.BoundedSemaphore(compute_slots)
        self.tick_s = tick_s
        self.connect_timeout_s = connect_timeout_s
        self.source_addresses = tuple(source_addresses)    # the devices' local addresses, dealt round-robin
        self.agents: dict[str, DeviceAgent] = {}
        self.first_added_at: float | None = None       # time.monotonic() of the first add()
        self.step_errors = 0
        self._pool = ThreadPoolExecutor(step_threads, thread_name_prefix="device-step")
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._running: set[str] = set()
        self._stopping = threading.Event()
        self._ticker = threading.Thread(target=self._tick_all, name="device-ticker", daemon=True)
        self._ticker.start()

    def link_factory(self, **kw) -> LoopLink:
        """For ``DeviceAgent(link_factory=...)``: the device's link on this host's loop, which
        wakes the device whenever a message arrives."""
        device_id, deliver = kw["client_id"], kw.pop("on_message")

        def on_message(topic: str, payload: bytes) -> None:
            deliver(topic, payload)
            self.notify(device_id)

        return LoopLink(self.loop, on_message=on_message, connect_timeout_s=self.connect_timeout_s,
                        source_address=self._next_source_address(), **kw)

    def _next_source_address(self) -> str | None:
        """The local address of the device being added (the n-th gets the n-th, round-robin)."""
        if not self.source_addresses:
            return None
        return self.source_addresses[len(self.agents) % len(self.source_addresses)]

    def add(self, make_agent: Callable[[Callable[..., LoopLink]], DeviceAgent]) -> DeviceAgent | None:
        """Create a device with ``make_agent(link_factory)`` and start it (connecting happens in the
        background). A device that cannot even be created is logged and skipped."""
        if self.first_added_at is None:
            self.first_added_at = time.monotonic()
        try:
            agent = make_agent(self.link_factory)
            agent.session.keep_acked_results = False   # an idle hosted device holds no past results
            self.agents[agent.device_id] = agent
            agent.start(own_thread=False)
            return agent
        except Exception:
            log.exception("device could not be started; the host's other devices go on")
            return None

    def notify(self, device_id: str) -> None:
        """Pump this device soon (thread-safe; coalesces, never runs one device twice at once)."""
        with self._lock:
            if device_id in self._pending:
                return
            self._pending.add(device_id)
            if device_id in self._running:
                return                   # its running step resubmits it when done
        self._submit(device_id)

    def _submit(self, device_id: str) -> None:
        try:
            self._pool.submit(self._step, device_id)
        except RuntimeError:             # the pool is shut down: the host is stopping
            pass

    def _step(self, device_id: str) -> None:
        with self._lock:
            self._pending.discard(device_id)
            self._running.add(device_id)
        try:
            self.agents[device_id].pump()
        except ENDS_THE_LOOP:            # that agent's loop ended (said, ended_by, presence offline): not pumped again
            pass
        except Exception:                # one device's bug ends its step, not the host
            self.step_errors += 1
            log.exception("%s: step failed", device_id)
        finally:
            with self._lock:
                self._running.discard(device_id)
                again = device_id in self._pending
        if again:
            self._submit(device_id)

    def _tick_all(self) -> None:
        while not self._stopping.wait(self.tick_s):
            # only devices a tick may change (see DeviceAgent.wants_tick): ticking 100,000 idle ones
            # every 2 s took a core; a message still wakes any device (link_factory's on_message)
            for device_id, agent in list(self.agents.items()):
                if agent.wants_tick:
                    self.notify(device_id)

    # reporting
    def connected(self) -> list[str]:
        return [d for d, a in self.agents.items() if a.link.connected.is_set()]

    def wait_connected(self, count: int | None = None, timeout_s: float = 60.0, poll_s: float = 0.1) -> int:
        """Wait until ``count`` devices (default: all) are connected; returns how many are."""
        want = len(self.agents) if count is None else count
        deadline = time.monotonic() + timeout_s
        while (n := len(self.connected())) < want and time.monotonic() < deadline:
            time.sleep(poll_s)
        return n

    def seconds_to_connect_all(self, timeout_s: float = 900.0, poll_s: float = 0.5) -> float | None:
        """Wait until every device is connected; seconds from the first device added until then
        (the host's start rate is ``len(agents) / that``), None if some never connected."""
        if self.wait_connected(timeout_s=timeout_s, poll_s=poll_s) < len(self.agents):
            return None
        return time.monotonic() - (self.first_added_at or time.monotonic())

    def connect_problems(self) -> dict[str, str]:
        """Devices not connected now, with the last reason their connection failed."""
        return {d: a.link.last_connect_error or "connecting" for d, a in self.agents.items()
                if not a.link.connected.is_set()}

    def stop(self) -> None:
        """Every device goes offline (presence, disconnect), then the loop stops."""
        self._stopping.set()
        self._ticker.join(timeout=self.tick_s + 1)
        list(self._pool.map(self._stop_agent, list(self.agents.values())))
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.loop.stop()

    @staticmethod
    def _stop_agent(agent: DeviceAgent) -> None:
        try:
            agent.stop()
        except Exception as exc:         # e.g. never connected: its offline presence cannot be sent
            log.info("%s: stop: %s", agent.device_id, exc)
            agent.link.stop()


def rss_mb() -> float:
    """This process's resident memory (Linux /proc), 0 where unknown."""
    return process_rss_mb("self")
