"""Start a private mosquitto for simulations and tests (the real broker, on a free local port)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from protocols.topics import Topics

from .processes import process_rss_mb, stop_all

# A private broker for thousands of devices: no connection cap (the caller raises the descriptor
# limit mosquitto inherits) and room to queue the chunks of ~1,000 concurrent uploads for the
# aggregator's subscription (later lines override the defaults written before them).
FLEET_BROKER_CONFIG = "max_connections -1\nmax_queued_messages 1000000\n"

MOSQUITTO_CANDIDATES = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")


def find_mosquitto() -> str:
    for c in MOSQUITTO_CANDIDATES:
        path = shutil.which(c) or (c if Path(c).is_file() else None)
        if path:
            return path
    raise FileNotFoundError("mosquitto not found: install it (Debian: apt-get install mosquitto) "
                            "or pass --broker mqtt://host:port to use an existing broker")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """The broker exited because another socket holds its port (a free port picked by one process
    can be taken by another before the broker binds it)."""


def _listening_sockets(port: int) -> set[str] | None:
    """The ``socket:[inode]`` names of the TCP sockets listening on ``port`` (Linux /proc/net/tcp
    and tcp6); None where /proc has no such table."""
    try:
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    try:
        rows += Path("/proc/net/tcp6").read_text().splitlines()[1:]
    except OSError:               # no IPv6 in this kernel
        pass
    found = set()
    for row in rows:
        fields = row.split()      # sl local_address rem_address st ... inode (the 10th)
        if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            found.add(f"socket:[{fields[9]}]")
    return found


def _listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` itself holds a socket listening on ``port`` (None: /proc cannot tell)."""
    sockets = _listening_sockets(port)
    if sockets is None:
        return None
    if not sockets:
        return False
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(fd) in sockets:
                return True
        except OSError:           # closed since listed
            continue
    return False


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def wait_until_listening(proc: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    """Wait until the broker process ``proc`` itself listens on ``port``: a connection accepted on
    the port is not enough, since another process may hold it (then this broker exits, and a bridge
    pointed at it would wait for nothing). PortTaken when the broker exits because the port is
    taken, RuntimeError (with its log) when it exits for another reason, TimeoutError if it never
    opens the port. Where /proc cannot tell whose socket it is, an accepted connection counts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text()[-2000:]
            raise (PortTaken if "Address already in use" in text else RuntimeError)(f"broker exited: {text}")
        # someone accepts first (cheap), then whose socket it is: /proc/net/tcp lists every
        # connection on the machine, read only once the port answers
        if _accepts(port) and _listens(proc.pid, port) is not False:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the broker did not open port {port} within {timeout} s")


class MosquittoBroker:
    """Context manager: ``with MosquittoBroker() as b: b.port``. Extra config lines may be given
    (ACLs, password files, TLS listeners); the default is an anonymous loopback listener."""

    PORT_ATTEMPTS = 5      # fresh ports tried when the one picked is taken before the broker binds it

    def __init__(self, port: int | None = None, extra_config: str = "", workdir: Path | None = None,
                 listener_config: str | None = None):
        self.port = port or free_port()
        self._port_given = port is not None or listener_config is not None
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fedfleet-mosquitto-")
            workdir = Path(self._tmp.name)
        self.workdir = Path(workdir)
        self.conf = self.workdir / "mosquitto.conf"
        self._listener_config, self._extra_config = listener_config, extra_config
        self._write_conf()
        self.proc: subprocess.Popen | None = None

    def _write_conf(self) -> None:
        listener = self._listener_config or f"listener {self.port} 127.0.0.1\nallow_anonymous true\n"
        self.conf.write_text(listener + "persistence false\nmax_queued_messages 10000\n"
                             "max_inflight_messages 100\nlog_dest stderr\nlog_type error\n"
                             "log_type warning\n" + self._extra_config)

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "MosquittoBroker":
        for attempt in range(self.PORT_ATTEMPTS):
            self.log = open(self.workdir / "mosquitto.log", "wb")
            self.proc = subprocess.Popen([find_mosquitto(), "-c", str(self.conf)], stdout=self.log,
                                         stderr=subprocess.STDOUT)
            try:
                wait_until_listening(self.proc, self.port, self.workdir / "mosquitto.log", timeout)
                return self
            except PortTaken:
                self.log.close()
                if self._port_given or attempt == self.PORT_ATTEMPTS - 1:
                    raise
                self.port = free_port()           # taken between free_port() and the bind: another one
                self._write_conf()
            except TimeoutError:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def reload(self) -> None:
        """SIGHUP: mosquitto re-reads password and ACL files without dropping clients."""
        import signal

        if self.proc:
            self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc:
            stop_all([self.proc], first_is_done=False, grace_s=5)
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# One process holds at most RLIMIT_NOFILE sockets (its hard limit: 20,000 on the machine this was
# measured on, and only a privileged process may raise it), and one loopback destination
# (address, port) offers ~28,000 source ports (net.ipv4.ip_local_port_range). Past that, devices
# go to several brokers: each its own process with its own descriptors and its own port.
DEVICES_PER_EDGE = 15_000


def bridge_config(name: str, core_port: int, topics: Topics) -> str:
    """An edge broker's bridge to the core broker: device uplinks out, aggregator downlinks in,
    QoS 1 both ways; its state ("1" connected, "0" lost) is published on the core under
    ``bridge_state_topic(name)``."""
    lines = [f"connection {name}", f"address 127.0.0.1:{core_port}", f"remote_clientid {name}",
             "cleansession true", "try_private true", "bridge_protocol_version mqttv311", "restart_timeout 1",
             "notifications true", f"notification_topic {bridge_state_topic(name)}"]
    lines += [f"topic {t} out 1" for t in topics.uplinks] + [f"topic {t} in 1" for t in topics.downlinks]
    return "\n".join(lines) + "\n"


def bridge_state_topic(name: str) -> str:
    return f"fedfleet-bridges/{name}/state"


DEVICES_PER_SOURCE_ADDRESS = 5_000


def loopback_sources(host_index: int, n_devices: int, per_address: int = DEVICES_PER_SOURCE_ADDRESS) -> list[str]:
    """The local addresses device host ``host_index`` connects its ``n_devices`` from:
    127.0.{2 + host_index}.1, .2, ..., one per ``per_address`` devices. One address has ~28,000
    ephemeral ports machine-wide, and connect() crawls as they run out (~15 devices/s past
    28,000 connections from 127.0.0.1); 5,000 per address keep each far from that, and 127.0.0.1's
    ports stay free for everything else on the machine."""
    count = max(1, -(-n_devices // per_address))
    if not 0 <= host_index < 252 or count > 254:
        raise ValueError(f"host {host_index} with {n_devices} devices: outside 127.0.2-253.1-254")
    return [f"127.0.{2 + host_index}.{1 + k}" for k in range(count)]


def broker_for(index: int, urls: list[str]) -> str:
    """The broker URL device ``index`` connects to: devices dealt round-robin over ``urls``."""
    return urls[index % len(urls)]


class BrokerTree:
    """A core mosquitto (the aggregator's) and ``edges`` mosquittos bridged to it, each taking
    an equal share of the devices (:func:`broker_for` over :attr:`device_urls`). With no edges,
    devices connect to the core itself. Context manager, like :class:`MosquittoBroker`."""

    def __init__(self, edges: int, topics: Topics, extra_config: str = FLEET_BROKER_CONFIG):
        self.core = MosquittoBroker(extra_config=extra_config)
        self._edges, self._topics, self._extra_config = edges, topics, extra_config
        self.edges: list[MosquittoBroker] = []      # made once the core listens: they bridge to its port

    @classmethod
    def for_devices(cls, n_devices: int, topics: Topics, per_edge: int = DEVICES_PER_EDGE) -> "BrokerTree":
        """No edges up to ``per_edge`` devices, else enough edges for ``per_edge`` devices each."""
        return cls(cls.edges_for(n_devices, per_edge), topics)

    @staticmethod
    def edges_for(n_devices: int, per_edge: int = DEVICES_PER_EDGE) -> int:
        return 0 if n_devices <= per_edge else -(-n_devices // per_edge)

    @property
    def url(self) -> str:
        return self.core.url

    @property
    def device_urls(self) -> list[str]:
        return [e.url for e in self.edges] or [self.core.url]

    def start(self, timeout: float = 30.0) -> "BrokerTree":
        try:
            self.core.start()
            for i in range(self._edges):
                bridge = bridge_config(f"edge{i}", self.core.port, self._topics)
                self.edges.append(MosquittoBroker(extra_config=self._extra_config + bridge))
                self.edges[-1].start()
            wait_for_bridges(self.core.port, [f"edge{i}" for i in range(len(self.edges))], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def rss_mb(self) -> float:
        """The brokers' resident memory together (Linux /proc), 0 where unknown."""
        return sum(process_rss_mb(b.proc.pid) for b in (self.core, *self.edges) if b.proc)

    def stop(self) -> None:
        for broker in (*self.edges, self.core):
            broker.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def wait_for_bridges(core_port: int, names: list[str], timeout: float) -> None:
    """Wait until every named bridge reports itself connected on the core (its retained state
    message); TimeoutError naming those that did not."""
    if not names:
        return
    import paho.mqtt.client as mqtt

    up: set[str] = set()
    all_up = threading.Event()

    def on_message(client, userdata, msg):
        name = msg.topic.split("/")[1]
        (up.add if msg.payload == b"1" else up.discard)(name)
        if up >= set(names):
            all_up.set()

    probe = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    probe.on_connect = lambda client, *a: client.subscribe(bridge_state_topic("+"), 1)
    probe.on_message = on_message
    probe.connect("127.0.0.1", core_port)
    probe.loop_start()
    try:
        if not all_up.wait(timeout):
            raise TimeoutError(f"broker bridges not connected within {timeout} s: {sorted(set(names) - up)}")
    finally:
        probe.disconnect()
        probe.loop_stop()
