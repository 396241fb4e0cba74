"""A thin paho-mqtt 2.x adapter shared by devices and the aggregator.

It only moves bytes: QoS 1 publishes, automatic reconnect with exponential backoff, re-subscribe
and a hook on every (re)connect, a last will, and chunked publishing of large envelopes. Message
semantics live in the sans-IO modules (envelope, chunking, rounds); callers receive raw
``(topic, payload)`` pairs on paho's network thread and should post them to their own
:class:`~protocols.message_loop.MessageLoop` (:class:`LinkWorker`: a link with one of its own).
Works with any MQTT 3.1.1 or 5 broker: the version is part of the broker address
(``mqtt://host:1883?version=3.1.1``, default 5).
"""

from __future__ import annotations

import functools
import logging
import ssl
import threading
from collections import deque
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, Self

import paho.mqtt.client as mqtt

from .chunking import DEFAULT_CHUNK_SIZE, encode_parts
from .envelope import Envelope
from .message_loop import ENDS_THE_LOOP, MessageLoop, QueueBound
from .topics import role_account

log = logging.getLogger("fedfleet.mqtt")


PROTOCOL_VERSIONS = ("5", "3.1.1")
# QoS 1 publishes handed to paho and not yet acknowledged, at most. paho numbers them with 16-bit
# message ids: past 65,535 outstanding, ids are reused, the reused entries overwrite each other and
# the link stalls (measured: an aggregator opening a round of 100,000 devices delivered 65,727
# tasks, then nothing). Publishes beyond it wait in the link's own queue, in order.
MAX_UNACKED = 32_768


def check_ca_file(path: str) -> None:
    """Refuse (ValueError, one line) a broker CA file that is not a bounded regular file of PEM
    certificates: a FIFO blocked the device and the aggregator at connect time, and a file of
    something else was an ssl.SSLError traceback once the broker had been reached (a review's finding)."""
    import ssl

    from protocols.regular_file import OPTION_FILE_BYTES, read_regular_file

    data = read_regular_file(path, "the broker's CA file (--tls-ca)", OPTION_FILE_BYTES)
    try:
        ssl.create_default_context().load_verify_locations(cadata=data.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"the broker's CA file (--tls-ca) {str(path)[:200]!r} holds no PEM certificate: {exc}") from None


@dataclass(frozen=True)
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None          # CA file: enables TLS
    tls_cert: str | None = None        # client certificate (mutual TLS)
    tls_key: str | None = None
    protocol: str = "5"                # "5" or "3.1.1"
    keepalive: int = 30
    # TLS without a CA file of its own (an mqtts:// address, no tls_ca): verified against the
    # system's trusted CAs, as the Java client's ssl:// is. It was a plain connection before, its
    # CONNECT carrying the password in the clear (a review's finding).
    tls: bool = False

    @classmethod
    def from_url(cls, url: str, **kw) -> "BrokerConfig":
        """``mqtt://[user:pass@]host[:port][?version=3.1.1|5]`` or ``mqtts://...`` (TLS, verified
        against ``tls_ca`` in kw, else the system's trusted CAs). The MQTT protocol version is part of the address (default 5), so every command that
        takes a broker speaks to a 3.1.1-only broker the same way. Raises ValueError, naming the part."""
        from urllib.parse import parse_qs, unquote, urlparse

        u = urlparse(url if "://" in url else f"mqtt://{url}")
        if u.scheme not in ("mqtt", "mqtts"):
            raise ValueError(f"broker URL {url!r}: the scheme must be mqtt:// or mqtts://, not {u.scheme + '://'!r}")
        try:
            port = u.port
        except ValueError:
            raise ValueError(f"broker URL {url!r}: the port must be a number from 1 to 65535") from None
        query = parse_qs(u.query, keep_blank_values=True)
        unknown = sorted(set(query) - {"version"})
        if unknown:
            raise ValueError(f"broker URL {url!r}: unknown parameter {unknown[0]!r} (known: version)")
        version = query.get("version", [kw.pop("protocol", "5")])[-1]
        if version not in PROTOCOL_VERSIONS:
            raise ValueError(f"broker URL {url!r}: version must be one of {', '.join(PROTOCOL_VERSIONS)}, "
                             f"not {version!r}")
        if kw.get("tls_ca"):
            check_ca_file(kw["tls_ca"])
        return cls(host=u.hostname or "127.0.0.1", port=port or (8883 if u.scheme == "mqtts" else 1883),
                   username=unquote(u.username) if u.username else None,
                   password=unquote(u.password) if u.password else None, protocol=version,
                   tls=u.scheme == "mqtts", **kw)

    def for_role(self, role: str) -> "BrokerConfig":
        """The config of this party's connection for ``role`` (the deployment follower, the
        deployment controller): its own account ``{user}/{role}`` with the same password when the
        broker authenticates (the generated ACL broker has one for each), so every connection has
        its own MQTT identity; unchanged on a broker without accounts."""
        return self if not self.username else replace(self, username=role_account(self.username, role))

    def check_reachable(self, timeout: float = 3.0) -> None:
        """Fail fast (ConnectionError, one clear line) when nothing listens at the broker's address,
        instead of a connect loop that gives up only after its own timeout."""
        import socket

        try:
            socket.create_connection((self.host, self.port), timeout=timeout).close()
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ConnectionError(f"cannot reach the MQTT broker at {self.host}:{self.port} ({reason}): "
                                  f"is it running, and is --broker right?") from None

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca) or self.tls

    def url(self) -> str:
        """The address again (without the password), e.g. for logs and worker specs."""
        user = f"{self.username}@" if self.username else ""
        scheme = "mqtts" if self.uses_tls else "mqtt"
        return f"{scheme}://{user}{self.host}:{self.port}?version={self.protocol}"


def _survives(callback):
    """A paho callback of the link's that logs what it raises and returns. paho re-raises what a
    callback raises (``suppress_exceptions`` off) out of its network loop, whose thread then ends and
    the link with it: no reconnect, nothing received, the party silent with one line on stderr;
    suppressed, paho logs it nowhere unless given a logger. A link goes on, as its party's loop does
    (protocols/message_loop.py ENDS_THE_LOOP)."""
    @functools.wraps(callback)
    def guarded(self, *args, **kwargs):
        return _logged_if_raising(self.client_id, callback.__name__, callback, self, *args, **kwargs)
    return guarded


def _logged_if_raising(client_id: str, what: str, step: Callable[..., Any], *args, **kwargs) -> Any:
    """``step(*args, **kwargs)``; what it raises (but ENDS_THE_LOOP) logged, once, naming ``what``,
    and None returned: the link goes on."""
    try:
        return step(*args, **kwargs)
    except ENDS_THE_LOOP:
        raise
    except BaseException:
        log.exception("%s: the MQTT link's %s raised; the link goes on", client_id, what)


class MqttLink:
    def __init__(self, client_id: str, broker: BrokerConfig,
                 on_message: Callable[[str, bytes], None],
                 subscriptions: list[tuple[str, int]] = (),
                 on_connect: Callable[[], None] | None = None,
                 will: tuple[str, bytes, bool] | None = None,
                 clean_start: bool = False):
        self.client_id = client_id
        self.broker = broker
        self.subscriptions = list(subscriptions)
        self._on_message = on_message
        self._on_connect_hook = on_connect
        self.connected = threading.Event()
        self.bytes_sent = 0
        self.bytes_received = 0
        v5 = broker.protocol == "5"
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                                  protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
                                  clean_session=None if v5 else clean_start)
        self._clean_start = clean_start
        if broker.username:
            self.client.username_pw_set(broker.username, broker.password)
        if broker.uses_tls:             # no tls_ca: paho loads the system's trusted CAs
            self.client.tls_set(ca_certs=broker.tls_ca, certfile=broker.tls_cert, keyfile=broker.tls_key,
                                tls_version=ssl.PROTOCOL_TLS_CLIENT)
        if will:
            self.client.will_set(will[0], will[1], qos=1, retain=will[2])
        self.client.reconnect_delay_set(min_delay=1, max_delay=30)
        self.client.max_inflight_messages_set(64)
        self.client.max_queued_messages_set(0)
        self._unacked = 0                   # QoS 1 publishes paho holds (see MAX_UNACKED)
        self._held: deque[tuple[str, bytes, bool]] = deque()     # publishes waiting for room, in order
        self._held_lock = threading.Lock()
        self.client.on_publish = self._handle_published
        self.client.on_connect = self._handle_connect
        self.client.on_disconnect = self._handle_disconnect
        self.client.on_message = self._handle_message
        self.last_connect_error: str | None = None

    def _connect_properties(self) -> dict:
        """connect() keywords: MQTT 5 clean start and session expiry (an hour, unless clean)."""
        if self.broker.protocol != "5":
            return {}
        from paho.mqtt.properties import Properties
        from paho.mqtt.packettypes import PacketTypes

        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 0 if self._clean_start else 3600
        return {"clean_start": self._clean_start, "properties": props}

    def start(self, timeout: float = 15.0) -> None:
        kw = self._connect_properties()
        self.client.connect_async(self.broker.host, self.broker.port, keepalive=self.broker.keepalive, **kw)
        self.client.loop_start()
        if not self.connected.wait(timeout):
            self.stop()
            raise ConnectionError(f"{self.client_id}: no connection to {self.broker.host}:{self.broker.port} "
                                  f"within {timeout}s ({self.last_connect_error or 'no answer'})")

    def stop(self) -> None:
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    def subscribe(self, topic: str, qos: int = 1) -> None:
        """Subscribe now (if connected) and again after every reconnect."""
        self.subscriptions.append((topic, qos))
        if self.connected.is_set():
            self.client.subscribe(topic, qos=qos)

    def fetch_retained(self, topic: str, qos: int = 1) -> None:
        """Have the broker send the retained messages of ``topic`` (a filter) again: subscribing
        delivers them, and a filter this link does not keep is dropped at once (its messages keep
        coming through the wildcard that covers them); one it keeps is only renewed. Nothing while
        disconnected: the subscriptions made again on reconnecting deliver them anyway."""
        if self.connected.is_set():
            self.client.subscribe(topic, qos=qos)
            if topic not in {t for t, _ in self.subscriptions}:
                self.client.unsubscribe(topic)

    def unsubscribe(self, topic: str) -> None:
        """Stop receiving ``topic`` now (if connected) and after every reconnect."""
        self.subscriptions = [(t, q) for t, q in self.subscriptions if t != topic]
        if self.connected.is_set():
            self.client.unsubscribe(topic)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, wait: bool = False) -> None:
        """Publish; a QoS 1 publish beyond MAX_UNACKED outstanding is held here and handed to paho
        as acknowledgements make room (``wait`` publishes are never held: a device's few)."""
        self.bytes_sent += len(payload)
        if qos:
            with self._held_lock:
                if not wait and (self._held or self._unacked >= MAX_UNACKED):
                    self._held.append((topic, payload, retain))
                    return
                self._unacked += 1
        # never under _held_lock: paho calls _handle_published holding its own lock, which this needs
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        if wait:
            info.wait_for_publish(timeout=60)

    @property
    def held(self) -> int:
        """Publishes waiting for room under MAX_UNACKED."""
        return len(self._held)

    def publish_envelope(self, topic: str, env: Envelope, signer=None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                         retain: bool = False, wait: bool = False,
                         before_each: Callable[[int], None] | None = None) -> int:
        """Encode, chunk when large, publish (QoS 1). ``before_each(nbytes)`` can throttle. Returns bytes sent."""
        return self.publish_parts(topic, encode_parts(env, signer, chunk_size), retain=retain, wait=wait,
                                  before_each=before_each)

    def publish_parts(self, topic: str, parts: list[bytes], retain: bool = False, wait: bool = False,
                      before_each: Callable[[int], None] | None = None) -> int:
        """Publish one message's payloads (:func:`~protocols.chunking.encode_parts`) in order, QoS 1;
        retained only when it is one payload. Returns bytes sent."""
        total = 0
        for part in parts:
            if before_each:
                before_each(len(part))
            self.publish(topic, part, retain=retain and len(parts) == 1, wait=wait)
            total += len(part)
        return total

    # paho callbacks (network thread)
    @_survives
    def _handle_published(self, client, userdata, mid, reason_code=None, properties=None):
        # paho holds its outgoing-message lock here, so a publish handed over now keeps its place
        # ahead of any publish another thread makes meanwhile
        with self._held_lock:
            # QoS 0 publishes report here too without having counted: the floor keeps the count
            # from going negative (it may then run below paho's true number, far under 65,535)
            self._unacked = max(0, self._unacked - 1)
        self._drain(client)

    def _drain(self, client) -> None:
        """Hand held publishes to paho while there is room."""
        while True:
            with self._held_lock:
                if not self._held or self._unacked >= MAX_UNACKED:
                    return
                topic, payload, retain = self._held.popleft()
                self._unacked += 1
            client.publish(topic, payload, qos=1, retain=retain)

    @_survives
    def _handle_connect(self, client, userdata, flags, reason_code, properties=None):
        if reason_code.is_failure:
            self.last_connect_error = str(reason_code)
            return
        with self._held_lock:        # a clean session drops what paho held without acknowledging it
            self._unacked = len(getattr(client, "_out_messages", ()))
        # each step fails on its own, said once: one that raised skipped the rest before, the link
        # connected but deaf (its other subscriptions never made) and start() kept waiting
        try:
            _logged_if_raising(self.client_id, "handing over held publishes", self._drain, client)
            for topic, qos in self.subscriptions:
                _logged_if_raising(self.client_id, f"subscription to {topic[:120]!r}", client.subscribe,
                                   topic, qos=qos)
            if self._on_connect_hook:
                _logged_if_raising(self.client_id, "on-connect hook", self._on_connect_hook)
        finally:            # connected all the same (an ENDS_THE_LOOP too): start() not kept waiting
            self.connected.set()

    @_survives
    def _handle_disconnect(self, client, userdata, flags, reason_code, properties=None):
        self.connected.clear()

    @_survives
    def _handle_message(self, client, userdata, msg):
        self.bytes_received += len(msg.payload)
        self._on_message(msg.topic, msg.payload)


class LinkWorker(ABC):
    """An MQTT link and a :class:`~protocols.message_loop.MessageLoop` on a thread of its own that
    handles what the link receives.

    The subclass's link only posts what arrives (``on_message=self._post``); the loop's thread hands
    each item to :meth:`_handle`, in order, and calls :meth:`_tick` after each and every ``tick_s``
    of quiet; :meth:`call` runs code on that thread. What ``_handle`` or ``_tick`` raises goes to
    :meth:`_failed` (by default: logged, and the loop goes on). A subclass calls ``__init__``
    first, then creates ``self.link``."""

    link: MqttLink

    def __init__(self, thread_name: str, tick_s: float, bound: QueueBound | None = None):
        self.loop = MessageLoop(self._handle, self._tick, tick_s, name=thread_name, failed=self._failed, bound=bound)

    def _post(self, topic: str, payload: bytes) -> None:
        """The link's ``on_message``: paho's network thread only queues (within the loop's bound)."""
        self.loop.post((topic, payload), topic, len(payload))

    def start(self) -> Self:
        self.link.start()
        self.loop.start()
        return self

    def stop(self) -> None:
        self.loop.stop()
        self.link.stop()

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the worker's thread and return its result or raise its error."""
        return self.loop.call(fn, timeout)

    @abstractmethod
    def _handle(self, item: tuple[str, bytes]) -> None:
        """One ``(topic, payload)`` the link received."""

    @abstractmethod
    def _tick(self, now: float) -> None:
        """Time passed (``now``: ``time.monotonic()``)."""

    def _failed(self, item: tuple[str, bytes] | None, exc: BaseException) -> None:
        """``_handle(item)`` (``item`` None: ``_tick``) raised ``exc``; re-raise to end the loop."""
        self.loop.log_failure(item, exc)
