"""Many MQTT connections on one event loop: paho-mqtt 2.x clients driven by an epoll selector.

:class:`MqttLink` gives every connection its own paho network thread, and paho's threaded loop
waits in ``select()``, which cannot watch a file descriptor above 1024. A process that hosts
thousands of emulated devices instead runs one :class:`MqttEventLoop`: a single thread that waits
on all sockets with ``selectors.DefaultSelector`` (epoll on Linux, no descriptor limit) and calls
paho's external-loop API (``loop_read`` / ``loop_write`` / ``loop_misc``, ``on_socket_open`` /
``on_socket_close`` / ``on_socket_register_write``). Each :class:`LoopLink` is still one device's
own MQTT connection: own client id, credentials, session, subscriptions and last will.

Threads: the loop thread owns the selector (other threads hand it changes through
:meth:`MqttEventLoop.call_soon`); a connector thread opens TCP connections, so a slow or refused
connect never stalls the loop; callers publish from their own threads (paho's own locks make that
safe, as with ``loop_start``). A link that cannot connect (refused, bad credentials, no CONNACK
within ``connect_timeout_s``) retries with exponential backoff on its own, recording why in
``last_connect_error``; no other link notices.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import resource
import selectors
import socket
import ssl
import threading
import time
from collections import deque
from typing import Callable

from .mqtt_link import BrokerConfig, MqttLink

log = logging.getLogger("fedfleet.mqtt_eventloop")

MISC_INTERVAL_S = 1.0          # keepalive pings, connect timeouts, lost write interest
MAX_AWAITING_CONNACK = 256     # connections one loop has opened and not yet seen answered
STALE_CONNECT_S = 60.0         # an attempt unanswered this long no longer counts against that cap


def raise_open_file_limit(wanted: int | None = None) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``wanted`` (default: the hard limit); returns
    the new soft limit. Children started afterwards (mosquitto, workers) inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if wanted is None else min(hard, max(soft, wanted))
    if hard == resource.RLIM_INFINITY and wanted is None:
        target = max(soft, 1 << 20)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class _Connector:
    """One thread that opens connections when they are due (first connect and backoff retries),
    at most ``max_awaiting`` of them awaiting their CONNACK at a time.

    Why the cap: a host that opens 12,500 connections back to back overflows the broker's accept
    queue, handshakes stall in SYN retries, CONNACKs miss their timeout and every miss reconnects
    (measured: 100,000 devices took 570 s to connect, with 14,000 connections lost per host).
    Opening the next connection when one is answered keeps the rate at what the broker and the
    loop can take."""

    def __init__(self, name: str, max_awaiting: int = MAX_AWAITING_CONNACK):
        self._due: list[tuple[float, int, "LoopLink"]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._stopping = False
        self.max_awaiting = max_awaiting
        self._awaiting: dict[LoopLink, float] = {}     # link -> when it was opened
        self.peak_awaiting = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def schedule(self, link: "LoopLink", delay_s: float) -> None:
        with self._cv:
            heapq.heappush(self._due, (time.monotonic() + delay_s, next(self._order), link))
            self._cv.notify()

    def _full(self) -> bool:
        if len(self._awaiting) < self.max_awaiting:
            return False
        # an attempt nobody reported on (its socket's own timeouts end it well before) is not waited for
        stale = time.monotonic() - STALE_CONNECT_S
        for link in [k for k, opened in self._awaiting.items() if opened < stale]:
            del self._awaiting[link]
        return len(self._awaiting) >= self.max_awaiting

    def settled(self, link: "LoopLink") -> None:
        """``link``'s connection attempt ended (CONNACK, refusal, failure, timeout or stop)."""
        with self._cv:
            if self._awaiting.pop(link, None) is not None:
                self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and (not self._due or self._due[0][0] > time.monotonic()
                                              or self._full()):
                    wait = 1.0 if self._full() else (
                        None if not self._due else max(0.0, self._due[0][0] - time.monotonic()))
                    self._cv.wait(wait)
                if self._stopping:
                    return
                _, _, link = heapq.heappop(self._due)
                self._awaiting[link] = time.monotonic()
                self.peak_awaiting = max(self.peak_awaiting, len(self._awaiting))
            link._open()


class MqttEventLoop:
    """One selector thread for any number of :class:`LoopLink` connections."""

    def __init__(self, name: str = "mqtt-eventloop"):
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: deque[Callable[[], None]] = deque()
        self._links: set[LoopLink] = set()
        self._stopping = False
        # how late the loop ran its once-a-second keepalive pass, at worst: a loop starved of the
        # GIL or CPU for longer than the keepalive's grace loses every connection it holds
        self.max_lag_s = 0.0
        self.connector = _Connector(f"{name}-connect")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread (thread-safe)."""
        self._calls.append(fn)
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass      # the wake-up pipe is full: the loop is awake anyway

    def stop(self) -> None:
        self._stopping = True
        self.call_soon(lambda: None)
        self._thread.join(timeout=10)
        self.connector.stop()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # selector bookkeeping (loop thread only)
    def _watch(self, link: "LoopLink", sock, write: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        try:
            key = self._sel.get_map().get(sock.fileno())
        except (OSError, ValueError):
            return                       # closed before the loop got to it
        if key is not None and key.fileobj is not sock:
            self._sel.unregister(key.fileobj)   # a closed socket whose descriptor number was reused
            key = None
        try:
            if key is None:
                self._sel.register(sock, events, link)
            elif key.events != events:
                self._sel.modify(sock, events, link)
        except (OSError, ValueError):
            pass                         # closed meanwhile: nothing to watch

    def _unwatch(self, sock) -> None:
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass

    def _run(self) -> None:
        next_misc = time.monotonic() + MISC_INTERVAL_S
        while not self._stopping:
            timeout = max(0.0, next_misc - time.monotonic())
            for key, mask in self._sel.select(timeout):
                if key.data is None:
                    try:
                        while self._wake_r.recv(65536):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                    continue
                key.data._on_ready(key.fileobj, mask)
            while self._calls:
                self._calls.popleft()()
            if (now := time.monotonic()) >= next_misc:
                self.max_lag_s = max(self.max_lag_s, now - next_misc)
                for link in list(self._links):
                    link._misc()
                next_misc = time.monotonic() + MISC_INTERVAL_S


class LoopLink(MqttLink):
    """:class:`MqttLink` whose network I/O runs on a shared :class:`MqttEventLoop`.

    ``start()`` only asks the loop to connect (it does not wait unless ``timeout`` is given): the
    link connects, and reconnects after a loss or a refusal, with backoff on its own; QoS 1
    publishes made meanwhile are queued by paho and sent once connected.

    ``source_address``: the local address the connection is made from (e.g. ``127.0.0.5``): a
    host with tens of thousands of loopback connections gives them their own source address, as
    one address offers ~28,000 ephemeral ports machine-wide (connect() slows to a crawl as they
    run out, and every other process's bind to that address fails)."""

    def __init__(self, loop: MqttEventLoop, client_id: str, broker: BrokerConfig, *args,
                 connect_timeout_s: float = 15.0, source_address: str | None = None, **kw):
        super().__init__(client_id, broker, *args, **kw)
        self.loop = loop
        self.source_address = source_address or ""
        self.connect_timeout_s = connect_timeout_s
        self.connect_failures = 0
        self.connections_lost = 0       # established connections that closed without stop()
        self._backoff_s = 0.0
        self._connecting_since: float | None = None
        self._stopped = True
        c = self.client
        c.on_socket_open = lambda client, userdata, sock: loop.call_soon(lambda: loop._watch(self, sock, True))
        c.on_socket_close = lambda client, userdata, sock: loop.call_soon(lambda: loop._unwatch(sock))
        c.on_socket_register_write = lambda client, userdata, sock: loop.call_soon(
            lambda: loop._watch(self, sock, True))
        c.on_socket_unregister_write = self._write_done

    def start(self, timeout: float | None = None) -> None:
        self._stopped = False
        self.loop.call_soon(lambda: self.loop._links.add(self))
        self.loop.connector.schedule(self, 0.0)
        if timeout is not None and not self.connected.wait(timeout):
            raise ConnectionError(f"{self.client_id}: no connection to {self.broker.host}:{self.broker.port} "
                                  f"within {timeout}s ({self.last_connect_error or 'no answer'})")

    def stop(self) -> None:
        self._stopped = True
        if self.connected.is_set():
            self.client.disconnect()     # DISCONNECT is queued; the loop writes it, then the socket closes
            deadline = time.monotonic() + 2.0
            while self.client.socket() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
        sock = self.client.socket()
        if sock is not None:
            self._shutdown(sock)
        self.loop.call_soon(lambda: self.loop._links.discard(self))
        self.loop.connector.settled(self)
        self.connected.clear()

    def _write_done(self, client, userdata, sock) -> None:
        # From loop_write (loop thread) once paho's queue is empty; from _sock_close (any thread)
        # the socket is already detached and its close callback unregisters it.
        if self.loop.in_loop_thread and client.socket() is sock:
            self.loop._watch(self, sock, False)

    # connector thread
    def _open(self) -> None:
        if self._stopped:
            self.loop.connector.settled(self)
            return
        try:
            kw = self._connect_properties()
            self.client.connect(self.broker.host, self.broker.port, keepalive=self.broker.keepalive,
                                bind_address=self.source_address, **kw)
            # the CONNACK timeout runs from the CONNECT sent, not from a handshake the broker's
            # accept queue held up (that has the socket's own connect timeout)
            self._connecting_since = time.monotonic()
        except (OSError, ValueError) as exc:
            self.last_connect_error = f"{type(exc).__name__}: {exc}"
            self._connecting_since = None
            self.loop.connector.settled(self)
            self._retry_later()

    def _retry_later(self) -> None:
        self.connect_failures += 1
        self._backoff_s = min(30.0, max(1.0, self._backoff_s * 2))
        if not self._stopped:
            self.loop.connector.schedule(self, self._backoff_s)

    # loop thread
    def _on_ready(self, sock, mask: int) -> None:
        if self.client.socket() is not sock:
            self.loop._unwatch(sock)
            return
        try:
            if mask & selectors.EVENT_READ:
                self.client.loop_read()
                # TLS may hold decrypted bytes that epoll cannot see: read them now
                while isinstance(sock, ssl.SSLSocket) and self.client.socket() is sock and sock.pending():
                    self.client.loop_read()
            if mask & selectors.EVENT_WRITE and self.client.socket() is sock:
                self.client.loop_write()
                if not self.client.want_write():
                    # paho reports the end of a write interest only if it registered it itself; one
                    # taken at socket open or restored by _misc would otherwise stay, and epoll
                    # would report the idle socket writable on every call (a busy loop)
                    self.loop._watch(self, sock, False)
        except Exception:     # one connection's trouble must not end the loop for the others
            log.exception("%s: network error", self.client_id)
            self._shutdown(sock)

    def _misc(self) -> None:
        sock = self.client.socket()
        if sock is None:
            return
        self.client.loop_misc()
        if (not self.connected.is_set() and self._connecting_since is not None
                and time.monotonic() - self._connecting_since > self.connect_timeout_s):
            self.last_connect_error = f"no CONNACK within {self.connect_timeout_s:g}s"
            self._shutdown(sock)
        elif self.client.want_write():
            self.loop._watch(self, sock, True)   # a write interest lost between threads is restored here

    @staticmethod
    def _shutdown(sock) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)     # the next read sees EOF: paho closes and reports the loss
        except OSError:
            pass

    # paho callbacks (loop thread)
    def _handle_connect(self, client, userdata, flags, reason_code, properties=None):
        if reason_code.is_failure:
            self.last_connect_error = str(reason_code)
            self.loop.connector.settled(self)
            return
        self._backoff_s = 0.0
        self._connecting_since = None
        self.loop.connector.settled(self)
        super()._handle_connect(client, userdata, flags, reason_code, properties)

    def _handle_disconnect(self, client, userdata, flags, reason_code, properties=None):
        if self.connected.is_set() and not self._stopped:
            self.connections_lost += 1
        super()._handle_disconnect(client, userdata, flags, reason_code, properties)
        self._connecting_since = None
        self.loop.connector.settled(self)
        if not self._stopped:
            self._retry_later()
