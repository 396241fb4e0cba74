"""Start a private mosquitto for simulations and tests (the real broker, on a free local port)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .processes import stop_all

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


def wait_until_listening(proc: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    """Wait until a broker process accepts TCP connections on ``port``; RuntimeError (with its log)
    if it exits first, TimeoutError if it never opens the port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"the broker did not open port {port} within {timeout} s")


class MosquittoBroker:
    """Context manager: ``with MosquittoBroker() as b: b.port``. Extra config lines may be given
    (ACLs, password files, TLS listeners); the default is an anonymous loopback listener."""

    def __init__(self, port: int | None = None, extra_config: str = "", workdir: Path | None = None,
                 listener_config: str | None = None):
        self.port = port or free_port()
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fedfleet-mosquitto-")
            workdir = Path(self._tmp.name)
        self.workdir = Path(workdir)
        self.conf = self.workdir / "mosquitto.conf"
        listener = listener_config or f"listener {self.port} 127.0.0.1\nallow_anonymous true\n"
        self.conf.write_text(listener + "persistence false\nmax_queued_messages 10000\n"
                             "max_inflight_messages 100\nlog_dest stderr\nlog_type error\n"
                             "log_type warning\n" + extra_config)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "MosquittoBroker":
        self.log = open(self.workdir / "mosquitto.log", "wb")
        self.proc = subprocess.Popen([find_mosquitto(), "-c", str(self.conf)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        try:
            wait_until_listening(self.proc, self.port, self.workdir / "mosquitto.log", timeout)
        except TimeoutError:
            self.stop()
            raise
        return self

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
